#include "planning.h"

#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "evaluation.h"
#include "measurements.h"
#include "model.h"
#include "model_cost.h"
#include "model_setup.h"
#include "optimizer.h"
#include "rank_setup.h"

namespace fsdp_gpt {

namespace {

// The precisions the plan considers: the flags' own, or every one the search tries.
std::vector<at::ScalarType> plan_precisions(const TrainConfig& config, bool flags_only) {
  if (flags_only)
    return {config.mixed_precision == "bf16"   ? at::kBFloat16
            : config.mixed_precision == "fp16" ? at::kHalf
                                               : at::kFloat};
  return fsdp::PlanRequest().precisions();
}

// The flags whose effects the planner does not model (docs/planner.md): named beside its predictions.
// Another optimizer's state is modeled, its step's time only by a runtime calibration.
std::vector<std::string> unmodeled_flags(const TrainConfig& config, const fsdp::Calibration& calibration) {
  std::vector<std::string> flags;
  if (config.optimizer != "adamw" && calibration.runtime.empty())
    flags.push_back("--optimizer " + config.optimizer + "'s step time");
  if (config.step_in_backward && config.step_thread == "own") flags.push_back("--step-in-backward with its own thread");
  return flags;
}

// Rank 0's line before a prediction that leaves flags out; nothing when it leaves none out.
void say_what_is_left_out(const TrainConfig& config, const fsdp::Calibration& calibration) {
  const auto flags = unmodeled_flags(config, calibration);
  if (flags.empty()) return;
  std::cout << "the plan leaves out";
  for (size_t i = 0; i < flags.size(); ++i) std::cout << (i == 0 ? " " : ", ") << flags[i];
  std::cout << ": the planner does not model " << (flags.size() == 1 ? "it" : "them")
            << " and predicts the run without (docs/planner.md)\n";
}

}  // namespace

fsdp::Calibration calibrate_gpt(const TrainConfig& config, bool flags_only) {
  gpt::GPTConfig model_config;
  model_config.context = config.context;
  model_config.width = config.width;
  model_config.layers = config.layers;
  model_config.heads = config.heads;
  // Checkpointed blocks, so the calibration also measures the checkpointed passes' memory.
  model_config.activation_checkpointing = !flags_only || config.activation_checkpointing;
  torch::manual_seed(config.seed);
  gpt::GPT model(model_config);  // a throwaway copy, real memory
  const int64_t rows = config.batch_size > 0 ? config.batch_size : config.batch_per_rank;
  gpt::Batch batch;
  batch.inputs = torch::randint(model_config.vocab_size, {rows, config.context}, torch::kLong);
  batch.targets = torch::randint(model_config.vocab_size, {rows, config.context}, torch::kLong);
  // Half the rows too, so that smaller micro-batches are planned with the passes' fixed cost.
  const int64_t half = rows / 2;
  gpt::Batch small;
  small.inputs = batch.inputs.narrow(0, 0, std::max<int64_t>(half, 1));
  small.targets = batch.targets.narrow(0, 0, std::max<int64_t>(half, 1));
  auto options = fsdp::CalibrateOptions()
                     .repetitions(5)  // the median of five or more: steadier on a machine others share
                     .precisions(plan_precisions(config, flags_only))
                     .optimizer([&](const std::vector<at::Tensor>&) -> std::unique_ptr<torch::optim::Optimizer> {
                       std::vector<std::pair<std::string, torch::Tensor>> named;
                       std::map<std::string, int64_t> dims;
                       for (const auto& p : model->named_parameters()) {
                         named.emplace_back(p.key(), p.value());
                         dims[p.key()] = p.value().dim();
                       }
                       return gpt::make_adamw(named, dims, config.lr, config.weight_decay, config.fused_adamw);
                     });
  // The flags' quantization formats, for the packing work of quantized candidates.
  std::vector<fsdp::Quantization> formats;
  for (const fsdp::Quantization& q :
       {quantization_flags(config, config.quantize_all_gather), reduce_quantization_flags(config)})
    if (q.enabled() &&
        (formats.empty() || formats[0].dtype() != q.dtype() || formats[0].block_size() != q.block_size()))
      formats.push_back(q);
  options.quantizations(formats);
  if (half >= 1)
    options.smaller_loss([&] { return next_token_loss(model, small); }).smaller_tokens(half * config.context);
  return fsdp::calibrate(
      *model, [&] { return next_token_loss(model, batch); }, rows * config.context, options);
}

void calibrate_gpt_runtime(const TrainConfig& config, const fsdp::ProcessGroupPtr& pg, bool flags_only,
                           bool both_wrappings, fsdp::Calibration& calibration) {
  TrainConfig copy = config;
  copy.activation_checkpointing = false;
  copy.checkpointed_blocks = 0;  // timed checkpointed, every block is (as the plan's meta model has them)
  copy.measure_exposed_comm = true;
  copy.quantize_all_gather = copy.quantize_reduce = "none";
  copy.deterministic = false;
  copy.reshard_after_forward = "strategy";
  copy.reshard_after_forward_size = 0;
  if (copy.init == "deferred" && !fsdp::DeferredInit::supported()) copy.init = "eager";
  const int64_t rows = config.batch_size > 0 ? config.batch_size : config.batch_per_rank;
  torch::manual_seed(config.seed + pg->rank());
  gpt::Batch batch;
  batch.inputs = torch::randint(gpt::GPTConfig().vocab_size, {rows, config.context}, torch::kLong);
  batch.targets = torch::randint(gpt::GPTConfig().vocab_size, {rows, config.context}, torch::kLong);
  // The flags' strategy and, at more than one rank, another with other collectives, so that the plan
  // tells FSDP's work per unit from its work per collective; where the plan searches the wrapping
  // (or the calibration is saved for later plans), the flags' strategy wrapped the other way, so that it tells work per unit from work per pass;
  // where the plan considers checkpointing, the flags' strategy with its blocks checkpointed, for
  // what checkpointing changes; under a modeled network, the flags' strategy on the transport
  // beneath it, for the waits on peers the ranks have without the modeled link.
  struct Timed {
    std::string strategy, wrap;
    bool checkpointing = false, beneath = false;
  };
  const std::optional<fsdp::NetworkModel> network = pg->options().network_model;
  std::vector<Timed> timings{{config.strategy, config.wrap}};
  if (pg->size() > 1) timings.push_back({config.strategy == "NO_SHARD" ? "FULL_SHARD" : "NO_SHARD", config.wrap});
  if (both_wrappings) timings.push_back({config.strategy, config.wrap == "none" ? "block" : "none"});
  if (!flags_only || config.activation_checkpointing) timings.push_back({config.strategy, config.wrap, true});
  if (pg->size() > 1 && network) timings.push_back({config.strategy, config.wrap, false, true});
  for (const at::ScalarType precision : plan_precisions(config, flags_only))
    for (const auto& [strategy, wrap, checkpointing, beneath] : timings) {
      if (beneath) pg->set_network_model(std::nullopt);  // communicators handed out from here on are unmodeled
      copy.mixed_precision = precision == at::kBFloat16 ? "bf16" : precision == at::kHalf ? "fp16" : "none";
      copy.strategy = strategy;
      copy.wrap = wrap;
      copy.activation_checkpointing = checkpointing;
      copy.sharding_factor = strategy == "HYBRID_SHARD" ? config.sharding_factor : 0;
      BuiltModel built = build_model(copy);  // a throwaway copy, sharded as the flags say
      auto sharded = shard_model(built, copy, pg);
      fsdp::RuntimeTiming timed;
      timed.wrap = copy.wrap;
      timed.strategy = fsdp::parse_sharding_strategy(copy.strategy);
      timed.sharding_factor = copy.sharding_factor;
      timed.precision = precision;
      timed.activation_checkpointing = checkpointing;
      timed.micro_batch = static_cast<int>(rows);
      timed.all_gather_limit = copy.all_gather_limit;
      timed.backward_prefetch = fsdp::parse_backward_prefetch(copy.backward_prefetch);
      timed.forward_prefetch = copy.forward_prefetch;
      timed.beneath_network_model = beneath;
      auto optimizer = build_optimizer(*sharded, copy);
      fsdp::calibrate_runtime(
          calibration, *sharded, *pg, [&] { return next_token_loss(built.model, batch); }, timed, 5,
          [&] { optimizer->step(); });
      if (beneath) pg->set_network_model(network);
    }
}

fsdp::Cluster plan_cluster(const TrainConfig& config, int world) {
  if (!config.cluster.empty()) return fsdp::Cluster::parse(config.cluster);
  return fsdp::Cluster::preset("cpu", 1, world);
}

// The search space narrowed to the configuration the flags select.
fsdp::PlanRequest only_the_flags(fsdp::PlanRequest request, const TrainConfig& config) {
  const auto precision = config.mixed_precision == "bf16"   ? at::kBFloat16
                         : config.mixed_precision == "fp16" ? at::kHalf
                                                            : at::kFloat;
  const auto strategy = fsdp::parse_sharding_strategy(config.strategy);
  std::vector<fsdp::NamedWrapPolicy> wrap;
  for (const auto& w : request.wrap_policies())
    if (w.name == config.wrap) wrap.push_back(w);
  request.calibration_wrap_policies(request.wrap_policies());  // a saved calibration may have timed another
  return request.strategies({strategy})
      .hybrid_factors({config.sharding_factor})
      .wrap_policies(wrap)
      .reshard_after_forward_sizes({config.reshard_after_forward_size})
      .activation_checkpointing({config.activation_checkpointing})
      .checkpointed_shares({config.checkpointed_blocks > 0
                                ? static_cast<double>(config.checkpointed_blocks) / static_cast<double>(config.layers)
                                : 1.0})
      .cpu_offload({false})
      .precisions({precision})
      .all_gather_limits({config.all_gather_limit})
      .backward_prefetch({fsdp::parse_backward_prefetch(config.backward_prefetch)})
      .forward_prefetch({config.forward_prefetch})
      .micro_batches({config.batch.micro})
      .no_sync({config.grad_accum_mode == "no-sync" || config.grad_accum_mode == "no-sync-unsharded"})
      .keep_unsharded({config.grad_accum_mode == "no-sync-unsharded"})
      .replica_deferred({config.grad_accum_mode == "replica-deferred"})
      .step_in_backward({config.step_in_backward});
}

void write_entries(const std::string& path, const fsdp::Plan& plan, const TrainConfig& config,
                   const fsdp::Calibration& calibration) {
  std::ofstream out(path);
  FSDP_CHECK(out.good(), "cannot write the plan file ", path);
  out << plan.json_lines(unmodeled_flags(config, calibration));
}

// The state of the optimizer build_optimizer makes for `config`.
fsdp::OptimizerStateFn optimizer_state(const TrainConfig& config) {
  if (config.optimizer == "adafactor") return fsdp::adafactor_state(false);
  if (config.optimizer == "muon") return fsdp::muon_state(gpt::muon_steps);
  return fsdp::per_element_state(2);  // AdamW, LAMB
}

namespace {

// Under --resume, the newest checkpoint's global batch, which the run keeps (main.cpp), and its
// directory; 0 and "" otherwise.
std::pair<int, std::string> resumed_batch(const TrainConfig& config) {
  const std::string dir = config.resume ? fsdp::checkpoint::latest(config.save_dir) : "";
  if (dir.empty()) return {0, ""};
  const fsdp::checkpoint::Extra extra = fsdp::checkpoint::read_extra(dir);
  return {extra.count("global_batch") != 0 ? std::stoi(extra.at("global_batch")) : 0, dir};
}

}  // namespace

fsdp::Plan plan_gpt(const TrainConfig& config, const fsdp::Cluster& cluster, int64_t process_bytes, bool flags_only,
                    const fsdp::Calibration& calibration) {
  gpt::GPTConfig model_config;
  model_config.context = config.context;
  model_config.width = config.width;
  model_config.layers = config.layers;
  model_config.heads = config.heads;
  // Checkpointed blocks wherever a checkpointed candidate may be planned, as the run builds them.
  model_config.activation_checkpointing = !flags_only || config.activation_checkpointing;
  fsdp::DeferredInit deferred;  // shapes only: nothing is allocated
  gpt::GPT model(model_config);
  const int world = cluster.world();
  int global = config.global_batch > 0 ? config.global_batch : world * config.batch_per_rank;
  if (const auto [resumed, dir] = resumed_batch(config); resumed > 0) global = resumed;
  const int micro = config.batch.micro;
  if (config.deterministic && micro > 0 && global % micro == 0)  // with the padding passes that even out the ranks
    global = (global / micro + world - 1) / world * world * micro;
  auto request = fsdp::PlanRequest()
                     .world(world)
                     .global_batch(global)
                     .seq_len(config.context)
                     .process_bytes(cluster.device_is_host ? process_bytes : 0)  // the host's, not a device's
                     .calibration(calibration)
                     .wrap_policies({{"block", fsdp::wrap::by_type<gpt::BlockImpl>()}, {"none", nullptr}});
  if (config.plan_trace)  // one sequence's forward and loss, on the meta device like the model
    request.trace_forward([&] {
      gpt::Batch sequence;
      sequence.inputs = torch::zeros({1, config.context}, torch::kLong);
      sequence.targets = torch::zeros({1, config.context}, torch::kLong);
      next_token_loss(model, sequence);
    });
  else
    request.module_cost(gpt::module_cost);
  if (!config.memory_budget.empty()) request.memory_budget(fsdp::parse_bytes(config.memory_budget));
  request.optimizer_state(optimizer_state(config))
      .memory_margin(config.memory_margin)
      .all_gather_quantization(quantization_flags(config, config.quantize_all_gather))
      .reduce_quantization(reduce_quantization_flags(config))
      .deterministic(config.deterministic)
      .reshard_after_forward_policy(reshard_policy(config));
  // The step in backward where the flags allow it (train_config.cpp): --step-in-backward keeps it.
  if (config.step_in_backward)  // with micro-batches only under no_sync, as train_config.cpp requires
    request.step_in_backward({true}).no_sync({true}).replica_deferred({false});
  else if (config.optimizer == "adamw" && config.clip_grad_norm == 0)
    request.step_in_backward({false, true});
  // Deterministic training gives the same values at any world size for one micro-batch size: the
  // plan keeps the flags' (a world-dependent choice would change the values with the world).
  if (config.deterministic && micro > 0 && (global / world) % micro == 0) request.micro_batches({micro});
  if (flags_only) request = only_the_flags(request, config);
  return fsdp::plan(*model, cluster, request);
}

void apply_candidate(const fsdp::Candidate& c, TrainConfig& config) {
  config.strategy = fsdp::to_string(c.strategy);
  config.sharding_factor = c.strategy == fsdp::ShardingStrategy::kHybridShard ? c.sharding_factor : 0;
  config.reshard_after_forward_size = c.reshard_after_forward_size;
  config.wrap = c.wrap.name;
  config.activation_checkpointing = c.activation_checkpointing;
  config.checkpointed_blocks = c.checkpointed_units;  // the first blocks (each block a unit)
  config.mixed_precision = c.precision == at::kBFloat16 ? "bf16" : c.precision == at::kHalf ? "fp16" : "none";
  config.all_gather_limit = c.all_gather_limit;
  config.backward_prefetch = fsdp::to_string(c.backward_prefetch);
  config.forward_prefetch = c.forward_prefetch;
  config.batch_size = c.micro_batch;
  config.step_in_backward = config.step_in_backward || c.step_in_backward;  // a flag the search could not model stays
  if (c.accumulation > 1)
    config.grad_accum_mode = c.no_sync            ? (c.keep_unsharded ? "no-sync-unsharded" : "no-sync")
                             : c.replica_deferred ? "replica-deferred"
                                                  : "reduce";
}

namespace {

// What a plan for this job is made from, alike on every rank: the cluster (with the matmul rates
// the ranks measured where it is this machine), the process's own memory and the calibration.
struct PlanInputs {
  fsdp::Cluster cluster;
  int64_t process_bytes = 0;
  fsdp::Calibration calibration;
};

PlanInputs plan_inputs(const TrainConfig& config, const fsdp::ProcessGroupPtr& pg_ptr, double job_matmul_flops,
                       bool flags_only) {
  fsdp::ProcessGroup& pg = *pg_ptr;
  PlanInputs in;
  in.cluster = plan_cluster(config, pg.size());
  if (config.cluster.empty() && job_matmul_flops > 0 && pg.world()->device().is_cpu())
    in.cluster = fsdp::this_machine(pg, job_matmul_flops);  // the rates every rank measured at once
  in.process_bytes = static_cast<int64_t>(fsdp::mean_across_ranks(pg, static_cast<double>(resident_bytes())));
  if (config.calibrate) {  // every rank at once, so the times include their sharing of the machine
    if (pg.size() > 1) pg.world()->barrier();
    in.calibration = calibrate_gpt(config, flags_only);
    fsdp::agree_across_ranks(in.calibration, *pg.world());  // the same figures on every rank: the same plan
    fsdp::calibrate_link(in.calibration, pg);
    calibrate_gpt_runtime(config, pg_ptr, flags_only, !flags_only || !config.calibration_file.empty(), in.calibration);
    if (pg.rank() == 0 && !config.calibration_file.empty()) in.calibration.save(config.calibration_file);
  } else if (!config.calibration_file.empty()) {
    in.calibration = fsdp::Calibration::from_file(config.calibration_file);
  }
  return in;
}

}  // namespace

int print_plan(const TrainConfig& config, const fsdp::ProcessGroupPtr& pg, double job_matmul_flops) {
  const PlanInputs in = plan_inputs(config, pg, job_matmul_flops, false);
  const fsdp::Plan plan = plan_gpt(config, in.cluster, in.process_bytes, false, in.calibration);
  if (pg->rank() != 0) return 0;
  if (!config.plan_file.empty()) write_entries(config.plan_file, plan, config, in.calibration);
  say_what_is_left_out(config, in.calibration);
  std::cout << plan.table();
  if (plan.any_fits())
    std::cout << "best: " << plan.best().candidate.describe() << "\n";
  else
    std::cout << "nothing fits in " << fsdp::format_bytes(plan.budget) << " per rank; the smallest needs "
              << fsdp::format_bytes(plan.smallest_peak()) << "\n";
  return 0;
}

void adopt_plan(TrainConfig& config, const fsdp::ProcessGroupPtr& pg_ptr, double job_matmul_flops) {
  fsdp::ProcessGroup& pg = *pg_ptr;
  const fsdp::Cluster cluster = plan_cluster(config, pg.size());
  FSDP_CHECK(cluster.world() == pg.size(), "--cluster ", config.cluster, " has ", cluster.world(),
             " ranks but the job has ", pg.size(), "; training plans for the job's own ranks");
  FSDP_CHECK(cluster.device_is_host == pg.world()->device().is_cpu(), "--cluster ", config.cluster, " plans for ",
             cluster.device.name, " devices, but this job trains on ", pg.world()->device().str(),
             "; training plans for its own devices (drop --cluster, or describe them in a cluster file)");
  const bool flags_only = config.memory_budget.empty();  // --plan-file alone: this run's prediction
  const PlanInputs in = plan_inputs(config, pg_ptr, job_matmul_flops, flags_only);
  if (flags_only) {
    if (pg.rank() == 0) {
      write_entries(config.plan_file, plan_gpt(config, in.cluster, in.process_bytes, true, in.calibration), config,
                    in.calibration);
      say_what_is_left_out(config, in.calibration);
    }
    return;
  }
  const fsdp::Plan plan = plan_gpt(config, in.cluster, in.process_bytes, false, in.calibration);
  if (pg.rank() == 0)
    for (const std::string& note : plan.notes) std::cout << "note: " << note << "\n";
  // Every rank planned alike: when nothing fits, rank 0 names the smallest budget, once, before
  // any rank exits (the launcher stops the others when one does).
  if (!plan.any_fits()) {
    if (pg.rank() == 0) try {
        (void)plan.best();
      } catch (const std::exception& e) {
        std::cerr << "fsdp_gpt" << g_rank_label << ": error: " << e.what() << "\n" << std::flush;
      }
    if (pg.size() > 1) pg.world()->barrier();
    throw ReportedByRankZero("nothing fits the budget");
  }
  const fsdp::PlanEntry& best = plan.best();
  apply_candidate(best.candidate, config);
  const auto [resumed, dir] = resumed_batch(config);
  resolve_batch(config, pg.size(), resumed, dir);
  if (pg.rank() == 0 && !config.plan_file.empty())
    write_entries(config.plan_file, plan_gpt(config, in.cluster, in.process_bytes, true, in.calibration), config,
                  in.calibration);
  if (pg.rank() == 0) say_what_is_left_out(config, in.calibration);
  if (pg.rank() == 0)
    std::cout << "planned for " << fsdp::format_bytes(plan.budget) << " per rank: " << best.candidate.describe()
              << "; predicted peak " << fsdp::format_bytes(best.memory.peak) << " (FSDP parameters "
              << fsdp::format_bytes(best.memory.params) << ", gradients " << fsdp::format_bytes(best.memory.grads)
              << "), step " << best.time.step_s * 1e3 << " ms\n"
              << std::flush;
}

}  // namespace fsdp_gpt
