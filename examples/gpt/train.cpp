// fsdp_gpt: trains the small GPT of model.h on text with libfsdp, one process per rank.
//
//   fsdp-run --nproc-per-node 4 ./fsdp_gpt                  # fortunes corpus, FULL_SHARD
//   fsdp-run --nproc-per-node 4 ./fsdp_gpt --strategy HYBRID_SHARD --sharding-factor 2
//   ./fsdp_gpt --data my_text.txt --steps 1000              # a single process works too
//   fsdp-run --nproc-per-node 4 ./fsdp_gpt --save-dir ckpt --save-every 50 [--resume]
//
// Every rank runs this same program (SPMD). Rank 0 alone prints and writes the metrics file, but
// every forward pass (training, validation, sampling) is run by every rank: FSDP gathers each
// unit's parameters from all ranks when an operation reads them, so a forward is collective.
#include <ATen/CPUGeneratorImpl.h>
#include <dlfcn.h>
#include <fsdp/checkpoint.h>
#include <fsdp/fsdp.h>
#include <sched.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "data.h"
#include "model.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr double kPi = 3.14159265358979323846;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// ---------------------------------------------------------------------------------------------
// Flags

struct TrainConfig {
  int layers = 4;
  int width = 128;
  int heads = 4;
  int context = 64;
  int batch_per_rank = 8;
  int steps = 250;
  double lr = 1e-3;
  double min_lr = 1e-4;
  int warmup = -1;  // unset: a tenth of --steps
  std::string schedule = "cosine";
  double weight_decay = 0.1;
  uint64_t seed = 1;
  std::string strategy = "FULL_SHARD";
  int sharding_factor = 0;  // 0: the library's default for the strategy
  std::string wrap = "block";
  std::string backward_prefetch = "BACKWARD_PRE";
  bool forward_prefetch = true;
  int all_gather_limit = 2;  // 0: rate limiter off
  std::string init = "deferred";
  std::string data;  // empty: the fortunes corpus
  int log_interval = 25;
  int eval_batches = 8;
  std::string metrics_file;
  int sample_bytes = 200;
  std::string prompt = "The ";
  double temperature = 0.8;
  bool show_memory = false;
  // Training controls (docs/usage.md).
  std::string mixed_precision = "none";            // none, bf16, fp16
  int grad_accum = 1;                              // micro-batches per step
  std::string grad_accum_mode = "no-sync";         // how micro-batches other than the last treat gradients
  double clip_grad_norm = 0;                       // 0: no clipping
  std::string reshard_after_forward = "strategy";  // strategy, true, false, except-last
  int reshard_after_forward_size = 0;              // ranks a resharded block stays sharded over until backward
  bool activation_checkpointing = false;
  bool step_in_backward = false;     // FullyShardedModule::set_step_in_backward
  std::string step_thread = "auto";  // its fsdp::StepThread
  // Checkpoints (docs/checkpoints.md).
  std::string save_dir;
  int save_every = 0;  // 0: only at the end (and at --stop-after / SIGTERM)
  bool resume = false;
  int stop_after = 0;       // 0: run to --steps
  bool async_save = false;  // --save-every saves written in the background
  std::string export_file;
};

// Declares every flag on `app`, each parsed into its field of `config`.
void add_flags(CLI::App& app, TrainConfig& config) {
  app.add_option("--layers", config.layers, "Transformer blocks")->check(CLI::Range(1, 256))->capture_default_str();
  app.add_option("--width", config.width, "Embedding width")->check(CLI::Range(8, 16384))->capture_default_str();
  app.add_option("--heads", config.heads, "Attention heads (must divide --width)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--context", config.context, "Tokens per training sequence")
      ->check(CLI::Range(2, 8192))
      ->capture_default_str();
  app.add_option("--batch-per-rank", config.batch_per_rank,
                 "Sequences per rank per step; the global batch is "
                 "world size times this")
      ->check(CLI::Range(1, 1 << 16))
      ->capture_default_str();
  app.add_option("--grad-accum-mode", config.grad_accum_mode,
                 "With --grad-accum: no-sync (unsharded gradients kept local, parameters re-gathered per "
                 "micro-batch), no-sync-unsharded (the same, parameters kept unsharded between micro-batches: no "
                 "re-gather, more memory), reduce (every micro-batch reduce-scatters: least memory, most "
                 "communication), replica-deferred (HYBRID_SHARD: reduce-scatter in the shard group every "
                 "micro-batch, the replica all-reduce only on the last)")
      ->transform(CLI::IsMember({"no-sync", "no-sync-unsharded", "reduce", "replica-deferred"}, CLI::ignore_case))
      ->capture_default_str();
  app.add_option("--steps", config.steps, "Optimizer steps")->check(CLI::Range(1, 100000000))->capture_default_str();
  app.add_option("--lr", config.lr, "Peak learning rate (AdamW)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--min-lr", config.min_lr, "Learning rate at the end of the cosine decay")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--warmup", config.warmup, "Steps of linear warm-up from 0 to --lr (default: a tenth of --steps)")
      ->check(CLI::Range(0, 100000000));
  app.add_option("--schedule", config.schedule, "Learning-rate schedule after warm-up")
      ->transform(CLI::IsMember({"cosine", "constant"}, CLI::ignore_case))
      ->capture_default_str();
  app.add_option("--weight-decay", config.weight_decay, "AdamW weight decay for weight matrices and embeddings")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--seed", config.seed, "Seed for initialization, batches and sampling")->capture_default_str();
  app.add_option("--strategy", config.strategy, "FSDP sharding strategy")
      ->transform(CLI::IsMember({"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"}, CLI::ignore_case))
      ->capture_default_str();
  app.add_option("--sharding-factor", config.sharding_factor,
                 "HYBRID_SHARD: ranks per shard group (0: ranks per "
                 "host); others accept 0 or their implied factor")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  app.add_option("--wrap", config.wrap,
                 "FSDP units: 'block' makes every transformer block a unit, 'none' makes "
                 "the whole model one unit")
      ->transform(CLI::IsMember({"block", "none"}, CLI::ignore_case))
      ->capture_default_str();
  app.add_option("--backward-prefetch", config.backward_prefetch,
                 "When to gather the next unit in backward: "
                 "BACKWARD_PRE, BACKWARD_POST or NONE")
      ->capture_default_str();
  app.add_flag("--forward-prefetch,!--no-forward-prefetch", config.forward_prefetch,
               "Gather the next unit before computing the current "
               "one in forward (one more unit of memory)");
  app.add_option("--all-gather-limit", config.all_gather_limit,
                 "Rate limiter: most blocks unsharded at once; prefetching looks ahead until this many are "
                 "(3: one more block of memory, rides out uneven compute; 0: limiter off)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  app.add_option("--init", config.init,
                 "deferred: build the model on the meta device and let FSDP allocate, "
                 "initialize and shard one unit at a time; eager: build the whole model on every rank first "
                 "(same weights)")
      ->check(CLI::IsMember({"deferred", "eager"}))
      ->capture_default_str();
  app.add_option("--data", config.data,
                 std::string("Text file to train on (default: the fortunes in ") + gpt::kFortunesDir + ")")
      ->check(CLI::ExistingFile);
  app.add_option("--log-interval", config.log_interval, "Steps between log lines")
      ->check(CLI::Range(1, 100000000))
      ->capture_default_str();
  app.add_option("--eval-batches", config.eval_batches, "Held-out batches (16 sequences each) in each validation loss")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--metrics-file", config.metrics_file, "Write one JSON object per logged step to this file");
  app.add_option("--sample-bytes", config.sample_bytes, "Bytes to generate after training (0: none)")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  app.add_option("--prompt", config.prompt, "Start of the generated sample")->capture_default_str();
  app.add_option("--temperature", config.temperature, "Sampling temperature (0: greedy)")
      ->check(CLI::Range(0.0, 10.0))
      ->capture_default_str();
  app.add_flag("--show-memory", config.show_memory, "Print per-rank model-state memory next to NO_SHARD's");
  app.add_option("--mixed-precision", config.mixed_precision,
                 "none; bf16 (bf16 gathers and compute, fp32 reduction and master weights); fp16 (the same in "
                 "float16, with the sharded gradient scaler)")
      ->transform(CLI::IsMember({"none", "bf16", "fp16"}, CLI::ignore_case))
      ->capture_default_str();
  app.add_option("--grad-accum", config.grad_accum,
                 "Micro-batches per step (must divide --batch-per-rank); all but the last run without "
                 "gradient communication")
      ->check(CLI::Range(1, 1 << 16))
      ->capture_default_str();
  app.add_option("--clip-grad-norm", config.clip_grad_norm, "Clip the gradients' total 2-norm to this (0: off)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_flag("--activation-checkpointing", config.activation_checkpointing,
               "Keep only each block's input in forward and recompute the block in backward");
  app.add_flag("--step-in-backward", config.step_in_backward,
               "Step the optimizer on each unit's shard as soon as its gradients are reduced, overlapping the step "
               "with communication (not with --clip-grad-norm, fp16 or --grad-accum-mode reduce)");
  app.add_option("--step-thread", config.step_thread,
                 "With --step-in-backward, where the steps run: auto (a thread of their own under offload, else "
                 "backward's), backward, or own (a host thread beside backward)")
      ->transform(CLI::IsMember({"auto", "backward", "own"}, CLI::ignore_case))
      ->capture_default_str();
  app.add_option("--reshard-after-forward", config.reshard_after_forward,
                 "strategy (its own choice; FULL_SHARD keeps the block backward needs first from the second step "
                 "on), true or false for every block, or except-last (every block but the last, from the first step)")
      ->transform(CLI::IsMember({"strategy", "true", "false", "except-last"}, CLI::ignore_case))
      ->capture_default_str();
  app.add_option("--reshard-after-forward-size", config.reshard_after_forward_size,
                 "Blocks resharded after forward stay sharded over groups of this many consecutive ranks (e.g. "
                 "one host's) until backward, whose all-gathers then stay in the group; 0: free them completely")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--save-dir", config.save_dir,
                 "Save sharded checkpoints (model, AdamW state, data position) under "
                 "this directory as step-NNNNNNNN, at the end and on SIGTERM");
  app.add_option("--save-every", config.save_every, "Also save every N steps (needs --save-dir)")
      ->check(CLI::Range(0, 100000000));
  app.add_flag("--resume", config.resume,
               "Continue from the newest complete checkpoint under --save-dir (start "
               "afresh if there is none)");
  app.add_option("--stop-after", config.stop_after,
                 "Save and exit after this step; the schedule still follows "
                 "--steps (needs --save-dir)")
      ->check(CLI::Range(1, 100000000));
  app.add_flag("--async-save", config.async_save,
               "Write --save-every checkpoints in the background: training pauses only to copy its shards to "
               "host memory (the final, --stop-after and SIGTERM saves stay synchronous)");
  app.add_option("--export", config.export_file, "Write the trained model as one safetensors file");
}

