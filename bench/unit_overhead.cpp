// Per-unit CPU overhead (COMPASS P8): a model of many tiny units (Linear(W, W) + tanh, each its own
// FSDP unit), trained with and without FSDP in one run, interleaved; the difference per unit per
// iteration is what FSDP's hooks and bookkeeping cost. At world > 1 the iteration also waits on
// its collectives (tiny, so latency-bound): a traced run measures those waits and they are
// reported apart. Also counted: operators per iteration that read a parameter (the ones FSDP
// intercepts), to give the cost per intercepted operator.
//
//   build/tools/fsdp-run --nproc-per-node 2 build/bench/fsdp_bench_unit_overhead [--units 256 --width 8]
//
// Output (rank 0): medians over --reps rounds of --steps iterations; the overhead columns are the
// median of the rounds' paired differences (FSDP round minus the plain round before it).
#include <ATen/record_function.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <unordered_set>
#include <vector>

#include "fsdp/fsdp.h"

namespace {

struct TinyImpl : torch::nn::Module {
  TinyImpl(int units, int width) {
    for (int i = 0; i < units; ++i)
      layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(width, width)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = torch::tanh(l(x));
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(Tiny);

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Seconds per iteration of `steps` forward + backward + SGD steps.
template <class Model>
double time_steps(Model& model, torch::optim::Optimizer& opt, const at::Tensor& x, int steps) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    model->forward(x).pow(2).mean().backward();
    opt.step();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / steps;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Per-unit CPU overhead of FSDP: many tiny units with and without FSDP"};
  int units = 256, width = 8, batch = 4, steps = 10, reps = 21, warmup = 5;
  app.add_option("--units", units, "Units (Linear(width, width) + tanh each)")->check(CLI::Range(1, 100000));
  app.add_option("--width", width, "Width of each Linear")->check(CLI::Range(1, 4096));
  app.add_option("--batch", batch, "Rows per rank")->check(CLI::Range(1, 4096));
  app.add_option("--steps", steps, "Iterations per timed round")->check(CLI::Range(1, 100000));
  app.add_option("--reps", reps, "Timed rounds per contender (interleaved)")->check(CLI::Range(1, 1000));
  app.add_option("--warmup", warmup, "Untimed iterations per contender first")->check(CLI::Range(0, 100000));
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(1);
  auto pg = fsdp::ProcessGroup::from_env();
  const bool main_rank = pg->rank() == 0;
  at::Tensor x = at::randn({batch, width}, at::detail::createCPUGenerator(pg->rank()));

  torch::manual_seed(1);
  Tiny local(units, width);
  torch::optim::SGD local_opt(local->parameters(), torch::optim::SGDOptions(0.01));
  torch::manual_seed(1);
  Tiny model(units, width);
  auto sharded =
      fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  torch::optim::SGD opt(sharded->parameters(), torch::optim::SGDOptions(0.01));

  // Operators per iteration of the plain model that read one of its parameters.
  std::unordered_set<const c10::TensorImpl*> params;
  for (const auto& p : local->parameters()) params.insert(p.unsafeGetTensorImpl());
  static std::atomic<int64_t> param_ops{0};
  static std::unordered_set<const c10::TensorImpl*>* watched = nullptr;
  watched = &params;
  auto handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
        for (const auto& v : fn.inputs())
          if (v.isTensor() && v.toTensor().defined() && watched->count(v.toTensor().unsafeGetTensorImpl())) {
            ++param_ops;
            break;
          }
        return nullptr;
      })
          .needsInputs(true)
          .scopes({at::RecordScope::FUNCTION}));
  time_steps(local, local_opt, x, 1);
  at::removeCallback(handle);
  const int64_t ops_per_iteration = param_ops.load();

  for (int s = 0; s < warmup; ++s) {
    time_steps(local, local_opt, x, 1);
    time_steps(model, opt, x, 1);
  }
  std::vector<double> t_local, t_fsdp, t_traced, waits;
  for (int r = 0; r < reps; ++r) {
    t_local.push_back(time_steps(local, local_opt, x, steps));
    t_fsdp.push_back(time_steps(model, opt, x, steps));
    // The same with the event trace on, for the time spent waiting on collectives.
    sharded->set_trace(true);
    double wait_us = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      model->forward(x).pow(2).mean().backward();
      opt.step();
      wait_us += sharded->last_trace().exposed_comm_us;
    }
    t_traced.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / steps);
    waits.push_back(wait_us / steps);
    sharded->set_trace(false);
  }
  // Every rank's medians; the row is rank 0's (ranks run in lockstep).
  // The overhead is the median of the rounds' paired differences (each FSDP round against the plain
  // round just before it), which cancels the machine's slower drifts.
  std::vector<double> diffs;
  for (size_t r = 0; r < t_local.size(); ++r) diffs.push_back((t_fsdp[r] - t_local[r]) * 1e6);
  const double local_us = median(t_local) * 1e6, fsdp_us = median(t_fsdp) * 1e6, wait_us = median(waits);
  const double extra_us = median(diffs);
  const double per_unit = extra_us / units;
  const double per_unit_no_wait = (extra_us - wait_us) / units;
  if (main_rank) {
    std::printf("# units %d, Linear(%d,%d)+tanh each, batch %d, world %d, transport %s, LibTorch %s\n", units, width,
                width, batch, pg->size(), std::getenv("FSDP_TRANSPORT") ? std::getenv("FSDP_TRANSPORT") : "auto",
                TORCH_VERSION);
    std::printf("# operators reading a parameter per iteration (plain model): %lld (%.1f per unit)\n",
                static_cast<long long>(ops_per_iteration), double(ops_per_iteration) / units);
    std::printf("%10s %10s %12s %14s %14s %18s %16s\n", "local_us", "fsdp_us", "ratio", "wait_us(traced)",
                "us/unit/iter", "us/unit/iter-wait", "us/param-op");
    std::printf("%10.0f %10.0f %12.2f %14.0f %14.2f %18.2f %16.2f\n", local_us, fsdp_us, fsdp_us / local_us, wait_us,
                per_unit, per_unit_no_wait, ops_per_iteration ? (extra_us - wait_us) / double(ops_per_iteration) : 0.0);
  }
  pg->shutdown();
  return 0;
}
