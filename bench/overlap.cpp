// Overlap benchmark (paper 3.3, 3.4, Fig. 5): one model, trained under a *modeled* network whose
// bandwidth is chosen so that communication time ~ computation time, for each prefetch / rate
// limiter configuration, interleaved in one run. Reports step time, exposed communication (time
// the compute thread waited for collectives, from the runtime's trace) and peak parameter memory,
// each against prefetch NONE measured in the same run.
//
//   build/tools/fsdp-run --nproc-per-node 2 build/bench/fsdp_bench_overlap [--layers 8 --width 384 ...]
//
// Calibration: the model first runs without a network model and without prefetch; its compute
// time per iteration (iteration time minus the time spent waiting on collectives, max over ranks)
// and the bytes its collectives move set the modeled bandwidth: bandwidth = bytes on the wire per
// iteration / (comm_ratio x compute time). With --recalibrate (default) each configuration then gets
// the bandwidth that its own computation, measured in its previous run, and its own bytes on the
// wire set, so its communication is comm_ratio x its computation. --gbps fixes it instead.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

#include "fsdp/fsdp.h"
#include "posix_files.h"

namespace {

// A residual MLP stack with an input and an output projection in the root unit.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int d) {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc1 = register_module("fc1", torch::nn::Linear(d, 4 * d));
    fc2 = register_module("fc2", torch::nn::Linear(4 * d, d));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::gelu(fc1(ln(x)))); }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

struct StackImpl : torch::nn::Module {
  StackImpl(int d, int layers) {
    in = register_module("in", torch::nn::Linear(d, d));
    for (int i = 0; i < layers; ++i) blocks->push_back(Block(d));
    register_module("blocks", blocks);
    out = register_module("out", torch::nn::Linear(d, d));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = in(x);
    for (auto& b : *blocks) x = b->as<BlockImpl>()->forward(x);
    return out(x);
  }
  torch::nn::Linear in{nullptr}, out{nullptr};
  torch::nn::ModuleList blocks;
};
TORCH_MODULE(Stack);

struct Config {
  std::string name;
  fsdp::BackwardPrefetch backward;
  bool forward;
  int limit;                      // 0: limiter off
  int reductions = 2;             // Options::reductions_in_flight
  bool step_in_backward = false;  // FullyShardedModule::set_step_in_backward
};