// Checks that involve several flags, thrown as CLI::ValidationError like CLI11's own; resolves --warmup.
void check_flag_combinations(const fsdp::RankEnv& env, TrainConfig& config) {
  if (config.width % config.heads != 0)
    throw CLI::ValidationError(
        "--heads", std::to_string(config.heads) + " does not divide --width " + std::to_string(config.width));
  if (config.warmup < 0) config.warmup = config.steps / 10;
  if (config.warmup > config.steps)
    throw CLI::ValidationError("--warmup",
                               std::to_string(config.warmup) + " is more than --steps " + std::to_string(config.steps));
  if (config.min_lr > config.lr) throw CLI::ValidationError("--min-lr", "must not exceed --lr");
  if (config.prompt.empty()) throw CLI::ValidationError("--prompt", "must not be empty");
  if (config.mixed_precision == "fp16") {
    try {  // LibTorch 1.13 has no float16 matrix product on the CPU; 2.x and GPUs have
      torch::mm(torch::ones({2, 2}, torch::kHalf), torch::ones({2, 2}, torch::kHalf));
    } catch (const c10::Error&) {
      throw CLI::ValidationError("--mixed-precision", "fp16: this LibTorch has no float16 matrix product on the CPU; "
                                                      "use bf16 (or LibTorch 2.x, or a GPU)");
    }
  }
  if (config.grad_accum_mode == "replica-deferred" && config.strategy != "HYBRID_SHARD")
    throw CLI::ValidationError("--grad-accum-mode", "replica-deferred needs --strategy HYBRID_SHARD (got " +
                                                        config.strategy + "); use no-sync");
  if (!config.step_in_backward && config.step_thread != "auto")
    throw CLI::ValidationError("--step-thread", "says where the steps in backward run; add --step-in-backward");
  if (config.step_in_backward) {
    if (config.clip_grad_norm > 0)
      throw CLI::ValidationError("--step-in-backward",
                                 "cannot clip: each unit is stepped before the total norm exists; "
                                 "drop --clip-grad-norm or --step-in-backward");
    if (config.mixed_precision == "fp16")
      throw CLI::ValidationError("--step-in-backward", "fp16 loss scaling must unscale and check every gradient "
                                                       "before the step; use bf16 or drop --step-in-backward");
    if (config.grad_accum > 1 && config.grad_accum_mode == "reduce")
      throw CLI::ValidationError("--step-in-backward", "--grad-accum-mode reduce reduces every micro-batch, and "
                                                       "each reducing backward would step; use no-sync");
  }
  if (config.batch_per_rank % config.grad_accum != 0)
    throw CLI::ValidationError("--grad-accum", std::to_string(config.grad_accum) +
                                                   " does not divide --batch-per-rank " +
                                                   std::to_string(config.batch_per_rank));
  for (const auto& [flag, used] : {std::pair<const char*, bool>{"--save-every", config.save_every > 0},
                                   {"--resume", config.resume},
                                   {"--stop-after", config.stop_after > 0},
                                   {"--async-save", config.async_save}})
    if (used && config.save_dir.empty()) throw CLI::ValidationError(flag, "needs --save-dir");
  const int world = env.world_size, factor = config.sharding_factor;
  if (config.strategy == "HYBRID_SHARD" && factor != 0 && world % factor != 0)
    throw CLI::ValidationError("--sharding-factor", std::to_string(factor) + " does not divide the world size " +
                                                        std::to_string(world) + " (shard groups are " +
                                                        "consecutive ranks)");
  if ((config.strategy == "FULL_SHARD" || config.strategy == "SHARD_GRAD_OP") && factor != 0 && factor != world)
    throw CLI::ValidationError("--sharding-factor", config.strategy + " shards over all " + std::to_string(world) +
                                                        " ranks; use 0 or " + std::to_string(world) +
                                                        ", or --strategy HYBRID_SHARD to shard over fewer");
  if (config.strategy == "NO_SHARD" && factor > 1)
    throw CLI::ValidationError("--sharding-factor", "NO_SHARD does not shard; use 0 or 1");
}

