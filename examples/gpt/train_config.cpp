#include "train_config.h"

#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>

#include "data.h"

namespace fsdp_gpt {

namespace {

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
  auto* global_batch =
      app.add_option("--global-batch", config.global_batch,
                     "Sequences per optimizer step over all ranks, kept on --resume at any world size (default: "
                     "the checkpoint's on --resume, else world size times --batch-per-rank)")
          ->check(CLI::Range(1, 1 << 24));
  auto* batch_size = app.add_option("--batch-size", config.batch_size,
                                    "Sequences per micro-batch per rank; each rank runs --global-batch / (world "
                                    "size x this) micro-batches per step (default: --batch-per-rank / --grad-accum, "
                                    "at most a rank's share of the global batch)")
                         ->check(CLI::Range(1, 1 << 16));
  app.add_option("--batch-per-rank", config.batch_per_rank,
                 "Sequences per rank per step at the world size the run starts with: sets the default "
                 "--global-batch (world size times this)")
      ->check(CLI::Range(1, 1 << 16))
      ->excludes(global_batch)
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
  app.add_option("--optimizer", config.optimizer,
                 "adamw, lamb, adafactor, or muon (Muon for the blocks' matrices at 20 x --lr, "
                 "AdamW for the rest)")
      ->transform(CLI::IsMember({"adamw", "lamb", "adafactor", "muon"}, CLI::ignore_case))
      ->capture_default_str();
  app.add_flag("--fused-adamw", config.fused_adamw,
               "With --optimizer adamw: step through fsdp::FusedAdamW, one pass per parameter (the same update to "
               "float rounding; docs/design.md, Note [FusedAdamW])");
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
  auto* metrics_file =
      app.add_option("--metrics-file", config.metrics_file, "Write one JSON object per logged step to this file");
  app.add_flag("--measure-exposed-comm", config.measure_exposed_comm,
               "Trace every iteration and write the share of each step spent waiting on collectives to "
               "--metrics-file (exposed_comm_share)")
      ->needs(metrics_file);
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
  app.add_option("--quantize-all-gather", config.quantize_all_gather,
                 "Parameter all-gathers carry 8-bit codes with a scale per --quantize-block values (every block "
                 "but the root unit, which holds the embeddings and the head): none, int8, fp8")
      ->transform(CLI::IsMember({"none", "int8", "fp8"}, CLI::ignore_case))
      ->capture_default_str();
  app.add_option("--quantize-reduce", config.quantize_reduce,
                 "Gradient reductions carry 8-bit codes, summed in float32 on arrival (reduce-scatters; NO_SHARD's "
                 "and the replicas' all-reduces also gather the sums as codes): none, int8, fp8")
      ->transform(CLI::IsMember({"none", "int8", "fp8"}, CLI::ignore_case))
      ->capture_default_str();
  app.add_flag("--quantize-error-feedback", config.quantize_error_feedback,
               "With --quantize-reduce: each rank adds what rounding dropped from its quantized gradients (and sums) "
               "to the next step's before quantizing");
  app.add_option("--quantize-block", config.quantize_block, "Values per scale of quantized communication")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--quantization-report", config.quantization_report,
                 "After training, each parameter's relative error through int8 (and fp8) all-gathers and gradient "
                 "reductions, against unquantized ones, at these block sizes (comma-separated)")
      ->delimiter(',')
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--grad-accum", config.grad_accum,
                 "Splits --batch-per-rank into this many micro-batches (must divide it): sets the default "
                 "--batch-size; all micro-batches but the last of a step run without gradient communication")
      ->check(CLI::Range(1, 1 << 16))
      ->excludes(batch_size)
      ->capture_default_str();
  app.add_option("--clip-grad-norm", config.clip_grad_norm, "Clip the gradients' total 2-norm to this (0: off)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_flag("--activation-checkpointing", config.activation_checkpointing,
               "Keep only each block's input in forward and recompute the block in backward");
  app.add_option("--checkpointed-blocks", config.checkpointed_blocks,
                 "With --activation-checkpointing: checkpoint only the first N blocks (0: every one)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--dropout", config.dropout, "Dropout on each block's attention and MLP outputs in training")
      ->check(CLI::Range(0.0, 1.0, "a probability in [0, 1]"));
  app.add_flag("--deterministic", config.deterministic,
               "Bit-identical training at any world size and strategy: --global-batch is a fixed list of "
               "--batch-size micro-batches, each rank runs a contiguous range of them, and gradients, clipping and "
               "the logged loss are summed exactly");
  app.add_flag("--step-in-backward", config.step_in_backward,
               "Step the optimizer on each unit's shard as soon as its gradients are reduced, overlapping the step "
               "with communication (not with --clip-grad-norm, fp16 or --grad-accum-mode reduce)");
  app.add_option("--step-thread", config.step_thread,
                 "With --step-in-backward, where the steps run: auto (a thread of their own under offload, else "
                 "backward's), backward, or own (a host thread beside backward)")
      ->transform(CLI::IsMember({"auto", "backward", "own"}, CLI::ignore_case))
      ->capture_default_str();
  app.add_option("--malloc", config.malloc,
                 "keep: glibc keeps its heap between steps instead of returning freed memory and faulting it in "
                 "again (docs/usage.md); default: glibc's settings. MALLOC_*_ or GLIBC_TUNABLES override either")
      ->transform(CLI::IsMember({"keep", "default"}, CLI::ignore_case))
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
  app.add_flag("--plan", config.plan,
               "Print the planner's prediction (memory by kind, step time) for every configuration and exit");
  app.add_option("--cluster", config.cluster,
                 "The cluster --plan plans for: a preset NAME:NODESxRANKS (cpu, a100-40g, a100-80g, paper, h100, "
                 "h200; e.g. a100-80g:64x8) or a JSON file (default: this machine with the job's ranks)");
  app.add_option("--memory-budget", config.memory_budget,
                 "Bytes per rank (e.g. 1GiB, 70GB): train with the fastest planned configuration that fits, "
                 "replacing --strategy, --wrap, --activation-checkpointing, --mixed-precision and --batch-size");
  app.add_option("--memory-margin", config.memory_margin,
                 "Share of each predicted peak kept free for the prediction's error when planning for a budget")
      ->check(CLI::Range(0.0, 10.0))
      ->capture_default_str();
  app.add_option("--plan-file", config.plan_file,
                 "Write predictions as JSON lines: with --plan every configuration's, else this run's own");
  app.add_flag("--plan-trace", config.plan_trace,
               "Count the model's FLOPs and saved activations for the planner by tracing one forward and loss "
               "on the meta device, instead of by rule (docs/planner.md, The operator trace)");
  app.add_flag("--calibrate", config.calibrate,
               "Plan with this machine's measured times: every rank times a copy of the model's forward, "
               "backward and optimizer step first (needs the model to fit once per rank)");
  app.add_option("--calibration-file", config.calibration_file,
                 "With --calibrate: save the measured times there (JSON); without: plan with the times saved there");
}