struct Sample {
  double step_ms, comm_ms, exposed_ms, peak_param_mb, peak_grad_mb;
  double compute_ms;  // the computation inside units' forward and backward (the trace's compute spans)
  int max_unsharded;
  double modeled_ms = 0;  // the modeled communication of one iteration in effect for this sample
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

// Every rank's values of per-rank figures: [ranks, figures], in rank order.
at::Tensor gather_over_ranks(fsdp::ProcessGroup& pg, const std::vector<double>& v) {
  at::Tensor mine = torch::tensor(v, torch::kDouble);
  at::Tensor all = torch::zeros({pg.size() * int64_t(v.size())}, torch::kDouble);
  pg.world()->all_gather_into(all, mine)->wait();
  return all.view({pg.size(), int64_t(v.size())});
}

// Max over ranks of a per-rank figure.
double max_over_ranks(fsdp::ProcessGroup& pg, double v) { return gather_over_ranks(pg, {v}).max().item<double>(); }

// Exposed / comm in percent on the rank whose computation is longest: it sets the pace, and what it
// waits for is communication, while a faster rank also waits for it (Note [Exposed on the slowest
// rank] in docs/design.md).
double slowest_exposed_pct(fsdp::ProcessGroup& pg, double compute, double exposed, double comm) {
  const at::Tensor all = gather_over_ranks(pg, {compute, exposed, comm});
  const at::Tensor there = all[all.select(1, 0).argmax().item<int64_t>()];
  return 100.0 * there[1].item<double>() / std::max(1e-9, there[2].item<double>());
}

struct Args {
  int layers = 8, width = 384, batch = 32, steps = 6, warmup = 2, reps = 3;
  double gbps = 0, comm_ratio = 1.0, latency_us = 10;
  int ranks_per_host = 0;
  std::string trace_dir;
  std::string calibrate = "units";
  bool recalibrate = true;
};

std::string slug(const std::string& name) {
  std::string out;
  for (char c : name) out += std::isalnum(static_cast<unsigned char>(c)) ? char(std::tolower(c)) : '_';
  return out;
}

// Bytes each rank sends in one iteration's collectives (ring formulas, the same as the network
// model's), counted from that iteration's trace: each all-gather and reduce-scatter moves
// (n-1)/n of its unit's padded bytes.
double wire_bytes_of(const fsdp::FullyShardedModule& sharded, const fsdp::IterationTrace& trace) {
  const int n = sharded.world_size();
  double bytes = 0;
  for (const auto& e : trace.events)
    if (e.unit >= 0 && (e.kind == fsdp::TraceEvent::Kind::kUnshard || e.kind == fsdp::TraceEvent::Kind::kReduce))
      bytes += double(sharded.units()[e.unit].padded_bytes) * (n - 1) / n;
  return bytes;
}

// Runs one configuration; `wire_bytes`, if given, receives the bytes of the last iteration's collectives.
std::vector<Sample> run_config(fsdp::ProcessGroupPtr pg, const Args& a, const Config& c, int iterations,
                               const std::string& trace_path = "", double* wire_bytes = nullptr) {
  torch::manual_seed(1234);
  Stack model(a.width, a.layers);
  auto sharded = fsdp::fully_shard(model, pg,
                                   fsdp::Options()
                                       .auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>())
                                       .backward_prefetch(c.backward)
                                       .forward_prefetch(c.forward)
                                       .limit_all_gathers(c.limit > 0)
                                       .all_gather_limit(std::max(1, c.limit))
                                       .reductions_in_flight(c.reductions)
                                       .trace(true));
  torch::optim::AdamW opt(sharded->parameters(), torch::optim::AdamWOptions(1e-4));
  if (c.step_in_backward) sharded->set_step_in_backward(&opt);  // opt.step() below then finds nothing left
  auto gen = at::detail::createCPUGenerator(77 + pg->rank());
  std::vector<Sample> out;
  for (int it = 0; it < iterations; ++it) {
    at::Tensor x = at::randn({a.batch, a.width}, gen);
    sharded->reset_peak_memory_stats();
    const auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad();
    model->forward(x).pow(2).mean().backward();
    opt.step();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const auto trace = sharded->last_trace();
    double compute_us = 0;
    for (const auto& e : trace.events)
      if (e.kind == fsdp::TraceEvent::Kind::kCompute) compute_us += e.duration_us;
    out.push_back({ms, trace.comm_us / 1e3, trace.exposed_comm_us / 1e3,
                   sharded->memory_stats().param_peak_bytes / 1048576.0,
                   sharded->memory_stats().grad_peak_bytes / 1048576.0, compute_us / 1e3, trace.max_unsharded_units});
    if (!trace_path.empty() && it == iterations - 1 && pg->rank() == 0) trace.write_chrome_json(trace_path);
    if (wire_bytes && it == iterations - 1) *wire_bytes = wire_bytes_of(*sharded, trace);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"libfsdp overlap benchmark: prefetch and rate limiter under a modeled network"};
  Args a;
  app.add_option("--layers", a.layers, "blocks (one unit each)")->check(CLI::Range(1, 256));
  app.add_option("--width", a.width, "model width d (block: d -> 4d -> d)")->check(CLI::Range(8, 16384));
  app.add_option("--batch", a.batch, "rows per rank")->check(CLI::Range(1, 1 << 20));
  app.add_option("--steps", a.steps, "measured iterations per configuration and repetition")
      ->check(CLI::Range(1, 10000));
  app.add_option("--warmup", a.warmup, "unmeasured iterations first")->check(CLI::Range(0, 1000));
  app.add_option("--reps", a.reps, "repetitions; configurations are interleaved")->check(CLI::Range(1, 1000));
  app.add_option("--gbps", a.gbps, "modeled bandwidth in GB/s (0: calibrate so that comm = comm-ratio x compute)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--comm-ratio", a.comm_ratio, "calibration target: modeled comm time / compute time")
      ->check(CLI::PositiveNumber);
  app.add_option("--calibrate", a.calibrate,
                 "what comm-ratio is relative to: 'units' (the computation inside units' forward and backward, "
                 "which communication can overlap) or 'step' (step time minus waits: also the optimizer step, loss, "
                 "input and bookkeeping)")
      ->check(CLI::IsMember({"units", "step"}));
  app.add_flag("--recalibrate,!--no-recalibrate", a.recalibrate,
               "give each configuration the bandwidth at which its own computation, measured in an unrecorded "
               "first pass and then in each repetition, meets comm-ratio; so every row runs at comm-ratio although "
               "configurations compute at different speeds and the machine's speed drifts (default on)");
  app.add_option("--latency-us", a.latency_us, "modeled latency per ring step")->check(CLI::NonNegativeNumber);
  app.add_option("--trace-dir", a.trace_dir, "write rank 0's last iteration of each configuration as Chrome JSON here");
  CLI11_PARSE(app, argc, argv);
  if (!a.trace_dir.empty()) bench_files::make_dirs(a.trace_dir);  // every rank: same path
  at::set_num_threads(1);