// Returns -1 to go on, or the exit code (0 after --help). Only rank 0 prints, so a bad flag is
// reported once, while every rank exits with the same code.
int parse_flags(int argc, char** argv, const fsdp::RankEnv& env, TrainConfig& config) {
  CLI::App app{"Train a small GPT on text with libfsdp (Fully Sharded Data Parallel).", "fsdp_gpt"};
  app.get_formatter()->column_width(32);
  add_flags(app, config);
  try {
    app.parse(argc, argv);
    check_flag_combinations(env, config);
  } catch (const CLI::ParseError& e) {
    if (env.rank == 0) return app.exit(e);
    // Every rank fails alike; give rank 0 a moment to print before a launcher that stops all
    // ranks at the first failure stops it too.
    if (e.get_exit_code() != 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    return e.get_exit_code();
  }
  return -1;
}

// ---------------------------------------------------------------------------------------------
// Measurements

// CPUs this process may run on (respects taskset / cgroup cpusets, unlike the core count).
int usable_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
}

// OpenBLAS (Debian's LibTorch calls it for matmuls) keeps its own thread pool, sized from
// OMP_NUM_THREADS when it loads and left alone by torch::set_num_threads; without this, every
// rank started without OMP_NUM_THREADS (mpirun, srun) would run one BLAS thread per core.
void set_openblas_threads(int threads) {
  using SetThreads = void (*)(int);
  if (auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) set(threads);
}

// Resident set size of this process, from /proc/self/status (0 where unavailable).
int64_t resident_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;  // "VmRSS:  1234 kB"
  return 0;
}

// Matmul throughput of this rank in FLOP/s: a few 1024x1024 float matmuls, 2 * n^3 FLOPs each,
// on the rank's own thread count. All ranks measure at the same time (after a barrier), so ranks
// sharing a host also share its cores as they will while training, and the sum over ranks is the
// job's peak:  peak = sum over ranks r of 2 * n^3 * reps / seconds_r
//                   (= per-rank rate x ranks per host x hosts, for identical hosts).
// MFU = achieved model FLOP/s / peak. The fastest of several matmuls counts: a peak is what the
// hardware can do, and a slower one was interrupted (other processes on a shared machine),
// which would understate the peak and overstate MFU.
double measure_matmul_flops() {
  const int64_t n = 1024, reps = 8;
  auto a = torch::randn({n, n}), b = torch::randn({n, n});
  auto c = torch::mm(a, b);  // warm-up: thread pool start, page faults
  double fastest = 1e30;
  for (int i = 0; i < reps; ++i) {
    const auto start = Clock::now();
    c = torch::mm(a, b);
    fastest = std::min(fastest, seconds_since(start));
  }
  return 2.0 * n * n * n / fastest;
}

// Model FLOPs per trained token (forward + backward, PaLM's estimate): 6 per parameter (a
// multiply-add forward, two backward) plus the attention score and mixing matmuls,
// 2 matmuls x 2 FLOPs x context x width per layer forward, tripled for backward: 12 L T W.
double training_flops_per_token(int64_t parameters, const TrainConfig& c) {
  return 6.0 * static_cast<double>(parameters) + 12.0 * c.layers * c.context * c.width;
}

double learning_rate(int step, const TrainConfig& c) {
  if (step <= c.warmup) return c.lr * step / std::max(1, c.warmup);
  if (c.schedule == "constant" || c.steps == c.warmup) return c.lr;
  const double progress = static_cast<double>(step - c.warmup) / (c.steps - c.warmup);  // (0, 1]
  return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1.0 + std::cos(kPi * progress));
}

// ---------------------------------------------------------------------------------------------
// Output helpers (rank 0)

std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return (n < 0 ? "-" : "") + out;
}

std::string fixed(double v, int digits) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(digits) << v;
  return s.str();
}

std::string mib(int64_t bytes) { return fixed(bytes / (1024.0 * 1024.0), 2) + " MiB"; }

bool stdout_is_terminal(const fsdp::RankEnv& env) {
  const char* forced = std::getenv("FSDP_RUN_STDOUT_IS_TTY");  // set by fsdp-run, which pipes our stdout
  if (forced && std::string(forced) == "1") return true;
  // Open MPI gives every rank a pseudo-terminal even when mpirun's own output goes to a file, so
  // isatty() says nothing there; print no progress bar under mpirun.
  return env.source != "mpirun" && isatty(1);
}

// A one-line progress bar redrawn in place; log lines clear it first so they are not interleaved.
class ProgressBar {
 public:
  ProgressBar(bool enabled, int total) : enabled_(enabled), total_(total) {}
  void draw(int step, double loss, double elapsed_s) {
    if (!enabled_) return;
    const int width = 30, filled = static_cast<int>(int64_t{width} * step / total_);
    const double eta = step ? elapsed_s / step * (total_ - step) : 0.0;
    std::cout << "\r\033[K[" << std::string(filled, '#') << std::string(width - filled, '.') << "] " << step << "/"
              << total_ << "  loss " << fixed(loss, 4) << "  eta " << fixed(eta, 0) << "s" << std::flush;
    shown_ = true;
  }
  void clear() {
    if (shown_) std::cout << "\r\033[K" << std::flush;
    shown_ = false;
  }

 private:
  bool enabled_;
  int total_;
  bool shown_ = false;
};

// The sample for printing: the model emits arbitrary bytes, and invalid UTF-8 or control
// characters garble terminals and break log readers that decode UTF-8 (torchrun's log tailer
// stops at the first bad byte). Each such byte becomes U+FFFD; valid UTF-8, newlines and tabs stay.
std::string printable(const std::string& bytes) {
  const std::string replacement = "\xEF\xBF\xBD";  // U+FFFD
  std::string out;
  size_t i = 0;
  auto byte = [&](size_t k) {
    return k < bytes.size() ? static_cast<unsigned char>(bytes[k]) : 0u;
  };
  while (i < bytes.size()) {
    const unsigned c = byte(i);
    if (c < 0x80) {
      out += (c >= 0x20 && c != 0x7f) || c == '\n' || c == '\t' ? std::string(1, static_cast<char>(c)) : replacement;
      ++i;
      continue;
    }
    // Length and the allowed range of the second byte (which rules out overlong forms and
    // surrogates); later bytes are 0x80-0xBF.
    size_t length = 0;
    unsigned low = 0x80, high = 0xBF;
    if (c >= 0xC2 && c <= 0xDF)
      length = 2;
    else if (c == 0xE0)
      length = 3, low = 0xA0;
    else if (c == 0xED)
      length = 3, high = 0x9F;
    else if (c >= 0xE1 && c <= 0xEF)
      length = 3;
    else if (c == 0xF0)
      length = 4, low = 0x90;
    else if (c >= 0xF1 && c <= 0xF3)
      length = 4;
    else if (c == 0xF4)
      length = 4, high = 0x8F;
    bool valid = length > 0 && byte(i + 1) >= low && byte(i + 1) <= high;
    for (size_t k = 2; valid && k < length; ++k) valid = byte(i + k) >= 0x80 && byte(i + k) <= 0xBF;
    if (valid) {
      out.append(bytes, i, length);
      i += length;
    } else {
      out += replacement;
      ++i;
    }
  }
  return out;
}

// Which launcher convention told this process its rank (fsdp::RankEnv::source).
std::string launcher_variables(const fsdp::RankEnv& env) {
  if (env.source == "torchrun") return "RANK, WORLD_SIZE from fsdp-run or torchrun";
  if (env.source == "mpirun") return "OMPI_COMM_WORLD_* from mpirun";
  if (env.source == "srun") return "SLURM_* from srun";
  return "no launcher";
}

