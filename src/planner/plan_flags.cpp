// The planner's command-line flags and what they do for a job (include/fsdp/plan_flags.h).
#include "fsdp/plan_flags.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "deferred_init_impl.h"
#include "fsdp/calibration.h"
#include "fsdp/check.h"
#include "planner/process_status.h"

namespace fsdp {
namespace {

// An error's message without the library's prefix, to quote inside another.
std::string quoted(const std::exception& e) {
  const std::string what = e.what(), prefix = "libfsdp: ";
  return what.rfind(prefix, 0) == 0 ? what.substr(prefix.size()) : what;
}

// Checks `value` for the flag `name` (one of value_flags()) and sets it.
void set_value(PlanFlags& flags, const std::string& name, const std::string& value) {
  FSDP_CHECK(!value.empty(), name, " needs a value");
  if (name == "--memory-budget") {
    int64_t bytes = 0;
    try {
      bytes = parse_bytes(value);
    } catch (const std::exception& e) {
      FSDP_FAIL("--memory-budget ", value, ": ", quoted(e));
    }
    FSDP_CHECK(bytes > 0, "--memory-budget ", value, ": give the bytes each rank may use, above 0 (e.g. 40GiB)");
    flags.memory_budget(value);
  } else if (name == "--memory-margin") {
    size_t used = 0;
    double margin = -1;
    try {
      margin = std::stod(value, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    FSDP_CHECK(used == value.size() && std::isfinite(margin) && margin >= 0 && margin <= 10, "--memory-margin ", value,
               ": give a share of the peak from 0 to 10 (0.1 keeps 10% free)");
    flags.memory_margin(margin);
  } else if (name == "--cluster") {
    try {
      (void)Cluster::parse(value);
    } catch (const std::exception& e) {
      FSDP_FAIL("--cluster ", value, ": ", quoted(e));
    }
    flags.cluster(value);
  } else if (name == "--plan-file") {
    flags.plan_file(value);
  } else {  // --calibration-file: read (or, with --calibrate, written) once every flag is in
    flags.calibration_file(value);
  }
}

const std::vector<std::string>& value_flags() {
  static const std::vector<std::string> names{"--memory-budget", "--memory-margin", "--cluster", "--plan-file",
                                              "--calibration-file"};
  return names;
}

// FLOP/s of this thread's fastest n x n product in `dtype` over at least `at_least` (after two
// warm-ups: a first product may start a thread pool or compile its kernel).
double matmul_rate(at::ScalarType dtype, int64_t n, std::chrono::milliseconds at_least) {
  auto a = torch::randn({n, n}).to(dtype), b = torch::randn({n, n}).to(dtype);
  auto c = torch::mm(a, b);
  c = torch::mm(a, b);
  double fastest = 1e30;
  const auto begin = std::chrono::steady_clock::now();
  for (int i = 0; i < 8 || std::chrono::steady_clock::now() - begin < at_least; ++i) {
    const auto start = std::chrono::steady_clock::now();
    c = torch::mm(a, b);
    fastest = std::min(fastest, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return 2.0 * static_cast<double>(n * n * n) / fastest;
}

// "planned for 1.00 GiB per rank: ...; predicted peak ..., step ... ms"
std::string chosen_line(const Plan& plan, const PlanEntry& best) {
  std::ostringstream o;
  o << "planned for " << format_bytes(plan.budget) << " per rank: " << best.candidate.describe() << "; predicted peak "
    << format_bytes(best.memory.peak) << " (FSDP parameters " << format_bytes(best.memory.params) << ", gradients "
    << format_bytes(best.memory.grads) << "), step " << std::setprecision(3) << best.time.step_s * 1e3 << " ms";
  return o.str();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  FSDP_CHECK(out.good(), "--plan-file ", path, ": cannot write it (does its directory exist?)");
  out << text;
  FSDP_CHECK(out.good(), "--plan-file ", path, ": writing it failed");
}

}  // namespace

PlanFlags PlanFlags::parse(int& argc, char** argv) {
  PlanFlags flags;
  std::vector<char*> kept;
  int i = 0;
  if (argc > 0) kept.push_back(argv[i++]);  // the program's name
  for (; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;  // the rest is the program's
    if (arg == "--plan" || arg == "--calibrate") {
      (arg == "--plan" ? flags.plan(true) : flags.calibrate(true));
      continue;
    }
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(0, eq);
    if (std::find(value_flags().begin(), value_flags().end(), name) == value_flags().end()) {
      kept.push_back(argv[i]);
      continue;
    }
    if (eq != std::string::npos) {
      set_value(flags, name, arg.substr(eq + 1));
    } else {
      FSDP_CHECK(i + 1 < argc, name, " needs a value, e.g. ",
                 name == "--memory-budget" ? "--memory-budget 40GiB" : name + " VALUE");
      set_value(flags, name, argv[++i]);
    }
  }
  for (; i < argc; ++i) kept.push_back(argv[i]);
  FSDP_CHECK(flags.plan_file().empty() || flags.any(), "--plan-file ", flags.plan_file(),
             " writes the predictions of --plan or --memory-budget: give one of them");
  FSDP_CHECK(!flags.calibrate() || flags.any(),
             "--calibrate times the model for --plan or --memory-budget: give one of them");
  FSDP_CHECK((!flags.calibrate() && flags.calibration_file().empty()) || flags.cluster().empty(),
             flags.calibrate() ? "--calibrate" : "--calibration-file", " holds this machine's times, but --cluster ",
             flags.cluster(), " plans for another; drop one of them");
  if (!flags.calibration_file().empty() && !flags.calibrate()) try {
      (void)Calibration::from_file(flags.calibration_file());
    } catch (const std::exception& e) {
      FSDP_FAIL("--calibration-file ", flags.calibration_file(), ": ", quoted(e),
                " (--calibrate measures the times and saves them there)");
    }
  for (size_t k = 0; k < kept.size(); ++k) argv[k] = kept[k];
  if (static_cast<int>(kept.size()) < argc) argv[kept.size()] = nullptr;
  argc = static_cast<int>(kept.size());
  return flags;
}

std::string PlanFlags::help() {
  return "  --plan                   print every configuration's predicted memory and step time, and exit\n"
         "  --memory-budget SIZE     train with the fastest configuration that fits SIZE per rank (e.g. 40GiB)\n"
         "  --memory-margin F        keep F of each predicted peak free for the prediction's error (0.1)\n"
         "  --cluster SPEC           plan for a preset NAME:NODESxRANKS (" +
         [] {
           std::string names;
           for (const std::string& n : Cluster::preset_names()) names += (names.empty() ? "" : ", ") + n;
           return names;
         }() +
         ") or a JSON file; default: this machine\n"
         "  --plan-file FILE         write the predictions as JSON lines (--plan: every one; else the chosen)\n"
         "  --calibrate              time the model on this machine first, and plan with those times\n"
         "  --calibration-file FILE  with --calibrate, save the times there; else plan with the times saved there\n";
}

Cluster this_machine(ProcessGroup& pg, double job_matmul_flops) {
  detail::DeferralPause real_tensors;
  Communicator& world = *pg.world();
  FSDP_CHECK(world.device().is_cpu(), "this_machine plans for CPU ranks, but this job runs on ", world.device().str(),
             ": name its cluster (a preset such as h100:1x", pg.size(), ", or a cluster file; docs/planner.md)");
  const int ranks = pg.size();
  // One node per host: the launcher's ranks per host where they divide the job, else one host.
  const int local = pg.env().local_world_size;
  const int per_host = local > 0 && local <= ranks && ranks % local == 0 ? local : ranks;
  Cluster cluster = Cluster::preset("cpu", ranks / per_host, per_host);
  // Every rank at once, so that ranks sharing the cores share them as they will in training.
  if (ranks > 1) world.barrier();
  if (job_matmul_flops <= 0) {
    double own = 0;  // the fastest of a few: a slower product was interrupted
    for (int i = 0; i < 3; ++i) own = std::max(own, matmul_rate(at::kFloat, 1024, std::chrono::milliseconds(0)));
    job_matmul_flops = mean_across_ranks(pg, own) * ranks;
    if (ranks > 1) world.barrier();
  }
  double fp32 = 0, bf16 = 0;  // interleaved: a busy core slows one try, not one precision
  for (int i = 0; i < 3; ++i) {
    fp32 = std::max(fp32, matmul_rate(at::kFloat, 256, std::chrono::milliseconds(20)));
    bf16 = std::max(bf16, matmul_rate(at::kBFloat16, 256, std::chrono::milliseconds(20)));
  }
  cluster.device.peak_flops_fp32 = job_matmul_flops / ranks;
  cluster.device.peak_flops_16 = cluster.device.peak_flops_fp32 * mean_across_ranks(pg, bf16 / fp32);
  cluster.device.matmul_efficiency = 1.0;
  // The host's memory, shared by its ranks; the mean over hosts, so that every rank plans alike.
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  const double physical = pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0;
  const auto host = static_cast<int64_t>(mean_across_ranks(pg, physical));
  if (host > 0) {
    cluster.host_memory_bytes = host;
    cluster.device.memory_bytes = host / per_host;
  }
  return cluster;
}

PlanDecision plan_from_flags(const PlanFlags& flags, ProcessGroup& pg, torch::nn::Module& model, PlanRequest request,
                             const CalibrationFn& calibrate) {
  PlanDecision decision;
  if (!flags.any()) return decision;
  detail::DeferralPause real_tensors;  // the collectives' and measurements' own, in a DeferredInit scope too
  const bool training = !flags.memory_budget().empty() && !flags.plan();
  // The files rank 0 writes, checked before any work and refused on every rank alike.
  for (const auto& [flag, path] : {std::pair<const char*, std::string>{"--plan-file", flags.plan_file()},
                                   {"--calibration-file", flags.calibrate() ? flags.calibration_file() : ""}}) {
    if (path.empty()) continue;
    double writable = 1;
    if (pg.rank() == 0) writable = std::ofstream(path, std::ios::app).good() ? 1 : 0;
    FSDP_CHECK(mean_across_ranks(pg, writable) == 1, flag, " ", path,
               ": rank 0 cannot write it (does its directory exist?)");
  }
  const Cluster cluster = flags.cluster().empty() ? this_machine(pg) : Cluster::parse(flags.cluster());
  if (training) {
    FSDP_CHECK(cluster.world() == pg.size(), "--cluster ", flags.cluster(), " has ", cluster.world(),
               " ranks but the job has ", pg.size(), "; training plans for the job's own ranks (--plan plans for any)");
    FSDP_CHECK(cluster.device_is_host == pg.world()->device().is_cpu(), "--cluster ", flags.cluster(), " plans for ",
               cluster.device.name, " devices, but this job trains on ", pg.world()->device().str(),
               "; training plans for its own devices (drop --cluster, or describe them in a cluster file)");
  }
  request.world(cluster.world()).memory_margin(flags.memory_margin());
  if (!flags.memory_budget().empty()) request.memory_budget(parse_bytes(flags.memory_budget()));
  if (flags.calibrate()) {
    FSDP_CHECK(calibrate != nullptr,
               "--calibrate: this program passes plan_from_flags no calibration function, so it "
               "cannot time its model; plan without --calibrate (nominal rates) or with --calibration-file");
    if (pg.size() > 1) pg.world()->barrier();  // every rank at once: the times include their sharing of the machine
    Calibration measured = calibrate();
    agree_across_ranks(measured, *pg.world());
    calibrate_link(measured, pg);
    if (pg.rank() == 0 && !flags.calibration_file().empty()) measured.save(flags.calibration_file());
    request.calibration(measured);
  } else if (!flags.calibration_file().empty()) {
    request.calibration(Calibration::from_file(flags.calibration_file()));
  }
  // The resident set of this process (the program, its libraries and data) on this machine: the
  // mean over ranks, so that every rank plans alike.
  const double resident = mean_across_ranks(pg, static_cast<double>(detail::status_bytes("VmRSS")));
  if (cluster.device_is_host && request.process_bytes() == 0) request.process_bytes(static_cast<int64_t>(resident));

  const Plan plan = fsdp::plan(model, cluster, request);
  const bool leader = pg.rank() == 0;
  if (flags.plan()) {
    if (leader) {
      if (!flags.plan_file().empty()) write_file(flags.plan_file(), plan.json_lines());
      std::cout << plan.table();
      if (plan.any_fits())
        std::cout << "best: " << plan.best().candidate.describe() << "\n";
      else
        std::cout << "nothing fits in " << format_bytes(plan.budget) << " per rank; the smallest needs "
                  << format_bytes(plan.smallest_peak()) << "\n";
      std::cout << std::flush;
    }
    decision.exit = true;
    return decision;
  }
  if (leader)
    for (const std::string& note : plan.notes) std::cout << "note: " << note << "\n";
  if (!plan.any_fits()) {
    if (leader) try {
        (void)plan.best();
      } catch (const std::exception& e) {
        std::cerr << "error: " << e.what() << "\n" << std::flush;
      }
    if (pg.size() > 1) pg.world()->barrier();  // reported before any rank ends
    decision.exit = true;
    decision.exit_code = 1;
    return decision;
  }
  const PlanEntry& best = plan.best();
  // Every rank planned from the same figures; a file that differs between hosts would not.
  const double index = static_cast<double>(&best - plan.entries.data());
  FSDP_CHECK(mean_across_ranks(pg, index) == index,
             "the ranks chose different configurations: their "
             "--cluster or --calibration-file differ between hosts; give every rank the same files");
  decision.chosen = best;
  if (leader) {
    if (!flags.plan_file().empty()) {
      Plan chosen = plan;
      chosen.entries = {best};
      write_file(flags.plan_file(), chosen.json_lines());
    }
    std::cout << chosen_line(plan, best) << "\n" << std::flush;
  }
  return decision;
}

}  // namespace fsdp
