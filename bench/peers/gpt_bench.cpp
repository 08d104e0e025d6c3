// gpt_bench: one contender of the peer benchmark (bench/peers/run.py). Trains the example GPT
// (examples/gpt/model.h) for a few steps, either as plain single-process LibTorch (--mode local)
// or with libfsdp (--mode fsdp --strategy ...), and reports step times, losses and per-rank
// memory as one JSON object. PyTorch DDP (bench/peers/ddp_gpt.py) runs the same model on the same
// inputs; `--write-inputs FILE` writes them (initial weights and every step's global batch).
//
//   gpt_bench --write-inputs in.bin --layers 4 --width 256 --context 128 --global-batch 16 --steps 10
//   gpt_bench --mode local --global-batch 16 ... --result local.json
//   fsdp-run --nproc-per-node 4 gpt_bench --mode fsdp --strategy FULL_SHARD --global-batch 16 ... --result f.json
//
// The step is what every contender times: zero_grad, forward, loss, backward, optimizer step and
// reading the loss. Batches are drawn before the first step.
#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <fsdp/fsdp.h>
#include <sys/resource.h>
#include <torch/torch.h>
#include <torch/version.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "counting_allocator.h"
#include "data.h"
#include "model.h"
#include "optimizer.h"

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;
using fsdp_bench::CountingAllocator;

struct BenchConfig {
  std::string mode = "fsdp";
  std::string strategy = "FULL_SHARD";
  int sharding_factor = 0;
  std::string wrap = "block";
  int layers = 4, width = 128, heads = 4, context = 64;
  int global_batch = 8;  // sequences per step over all ranks
  int warmup = 2;        // untimed steps first (the first step also allocates AdamW state)
  int steps = 5;         // timed steps
  double lr = 3e-4, weight_decay = 0.1;
  uint64_t seed = 1;
  int threads = 0;  // 0: keep LibTorch's (OMP_NUM_THREADS)
  std::string write_inputs, inputs, result, label;
  std::string trace;  // rank 0 writes the last iteration's FSDP event trace (Chrome JSON) here
  int64_t memory_cap_mib = 0;
  bool count_allocations = false;
  std::string init = "deferred";   // deferred: built under fsdp::DeferredInit, initialized unit by unit
  bool operator_callback = false;  // local mode: an operator callback like libfsdp's interception
  std::string backward_prefetch = "BACKWARD_PRE";
  bool forward_prefetch = true;
  int all_gather_limit = 2;  // 0: no rate limiter
  int reductions_in_flight = 2;
  bool reuse_buffers = true;
  bool activation_checkpointing = false;  // every block in fsdp::Checkpointed (any mode)
};

// ---------------------------------------------------------------------------------------------
// Memory measurements

// A field of /proc/self/status in bytes ("VmHWM:  1234 kB"), 0 if absent.
int64_t proc_status_bytes(const char* field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(status, line))
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(key.size())) * 1024;
  return 0;
}

// Wraps LibTorch's CPU allocator and counts the bytes of live tensor storage, with its peak, so
// the benchmark can check the library's own accounting against what was really allocated.
// LibTorch requires CPU data pointers to be their own deleter context (raw_allocate), so sizes
// are remembered by address.
// --operator-callback: the per-operator work of libfsdp's interception (src/runtime/hooks.cpp)
// without the rest of FSDP: RecordFunction boxes every operator's inputs for the callback, which
// looks each tensor input's storage up in a table of the parameters' storages.
std::unordered_set<const c10::StorageImpl*> g_parameter_storages;
std::atomic<int64_t> g_parameter_inputs{0};

std::unique_ptr<at::ObserverContext> on_operator(const at::RecordFunction& fn) {
  int64_t hits = 0;
  auto visit = [&](const at::Tensor& t) {
    if (t.defined() && t.has_storage()) hits += g_parameter_storages.count(t.storage().unsafeGetStorageImpl());
  };
  for (const c10::IValue& v : fn.inputs()) {
    if (v.isTensor())
      visit(v.toTensor());
    else if (v.isTensorList())
      for (const at::Tensor& t : v.toTensorList().vec()) visit(t);
  }
  g_parameter_inputs.fetch_add(hits, std::memory_order_relaxed);
  return nullptr;
}

