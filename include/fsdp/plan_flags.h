#pragma once
// The planner from the command line of any program built on the library: `--plan` prints every
// configuration's prediction and ends the program, `--memory-budget 40GiB` trains with the fastest
// configuration that fits (docs/planner.md, Planning from the command line).
#include <torch/arg.h>
#include <torch/torch.h>

#include <functional>
#include <optional>
#include <string>

#include "fsdp/calibration.h"
#include "fsdp/cluster.h"
#include "fsdp/planner.h"
#include "fsdp/process_group.h"

namespace fsdp {

struct PlanFlags {
  // Takes the flags below out of argv ("--flag VALUE" or "--flag=VALUE"; none after "--"), shrinking
  // argc and keeping the program's own arguments in order. Throws fsdp::Error naming a flag without
  // its value, a bad value, --plan-file or --calibrate without --plan or --memory-budget, or this
  // machine's times (--calibrate, --calibration-file) with another's --cluster.
  static PlanFlags parse(int& argc, char** argv);
  // The flags, a line each, for a program's --help.
  static std::string help();
  // Whether --plan or --memory-budget is given: whether plan_from_flags has anything to do.
  bool any() const { return plan() || !memory_budget().empty(); }

  /// --plan: rank 0 prints every configuration's prediction; the program ends.
  TORCH_ARG(bool, plan) = false;
  /// --memory-budget SIZE: train with the fastest configuration whose peak fits SIZE per rank (e.g. 40GiB).
  TORCH_ARG(std::string, memory_budget) = "";
  /// --memory-margin F: a configuration fits when its predicted peak x (1 + F) is within the budget.
  TORCH_ARG(double, memory_margin) = 0.1;
  /// --cluster SPEC: a preset NAME:NODESxRANKS (e.g. a100-80g:64x8) or a JSON file; empty: this machine.
  TORCH_ARG(std::string, cluster) = "";
  /// --plan-file FILE: rank 0 writes the predictions as JSON lines (--plan: every one; else the chosen).
  TORCH_ARG(std::string, plan_file) = "";
  /// --calibrate: every rank times the program's calibration (plan_from_flags' `calibrate`) first.
  TORCH_ARG(bool, calibrate) = false;
  /// --calibration-file FILE: with --calibrate, rank 0 saves the times there; else the plan uses the times saved there.
  TORCH_ARG(std::string, calibration_file) = "";
};

// What the flags decided, alike on every rank.
struct PlanDecision {
  bool exit = false;  // end the program with exit_code: --plan printed its table, or nothing fits
  int exit_code = 0;
  std::optional<PlanEntry> chosen;  // --memory-budget: train with chosen->candidate (options() and the rest)
};

// Times the program's model on this machine for --calibrate: typically fsdp::calibrate over a real,
// throwaway copy of it (calibration.h). Collective-free.
using CalibrationFn = std::function<Calibration()>;

// Collective over `pg`: plans `model` (built on the meta device) as `flags` say and reports on rank
// 0. The request's world becomes the cluster's, its budget, margin and calibration the flags'; on this
// machine, its process_bytes this process's resident set (the mean over ranks). --calibrate runs
// `calibrate` on every rank at once, agrees the times across ranks and adds the link between them
// (calibrate_link). Training (--memory-budget) plans for the job's own ranks and devices. Where
// nothing fits, rank 0 names the smallest budget that would, and every rank gets exit_code 1.
// Without --plan or --memory-budget, nothing happens.
PlanDecision plan_from_flags(const PlanFlags& flags, ProcessGroup& pg, torch::nn::Module& model, PlanRequest request,
                             const CalibrationFn& calibrate = nullptr);

// This machine as a cluster for pg's job (CPU ranks only): the "cpu" preset with a node per host
// (the launcher's LOCAL_WORLD_SIZE ranks each; one node where that does not divide the job), each
// rank's share of its host's memory, each rank's peak float32 FLOP/s `job_matmul_flops` / ranks (0:
// measured here by every rank at once, so that ranks sharing the cores share them as in training)
// and its 16-bit peak at the ratio of a 16-bit to a float32 product measured here; every figure
// alike on every rank. Collective. Throws fsdp::Error on a device other than the CPU, whose cluster
// a program names (--cluster).
Cluster this_machine(ProcessGroup& pg, double job_matmul_flops = 0);

}  // namespace fsdp