// Checks that involve several flags, thrown as CLI::ValidationError like CLI11's own; resolves --warmup.
void check_flag_combinations(const CLI::App& app, const fsdp::RankEnv& env, TrainConfig& config) {
  if (config.width % config.heads != 0)
    throw CLI::ValidationError(
        "--heads", std::to_string(config.heads) + " does not divide --width " + std::to_string(config.width));
  if (config.warmup < 0) config.warmup = config.steps / 10;
  if (config.warmup > config.steps)
    throw CLI::ValidationError("--warmup",
                               std::to_string(config.warmup) + " is more than --steps " + std::to_string(config.steps));
  if (config.min_lr > config.lr) throw CLI::ValidationError("--min-lr", "must not exceed --lr");
  if (config.stop_after > config.steps)
    throw CLI::ValidationError("--stop-after", std::to_string(config.stop_after) + " is past --steps " +
                                                   std::to_string(config.steps) +
                                                   ": the run ends before it; give a step of the run, or drop it");
  if (config.prompt.empty()) throw CLI::ValidationError("--prompt", "must not be empty");
  if (config.deterministic && config.grad_accum_mode != "no-sync" && config.grad_accum_mode != "no-sync-unsharded")
    throw CLI::ValidationError("--deterministic", "accumulates each rank's micro-batches locally and reduces once; "
                                                  "use --grad-accum-mode no-sync or no-sync-unsharded");
  for (const auto& [flag, value] : {std::pair{"--quantize-all-gather", &config.quantize_all_gather},
                                    std::pair{"--quantize-reduce", &config.quantize_reduce}})
    if (*value == "fp8" && !fsdp::has_float8())
      throw CLI::ValidationError(flag, "fp8: this LibTorch has no 8-bit float type (LibTorch 2.1 and later have "
                                       "it); use int8");
  if (config.quantize_error_feedback && config.quantize_reduce == "none")
    throw CLI::ValidationError("--quantize-error-feedback", "keeps what quantized reductions round off; add "
                                                            "--quantize-reduce int8 (or fp8)");
  if (app.count("--quantize-block") > 0 && config.quantize_all_gather == "none" && config.quantize_reduce == "none" &&
      config.quantization_report.empty())
    throw CLI::ValidationError("--quantize-block", "sets the values per scale of quantized communication, which is "
                                                   "off; add --quantize-all-gather or --quantize-reduce");
  if (config.deterministic && (config.quantize_all_gather != "none" || config.quantize_reduce != "none"))
    throw CLI::ValidationError("--deterministic", "sums gradients exactly and keeps every value the same at any world "
                                                  "size, which quantized communication does not; drop "
                                                  "--quantize-all-gather and --quantize-reduce, or --deterministic");
  if (!config.memory_budget.empty()) {
    try {
      if (fsdp::parse_bytes(config.memory_budget) <= 0) throw fsdp::Error("must be positive");
    } catch (const fsdp::Error& e) {
      throw CLI::ValidationError("--memory-budget", e.what());
    }
  }
  const bool calibrated = config.calibrate || !config.calibration_file.empty();
  const char* calibration_flag = config.calibrate ? "--calibrate" : "--calibration-file";
  if (calibrated && !config.plan && config.memory_budget.empty() && config.plan_file.empty())
    throw CLI::ValidationError(calibration_flag, "gives the planner this machine's times; add --plan, "
                                                 "--memory-budget or --plan-file");
  if (calibrated && !config.cluster.empty())
    throw CLI::ValidationError(calibration_flag, "holds this machine's times, but --cluster " + config.cluster +
                                                     " plans for another; drop one of them");
  if (!config.cluster.empty() && !config.plan && config.memory_budget.empty())
    throw CLI::ValidationError("--cluster", "is what --plan or --memory-budget plan for; add one of them");
  const bool planning = config.plan || !config.memory_budget.empty() || !config.plan_file.empty();
  if (config.plan_trace && !planning)
    throw CLI::ValidationError("--plan-trace", "changes how the planner counts the model; add --plan, "
                                               "--memory-budget or --plan-file");
  if (config.memory_margin != TrainConfig().memory_margin && !config.plan && config.memory_budget.empty())
    throw CLI::ValidationError("--memory-margin", "is kept free when planning for a budget; add --memory-budget "
                                                  "(or --plan with one)");
  if (config.mixed_precision == "fp16") {
    try {  // LibTorch 1.13 has no float16 matrix product on the CPU; 2.x and GPUs have
      torch::mm(torch::ones({2, 2}, torch::kHalf), torch::ones({2, 2}, torch::kHalf));
    } catch (const c10::Error&) {
      throw CLI::ValidationError("--mixed-precision", "fp16: this LibTorch has no float16 matrix product on the CPU; "
                                                      "use bf16 (or LibTorch 2.x, or a GPU)");
    }
  }
  if (!config.quantization_report.empty() && env.world_size < 2)
    throw CLI::ValidationError("--quantization-report", "a world of one rank moves nothing and quantizes nothing; "
                                                        "run it with at least 2 ranks");
  if (config.grad_accum_mode == "replica-deferred" && config.strategy != "HYBRID_SHARD")
    throw CLI::ValidationError("--grad-accum-mode", "replica-deferred needs --strategy HYBRID_SHARD (got " +
                                                        config.strategy + "); use no-sync");
  if (config.checkpointed_blocks > 0 && !config.activation_checkpointing)
    throw CLI::ValidationError("--checkpointed-blocks", "says how many blocks --activation-checkpointing checkpoints; "
                                                        "add --activation-checkpointing");
  if (config.checkpointed_blocks > config.layers)
    throw CLI::ValidationError("--checkpointed-blocks", std::to_string(config.checkpointed_blocks) +
                                                            " is more than the model's " +
                                                            std::to_string(config.layers) + " blocks (--layers)");
  if (config.fused_adamw && config.optimizer != "adamw")
    throw CLI::ValidationError("--fused-adamw",
                               "is AdamW's step, but --optimizer is " + config.optimizer + "; drop one of them");
  if (!config.step_in_backward && config.step_thread != "auto")
    throw CLI::ValidationError("--step-thread", "says where the steps in backward run; add --step-in-backward");
  if (config.step_in_backward) {
    if (config.optimizer != "adamw")
      throw CLI::ValidationError("--step-in-backward", "steps one unit at a time, but " + config.optimizer +
                                                           " needs every parameter's whole gradient; use "
                                                           "--optimizer adamw or drop --step-in-backward");
    if (config.clip_grad_norm > 0)
      throw CLI::ValidationError("--step-in-backward",
                                 "cannot clip: each unit is stepped before the total norm exists; "
                                 "drop --clip-grad-norm or --step-in-backward");
    if (config.mixed_precision == "fp16")
      throw CLI::ValidationError("--step-in-backward", "fp16 loss scaling must unscale and check every gradient "
                                                       "before the step; use bf16 or drop --step-in-backward");
  }
  if (!config.resume) {  // a resumed run's global batch is the checkpoint's: resolved once it is loaded
    try {
      resolve_batch(config, env.world_size);
    } catch (const BatchError& e) {
      throw CLI::ValidationError(e.flag, e.what());
    }
  }
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

}  // namespace