// Aborts the process as soon as its resident set passes the cap (sampled every millisecond), so
// an over-budget probe of the largest-model search stops early. The verdict itself uses VmHWM,
// the kernel's exact high-water mark, which a sampler can miss between two samples.
class MemoryWatchdog {
 public:
  explicit MemoryWatchdog(int64_t cap_bytes) : cap_(cap_bytes) {
    if (cap_ > 0) thread_ = std::thread([this] { run(); });
  }
  ~MemoryWatchdog() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    while (!stop_) {
      const int64_t rss = proc_status_bytes("VmRSS");
      if (rss > cap_) {
        const char* rank = std::getenv("RANK");
        std::fprintf(stderr, "gpt_bench [rank %s]: resident set %.1f MiB exceeds the cap of %.1f MiB; aborting\n",
                     rank ? rank : "0", rss / 1048576.0, cap_ / 1048576.0);
        std::fflush(stderr);
        std::_Exit(3);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  int64_t cap_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Resource use of every thread of this process: CPU seconds (user, system), minor page faults
// and context switches. System time is where loopback TCP (Gloo) copies and the page faults of
// freshly mapped memory show up; voluntary context switches count the times a thread blocked.
struct ResourceUse {
  double user_s = 0, system_s = 0;
  double minor_faults = 0, voluntary_switches = 0, involuntary_switches = 0;
  static ResourceUse now() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return {u.ru_utime.tv_sec + 1e-6 * u.ru_utime.tv_usec, u.ru_stime.tv_sec + 1e-6 * u.ru_stime.tv_usec,
            double(u.ru_minflt), double(u.ru_nvcsw), double(u.ru_nivcsw)};
  }
};

// Restarts the kernel's resident-set high-water mark (VmHWM) at the current RSS; false where the
// kernel does not allow it.
bool reset_high_water_mark() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}

// ---------------------------------------------------------------------------------------------
// Model and inputs

gpt::GPTConfig model_config(const BenchConfig& c) {
  gpt::GPTConfig m;
  m.layers = c.layers;
  m.width = c.width;
  m.heads = c.heads;
  m.context = c.context;
  m.activation_checkpointing = c.activation_checkpointing;
  return m;
}

// Each distinct parameter once (the tied embedding / head weight is registered twice), under its
// first name, in registration order.
std::vector<std::pair<std::string, torch::Tensor>> unique_named_parameters(torch::nn::Module& module) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : module.named_parameters())
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(item.key(), item.value());
  return out;
}

// The global batch of every step (warm-up and timed), drawn from the fortunes corpus exactly as
// the example trainer draws them: [steps, global_batch, context + 1] int64.
torch::Tensor draw_global_batches(const BenchConfig& c) {
  const auto corpus = gpt::load_fortunes();
  const auto splits = gpt::split_train_validation(gpt::encode(corpus.text));
  std::vector<torch::Tensor> steps;
  for (int step = 1; step <= c.warmup + c.steps; ++step) {
    auto b = gpt::sample_batch(splits.train, c.context, gpt::batch_key(c.seed, /*train stream*/ 1, step),
                               c.global_batch, 0, c.global_batch);
    // sample_batch returns inputs and targets as two views of the same windows.
    steps.push_back(torch::cat({b.inputs, b.targets.narrow(1, c.context - 1, 1)}, 1));
  }
  return torch::stack(steps);
}