void print_table(const std::vector<std::pair<std::string, std::string>>& rows) {
  size_t key_width = 0;
  for (const auto& row : rows) key_width = std::max(key_width, row.first.size());
  for (const auto& row : rows)
    std::cout << "  " << std::left << std::setw(key_width + 2) << row.first << row.second << "\n";
  std::cout << std::right;
}

// Model state each rank keeps between steps: parameters, gradients and AdamW's two moments, for
// this run's shards next to a replica's (NO_SHARD: every rank holds all N parameters).
void print_memory_comparison(const fsdp::FullyShardedModule& sharded, int64_t parameter_count) {
  int64_t param_bytes = 0, trainable_bytes = 0;
  for (const auto& piece : sharded.parameters()) {
    const int64_t bytes = piece.numel() * piece.element_size();
    param_bytes += bytes;
    if (piece.requires_grad()) trainable_bytes += bytes;
  }
  const int64_t replica_bytes = parameter_count * static_cast<int64_t>(sizeof(float));
  const int64_t ours = param_bytes + 3 * trainable_bytes, replicated = 4 * replica_bytes;
  auto row = [](const std::string& name, int64_t p, int64_t g, int64_t adam) {
    std::cout << "  " << std::left << std::setw(30) << name << std::right << std::setw(12) << mib(p) << std::setw(12)
              << mib(g) << std::setw(12) << mib(adam) << std::setw(12) << mib(p + g + adam) << "\n";
  };
  std::cout << "\nmodel-state memory per rank (rank 0; fp32 parameters + gradients + AdamW moments):\n";
  std::cout << "  " << std::left << std::setw(30) << "" << std::right << std::setw(12) << "params" << std::setw(12)
            << "grads" << std::setw(12) << "AdamW" << std::setw(12) << "total"
            << "\n";
  row(fsdp::to_string(sharded.sharding_strategy()) + " (this run, F=" + std::to_string(sharded.sharding_factor()) + ")",
      param_bytes, trainable_bytes, 2 * trainable_bytes);
  row("NO_SHARD (full replica)", replica_bytes, replica_bytes, 2 * replica_bytes);
  std::cout << "  this run keeps " << fixed(100.0 * ours / replicated, 1) << "% of a replica's model state on each "
            << "rank,\n  plus units gathered while they run (the 'fsdp peak' column of the step log)\n";
}

// ---------------------------------------------------------------------------------------------
// Training pieces

// Batch streams: independent random sequences for training and validation windows.
constexpr uint64_t kTrainStream = 1, kValidationStream = 2, kSampleStream = 3;

torch::Tensor next_token_loss(gpt::GPT& model, const gpt::Batch& batch) {
  auto logits = model->forward(batch.inputs).to(torch::kFloat);  // the loss in float32 under mixed precision
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), batch.targets.reshape({-1}));
}

// Validation batches have a fixed size, so the loss is comparable across world sizes and batch sizes.
constexpr int64_t kValidationRows = 16;

// Mean loss over a fixed set of held-out batches. Every rank evaluates the same batches (the
// forwards are collective), so every rank gets the same number without a reduction.
double validation_loss(gpt::GPT& model, const torch::Tensor& tokens, const TrainConfig& c) {
  torch::NoGradGuard no_grad;
  double total = 0.0;
  for (int i = 0; i < c.eval_batches; ++i) {
    const auto batch = gpt::sample_batch(tokens, c.context, gpt::batch_key(c.seed, kValidationStream, i),
                                         kValidationRows, 0, kValidationRows);
    total += next_token_loss(model, batch).item<double>();
  }
  return total / c.eval_batches;
}

// Samples `bytes` tokens after `prompt`, feeding back at most `context` tokens each time. Every
// rank runs it with the same generator seed, so all ranks agree on every token.
std::string generate(gpt::GPT& model, const std::string& prompt, const TrainConfig& c) {
  torch::NoGradGuard no_grad;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(gpt::batch_key(c.seed, kSampleStream, 0));
  auto tokens = gpt::encode(prompt);
  for (int i = 0; i < c.sample_bytes; ++i) {
    const int64_t window = std::min<int64_t>(tokens.numel(), c.context);
    auto logits = model->forward(tokens.narrow(0, tokens.numel() - window, window).unsqueeze(0));
    auto last = logits[0][window - 1];
    torch::Tensor next;
    if (c.temperature == 0.0) {
      next = last.argmax().reshape({1});
    } else {
      next = torch::multinomial(torch::softmax(last / c.temperature, -1), 1, false, generator);
    }
    tokens = torch::cat({tokens, next});
  }
  return gpt::decode(tokens);
}

// ---------------------------------------------------------------------------------------------
// Checkpoints: --save-dir, --save-every, --resume, --stop-after, --export, and SIGTERM

volatile std::sig_atomic_t g_stop_requested = 0;
void request_stop(int) { g_stop_requested = 1; }

// Preemption (Slurm, Kubernetes) sends SIGTERM before killing: finish the step, save, exit.
void install_stop_handler() {
  struct sigaction action {};
  action.sa_handler = request_stop;
  action.sa_flags = SA_RESTART;  // blocking calls in the communicators resume instead of failing
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
}

// True on every rank when any rank got SIGTERM, so that all stop after the same step.
bool stop_requested_anywhere(fsdp::ProcessGroup& pg) {
  auto flag = torch::tensor({static_cast<int64_t>(g_stop_requested)}, torch::kLong);
  if (pg.size() > 1) pg.world()->all_reduce(flag)->wait();
  return flag.item<int64_t>() > 0;
}

// What the trainer adds to a checkpoint to continue exactly: the step (batches and the learning
// rate follow from it), each rank's unlogged loss window, and the default generator's state.
struct Progress {
  int step = 0;
  double window_loss = 0.0;
  int window_steps = 0;
};

// A double as its 8 bytes (exact), and back.
std::string double_bytes(double v) { return std::string(reinterpret_cast<const char*>(&v), sizeof(v)); }
double double_of_bytes(const std::string& s, const std::string& what) {
  if (s.size() != sizeof(double)) throw std::runtime_error("checkpoint field " + what + " is not 8 bytes");
  double v;
  std::memcpy(&v, s.data(), sizeof(v));
  return v;
}

fsdp::checkpoint::Extra progress_extra(fsdp::ProcessGroup& pg, const TrainConfig& c, const Progress& p,
                                       const fsdp::GradScaler* scaler) {
  auto losses = torch::zeros({pg.size()}, torch::kDouble);
  losses[pg.rank()] = p.window_loss;
  if (pg.size() > 1) pg.world()->all_reduce(losses)->wait();  // every rank's, in rank order
  auto generator = at::detail::getDefaultCPUGenerator();
  at::Tensor rng;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    rng = generator.get_state();
  }
  fsdp::checkpoint::Extra extra{
      {"step", std::to_string(p.step)},
      {"window_steps", std::to_string(p.window_steps)},
      {"window_loss", std::string(static_cast<const char*>(losses.data_ptr()), losses.nbytes())},
      {"cpu_rng_state", std::string(static_cast<const char*>(rng.data_ptr()), rng.nbytes())},
      {"seed", std::to_string(c.seed)},
      {"world_size", std::to_string(pg.size())}};
  if (scaler) {  // --mixed-precision fp16: the loss scale and its growth count continue on resume
    extra["grad_scale"] = double_bytes(scaler->get_scale());
    extra["grad_scaler_growth_tracker"] = std::to_string(scaler->growth_tracker());
  }
  return extra;
}

