#pragma once
// Multi-rank tests on loopback: a test launches N copies of the test binary itself as rank
// processes (env RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), each running a named worker
// function; the test passes when every rank exits 0. Worker output is collected per rank.
#include <torch/torch.h>
#include <torch/version.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/fsdp.h"

namespace fsdp_test {

struct WorkerContext {
  int rank = 0;
  int world = 1;
  std::vector<std::string> args;
};
using WorkerFn = std::function<void(const WorkerContext&)>;

std::map<std::string, WorkerFn>& worker_registry();
// Registers a worker; a second worker of the same name aborts the test binary at start.
struct WorkerRegistrar {
  WorkerRegistrar(const std::string& name, WorkerFn fn);
};
#define FSDP_WORKER(name)                                             \
  static void name(const ::fsdp_test::WorkerContext& ctx);            \
  static ::fsdp_test::WorkerRegistrar name##_registrar(#name, &name); \
  static void name(const ::fsdp_test::WorkerContext& ctx)

struct RankResult {
  int exit_code = -1;
  std::string output;  // stdout + stderr
};
struct LaunchResult {
  std::vector<RankResult> ranks;
  bool timed_out = false;
  bool all_ok() const;
  std::string report() const;  // every rank's exit code and output, for failure messages
};

// A loopback port below the ephemeral range, held while this object lives: neither another
// holder nor an outgoing connection can take it, but a listener with SO_REUSEADDR (rank 0's store)
// can (docs/building.md, Test ports).
class LoopbackPort {
 public:
  LoopbackPort();
  ~LoopbackPort();
  LoopbackPort(const LoopbackPort&) = delete;
  LoopbackPort& operator=(const LoopbackPort&) = delete;
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// Runs worker `name` on `world` ranks; extra_env entries are "KEY=VALUE" for every rank.
LaunchResult launch(const std::string& name, int world, const std::vector<std::string>& args = {}, int timeout_s = 300,
                    const std::vector<std::string>& extra_env = {});

// The same in two halves, for tests that act on running ranks (e.g. kill them): start() returns
// at once; wait_for() collects exit codes and output (killing what is left after timeout_s).
struct RunningRanks {
  std::vector<int> pids;  // process ids; 0 once collected
  std::vector<std::string> logs;
  std::shared_ptr<LoopbackPort> master_port;  // held until the ranks are collected
};
RunningRanks start(const std::string& name, int world, const std::vector<std::string>& args = {},
                   const std::vector<std::string>& extra_env = {});
LaunchResult wait_for(RunningRanks& ranks, int timeout_s = 300);

// A fresh directory under the system's temporary directory, removed with everything in it at
// scope exit.
struct TempDir {
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return path + "/" + name; }
  std::string path;
};

// Files through POSIX calls: PyTorch's pip LibTorch exports copies of C++'s filesystem library.

// The names in `dir` except "." and "..", sorted; throws std::runtime_error if it cannot be listed.
std::vector<std::string> list_dir(const std::string& dir);
// Whether `path` exists (symlinks followed, as stat() does).
bool path_exists(const std::string& path);
// The target of symlink `path`, or "" when it is no symlink or cannot be read.
std::string read_link(const std::string& path);

// Inside a worker: throws std::runtime_error (exit code 1) with the message.
#define WORKER_CHECK(cond, ...)                                                                              \
  do {                                                                                                       \
    if (!(cond)) throw std::runtime_error(::fsdp::detail::compose("check failed: " #cond " ", __VA_ARGS__)); \
  } while (0)

// Whether `part` occurs in `s` (an error message, a rank's output).
inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// full_state_dict()'s tensors in name order, contiguous on the CPU (collective: every rank calls it).
std::vector<at::Tensor> full_tensors_by_name(fsdp::FullyShardedModule& sharded);

// Two non-empty lists of tensors with the same values bit for bit, in order.
inline bool bit_identical(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size() || a.empty()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

// The lines of `output` that start with `prefix`, each with its newline.
std::string lines_starting_with(const std::string& prefix, const std::string& output);

// Zeroes the optimizer's gradients in place, keeping the tensors: what Optimizer::zero_grad() does
// in LibTorch 1.x; from 2.0 on it drops them (set_to_none defaults to true).
inline void zero_grad_in_place(torch::optim::Optimizer& opt) {
#if TORCH_VERSION_MAJOR >= 2
  opt.zero_grad(/*set_to_none=*/false);
#else
  opt.zero_grad();
#endif
}

// Relative difference max|a-b| / max|b| (0 when both are zero).
double rel_diff(const at::Tensor& a, const at::Tensor& b);

// Each parameter of `module` once: LibTorch's parameters() lists a tied weight once per module
// that registers it, and an optimizer over that list would step it twice.
std::vector<at::Tensor> unique_parameters(const torch::nn::Module& module);

// Inside a worker: every parameter of `ref` equals (dtype, and within `tol` by rel_diff, compared
// on the CPU) the one of the same name in sharded.full_state_dict(); `what` heads the message otherwise.
void expect_same_parameters(const torch::nn::Module& ref, fsdp::FullyShardedModule& sharded, double tol,
                            const std::string& what);

// Inside a worker: `fn` must throw an fsdp::Error whose message contains `needle`; prints the
// message under `what`, and throws (failing the worker) otherwise.
void expect_error(const std::function<void()>& fn, const std::string& needle, const std::string& what);

// One step of local training of `ref` on the global batch x and of sharded training of `model` on
// this rank's `rows` rows of it, both on the loss mean(forward(x)^2).
template <class Ref, class Model>
void step_side_by_side(Ref& ref, torch::optim::Optimizer& ref_opt, Model& model, torch::optim::Optimizer& opt,
                       const at::Tensor& x, int rank, int rows) {
  ref_opt.zero_grad();
  ref->forward(x).pow(2).mean().backward();
  ref_opt.step();
  opt.zero_grad();
  model->forward(x.narrow(0, int64_t(rank) * rows, rows)).pow(2).mean().backward();
  opt.step();
}

class TinyTransformer;  // models.h

// Step `step`'s global batch of token rows for a TinyTransformer (models.h): 2 rows per rank.
at::Tensor token_batch(int world, int step);

// One step of local training of `ref` on token_batch(ctx.world, step) and of sharded training of
// `model` on this rank's rows of it, both on loss_of (models.h); after_forward / after_backward
// run between the sharded model's phases.
void lm_step_side_by_side(TinyTransformer& ref, torch::optim::Optimizer& ref_opt, TinyTransformer& model,
                          torch::optim::Optimizer& opt, const WorkerContext& ctx, int step,
                          const std::function<void()>& after_forward = nullptr,
                          const std::function<void()>& after_backward = nullptr);

// The bytes of every unit's shard of `sharded`, together.
int64_t shard_bytes(fsdp::FullyShardedModule& sharded);

// Options with `strategy` (HYBRID_SHARD with a sharding factor of 2) and each BlockImpl (models.h)
// as a unit.
fsdp::Options block_unit_options(const std::string& strategy);

// Seconds since t0.
double seconds_since(std::chrono::steady_clock::time_point t0);
// Names of /dev/shm entries a rank with one of `pids` created (ours are "fsdp-<creator pid>-...").
std::vector<std::string> leftover_segments(const std::vector<int>& pids);
// The state letter of process `pid` in /proc (R, S, T stopped, Z exited, ...), or '?' if gone.
char process_state(int pid);
// Whether a survivor's output names the dead member: its death seen by this rank, a peer that saw
// it and failed first, or its closed connection (Gloo over TCP).
bool names_dead_member(const std::string& out);

// The GPU tests' device (tests/gpu/), and their guard: skip where no CUDA device is visible.
inline const torch::Device kGpu(torch::kCUDA, 0);
#define REQUIRE_GPU() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible"

}  // namespace fsdp_test