// Inputs file for the Python contender: one JSON header line, then raw little-endian data.
//   {"parameters": [{"name", "shape", "offset"}...], "batches": {"shape", "offset"}, "config": {...}}
void write_inputs(const BenchConfig& c) {
  torch::manual_seed(c.seed);
  gpt::GPT model(model_config(c));
  const auto params = unique_named_parameters(*model);
  const auto batches = draw_global_batches(c);
  json header;
  header["config"] = {{"layers", c.layers},
                      {"width", c.width},
                      {"heads", c.heads},
                      {"context", c.context},
                      {"global_batch", c.global_batch},
                      {"steps", c.warmup + c.steps},
                      {"seed", c.seed}};
  int64_t offset = 0;
  for (const auto& [name, p] : params) {
    header["parameters"].push_back(
        {{"name", name}, {"shape", p.sizes().vec()}, {"offset", offset}, {"dtype", "float32"}});
    offset += p.numel() * 4;
  }
  header["batches"] = {{"shape", batches.sizes().vec()}, {"offset", offset}, {"dtype", "int64"}};
  std::ofstream out(c.write_inputs, std::ios::binary);
  if (!out) throw std::runtime_error("cannot write " + c.write_inputs);
  out << header.dump() << "\n";
  for (const auto& [name, p] : params) {
    auto t = p.detach().to(torch::kFloat).contiguous();
    out.write(static_cast<const char*>(t.data_ptr()), t.nbytes());
  }
  auto b = batches.contiguous();
  out.write(static_cast<const char*>(b.data_ptr()), b.nbytes());
  if (!out) throw std::runtime_error("short write to " + c.write_inputs);
}

// The batches of an inputs file (write_inputs), checked against this run's configuration.
torch::Tensor read_global_batches(const BenchConfig& c) {
  std::ifstream in(c.inputs, std::ios::binary);
  std::string line;
  if (!in || !std::getline(in, line)) throw std::runtime_error("cannot read --inputs " + c.inputs);
  const json header = json::parse(line);
  const json& cfg = header.at("config");
  const auto& b = header.at("batches");
  const auto shape = b.at("shape").get<std::vector<int64_t>>();
  if (cfg.at("context").get<int>() != c.context || cfg.at("global_batch").get<int>() != c.global_batch ||
      cfg.at("seed").get<uint64_t>() != c.seed || shape.size() != 3 || shape[0] < c.warmup + c.steps)
    throw std::runtime_error("--inputs " + c.inputs + " was written for context " + cfg.at("context").dump() +
                             ", global batch " + cfg.at("global_batch").dump() + ", seed " + cfg.at("seed").dump() +
                             " and " + std::to_string(shape.empty() ? 0 : shape[0]) +
                             " steps; this run needs context " + std::to_string(c.context) + ", global batch " +
                             std::to_string(c.global_batch) + ", seed " + std::to_string(c.seed) + " and " +
                             std::to_string(c.warmup + c.steps) + " steps");
  auto batches = torch::empty({c.warmup + c.steps, shape[1], shape[2]}, torch::kLong);
  const std::streamoff data_start = in.tellg();
  in.seekg(data_start + b.at("offset").get<std::streamoff>());
  in.read(static_cast<char*>(batches.data_ptr()), batches.nbytes());
  if (!in) throw std::runtime_error("--inputs " + c.inputs + " is truncated");
  return batches;
}

int64_t optimizer_state_bytes(const torch::optim::AdamW& opt) {
  int64_t bytes = 0;
  for (const auto& kv : opt.state()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*kv.second);
    for (const auto* t : {&s.exp_avg(), &s.exp_avg_sq(), &s.max_exp_avg_sq()})
      if (t->defined()) bytes += t->nbytes();
  }
  return bytes;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string wrap_description(const std::string& wrap) {
  if (wrap == "none") return "none (the whole model is one unit)";
  if (wrap == "block") return "block (every transformer block is a unit, plus the root)";
  if (wrap == "sublayer") return "sublayer (every attention and every MLP is a unit, plus the root)";
  return "linear (every nn::Linear is a unit, plus the root)";
}

// ---------------------------------------------------------------------------------------------