// A --async-save checkpoint still being written, announced when it is done.
struct PendingSave {
  fsdp::checkpoint::SaveHandle handle;
  std::string dir;
  int step = 0;
  // Waits for it and says so (rank 0); rethrows its error.
  void finish(const fsdp::ProcessGroup& pg) {
    if (dir.empty()) return;
    handle.wait();
    if (pg.rank() == 0) std::cout << "checkpoint: saved step " << step << " to " << dir << " (in the background)\n";
    dir.clear();
  }
};

// Saves step-NNNNNNNN under --save-dir; in the background (into `pending`) when `background`.
void save_checkpoint(fsdp::ProcessGroup& pg, const TrainConfig& c, fsdp::FullyShardedModule& sharded,
                     torch::optim::Optimizer& optimizer, const Progress& p, const fsdp::GradScaler* scaler,
                     bool background, PendingSave& pending) {
  pending.finish(pg);
  const auto start = Clock::now();
  char name[32];
  std::snprintf(name, sizeof(name), "step-%08d", p.step);
  const std::string dir = c.save_dir + "/" + name;
  const auto options = fsdp::checkpoint::SaveOptions().overwrite(true);
  if (background) {
    pending.handle = fsdp::checkpoint::async_save(dir, sharded, optimizer, progress_extra(pg, c, p, scaler), options);
    pending.dir = dir;
    pending.step = p.step;
    if (pg.rank() == 0)
      std::cout << "checkpoint: saving step " << p.step << " to " << dir << " in the background (training paused "
                << fixed(seconds_since(start), 3) << " s)\n"
                << std::flush;
    return;
  }
  fsdp::checkpoint::save(dir, sharded, optimizer, progress_extra(pg, c, p, scaler), options);
  if (pg.rank() == 0)
    std::cout << "checkpoint: saved step " << p.step << " to " << dir << " in " << fixed(seconds_since(start), 2)
              << " s\n"
              << std::flush;
}

// --resume: loads the newest complete checkpoint under --save-dir; returns where to continue.
Progress resume(fsdp::ProcessGroup& pg, const TrainConfig& c, fsdp::FullyShardedModule& sharded,
                torch::optim::Optimizer& optimizer, fsdp::GradScaler* scaler) {
  const std::string dir = fsdp::checkpoint::latest(c.save_dir);
  // Every rank must pick the same one (a shared file system): compare a hash of the path.
  const double h = static_cast<double>(std::hash<std::string>{}(dir) % 1000003);
  auto moments = torch::tensor({h, h * h}, torch::kDouble);
  if (pg.size() > 1) pg.world()->all_reduce(moments)->wait();
  if (moments[1].item<double>() * pg.size() != moments[0].item<double>() * moments[0].item<double>())
    throw std::runtime_error("ranks found different checkpoints under --save-dir " + c.save_dir +
                             "; put it on a file system every rank sees");
  Progress p;
  if (dir.empty()) {
    if (pg.rank() == 0) std::cout << "checkpoint: none complete under " << c.save_dir << "; starting at step 1\n";
    return p;
  }
  fsdp::checkpoint::Extra extra;
  fsdp::checkpoint::load(dir, sharded, optimizer, &extra);
  if (extra.at("seed") != std::to_string(c.seed))
    throw std::runtime_error(dir + " was written with --seed " + extra.at("seed") + "; resume with the same flags");
  p.step = std::stoi(extra.at("step"));
  p.window_steps = std::stoi(extra.at("window_steps"));
  const std::string& losses = extra.at("window_loss");
  std::vector<double> per_rank(losses.size() / sizeof(double));
  std::memcpy(per_rank.data(), losses.data(), per_rank.size() * sizeof(double));
  if (static_cast<int>(per_rank.size()) == pg.size())
    p.window_loss = per_rank[pg.rank()];
  else if (pg.rank() == 0)
    for (double l : per_rank) p.window_loss += l;  // another world size: same sum
  if (scaler && extra.count("grad_scale"))         // a checkpoint of a run without fp16 starts the scaler afresh
    scaler->load(double_of_bytes(extra.at("grad_scale"), "grad_scale"),
                 std::stoll(extra.at("grad_scaler_growth_tracker")));
  const std::string& rng = extra.at("cpu_rng_state");
  auto state = torch::empty({static_cast<int64_t>(rng.size())}, torch::kByte);
  std::memcpy(state.data_ptr(), rng.data(), rng.size());
  auto generator = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(state);
  }
  if (pg.rank() == 0) std::cout << "checkpoint: resumed from " << dir << " at step " << p.step << "\n" << std::flush;
  return p;
}

// " [rank R]" once the rank is known, for error messages (under any launcher, not only those setting RANK).
std::string g_rank_label;

// ---------------------------------------------------------------------------------------------
// Steps of a run, in order

// The launcher's rank environment (and g_rank_label); a single process's where it is broken.
fsdp::RankEnv read_rank_env() {
  fsdp::RankEnv env;
  try {
    env = fsdp::RankEnv::from_env();
    if (env.world_size > 1) g_rank_label = " [rank " + std::to_string(env.rank) + "]";
  } catch (const fsdp::Error&) {
    // A broken launcher environment: parse flags as a single process; ProcessGroup::from_env
    // reports the problem once the flags are parsed.
  }
  return env;
}

// Sets this rank's compute threads (unless OMP_NUM_THREADS did) and returns how many it uses.
int set_threads_per_rank(const fsdp::RankEnv& env) {
  // Ranks on one host share its cores. OMP_NUM_THREADS, if set, is the user's choice (LibTorch
  // already applied it); otherwise split the usable cores between the local ranks, since more
  // threads than cores makes every rank slower.
  if (!std::getenv("OMP_NUM_THREADS")) {
    const int threads = std::max(1, usable_cpus() / env.local_world_size);
    torch::set_num_threads(threads);
    set_openblas_threads(threads);
  }
  return torch::get_num_threads();
}

struct TrainingData {
  gpt::Corpus corpus;
  gpt::TokenSplits splits;
};

// The corpus, split the same way on every rank; nullopt (rank 0 says why) if too short for --context.
std::optional<TrainingData> load_data(const TrainConfig& config, bool is_main) {
  TrainingData data{config.data.empty() ? gpt::load_fortunes() : gpt::load_text_file(config.data), {}};
  data.splits = gpt::split_train_validation(gpt::encode(data.corpus.text));
  const auto& splits = data.splits;
  if (std::min(splits.train.numel(), splits.validation.numel()) <= config.context + 1) {
    if (is_main)
      std::cerr << "error: the text has " << data.corpus.text.size() << " bytes, split into " << splits.train.numel()
                << " for training and " << splits.validation.numel() << " for validation; each must be longer "
                << "than --context " << config.context << " + 1. Use a longer text or a shorter context.\n";
    return std::nullopt;
  }
  return data;
}

struct MatmulPeak {
  double rank0_flops = 0.0;  // this rank's own rate (printed by rank 0)
  double job_flops = 0.0;    // the sum over all ranks
};

// Peak matmul rate, measured by all ranks at once (see measure_matmul_flops).
MatmulPeak measure_peak(fsdp::ProcessGroup& pg) {
  if (pg.size() > 1) pg.world()->barrier();
  auto peak = torch::tensor({measure_matmul_flops()}, torch::kDouble);
  MatmulPeak result;
  result.rank0_flops = peak.item<double>();
  if (pg.size() > 1) pg.world()->all_reduce(peak)->wait();
  result.job_flops = peak.item<double>();
  return result;
}

// Falls back to --init eager, saying so on rank 0, where this LibTorch cannot defer initialization.
void resolve_init(TrainConfig& config, int rank) {
  if (config.init == "deferred" && !fsdp::DeferredInit::supported()) {
    if (rank == 0) std::cerr << "fsdp_gpt: this LibTorch cannot defer initialization; building the model eagerly\n";
    config.init = "eager";
  }
}