  try {
    auto pg = fsdp::ProcessGroup::from_env();
    const bool root = pg->rank() == 0;
    const Config none{"NONE", fsdp::BackwardPrefetch::kNone, false, 2};

    // The slowest rank's median of f over a run's samples after its warm-up.
    auto slowest_median = [&](const std::vector<Sample>& run, double (*f)(const Sample&)) {
      std::vector<double> v;
      for (auto it = run.begin() + a.warmup; it != run.end(); ++it) v.push_back(f(*it));
      return max_over_ranks(*pg, median(v));
    };
    auto units_of = [](const Sample& s) {
      return s.compute_ms;
    };
    auto not_waiting_of = [](const Sample& s) {
      return s.step_ms - s.exposed_ms;
    };
    auto step_of = [](const Sample& s) {
      return s.step_ms;
    };
    // What --calibrate calls computation.
    double (*const computation)(const Sample&) = a.calibrate == "units" ? +units_of : +not_waiting_of;

    // Calibration: real (loopback) communication, no prefetch.
    double compute_ms = 0, units_ms = 0, not_waiting_ms = 0, wire_bytes = 0, calib_step_ms = 0;
    {
      const auto samples = run_config(pg, a, none, a.warmup + a.steps, "", &wire_bytes);
      units_ms = slowest_median(samples, units_of);
      not_waiting_ms = slowest_median(samples, not_waiting_of);
      compute_ms = a.calibrate == "units" ? units_ms : not_waiting_ms;
      calib_step_ms = slowest_median(samples, step_of);
    }
    auto model_for = [&](double bandwidth) {
      return fsdp::NetworkModel()
          .intra(fsdp::Link().bandwidth_gbps(bandwidth).latency_us(a.latency_us))
          .inter(fsdp::Link().bandwidth_gbps(bandwidth).latency_us(a.latency_us))
          .ranks_per_host(pg->size());
    };
    // The bandwidth at which one iteration's `bytes` take comm_ratio x `ms`.
    auto bandwidth_for = [&](double ms, double bytes) {
      return bytes / (a.comm_ratio * ms * 1e-3) / 1e9;
    };
    double gbps = 0, modeled_ms = 0;  // modeled_ms: one iteration's modeled communication
    auto set_bandwidth = [&](double bandwidth) {
      gbps = max_over_ranks(*pg, bandwidth);  // one value on every rank
      pg->set_network_model(model_for(gbps));
      modeled_ms = wire_bytes / (gbps * 1e9) * 1e3;
    };
    set_bandwidth(a.gbps > 0 ? a.gbps : bandwidth_for(compute_ms, wire_bytes));

    if (root) {
      std::cout << "# libfsdp overlap benchmark (communication MODELED, computation real)\n"
                << "# world " << pg->size() << ", " << a.layers << " blocks of width " << a.width
                << " (+ root in/out), batch " << a.batch << "/rank, AdamW, FULL_SHARD, one unit per block\n"
                << "# calibration (no prefetch, real loopback Gloo): step " << std::fixed << std::setprecision(1)
                << calib_step_ms << " ms; not waiting on collectives " << not_waiting_ms
                << " ms, of which computing inside units' forward and backward " << units_ms << " ms; "
                << wire_bytes / 1e6 << " MB on the wire per rank per iteration\n"
                << "# comm-ratio is relative to " << compute_ms << " ms ("
                << (a.calibrate == "units" ? "computation inside units" : "not waiting on collectives")
                << ", --calibrate " << a.calibrate << ")\n"
                << "# " << model_for(gbps).describe() << "  => modeled comm " << modeled_ms << " ms/iteration (~"
                << std::setprecision(2) << modeled_ms / compute_ms << "x compute)\n"
                << "# " << a.reps << " repetitions x " << a.steps << " iterations (after " << a.warmup
                << " warm-up) per configuration, interleaved; medians"
                << (a.recalibrate && a.gbps == 0
                        ? "; each configuration runs at the bandwidth that its own computation in its previous run "
                          "(an unrecorded first pass, then each repetition) and its own bytes on the wire set "
                          "(--recalibrate)"
                        : "")
                << "\n";
    }

    const std::vector<Config> configs{
        none,
        {"BACKWARD_POST", fsdp::BackwardPrefetch::kBackwardPost, false, 2},
        {"BACKWARD_PRE", fsdp::BackwardPrefetch::kBackwardPre, false, 2},
        {"BACKWARD_PRE+forward", fsdp::BackwardPrefetch::kBackwardPre, true, 2},
        {"BACKWARD_PRE+forward, no limiter", fsdp::BackwardPrefetch::kBackwardPre, true, 0},
        {"BACKWARD_PRE+forward, limit 1", fsdp::BackwardPrefetch::kBackwardPre, true, 1},
        {"BACKWARD_PRE+forward, limit 3", fsdp::BackwardPrefetch::kBackwardPre, true, 3},
        {"BACKWARD_PRE+forward, 1 reduction", fsdp::BackwardPrefetch::kBackwardPre, true, 2, 1},
        {"BACKWARD_PRE+forward, step in bwd", fsdp::BackwardPrefetch::kBackwardPre, true, 2, 2, true},
    };
    // Per configuration: its computation in its last run, the slowest rank's.
    const bool per_row = a.recalibrate && a.gbps == 0;
    // and its bytes on the wire per iteration (a schedule may gather some units fewer times).
    std::map<std::string, double> own_ms, own_bytes;
    if (per_row)
      for (const auto& c : configs)
        own_ms[c.name] = slowest_median(run_config(pg, a, c, a.warmup + a.steps, "", &own_bytes[c.name]), computation);
    std::map<std::string, std::vector<Sample>> results;
    for (int rep = 0; rep < a.reps; ++rep)
      for (const auto& c : configs) {
        const bool traced = rep == a.reps - 1 && !a.trace_dir.empty();
        if (per_row) set_bandwidth(bandwidth_for(own_ms[c.name], own_bytes[c.name]));
        double bytes = 0;
        auto s = run_config(pg, a, c, a.warmup + a.steps,
                            traced ? a.trace_dir + "/overlap_" + slug(c.name) + ".json" : "", &bytes);
        for (auto& sample : s) sample.modeled_ms = bytes / (gbps * 1e9) * 1e3;  // this row's own traffic
        results[c.name].insert(results[c.name].end(), s.begin() + a.warmup, s.end());
        if (per_row) own_ms[c.name] = slowest_median(s, computation);
      }

    struct Row {
      double step, comm, exposed, peak, grad_peak, compute, ratio;
      int max_unsharded;
      double slowest_exposed_pct;  // exposed / comm on the rank with the most computation
    };
    std::map<std::string, Row> rows;
    for (const auto& c : configs) {
      std::vector<double> step, comm, exposed, peak, grad_peak, compute, ratio;
      int most = 0;
      for (const auto& s : results[c.name]) {
        step.push_back(s.step_ms);
        comm.push_back(s.comm_ms);
        exposed.push_back(s.exposed_ms);
        peak.push_back(s.peak_param_mb);
        grad_peak.push_back(s.peak_grad_mb);
        compute.push_back(s.compute_ms);
        ratio.push_back(s.modeled_ms / std::max(1e-9, s.compute_ms));
        most = std::max(most, s.max_unsharded);
      }
      // The slowest rank sets the pace; report it.
      rows[c.name] = {max_over_ranks(*pg, median(step)),
                      max_over_ranks(*pg, median(comm)),
                      max_over_ranks(*pg, median(exposed)),
                      max_over_ranks(*pg, median(peak)),
                      max_over_ranks(*pg, median(grad_peak)),
                      max_over_ranks(*pg, median(compute)),
                      max_over_ranks(*pg, median(ratio)),
                      int(max_over_ranks(*pg, most)),
                      slowest_exposed_pct(*pg, median(compute), median(exposed), median(comm))};
    }
    if (root) {
      const Row& base = rows.at("NONE");
      std::printf("\n%-36s %9s %7s %9s %6s %11s %11s %9s %11s %7s %7s %9s %9s\n", "configuration", "step ms", "vs NONE",
                  "units ms", "ratio", "comm ms*", "exposed ms", "exposed%", "exp vs NONE", "peak MB", "grad MB",
                  "unsharded", "slowest%");
      for (const auto& c : configs) {
        const Row& r = rows.at(c.name);
        std::printf("%-36s %9.1f %7.3f %9.1f %6.2f %11.1f %11.1f %8.1f%% %11.3f %7.2f %7.2f %9d %8.1f%%\n",
                    c.name.c_str(), r.step, r.step / base.step, r.compute, r.ratio, r.comm, r.exposed,
                    100.0 * r.exposed / std::max(1e-9, r.comm), r.exposed / std::max(1e-9, base.exposed), r.peak,
                    r.grad_peak, r.max_unsharded, r.slowest_exposed_pct);
      }
      std::printf(
          "# units ms: computation inside units' forward and backward (measured); ratio: the modeled "
          "communication of one iteration (its own bytes on the wire) / units ms, the comm-ratio this row actually ran "
          "at; * comm ms: sum of the "
          "collectives' durations per iteration as the modeled network completed them "
          "(MODELED); exposed ms: time the compute thread waited for collectives (measured); peak MB: FSDP "
          "parameter storage; grad MB: FSDP gradient storage (shards and unsharded buffers); unsharded: most "
          "non-root units unsharded at once; slowest%%: exposed / comm on the rank whose computation (units ms) "
          "is longest, the one that sets the pace (the other columns take each figure's largest over ranks)\n");
    }
    pg->world()->barrier();
  } catch (const std::exception& e) {
    std::cerr << "fsdp_bench_overlap: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
