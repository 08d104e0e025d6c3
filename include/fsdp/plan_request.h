#pragma once
// The planner's vocabulary (fsdp::plan, planner.h): what to plan for and which choices the search
// may make (PlanRequest), one configuration (Candidate) and its prediction (PlanEntry).
#include <torch/arg.h>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "fsdp/calibration.h"
#include "fsdp/options.h"
#include "fsdp/wrap_policy.h"

namespace fsdp {

// What one module adds per token (sequence position) beyond the planner's own rules for Linear,
// Embedding, LayerNorm and matrices (docs/planner.md): its functional operators (attention, a
// nonlinearity, a loss). For a module the rules miscount (convolutions, recurrent layers,
// attention, batch/instance/group norms, parameters of 3+ dimensions) a nonzero cost replaces them.
struct ModuleCost {
  double forward_flops = 0;      // per token
  double activation_values = 0;  // values kept for backward per token, in the compute dtype
  double activation_bytes = 0;   // bytes kept per token at a width no precision changes (float32 by choice, integers)
};
// Asked for every module (qualified name, module, sequence length).
using ModuleCostFn =
    std::function<ModuleCost(const std::string& name, const torch::nn::Module& module, int64_t seq_len)>;

// Optimizer state, in elements of the parameters' dtype, that a rank holding `piece_numel` (> 0)
// elements of the original parameter `name` (of whole shape `shape`) keeps.
using OptimizerStateFn = std::function<int64_t(const std::string& name, at::IntArrayRef shape, int64_t piece_numel)>;
// `states` values per element of the piece: AdamW and LAMB 2, SGD with momentum 1.
OptimizerStateFn per_element_state(int states);
// fsdp::Adafactor's: a matrix's row and column vectors (R + C) on every rank holding a piece of it,
// other shapes one value per element; with `first_moment` (beta1 > 0) one more per element.
OptimizerStateFn adafactor_state(bool first_moment = false);
// fsdp::Muon's: momentum (one per element) for the matrices `muon` names, AdamW's two per element
// for the rest.
OptimizerStateFn muon_state(std::function<bool(const std::string& name)> muon);

// A wrap policy the search may try, with the name tables show.
struct NamedWrapPolicy {
  std::string name;
  WrapPolicy policy;  // null: the root only
};

// What to plan for, and which choices the search may make (each list: the values it tries).
struct PlanRequest {
  // Bytes each rank may use; 0: the device's memory.
  TORCH_ARG(int64_t, memory_budget) = 0;
  // Kept free for the prediction's error: a candidate fits when its peak x (1 + margin) <= the budget.
  TORCH_ARG(double, memory_margin) = 0.0;
  // Sequences per optimizer step over all ranks; 0: batch_per_rank on every rank.
  TORCH_ARG(int, global_batch) = 0;
  /// Sequences per rank per step where global_batch is 0, whatever the world (a --cluster of another size).
  TORCH_ARG(int, batch_per_rank) = 1;
  TORCH_ARG(int64_t, seq_len) = 1;
  // Ranks; 0: every rank of the cluster.
  TORCH_ARG(int, world) = 0;
  // Optimizer state per parameter element, in the parameters' dtype (AdamW 2, SGD with momentum 1).
  TORCH_ARG(int, optimizer_states) = 2;
  /// Optimizer state per original parameter; replaces optimizer_states where set.
  TORCH_ARG(OptimizerStateFn, optimizer_state) = nullptr;
  TORCH_ARG(ModuleCostFn, module_cost) = nullptr;
  /// Runs one forward of `trace_sequences` sequences on the model (built on the meta device), for
  /// the planner to count its operators instead of its rules (docs/planner.md, The operator trace).
  TORCH_ARG(std::function<void()>, trace_forward) = nullptr;
  /// Sequences (samples) of `seq_len` tokens in trace_forward's input.
  TORCH_ARG(int64_t, trace_sequences) = 1;
  /// Most bytes of CPU tensors one operator's probe (what its backward keeps) may make; 0: the table only.
  TORCH_ARG(int64_t, trace_probe_bytes) = int64_t{64} << 20;
  // Memory the process holds outside tensors (libraries, threads, data), per rank.
  TORCH_ARG(int64_t, process_bytes) = 0;
  // The allocator's memory beyond the live tensors, as a share of their peak.
  TORCH_ARG(double, allocator_headroom) = 0.0;
  // Shard gradients stay allocated between steps (LibTorch 1.x zero_grad zeroes them in place).
  TORCH_ARG(bool, grads_kept_between_steps) = TORCH_VERSION_MAJOR < 2;
  // Measured times (fsdp::calibrate) that replace the device's nominal rates where they apply.
  TORCH_ARG(Calibration, calibration) = {};