struct BuiltModel {
  gpt::GPTConfig config;
  gpt::GPT model{nullptr};
  int64_t parameter_count = 0;
  std::map<std::string, int64_t> original_dims;  // each parameter's rank, by name
};

// The model as it would be built without FSDP, seeded with --seed (deferred: no parameter memory).
BuiltModel build_model(const TrainConfig& config) {
  torch::manual_seed(config.seed);
  BuiltModel built;
  built.config.context = config.context;
  built.config.width = config.width;
  built.config.layers = config.layers;
  built.config.heads = config.heads;
  built.config.activation_checkpointing = config.activation_checkpointing;
  if (config.init == "deferred") {
    fsdp::DeferredInit deferred;  // no parameter memory until fully_shard materializes each unit
    built.model = gpt::GPT(built.config);
  } else {
    built.model = gpt::GPT(built.config);
  }
  built.parameter_count = gpt::count_parameters(*built.model);
  // Weight decay applies to matrices (weights, embeddings), not to biases or LayerNorm gains. The
  // shard pieces are 1-D, so remember each parameter's original rank by name.
  for (const auto& item : built.model->named_parameters()) built.original_dims[item.key()] = item.value().dim();
  return built;
}

// fully_shard with the flags' strategy, prefetching and wrapping; initializes deferred units.
std::shared_ptr<fsdp::FullyShardedModule> shard_model(BuiltModel& built, const TrainConfig& config,
                                                      fsdp::ProcessGroupPtr pg) {
  const gpt::GPTConfig model_config = built.config;
  auto options = fsdp::Options()
                     .sharding_strategy(fsdp::parse_sharding_strategy(config.strategy))
                     .sharding_factor(config.sharding_factor)
                     .backward_prefetch(fsdp::parse_backward_prefetch(config.backward_prefetch))
                     .forward_prefetch(config.forward_prefetch)
                     .limit_all_gathers(config.all_gather_limit > 0)
                     .all_gather_limit(std::max(1, config.all_gather_limit))
                     .param_init_fn([model_config](const std::string& name, torch::nn::Module& module) {
                       gpt::initialize(model_config, name, module);
                     });
  if (config.wrap == "block") options.auto_wrap_policy(fsdp::wrap::by_type<gpt::BlockImpl>());
  if (config.mixed_precision != "none")
    options.mixed_precision(fsdp::MixedPrecision()
                                .param_dtype(config.mixed_precision == "bf16" ? torch::kBFloat16 : torch::kFloat16)
                                .reduce_dtype(torch::kFloat32));
  if (config.reshard_after_forward != "strategy") {
    const std::string choice = config.reshard_after_forward;
    const std::string last = "blocks." + std::to_string(config.layers - 1);
    options.reshard_after_forward([choice, last](const std::string& name, const torch::nn::Module&) {
      return c10::optional<bool>(choice == "true" || (choice == "except-last" && name != last));
    });
  }
  options.reshard_after_forward_size(config.reshard_after_forward_size);
  return fsdp::fully_shard(built.model, std::move(pg), options);
}

// AdamW over the shard pieces, weight decay on the pieces of matrices only; checked by FSDP.
std::unique_ptr<torch::optim::AdamW> build_optimizer(fsdp::FullyShardedModule& sharded,
                                                     const std::map<std::string, int64_t>& original_dims,
                                                     const TrainConfig& config) {
  std::vector<torch::Tensor> decayed, not_decayed;
  for (const auto& [name, piece] : sharded.named_parameters())
    (original_dims.at(name) >= 2 ? decayed : not_decayed).push_back(piece);
  // beta2 0.99 instead of 0.999 (nanoGPT's choice for small character-level runs): the
  // second-moment estimate then adapts within ~100 steps, a fraction of a run this short.
  auto adamw = [&](double weight_decay) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(config.lr).betas({0.9, 0.99}).weight_decay(weight_decay));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decayed, adamw(config.weight_decay));
  groups.emplace_back(not_decayed, adamw(0.0));
  auto optimizer = std::make_unique<torch::optim::AdamW>(std::move(groups), *adamw(config.weight_decay));
  sharded.check_optimizer(*optimizer);
  return optimizer;
}

// Figures of the whole job that the configuration and the step log report.
struct JobFigures {
  int world = 1;
  int threads_per_rank = 1;
  int64_t tokens_per_step = 0;
  double flops_per_token = 0.0;
  MatmulPeak peak;
};

// What --grad-accum-mode does with the micro-batches before the last, for the configuration table.
std::string grad_accum_mode_description(const std::string& mode) {
  if (mode == "no-sync") return "all but the last without communication";
  if (mode == "no-sync-unsharded") return "all but the last without communication, parameters kept unsharded";
  if (mode == "reduce") return "every one reduce-scattered";
  return "every one reduce-scattered in the shard group, the replica all-reduce on the last";
}

// Rank 0: the resolved configuration table, the units, and (--show-memory) the memory comparison.
void print_configuration(const TrainConfig& config, const fsdp::RankEnv& env, const JobFigures& job,
                         const fsdp::FullyShardedModule& sharded, const BuiltModel& built, const TrainingData& data) {
  const int world = job.world, threads_per_rank = job.threads_per_rank;
  const int64_t units = static_cast<int64_t>(sharded.units().size());
  std::cout << "fsdp_gpt configuration\n";
  print_table({
      {"world size", std::to_string(world) + " (" + std::to_string(env.local_world_size) + " on this host, " +
                         std::to_string(threads_per_rank) + " thread" + (threads_per_rank == 1 ? "" : "s") +
                         " per rank; " + launcher_variables(env) + ")"},
      {"strategy", fsdp::to_string(sharded.sharding_strategy())},
      {"sharding factor", std::to_string(sharded.sharding_factor())},
      {"wrap", config.wrap == "block" ? "block (every BlockImpl is a unit, plus the root)"
                                      : "none (the whole model is one unit)"},
      {"units", std::to_string(units)},
      {"reshard after forward",
       (config.reshard_after_forward == "strategy" ? std::string("the strategy's choice")
                                                   : config.reshard_after_forward + " (--reshard-after-forward)") +
           (config.reshard_after_forward_size
                ? ", then sharded over groups of " + std::to_string(config.reshard_after_forward_size) +
                      " ranks until backward"
                : std::string())},
      {"mixed precision", config.mixed_precision == "none"
                              ? std::string("none (float32)")
                              : config.mixed_precision + " gathers and compute, float32 reduction and master weights" +
                                    (config.mixed_precision == "fp16" ? ", sharded gradient scaler" : "")},
      {"grad accumulation", std::to_string(config.grad_accum) + " micro-batch" + (config.grad_accum == 1 ? "" : "es") +
                                " of " + std::to_string(config.batch_per_rank / config.grad_accum) + " per step" +
                                (config.grad_accum > 1 ? " (" + config.grad_accum_mode + ": " +
                                                             grad_accum_mode_description(config.grad_accum_mode) + ")"
                                                       : std::string())},
      {"activation checkpointing", config.activation_checkpointing ? "every block (recomputed in backward)" : "off"},
      {"optimizer step", config.step_in_backward
                             ? "in backward, unit by unit as gradients are reduced (thread: " + config.step_thread + ")"
                             : std::string("after backward")},
      {"gradient clipping", config.clip_grad_norm > 0 ? "total 2-norm " + fixed(config.clip_grad_norm, 3) : "off"},
      {"prefetch",
       "backward " + fsdp::to_string(fsdp::parse_backward_prefetch(config.backward_prefetch)) + ", forward " +
           (config.forward_prefetch ? "on" : "off") + ", rate limiter " +
           (config.all_gather_limit > 0 ? std::to_string(config.all_gather_limit) + " units" : std::string("off"))},
      {"parameters", with_commas(built.parameter_count) + " (tied embedding and head counted once); initialization " +
                         (config.init == "deferred" ? "deferred (unit by unit in fully_shard)" : "eager")},
      {"model", std::to_string(config.layers) + " layers, width " + std::to_string(config.width) + ", " +
                    std::to_string(config.heads) + " heads, context " + std::to_string(config.context) +
                    ", vocab 256 (bytes)"},
      {"batch", std::to_string(config.batch_per_rank) + " sequences per rank; global " +
                    std::to_string(world * config.batch_per_rank) + " x " + std::to_string(config.context) + " = " +
                    with_commas(job.tokens_per_step) + " tokens per step"},
      {"steps", std::to_string(config.steps) + " (log every " + std::to_string(config.log_interval) + ")"},
      {"optimizer", "AdamW, lr " + fixed(config.lr, 6) + ", warm-up " + std::to_string(config.warmup) + ", then " +
                        (config.schedule == "cosine" ? "cosine to " + fixed(config.min_lr, 6) : "constant") +
                        ", weight decay " + fixed(config.weight_decay, 3)},
      {"data", data.corpus.description},
      {"tokens", with_commas(static_cast<int64_t>(data.corpus.text.size())) +
                     " bytes: " + with_commas(data.splits.train.numel()) + " train, " +
                     with_commas(data.splits.validation.numel()) + " validation"},
      {"seed", std::to_string(config.seed)},
      {"FLOPs per token", fixed(job.flops_per_token / 1e6, 2) + " M (6N + 12 L T W)"},
      {"matmul peak", fixed(job.peak.job_flops / 1e12, 4) +
                          " TFLOP/s for the job (rank 0: " + fixed(job.peak.rank0_flops / 1e9, 1) +
                          " GFLOP/s: fastest of 8 1024x1024 matmuls, all ranks running)"},
  });
  std::cout << sharded.describe();
  if (config.show_memory) print_memory_comparison(sharded, built.parameter_count);
  std::cout << std::flush;
}

