#pragma once
// The trainer's configuration: every command-line flag, its checks, and the parsed result.
#include <fsdp/fsdp.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_gpt {

// How each optimizer step's global batch is split: global = world x accum x micro (--deterministic:
// at most that, the ranks' shares differing by one micro-batch). See "Batch" in docs/trainer.md.
struct BatchPlan {
  int global = 0;    // sequences per optimizer step, all ranks; a property of the run, kept on resume
  int per_rank = 0;  // global / world; --deterministic: the largest share, accum x micro
  int micro = 0;     // sequences per micro-batch per rank
  int accum = 0;     // micro-batches per rank per step: per_rank / micro
};

// Every flag's value; parse_flags fills it.
struct TrainConfig {
  int layers = 4;
  int width = 128;
  int heads = 4;
  int context = 64;
  int global_batch = 0;    // sequences per optimizer step, all ranks (0: see BatchPlan)
  int batch_size = 0;      // sequences per micro-batch per rank (0: see BatchPlan)
  int batch_per_rank = 8;  // sequences per rank per step at the world size a run starts with
  int steps = 250;
  double lr = 1e-3;
  double min_lr = 1e-4;
  int warmup = -1;  // unset: a tenth of --steps
  std::string schedule = "cosine";
  double weight_decay = 0.1;
  std::string optimizer = "adamw";  // adamw, lamb, adafactor, muon
  bool fused_adamw = false;         // adamw's step through fsdp::FusedAdamW
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
  bool measure_exposed_comm = false;  // trace iterations; the metrics' exposed_comm_share
  // Training controls (docs/usage.md).
  std::string mixed_precision = "none";            // none, bf16, fp16
  std::string quantize_all_gather = "none";        // none, int8, fp8: the parameter all-gathers' codes
  std::string quantize_reduce = "none";            // none, int8, fp8: the gradient reduce-scatters' codes
  int quantize_block = 256;                        // values per scale
  bool quantize_error_feedback = false;            // quantized reductions keep and re-add their rounding error
  std::vector<int> quantization_report;            // block sizes: after training, each parameter's quantization error
  int grad_accum = 1;                              // splits --batch-per-rank into micro-batches
  std::string grad_accum_mode = "no-sync";         // how micro-batches other than the last treat gradients
  double clip_grad_norm = 0;                       // 0: no clipping
  std::string reshard_after_forward = "strategy";  // strategy, true, false, except-last
  int reshard_after_forward_size = 0;              // ranks a resharded block stays sharded over until backward
  bool activation_checkpointing = false;
  int checkpointed_blocks = 0;  // with activation_checkpointing: the first this many blocks; 0: every one
  double dropout = 0.0;
  bool deterministic = false;        // bit-identical parameters at any world size (docs/usage.md)
  bool step_in_backward = false;     // FullyShardedModule::set_step_in_backward
  std::string step_thread = "auto";  // its fsdp::StepThread
  std::string malloc = "keep";       // keep (glibc keeps its heap between steps), default
  // Checkpoints (docs/checkpoints.md).
  std::string save_dir;
  int save_every = 0;  // 0: only at the end (and at --stop-after / SIGTERM)
  bool resume = false;
  int stop_after = 0;       // 0: run to --steps
  bool async_save = false;  // --save-every saves written in the background
  std::string export_file;
  // Planning (docs/planner.md).
  bool plan = false;             // print the planner's table and exit
  std::string cluster;           // empty: this machine with the job's ranks
  double memory_margin = 0.1;    // the planner's margin over each predicted peak
  std::string memory_budget;     // e.g. 1GiB: train with the fastest planned configuration that fits
  std::string plan_file;         // JSON lines: --plan's entries, or the prediction for this run
  bool calibrate = false;        // time the model on this machine before planning
  bool plan_trace = false;       // count the model's operators from a traced forward, not by rule
  std::string calibration_file;  // with calibrate: where to save it; without: the calibration to plan with
  BatchPlan batch;               // resolved by resolve_batch, not a flag
};

// Returns -1 to go on, or the exit code (0 after --help). Only rank 0 prints, so a bad flag is
// reported once, while every rank exits with the same code.
int parse_flags(int argc, char** argv, const fsdp::RankEnv& env, TrainConfig& config);

// Thrown by resolve_batch: the flag at fault and what is wrong.
struct BatchError : std::runtime_error {
  BatchError(std::string flag_name, const std::string& message)
      : std::runtime_error(message), flag(std::move(flag_name)) {}
  std::string flag;
};

// Fills config.batch for `world` ranks. The global batch is --global-batch, else `saved_global`
// (a resumed checkpoint's, 0: none), else world x --batch-per-rank; an explicit --global-batch
// that differs from `saved_global` is refused, naming both and `saved_from`. Throws BatchError.
void resolve_batch(TrainConfig& config, int world, int saved_global = 0, const std::string& saved_from = "");

}  // namespace fsdp_gpt