  TORCH_ARG(std::vector<ShardingStrategy>, strategies) = {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                                          ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard};
  // HYBRID_SHARD's sharding factors; empty: the ranks of one node (half the world on one node).
  TORCH_ARG(std::vector<int>, hybrid_factors) = {};
  TORCH_ARG(std::vector<NamedWrapPolicy>, wrap_policies) = {NamedWrapPolicy{"none", nullptr}};
  /// Wrap policies a runtime timing of `calibration` may name besides `wrap_policies`; not searched.
  TORCH_ARG(std::vector<NamedWrapPolicy>, calibration_wrap_policies) = {};
  // Units checkpointed, or none (checkpointed_shares says how many).
  TORCH_ARG(std::vector<bool>, activation_checkpointing) = {false, true};
  /// A checkpointed candidate per share: that share of the units that can be checkpointed (every non-root unit with an input), the first in forward order, at least one; 1: every one.
  TORCH_ARG(std::vector<double>, checkpointed_shares) = std::vector<double>{0.25, 0.5, 0.75, 1.0};
  /// hpZ sizes (Options::reshard_after_forward_size) tried where a candidate reshards after forward; empty: 0 and one node's ranks.
  TORCH_ARG(std::vector<int>, reshard_after_forward_sizes) = {};
  /// Per-unit reshard after forward (Options::reshard_after_forward_policy) in every candidate; null: each strategy's own; not searched.
  TORCH_ARG(ReshardPolicy, reshard_after_forward_policy) = nullptr;
  TORCH_ARG(std::vector<bool>, cpu_offload) = {false, true};  // never where the device is the host
  // Parameter dtypes for compute (reductions stay float32): kFloat, kBFloat16, kHalf.
  TORCH_ARG(std::vector<at::ScalarType>, precisions) = {at::kFloat, at::kBFloat16};
  TORCH_ARG(std::vector<int>, all_gather_limits) = {2};
  TORCH_ARG(std::vector<BackwardPrefetch>, backward_prefetch) = {BackwardPrefetch::kBackwardPre};
  TORCH_ARG(std::vector<bool>, forward_prefetch) = {true};
  TORCH_ARG(std::vector<int>, reductions_in_flight) = {2};
  // Sequences per micro-batch per rank; empty: every divisor of the per-rank batch.
  TORCH_ARG(std::vector<int>, micro_batches) = {};
  /// With accumulation, whether micro-batches before the last skip their reductions (no_sync) or each reduces.
  TORCH_ARG(std::vector<bool>, no_sync) = {false, true};
  /// HYBRID_SHARD with accumulation and without no_sync: whether micro-batches before the last reduce only within their shard group, the last one across replicas too (FullyShardedModule::set_requires_all_reduce).
  TORCH_ARG(std::vector<bool>, replica_deferred) = {false, true};
  /// With no_sync, whether micro-batches before the last also keep the parameters unsharded for the next forward (FullyShardedModule::set_reshard_after_backward).
  TORCH_ARG(std::vector<bool>, keep_unsharded) = {false, true};
  /// Quantized all-gathers (Options::all_gather_quantization) in every candidate; not searched.
  TORCH_ARG(Quantization, all_gather_quantization) = {};
  /// Quantized gradient reductions (Options::reduce_quantization) in every candidate; not searched.
  TORCH_ARG(Quantization, reduce_quantization) = {};
  /// Whether the optimizer steps each unit in backward (FullyShardedModule::set_step_in_backward on backward's thread); tried with one micro-batch per step or under no_sync, without offload or fp16.
  TORCH_ARG(std::vector<bool>, step_in_backward) = {false};
  /// Deterministic training (Options::deterministic) in every candidate: exact integer sums reduced, micro-batches accumulated under no_sync; not with quantization.
  TORCH_ARG(bool, deterministic) = false;
  /// Submodules of the planned model the run leaves alone (Options::ignored_modules: give the run's own to each candidate's options()); kept whole on every rank.
  TORCH_ARG(std::vector<std::shared_ptr<torch::nn::Module>>, ignored_modules) = {};
  /// Parameters of the planned model the run leaves alone (Options::ignored_parameters; set this or ignored_modules).
  TORCH_ARG(std::vector<at::Tensor>, ignored_parameters) = {};
  /// Whether an optimizer like the request's steps the ignored parameters that require a gradient (their state is counted).
  TORCH_ARG(bool, step_ignored) = true;
};

// One configuration.
struct Candidate {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int sharding_factor = 0;  // HYBRID_SHARD
  NamedWrapPolicy wrap;
  bool activation_checkpointing = false;
  int checkpointed_units = 0;  // with activation_checkpointing: the first this many in forward order; 0: every one
  std::vector<std::string> checkpointed_unit_names;  // filled by fsdp::plan: the units checkpointed
  bool cpu_offload = false;
  at::ScalarType precision = at::kFloat;
  int all_gather_limit = 2;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  bool forward_prefetch = true;
  int reductions_in_flight = 2;
  int reshard_after_forward_size = 0;          // hpZ: units resharded after forward keep 1/this of their parameters
  ReshardPolicy reshard_after_forward_policy;  // PlanRequest's
  int micro_batch = 1;                         // sequences per micro-batch per rank
  int accumulation = 1;                        // micro-batches per step
  bool no_sync = false;                  // micro-batches before the last keep their unsharded gradients, unreduced
  bool replica_deferred = false;         // HYBRID_SHARD: micro-batches before the last skip the replica all-reduce
  bool keep_unsharded = false;           // no_sync: micro-batches before the last leave the parameters unsharded
  Quantization all_gather_quantization;  // PlanRequest's
  Quantization reduce_quantization;      // PlanRequest's
  bool step_in_backward = false;         // the optimizer steps in backward: call set_step_in_backward
  bool deterministic = false;            // PlanRequest's