// Rank 0 with --metrics-file: the open file (throws if it cannot be written); otherwise not open.
std::ofstream open_metrics(const TrainConfig& config, bool is_main) {
  std::ofstream metrics;
  if (is_main && !config.metrics_file.empty()) {
    metrics.open(config.metrics_file);
    if (!metrics) throw std::runtime_error("cannot write --metrics-file " + config.metrics_file);
  }
  return metrics;
}

// What the training loop hands on to the report.
struct TrainingResult {
  double train_seconds = 0.0;
  double last_logged_loss = 0.0;
  int64_t param_peak_bytes = 0, grad_peak_bytes = 0;  // FSDP peaks over the logged windows
  int stopped_after = 0;  // --stop-after or SIGTERM: the step after which it saved and stopped
};

// What the training loop works with, set up before it.
struct TrainingLoop {
  const TrainConfig& config;
  fsdp::ProcessGroup& pg;
  gpt::GPT& model;
  fsdp::FullyShardedModule& sharded;
  torch::optim::AdamW& optimizer;
  const torch::Tensor& train_tokens;
  const JobFigures& job;
  std::ofstream& metrics;  // open on rank 0 with --metrics-file only
  Clock::time_point program_start;
  bool is_main;
  fsdp::GradScaler* scaler = nullptr;  // --mixed-precision fp16
};

// The steps since the last log line: their time and their summed local losses.
struct LogWindow {
  double seconds = 0.0, loss = 0.0;
  int steps = 0;
};