int parse_flags(int argc, char** argv, int rank, BenchConfig& c) {
  CLI::App app{"One contender of the libfsdp peer benchmark: the example GPT for a few steps.", "gpt_bench"};
  app.add_option("--mode", c.mode,
                 "local: one LibTorch process on the global batch; fsdp: libfsdp, one process per rank")
      ->transform(CLI::IsMember({"local", "fsdp"}))
      ->capture_default_str();
  app.add_option("--strategy", c.strategy, "FSDP sharding strategy")
      ->transform(CLI::IsMember({"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"}, CLI::ignore_case))
      ->capture_default_str();
  app.add_option("--sharding-factor", c.sharding_factor, "HYBRID_SHARD: ranks per shard group (0: ranks per host)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  app.add_option("--wrap", c.wrap, "FSDP units besides the root")
      ->transform(CLI::IsMember({"none", "block", "sublayer", "linear"}))
      ->capture_default_str();
  app.add_option("--layers", c.layers, "Transformer blocks")->check(CLI::Range(1, 4096))->capture_default_str();
  app.add_option("--width", c.width, "Embedding width")->check(CLI::Range(8, 65536))->capture_default_str();
  app.add_option("--heads", c.heads, "Attention heads")->check(CLI::Range(1, 1024))->capture_default_str();
  app.add_option("--context", c.context, "Tokens per sequence")->check(CLI::Range(2, 8192))->capture_default_str();
  app.add_option("--global-batch", c.global_batch, "Sequences per step over all ranks (divisible by the world size)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--warmup", c.warmup, "Untimed steps before the timed ones")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  app.add_option("--steps", c.steps, "Timed steps")->check(CLI::Range(1, 1000000))->capture_default_str();
  app.add_option("--lr", c.lr, "AdamW learning rate (constant)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--seed", c.seed, "Seed for initialization and batches")->capture_default_str();
  app.add_option("--threads", c.threads, "Intra-op threads per process (0: OMP_NUM_THREADS / LibTorch's default)")
      ->check(CLI::Range(0, 1024))
      ->capture_default_str();
  app.add_option("--write-inputs", c.write_inputs,
                 "Write the initial weights and all global batches to this file "
                 "(for ddp_gpt.py) and exit");
  app.add_option("--inputs", c.inputs,
                 "Read the batches from a file --write-inputs wrote (same context, global "
                 "batch and seed; at least as many steps) instead of drawing them from the corpus")
      ->check(CLI::ExistingFile);
  app.add_option("--result", c.result, "Rank 0 writes the result as JSON to this file");
  app.add_option("--label", c.label, "Name of this contender in the result");
  app.add_option("--memory-cap-mib", c.memory_cap_mib, "Abort a rank whose resident set passes this many MiB")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_option("--trace", c.trace, "FSDP: rank 0 writes the last step's event trace here (Chrome JSON, Perfetto)");
  app.add_option("--backward-prefetch", c.backward_prefetch, "FSDP: BACKWARD_PRE, BACKWARD_POST or NONE")
      ->capture_default_str();
  app.add_flag("--forward-prefetch,!--no-forward-prefetch", c.forward_prefetch,
               "FSDP: gather the next unit before computing the current one");
  app.add_option("--all-gather-limit", c.all_gather_limit, "FSDP: rate limiter, units unsharded at once (0: off)")
      ->check(CLI::Range(0, 1000))
      ->capture_default_str();
  app.add_option("--reductions-in-flight", c.reductions_in_flight,
                 "FSDP: gradient reductions left running while backward goes on")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  app.add_flag("!--no-reuse-buffers", c.reuse_buffers, "FSDP: free transient buffers instead of reusing them");
  app.add_flag("--activation-checkpointing", c.activation_checkpointing,
               "Keep only each block's input in forward and recompute the block in backward (any mode)");
  app.add_flag("--operator-callback", c.operator_callback,
               "Local mode: install a global operator callback that does what libfsdp's interception does for "
               "every operator (box the inputs, look each tensor's storage up among the parameters'), to "
               "measure that cost without FSDP");
  app.add_option("--init", c.init,
                 "Model construction: deferred (fsdp::DeferredInit; FSDP allocates and initializes one unit at a "
                 "time, local mode materializes the whole model) or eager (every rank builds the whole model "
                 "first); the weights are the same")
      ->check(CLI::IsMember({"deferred", "eager"}))
      ->capture_default_str();
  app.add_flag("--count-allocations", c.count_allocations, "Count live tensor bytes through a wrapping CPU allocator");
  try {
    app.parse(argc, argv);
    if (c.width % c.heads != 0)
      throw CLI::ValidationError("--heads",
                                 std::to_string(c.heads) + " does not divide --width " + std::to_string(c.width));
  } catch (const CLI::ParseError& e) {
    if (rank == 0) return app.exit(e);
    if (e.get_exit_code() != 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    return e.get_exit_code();
  }
  return -1;
}

int run(int argc, char** argv) {
  const char* rank_env = std::getenv("RANK");
  BenchConfig c;
  if (const int code = parse_flags(argc, argv, rank_env ? std::atoi(rank_env) : 0, c); code >= 0) return code;
  if (!c.write_inputs.empty()) {
    write_inputs(c);
    return 0;
  }
  const int64_t cap_bytes = c.memory_cap_mib * 1048576;
  MemoryWatchdog watchdog(cap_bytes);
  // Installed before any tensor exists, so every storage (and its reallocations) goes through it.
  static CountingAllocator* counting = nullptr;
  if (c.count_allocations) {
    counting = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(counting, /*priority=*/100);
  }
  if (c.threads > 0) torch::set_num_threads(c.threads);

  const bool local = c.mode == "local";
  if (c.operator_callback && !local) {
    std::cerr << "gpt_bench: error: --operator-callback is for --mode local (FSDP installs its own)\n";
    return 2;
  }
  fsdp::ProcessGroupPtr pg;
  if (!local) pg = fsdp::ProcessGroup::from_env();
  const int world = local ? 1 : pg->size(), rank = local ? 0 : pg->rank();
  if (c.global_batch % world != 0) {
    if (rank == 0)
      std::cerr << "gpt_bench: error: --global-batch " << c.global_batch << " is not divisible by the world size "
                << world << "\n";
    return 2;
  }
  const int rows = c.global_batch / world;

  const auto batches = (c.inputs.empty() ? draw_global_batches(c) : read_global_batches(c))
                           .narrow(1, int64_t(rank) * rows, rows)
                           .contiguous();
  const int64_t batch_bytes = batches.nbytes();

  torch::manual_seed(c.seed);
  const auto gpt_config = model_config(c);
  gpt::GPT model(nullptr);
  if (c.init == "deferred" && !fsdp::DeferredInit::supported()) {
    if (rank == 0) std::cerr << "gpt_bench: this LibTorch cannot defer initialization; building the model eagerly\n";
    c.init = "eager";
  }
  if (c.init == "deferred") {
    fsdp::DeferredInit deferred;
    model = gpt::GPT(gpt_config);
  } else {
    model = gpt::GPT(gpt_config);
  }
  const fsdp::ParamInitFn init_module = [&](const std::string& name, torch::nn::Module& module) {
    gpt::initialize(gpt_config, name, module);
  };
  if (local) fsdp::materialize(*model, init_module);
  const int64_t parameter_count = gpt::count_parameters(*model);
  std::map<std::string, int64_t> dims;
  for (const auto& item : model->named_parameters()) dims[item.key()] = item.value().dim();

  std::shared_ptr<fsdp::FullyShardedModule> sharded;
  std::vector<std::pair<std::string, torch::Tensor>> trained;  // what the optimizer steps
  if (local) {
    trained = unique_named_parameters(*model);
    if (c.operator_callback) {
      for (const auto& [name, p] : trained) g_parameter_storages.insert(p.storage().unsafeGetStorageImpl());
      at::addGlobalCallback(
          at::RecordFunctionCallback(&on_operator).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
    }
  } else {
    auto options = fsdp::Options()
                       .sharding_strategy(fsdp::parse_sharding_strategy(c.strategy))
                       .sharding_factor(c.sharding_factor)
                       .backward_prefetch(fsdp::parse_backward_prefetch(c.backward_prefetch))
                       .forward_prefetch(c.forward_prefetch)
                       .limit_all_gathers(c.all_gather_limit > 0)
                       .all_gather_limit(std::max(1, c.all_gather_limit))
                       .reductions_in_flight(c.reductions_in_flight)
                       .reuse_buffers(c.reuse_buffers)
                       .param_init_fn(init_module);
    if (c.wrap == "block") options.auto_wrap_policy(fsdp::wrap::by_type<gpt::BlockImpl>());
    if (c.wrap == "sublayer")
      options.auto_wrap_policy(fsdp::wrap::by_type<gpt::CausalSelfAttentionImpl, gpt::MLPImpl>());
    if (c.wrap == "linear") options.auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>());
    options.trace(!c.trace.empty());
    sharded = fsdp::fully_shard(model, pg, options);
    trained = sharded->named_parameters();
  }
  auto optimizer = gpt::make_adamw(trained, dims, c.lr, c.weight_decay);
  if (sharded) sharded->check_optimizer(*optimizer);
  int64_t piece_bytes = 0;  // this rank's part of the parameters (the optimizer's tensors)
  for (const auto& [name, p] : trained) piece_bytes += p.nbytes();

  if (rank == 0) {
    std::cout << "gpt_bench " << (c.label.empty() ? c.mode : c.label) << ": mode " << c.mode;
    if (!local)
      std::cout << ", " << fsdp::to_string(sharded->sharding_strategy()) << " (sharding factor "
                << sharded->sharding_factor() << "), wrap " << wrap_description(c.wrap) << ", "
                << sharded->units().size() << " units; backward prefetch " << c.backward_prefetch
                << ", forward prefetch " << (c.forward_prefetch ? "on" : "off") << ", all-gather limit "
                << (c.all_gather_limit > 0 ? std::to_string(c.all_gather_limit) : std::string("off"))
                << ", reductions in flight " << c.reductions_in_flight << ", buffer reuse "
                << (c.reuse_buffers ? "on" : "off");
    if (c.activation_checkpointing) std::cout << "; activation checkpointing";
    std::cout << "\n  world " << world << ", " << torch::get_num_threads() << " threads per process; model " << c.layers
              << " layers, width " << c.width << ", " << c.heads << " heads, context " << c.context << ", "
              << parameter_count << " parameters; global batch " << c.global_batch << " x " << c.context
              << " tokens; AdamW lr " << c.lr << " betas (0.9, 0.99) weight decay " << c.weight_decay << "; steps "
              << c.warmup << " warm-up + " << c.steps << " timed\n";
    if (sharded) std::cout << sharded->describe();
    std::cout << std::flush;
  }

  // The initialization peak (with --init eager the whole model is built on every rank before
  // fully_shard shards it), then the high-water mark restarts (clear_refs "5") so the steps' own peak is seen too.
  const int64_t hwm_init = proc_status_bytes("VmHWM");
  const bool hwm_reset = reset_high_water_mark();
  const int total_steps = c.warmup + c.steps;
  std::vector<double> step_seconds, losses;
  fsdp::MemoryStats memory;
  int64_t alloc_live_rest = 0, alloc_peak = 0;
  int64_t cached_rest = 0, comm_scratch_rest = 0;  // FSDP's reuse cache and communicator scratch, at rest
  ResourceUse use_at_timed_start;
  // Wall time of each phase of the timed steps (rank 0 reports them): where a step's time goes.
  std::vector<double> zero_grad_s, forward_s, backward_s, optimizer_s;
  for (int step = 0; step < total_steps; ++step) {
    if (step == c.warmup) {
      use_at_timed_start = ResourceUse::now();
      // Peaks from here on cover the timed, steady-state steps (gradients and AdamW state exist).
      if (sharded) {
        sharded->reset_peak_memory_stats();
        const auto at_rest = sharded->memory_stats();
        cached_rest = at_rest.cached_bytes;
        comm_scratch_rest = at_rest.comm_scratch_bytes;
      }
      if (counting) {
        alloc_live_rest = counting->live();
        counting->reset_peak();
      }
    }
    auto window = batches[step];  // [rows, context + 1]
    auto inputs = window.narrow(1, 0, c.context), targets = window.narrow(1, 1, c.context);
    const auto start = Clock::now();
    // In place, the gradients kept (as LibTorch 1.x's zero_grad(); 2.x drops them by default): the
    // memory formula (run.py) counts them between steps, and ddp_gpt.py zeroes the same way.
#if TORCH_VERSION_MAJOR >= 2
    optimizer->zero_grad(/*set_to_none=*/false);
#else
    optimizer->zero_grad();
#endif
    const auto zeroed = Clock::now();
    auto logits = model->forward(inputs);
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
    const auto forwarded = Clock::now();
    loss.backward();
    const auto backwarded = Clock::now();
    optimizer->step();
    const double value = loss.item<double>();
    const auto end = Clock::now();
    auto secs = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double>(b - a).count();
    };
    const double seconds = secs(start, end);
    losses.push_back(value);
    if (step >= c.warmup) {
      step_seconds.push_back(seconds);
      zero_grad_s.push_back(secs(start, zeroed));
      forward_s.push_back(secs(zeroed, forwarded));
      backward_s.push_back(secs(forwarded, backwarded));
      optimizer_s.push_back(secs(backwarded, end));
    }
    if (rank == 0)
      std::cout << "step " << step + 1 << "/" << total_steps << (step < c.warmup ? " (warm-up)" : "") << " | loss "
                << std::fixed << std::setprecision(6) << value << " (rank 0) | " << std::setprecision(1)
                << seconds * 1000 << " ms" << std::defaultfloat << "\n"
                << std::flush;
  }
  const ResourceUse use_at_end = ResourceUse::now();
  auto per_step = [&](double ResourceUse::*field) {
    return (use_at_end.*field - use_at_timed_start.*field) / c.steps;
  };
  if (sharded) memory = sharded->memory_stats();
  if (counting) alloc_peak = counting->peak();
  const int64_t adam_bytes = optimizer_state_bytes(*optimizer);
  const int64_t hwm_train = proc_status_bytes("VmHWM");
  const int64_t hwm = std::max(hwm_init, hwm_train);

  // Every rank's figures, and the loss averaged over ranks (each rank's loss is the mean over its
  // rows, and the rows are equal in number).
  constexpr int kFields = 20;
  auto per_rank = torch::zeros({world, kFields}, torch::kDouble);
  const double fields[kFields] = {double(hwm_init),
                                  double(hwm_reset ? hwm_train : 0),
                                  double(hwm),
                                  double(memory.param_peak_bytes),
                                  double(memory.grad_peak_bytes),
                                  double(memory.param_bytes),
                                  double(memory.grad_bytes),
                                  double(adam_bytes),
                                  double(piece_bytes),
                                  double(alloc_live_rest),
                                  double(alloc_peak),
                                  double(cached_rest),
                                  double(comm_scratch_rest),
                                  double(batch_bytes),
                                  median(step_seconds),
                                  per_step(&ResourceUse::minor_faults),
                                  per_step(&ResourceUse::voluntary_switches),
                                  per_step(&ResourceUse::involuntary_switches),
                                  per_step(&ResourceUse::user_s),
                                  per_step(&ResourceUse::system_s)};
  for (int k = 0; k < kFields; ++k) per_rank[rank][k] = fields[k];
  auto loss_sum = torch::tensor(losses, torch::kDouble);
  if (!local) {
    pg->world()->all_reduce(per_rank)->wait();
    pg->world()->all_reduce(loss_sum)->wait();
  }
  loss_sum.div_(world);

  if (sharded && rank == 0 && !c.trace.empty()) {
    const auto trace = sharded->last_trace();
    std::ofstream out(c.trace);
    trace.write_chrome_json(out);
    if (!out) throw std::runtime_error("cannot write --trace " + c.trace);
    std::cout << "trace of the last step: " << c.trace << " (at most " << trace.max_unsharded_units
              << " non-root units unsharded at once)\n";
  }
  if (rank == 0) {
    json result;
    result["label"] = c.label.empty() ? c.mode : c.label;
    result["implementation"] = local ? "libtorch-local" : "libfsdp";
    result["mode"] = c.mode;
    result["strategy"] = local ? "" : fsdp::to_string(sharded->sharding_strategy());
    result["sharding_factor"] = local ? 0 : sharded->sharding_factor();
    result["wrap"] = local ? "" : c.wrap;
    if (!local)
      result["overlap"] = {{"backward_prefetch", c.backward_prefetch},
                           {"forward_prefetch", c.forward_prefetch},
                           {"all_gather_limit", c.all_gather_limit},
                           {"reductions_in_flight", c.reductions_in_flight},
                           {"reuse_buffers", c.reuse_buffers}};
    result["world"] = world;
    result["threads_per_process"] = torch::get_num_threads();
    result["config"] = {{"layers", c.layers},
                        {"width", c.width},
                        {"heads", c.heads},
                        {"context", c.context},
                        {"activation_checkpointing", c.activation_checkpointing},
                        {"global_batch", c.global_batch},
                        {"warmup", c.warmup},
                        {"steps", c.steps},
                        {"lr", c.lr},
                        {"seed", c.seed},
                        {"init", c.init}};
    result["parameters"] = parameter_count;
    result["tokens_per_step"] = int64_t(c.global_batch) * c.context;
    result["step_seconds"] = step_seconds;
    const double med = median(step_seconds);
    result["median_step_s"] = med;
    result["tokens_per_s"] = c.global_batch * double(c.context) / med;
    // CPU seconds per timed step, summed over ranks: the work a step costs, which other jobs on a
    // shared machine disturb much less than the wall time.
    result["cpu_user_s_per_step"] = per_rank.select(1, kFields - 2).sum().item<double>();
    result["cpu_system_s_per_step"] = per_rank.select(1, kFields - 1).sum().item<double>();
    result["cpu_s_per_step"] =
        result["cpu_user_s_per_step"].get<double>() + result["cpu_system_s_per_step"].get<double>();
    result["minor_faults_per_step"] = per_rank.select(1, kFields - 5).sum().item<double>();
    result["voluntary_switches_per_step"] = per_rank.select(1, kFields - 4).sum().item<double>();
    result["involuntary_switches_per_step"] = per_rank.select(1, kFields - 3).sum().item<double>();
    result["phase_median_s"] = {{"zero_grad", median(zero_grad_s)},
                                {"forward", median(forward_s)},
                                {"backward", median(backward_s)},
                                {"optimizer", median(optimizer_s)}};
    result["losses"] = std::vector<double>(loss_sum.data_ptr<double>(), loss_sum.data_ptr<double>() + loss_sum.numel());
    result["memory_cap_bytes"] = cap_bytes;
    const char* names[kFields] = {"vmhwm_init_bytes",
                                  "vmhwm_train_bytes",
                                  "vmhwm_bytes",
                                  "fsdp_param_peak_bytes",
                                  "fsdp_grad_peak_bytes",
                                  "fsdp_param_bytes",
                                  "fsdp_grad_bytes",
                                  "adamw_state_bytes",
                                  "optimizer_param_bytes",
                                  "alloc_live_at_rest_bytes",
                                  "alloc_peak_bytes",
                                  "fsdp_cached_at_rest_bytes",
                                  "comm_scratch_at_rest_bytes",
                                  "batch_bytes",
                                  "median_step_s",
                                  "minor_faults_per_step",
                                  "voluntary_switches_per_step",
                                  "involuntary_switches_per_step",
                                  "cpu_user_s_per_step",
                                  "cpu_system_s_per_step"};
    for (int r = 0; r < world; ++r) {
      json row{{"rank", r}};
      for (int k = 0; k < kFields; ++k) row[names[k]] = per_rank[r][k].item<double>();
      result["ranks"].push_back(row);
    }
    if (sharded)
      for (const auto& u : sharded->units())
        result["units"].push_back({{"name", u.name},
                                   {"parent", u.parent},
                                   {"numel", u.numel},
                                   {"padded_numel", u.padded_numel},
                                   {"padded_bytes", u.padded_bytes},
                                   {"shard_bytes", u.shard_bytes},
                                   {"parameters", u.parameters}});
    std::cout << "median step " << std::fixed << std::setprecision(2) << med * 1000 << " ms, " << std::setprecision(0)
              << c.global_batch * double(c.context) / med << " tokens/s, peak RSS (rank 0) " << std::setprecision(1)
              << hwm / 1048576.0 << " MiB" << std::defaultfloat << "\n";
    if (!c.result.empty()) {
      std::ofstream out(c.result);
      out << result.dump(1) << "\n";
      if (!out) throw std::runtime_error("cannot write --result " + c.result);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    const char* rank = std::getenv("RANK");
    std::cerr << "gpt_bench" << (rank ? std::string(" [rank ") + rank + "]" : std::string()) << ": error: " << e.what()
              << "\n";
    return 1;
  }
}