  // fully_shard's options for it (activation checkpointing is the model's: apply it to the units).
  Options options() const;
  // Selects the units to checkpoint, for apply_activation_checkpointing: those named in
  // checkpointed_unit_names (every unit of the wrap policy where it is empty); null without checkpointing.
  WrapPolicy checkpoint_policy() const;
  std::string describe() const;
};

// Peak bytes per rank, by kind. The kinds peak at different moments; `peak` is the largest sum at
// one moment of the simulated step.
struct MemoryPrediction {
  int64_t params = 0;       // FSDP's parameter storage at its peak (MemoryStats::param_peak_bytes)
  int64_t grads = 0;        // FSDP's gradient storage at its peak (MemoryStats::grad_peak_bytes)
  int64_t optimizer = 0;    // optimizer state over this rank's shard pieces
  int64_t activations = 0;  // kept for backward at their peak (recomputation included)
  int64_t workspace = 0;    // the passes' other temporaries (calibrated: PrecisionTiming::peak_bytes)
  int64_t feedback = 0;     // error feedback's residuals (MemoryStats::feedback_bytes)
  int64_t ignored = 0;      // parameters the run leaves alone, whole, with their gradients and optimizer state
  int64_t headroom = 0;     // idle buffers FSDP's buffer pool keeps, and the allocator's share
  int64_t process = 0;      // outside tensors (PlanRequest::process_bytes)
  int64_t peak = 0;         // device total at its peak moment, headroom and process included
  int64_t host = 0;         // host memory CPU offload uses per rank
};

struct TimePrediction {
  double step_s = 0;
  double compute_s = 0;          // the compute thread busy (forward, backward, recomputation, optimizer)
  double exposed_comm_s = 0;     // the compute thread waiting for a collective
  double tflops_per_device = 0;  // model FLOPs (no recomputation) per second per rank
  double mfu = 0;                // tflops_per_device over the device's peak for the precision
};

struct PlanEntry {
  Candidate candidate;
  MemoryPrediction memory;
  TimePrediction time;
  bool fits = false;
};

}  // namespace fsdp