// One optimizer step at `lr` on this rank's rows of the step's global batch; returns the rank's loss.
double train_step(const TrainingLoop& loop, int step, double lr) {
  const TrainConfig& config = loop.config;
  for (auto& group : loop.optimizer.param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  const int64_t world = loop.pg.size(), rank = loop.pg.rank();
  const auto batch =
      gpt::sample_batch(loop.train_tokens, config.context, gpt::batch_key(config.seed, kTrainStream, step),
                        world * config.batch_per_rank, rank * config.batch_per_rank, config.batch_per_rank);
  loop.optimizer.zero_grad();
  // --grad-accum micro-batches; all but the last treat their gradients as --grad-accum-mode says.
  const int64_t micro = config.batch_per_rank / config.grad_accum;
  const std::string& mode = config.grad_accum_mode;
  double loss_sum = 0;
  for (int m = 0; m < config.grad_accum; ++m) {
    gpt::Batch part{batch.inputs.narrow(0, m * micro, micro), batch.targets.narrow(0, m * micro, micro)};
    const bool last = m + 1 == config.grad_accum;
    std::optional<fsdp::FullyShardedModule::NoSyncGuard> no_sync;
    if (!last && (mode == "no-sync" || mode == "no-sync-unsharded")) no_sync.emplace(loop.sharded.no_sync());
    if (mode == "no-sync-unsharded") loop.sharded.set_reshard_after_backward(last);
    if (mode == "replica-deferred") loop.sharded.set_requires_all_reduce(last);
    auto loss = next_token_loss(loop.model, part) / config.grad_accum;
    (loop.scaler ? loop.scaler->scale(loss) : loss).backward();
    loss_sum += loss.item<double>();
  }
  if (loop.scaler && config.clip_grad_norm > 0) loop.scaler->unscale_(loop.optimizer);
  if (config.clip_grad_norm > 0) loop.sharded.clip_grad_norm_(config.clip_grad_norm);
  if (loop.scaler) {
    loop.scaler->step(loop.optimizer);
    loop.scaler->update();
  } else {
    loop.optimizer.step();
  }
  return loss_sum;
}

// Closes a log window (collective): rank 0 logs its mean loss, speed and memory; a new window starts.
void log_window(const TrainingLoop& loop, int step, double lr, double local_loss, LogWindow& window,
                TrainingResult& result, ProgressBar& progress) {
  const TrainConfig& config = loop.config;
  const int world = loop.pg.size();
  // The logged loss is the mean over the window's steps and over all ranks' slices.
  auto loss_sum = torch::tensor({window.loss}, torch::kDouble);
  if (world > 1) loop.pg.world()->all_reduce(loss_sum)->wait();
  const double mean_loss = loss_sum.item<double>() / (window.steps * world);
  result.last_logged_loss = mean_loss;

  const double ms_per_step = 1000.0 * window.seconds / window.steps;
  const double tokens_per_s = loop.job.tokens_per_step * window.steps / window.seconds;
  const double model_flops = loop.job.flops_per_token * tokens_per_s;
  const double peak_flops = loop.job.peak.job_flops;
  const auto memory = loop.sharded.memory_stats();
  const int64_t fsdp_peak = memory.param_peak_bytes + memory.grad_peak_bytes;
  result.param_peak_bytes = std::max(result.param_peak_bytes, memory.param_peak_bytes);
  result.grad_peak_bytes = std::max(result.grad_peak_bytes, memory.grad_peak_bytes);
  const int64_t rss = resident_bytes();
  if (loop.is_main) {
    progress.clear();
    std::cout << "step " << std::setw(std::to_string(config.steps).size()) << step << "/" << config.steps << " | loss "
              << fixed(mean_loss, 4) << " | lr " << std::scientific << std::setprecision(2) << lr << std::defaultfloat
              << " | " << std::setw(7) << fixed(ms_per_step, 1) << " ms/step | " << std::setw(7)
              << with_commas(std::llround(tokens_per_s)) << " tok/s | " << fixed(model_flops / 1e12, 4)
              << " TFLOP/s | MFU " << fixed(100.0 * model_flops / peak_flops, 1) << "% | fsdp peak " << mib(fsdp_peak)
              << " | rss " << fixed(rss / 1048576.0, 0) << " MiB\n"
              << std::flush;
    progress.draw(step, local_loss, result.train_seconds);
    if (loop.metrics.is_open())
      loop.metrics << nlohmann::json{{"step", step},
                                     {"loss", mean_loss},
                                     {"lr", lr},
                                     {"ms_per_step", ms_per_step},
                                     {"tokens_per_s", tokens_per_s},
                                     {"model_tflops", model_flops / 1e12},
                                     {"mfu", model_flops / peak_flops},
                                     {"fsdp_param_peak_bytes", memory.param_peak_bytes},
                                     {"fsdp_grad_peak_bytes", memory.grad_peak_bytes},
                                     {"rss_bytes", rss},
                                     {"elapsed_s", seconds_since(loop.program_start)}}
                          .dump()
                   << "\n"
                   << std::flush;
  }
  loop.sharded.reset_peak_memory_stats();
  window = LogWindow();
}

// Runs --steps optimizer steps, logging at step 1, every --log-interval steps and at the last.
TrainingResult train(const TrainingLoop& loop) {
  const TrainConfig& config = loop.config;
  ProgressBar progress(loop.is_main && stdout_is_terminal(loop.pg.env()), config.steps);
  loop.sharded.reset_peak_memory_stats();
  TrainingResult result;
  LogWindow window;
  const Progress resumed =
      config.resume ? resume(loop.pg, config, loop.sharded, loop.optimizer, loop.scaler) : Progress{};
  window.loss = resumed.window_loss, window.steps = resumed.window_steps;
  if (!config.save_dir.empty()) install_stop_handler();
  PendingSave pending;
  for (int step = resumed.step + 1; step <= config.steps; ++step) {
    const auto step_start = Clock::now();
    const double lr = learning_rate(step, config);
    const double local_loss = train_step(loop, step, lr);
    const double step_seconds = seconds_since(step_start);
    result.train_seconds += step_seconds;
    window.seconds += step_seconds;
    window.loss += local_loss;
    ++window.steps;
    progress.draw(step, local_loss, result.train_seconds);
    if (step == 1 || step % config.log_interval == 0 || step == config.steps)
      log_window(loop, step, lr, local_loss, window, result, progress);
    if (!config.save_dir.empty()) {
      const bool stop = step == config.stop_after || stop_requested_anywhere(loop.pg);
      const bool last = stop || step == config.steps;
      if (last || (config.save_every > 0 && step % config.save_every == 0)) {
        progress.clear();
        save_checkpoint(loop.pg, config, loop.sharded, loop.optimizer, Progress{step, window.loss, window.steps},
                        loop.scaler, config.async_save && !last, pending);
      }
      if (stop && step < config.steps) {
        result.stopped_after = step;
        break;
      }
    }
  }
  pending.finish(loop.pg);
  progress.clear();
  return result;
}

// Rank 0: validation losses, peak memory (--show-memory), the sample and the summary line.
void print_report(const TrainConfig& config, const JobFigures& job, const TrainingResult& result, double val_loss_start,
                  double val_loss_end, const std::string& sample, Clock::time_point program_start) {
  std::cout << "validation loss after training: " << fixed(val_loss_end, 4) << " (before: " << fixed(val_loss_start, 4)
            << ")\n";
  if (config.show_memory)
    std::cout << "rank 0 FSDP peak during training: parameters " << mib(result.param_peak_bytes) << ", gradients "
              << mib(result.grad_peak_bytes) << "\n";
  if (!sample.empty())
    std::cout << "\n--- sample (temperature " << config.temperature << ") ---\n" << printable(sample) << "\n---\n\n";
  std::cout << "done: " << config.steps << " steps in " << fixed(seconds_since(program_start), 1) << " s ("
            << fixed(result.train_seconds, 1) << " s training) | final train loss " << fixed(result.last_logged_loss, 4)
            << " | val loss " << fixed(val_loss_start, 4) << " -> " << fixed(val_loss_end, 4) << " | mean "
            << with_commas(std::llround(job.tokens_per_step * config.steps / result.train_seconds)) << " tok/s\n"
            << std::flush;
}

// The whole program on one rank: flags, set-up, training, evaluation and report; the exit code.
int run(int argc, char** argv) {
  const auto program_start = Clock::now();
  const fsdp::RankEnv env = read_rank_env();
  TrainConfig config;
  if (const int code = parse_flags(argc, argv, env, config); code >= 0) return code;
  JobFigures job;
  job.threads_per_rank = set_threads_per_rank(env);

  auto pg = fsdp::ProcessGroup::from_env();
  const int rank = pg->rank();
  job.world = pg->size();
  const bool is_main = rank == 0;

  const std::optional<TrainingData> data = load_data(config, is_main);
  if (!data) return 1;
  job.peak = measure_peak(*pg);

  resolve_init(config, rank);
  BuiltModel built = build_model(config);
  auto sharded = shard_model(built, config, pg);
  auto optimizer = build_optimizer(*sharded, built.original_dims, config);
  if (config.step_in_backward)
    sharded->set_step_in_backward(optimizer.get(), config.step_thread == "own"        ? fsdp::StepThread::kOwn
                                                   : config.step_thread == "backward" ? fsdp::StepThread::kBackward
                                                                                      : fsdp::StepThread::kAuto);

  job.tokens_per_step = static_cast<int64_t>(job.world) * config.batch_per_rank * config.context;
  job.flops_per_token = training_flops_per_token(built.parameter_count, config);
  if (is_main) print_configuration(config, pg->env(), job, *sharded, built, *data);
  std::ofstream metrics = open_metrics(config, is_main);

  const double val_loss_start = validation_loss(built.model, data->splits.validation, config);
  if (is_main) std::cout << "validation loss before training: " << fixed(val_loss_start, 4) << "\n" << std::flush;

  std::optional<fsdp::GradScaler> scaler;
  if (config.mixed_precision == "fp16") scaler.emplace(*sharded);
  TrainingLoop loop{config,
                    *pg,
                    built.model,
                    *sharded,
                    *optimizer,
                    data->splits.train,
                    job,
                    metrics,
                    program_start,
                    is_main,
                    scaler ? &*scaler : nullptr};
  const TrainingResult result = train(loop);
  if (result.stopped_after > 0) {
    if (is_main)
      std::cout << "stopped after step " << result.stopped_after << " of " << config.steps
                << "; continue with --resume\n"
                << std::flush;
    return 0;
  }

  const double val_loss_end = validation_loss(built.model, data->splits.validation, config);
  std::string sample;
  if (config.sample_bytes > 0) {
    // The whole model at once for generation (full precision), instead of a gather per forward.
    auto full = sharded->summon_full_params();
    sample = generate(built.model, config.prompt, config);
  }
  if (is_main) print_report(config, job, result, val_loss_start, val_loss_end, sample, program_start);
  if (!config.export_file.empty()) {
    fsdp::checkpoint::export_full(config.export_file, *sharded);
    if (is_main) std::cout << "exported the model to " << config.export_file << " (safetensors)\n" << std::flush;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    // Errors after start-up can differ between ranks (a lost peer, a bad file on one host), so
    // every rank reports its own.
    std::cerr << "fsdp_gpt" << g_rank_label << ": error: " << e.what() << "\n";
    return 1;
  }
}