void resolve_batch(TrainConfig& config, int world, int saved_global, const std::string& saved_from) {
  const auto str = [](int64_t v) {
    return std::to_string(v);
  };
  const std::string ranks = str(world) + (world == 1 ? " rank" : " ranks");
  if (config.global_batch > 0 && saved_global > 0 && config.global_batch != saved_global)
    throw BatchError("--global-batch", "--global-batch " + str(config.global_batch) +
                                           " differs from the global batch " + str(saved_global) + " of " + saved_from +
                                           "; leave --global-batch out to "
                                           "continue with " +
                                           str(saved_global) + ", or start afresh in another --save-dir");
  // --grad-accum splits --batch-per-rank, or with --global-batch each rank's share of it.
  const bool splits_share = config.global_batch > 0 && !config.deterministic;
  if (!splits_share && config.batch_per_rank % config.grad_accum != 0)
    throw BatchError("--grad-accum",
                     str(config.grad_accum) + " does not divide --batch-per-rank " + str(config.batch_per_rank));
  BatchPlan b;
  std::string source;  // where the global batch comes from, for the errors
  if (config.global_batch > 0) {
    b.global = config.global_batch;
    source = "--global-batch " + str(b.global);
  } else if (saved_global > 0) {
    b.global = saved_global;
    source = "the global batch " + str(b.global) + " of " + saved_from;
  } else {
    b.global = world * config.batch_per_rank;
    source = "the global batch " + str(b.global) + " (world size " + str(world) + " x --batch-per-rank " +
             str(config.batch_per_rank) + ")";
  }
  if (config.deterministic) {
    // A fixed list of micro-batches of --batch-size, split into contiguous ranges; a rank with a
    // shorter range runs padding passes to keep step (deterministic_step.h).
    b.micro = config.batch_size > 0 ? config.batch_size : config.batch_per_rank / config.grad_accum;
    if (b.global % b.micro != 0)
      throw BatchError("--batch-size", source + " is not a multiple of the micro-batch " + str(b.micro));
    const int micro_batches = b.global / b.micro;
    b.accum = (micro_batches + world - 1) / world;
    b.per_rank = b.accum * b.micro;
    config.batch = b;
    return;
  }
  if (b.global % world != 0) throw BatchError("--global-batch", source + " does not split evenly over " + ranks);
  b.per_rank = b.global / world;
  if (config.batch_size > 0) {
    b.micro = config.batch_size;
    if (b.per_rank % b.micro != 0)
      throw BatchError("--batch-size", "--batch-size " + str(b.micro) + " does not divide the " + str(b.per_rank) +
                                           " sequences per rank of " + source + " over " + ranks);
  } else if (splits_share && config.grad_accum > 1) {
    if (b.per_rank % config.grad_accum != 0)
      throw BatchError("--grad-accum", "--grad-accum " + str(config.grad_accum) + " does not divide the " +
                                           str(b.per_rank) + " sequences per rank of " + source + " over " + ranks);
    b.micro = b.per_rank / config.grad_accum;
  } else {
    b.micro = std::min(config.batch_per_rank / config.grad_accum, b.per_rank);
    if (b.per_rank % b.micro != 0)
      throw BatchError("--global-batch", source + " gives " + str(b.per_rank) + " sequences per rank over " + ranks +
                                             ", not a multiple of the micro-batch " + str(b.micro) +
                                             " (--batch-per-rank / --grad-accum); pass a --batch-size "
                                             "that divides " +
                                             str(b.per_rank));
  }
  b.accum = b.per_rank / b.micro;
  if (config.step_in_backward && b.accum > 1 && config.grad_accum_mode == "reduce")
    throw BatchError("--step-in-backward", "--grad-accum-mode reduce reduces every micro-batch, and each reducing "
                                           "backward would step; use no-sync");
  config.batch = b;
}

int parse_flags(int argc, char** argv, const fsdp::RankEnv& env, TrainConfig& config) {
  CLI::App app{"Train a small GPT on text with libfsdp (Fully Sharded Data Parallel).", "fsdp_gpt"};
  app.get_formatter()->column_width(32);
  add_flags(app, config);
  try {
    app.parse(argc, argv);
    check_flag_combinations(app, env, config);
  } catch (const CLI::ParseError& e) {
    if (env.rank == 0) return app.exit(e);
    // Every rank fails alike; give rank 0 a moment to print before a launcher that stops all
    // ranks at the first failure stops it too.
    if (e.get_exit_code() != 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    return e.get_exit_code();
  }
  return -1;
}

}  // namespace fsdp_gpt
