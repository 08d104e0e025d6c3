// fsdp::plan (include/fsdp/planner.h): every candidate of the request's search space, each
// predicted by evaluate(); fitting ones first, fastest first.
#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "fsdp/activation_checkpoint.h"
#include "fsdp/check.h"
#include "fsdp/planner.h"
#include "planner/evaluate.h"
#include "planner/model_costs.h"
#include "planner/parameter_elements.h"
#include "planner/request_checks.h"
#include "unit_plan.h"

namespace fsdp {

namespace {

std::vector<int> hybrid_factors(const PlanRequest& request, const Cluster& cluster, int world) {
  std::vector<int> factors = request.hybrid_factors();
  if (factors.empty()) factors.push_back(cluster.nodes > 1 ? cluster.ranks_per_node : world / 2);
  std::vector<int> ok;
  for (const int f : factors)
    if (f > 1 && f < world && world % f == 0) ok.push_back(f);
  return ok;
}

// The request's hpZ sizes for a candidate with shard groups of `F` ranks: a size applies where the
// strategy reshards after forward and it divides F strictly between 1 and F; any other becomes 0.
std::vector<int> reshard_sizes(const PlanRequest& request, const Cluster& cluster, ShardingStrategy strategy, int F) {
  std::vector<int> sizes = request.reshard_after_forward_sizes();
  if (sizes.empty()) sizes = {0, cluster.nodes > 1 ? cluster.ranks_per_node : 0};
  const bool reshards = fsdp::reshards_after_forward(strategy);
  std::vector<int> out;
  for (int k : sizes) {
    if (!(reshards && k > 1 && k < F && F % k == 0)) k = 0;
    if (std::find(out.begin(), out.end(), k) == out.end()) out.push_back(k);
  }
  return out;
}

// The distinct values of a request's list of on/off choices for a candidate where the choice
// `applies`; where it does not, only off.
std::vector<bool> choices(const std::vector<bool>& requested, bool applies) {
  std::vector<bool> out;
  for (const bool on : requested) {
    const bool v = on && applies;
    if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
  }
  if (out.empty()) out.push_back(false);
  return out;
}

std::vector<int> micro_batches(const PlanRequest& request, int per_rank) {
  if (!request.micro_batches().empty()) return request.micro_batches();
  std::vector<int> all;
  for (int m = 1; m <= per_rank; ++m)
    if (per_rank % m == 0) all.push_back(m);
  return all;
}

// Each candidate with one more choice made, `values(c)` giving the choices for candidate c.
template <typename Values, typename Set>
std::vector<Candidate> expand(const std::vector<Candidate>& in, Values values, Set set) {
  std::vector<Candidate> out;
  for (const Candidate& c : in)
    for (const auto& v : values(c)) {
      Candidate d = c;
      set(d, v);
      out.push_back(std::move(d));
    }
  return out;
}

// Why some checkpointed unit's gradients arrive in several recomputations' backwards, which the step
// in backward refuses: a checkpointed module run more than once in the trace's forward (`before`: its
// runs until then), or a parameter held by two checkpointed modules. Empty: neither.
std::string checkpointed_passes(torch::nn::Module& model,
                                const std::unordered_map<const CheckpointedBase*, uint64_t>* before) {
  std::vector<std::pair<std::string, const CheckpointedBase*>> outer;
  std::unordered_set<const torch::nn::Module*> inner;
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    const auto* c = dynamic_cast<const CheckpointedBase*>(item.value().get());
    if (c == nullptr || inner.count(item.value().get()) != 0) continue;
    const uint64_t runs = before != nullptr ? c->forward_calls() - before->at(c) : 1;
    if (runs > 1)
      return "the checkpointed module '" + item.key() + "' runs " + std::to_string(runs) + " times in one forward";
    outer.emplace_back(item.key(), c);
    for (const auto& m : item.value()->modules(/*include_self=*/false)) inner.insert(m.get());
  }
  std::unordered_map<const c10::TensorImpl*, std::string> holder;
  for (const auto& [name, c] : outer) {
    if (inner.count(dynamic_cast<const torch::nn::Module*>(c)) != 0) continue;  // inside another one after all
    for (const auto& p : dynamic_cast<const torch::nn::Module*>(c)->named_parameters()) {
      const auto [it, first] = holder.emplace(p.value().unsafeGetTensorImpl(), name);
      if (!first && it->second != name)
        return "the checkpointed modules '" + it->second + "' and '" + name + "' share the parameter '" + p.key() + "'";
    }
  }
  return {};
}

// Every combination of the request's lists for one wrap policy of `units` units (`checkpointable`
// of them can be checkpointed), in the order the lists give, less those that make no sense (offload
// where the device is the host, checkpointing with only the root, strategies other than FULL_SHARD
// at one rank, the step in backward where `several_passes` says why a checkpointed candidate's
// gradients arrive in several passes).
std::vector<Candidate> candidates(const PlanRequest& request, const Cluster& cluster, int world, int per_rank,
                                  const NamedWrapPolicy& wrap, size_t units, int checkpointable, bool several_passes) {
  Candidate base;
  base.wrap = wrap;
  base.all_gather_quantization = request.all_gather_quantization();
  base.reduce_quantization = request.reduce_quantization();
  base.deterministic = request.deterministic();
  base.reshard_after_forward_policy = request.reshard_after_forward_policy();
  auto list = [](const auto& values) {
    return [&values](const Candidate&) {
      return values;
    };
  };
  std::vector<ShardingStrategy> strategies;
  for (const ShardingStrategy s : request.strategies())
    if (world > 1 || s == ShardingStrategy::kFullShard) strategies.push_back(s);  // all the same at one rank
  std::vector<bool> offload;
  std::vector<int> checkpointing;  // units checkpointed: -1 none, 0 every one, else the first k
  for (const bool on : request.activation_checkpointing())
    if (!on)
      checkpointing.push_back(-1);
    else if (units >= 2)  // only the root: nothing to checkpoint
      for (const double share : request.checkpointed_shares()) {
        const int k = std::clamp(static_cast<int>(std::lround(share * checkpointable)), 1, std::max(1, checkpointable));
        const int units_checkpointed = k >= checkpointable ? 0 : k;
        if (std::find(checkpointing.begin(), checkpointing.end(), units_checkpointed) == checkpointing.end())
          checkpointing.push_back(units_checkpointed);
      }
  for (const bool on : request.cpu_offload())
    if (!on || !cluster.device_is_host) offload.push_back(on);
  std::vector<int> micros;
  for (const int m : micro_batches(request, per_rank))
    if (m >= 1 && per_rank % m == 0) micros.push_back(m);
  const std::vector<int> zero{0}, factors = hybrid_factors(request, cluster, world);
  std::vector<Candidate> cs{base};
  cs = expand(cs, list(strategies), [](Candidate& c, ShardingStrategy s) { c.strategy = s; });
  cs = expand(
      cs, [&](const Candidate& c) { return c.strategy == ShardingStrategy::kHybridShard ? factors : zero; },
      [](Candidate& c, int f) { c.sharding_factor = f; });
  cs = expand(
      cs,
      [&](const Candidate& c) {  // only the root: it never reshards after forward
        return units < 2 ? zero
                         : reshard_sizes(request, cluster, c.strategy,
                                         c.strategy == ShardingStrategy::kHybridShard ? c.sharding_factor : world);
      },
      [](Candidate& c, int k) { c.reshard_after_forward_size = k; });
  cs = expand(cs, list(checkpointing), [](Candidate& c, int k) {
    c.activation_checkpointing = k >= 0;
    c.checkpointed_units = std::max(k, 0);
  });
  cs = expand(cs, list(offload), [](Candidate& c, bool on) { c.cpu_offload = on; });
  cs = expand(cs, list(request.precisions()), [](Candidate& c, at::ScalarType p) { c.precision = p; });
  cs = expand(cs, list(request.all_gather_limits()), [](Candidate& c, int l) { c.all_gather_limit = l; });
  cs = expand(cs, list(request.backward_prefetch()), [](Candidate& c, BackwardPrefetch p) { c.backward_prefetch = p; });
  cs = expand(cs, list(request.forward_prefetch()), [](Candidate& c, bool on) { c.forward_prefetch = on; });
  cs = expand(cs, list(request.reductions_in_flight()), [](Candidate& c, int n) { c.reductions_in_flight = n; });
  cs = expand(cs, list(micros), [&](Candidate& c, int m) {
    c.micro_batch = m;
    c.accumulation = per_rank / m;
  });
  // no_sync where a step has several micro-batches; with it, the parameters kept unsharded where
  // the strategy gathers its units; without it, under HYBRID_SHARD with several replica groups, the
  // replica all-reduce deferred to the last micro-batch.
  cs = expand(  // deterministic training accumulates a rank's micro-batches locally: no_sync only
      cs,
      [&](const Candidate& c) {
        return c.deterministic && c.accumulation > 1 ? std::vector<bool>{true}
                                                     : choices(request.no_sync(), c.accumulation > 1);
      },
      [](Candidate& c, bool on) { c.no_sync = on; });
  cs = expand(
      cs, [&](const Candidate& c) { return choices(request.keep_unsharded(), planner::can_keep_unsharded(c, world)); },
      [](Candidate& c, bool on) { c.keep_unsharded = on; });
  cs = expand(
      cs,
      [&](const Candidate& c) { return choices(request.replica_deferred(), planner::can_defer_replicas(c, world)); },
      [](Candidate& c, bool on) { c.replica_deferred = on; });
  // The step in backward where its figures are modeled: one micro-batch, the step on backward's thread.
  return expand(
      cs,
      [&](const Candidate& c) {
        return choices(request.step_in_backward(), (c.accumulation == 1 || c.no_sync) && !c.cpu_offload &&
                                                       c.precision != at::kHalf &&
                                                       !(several_passes && c.activation_checkpointing));
      },
      [](Candidate& c, bool on) { c.step_in_backward = on; });
}

// Notes where a calibration does not describe the candidates: another model's, or a precision it
// did not time (predicted from the cluster's nominal rates, which a measured one is not comparable to).
void note_calibration_gaps(torch::nn::Module& model, const PlanRequest& request, std::vector<std::string>& notes) {
  const Calibration& calibration = request.calibration();
  if (calibration.empty()) return;
  const int64_t numel = planner::parameter_elements(model);
  if (calibration.parameters > 0 && calibration.parameters != numel)
    notes.push_back("the calibration timed a model of " + std::to_string(calibration.parameters) +
                    " parameters, this one has " + std::to_string(numel) +
                    ": its times are another model's; calibrate this model");
  for (const at::ScalarType p : request.precisions())
    if (calibration.find(p) == nullptr)
      notes.push_back(std::string(p == at::kFloat      ? "fp32"
                                  : p == at::kBFloat16 ? "bf16"
                                                       : "fp16") +
                      " candidates are predicted from the cluster's nominal rates, not measured ones: the "
                      "calibration did not time that precision; time it too, or leave it out of "
                      "PlanRequest::precisions");
}

// Why the request's lists leave no candidate: the filters candidates() applies, where one empties a list.
std::string why_empty(const PlanRequest& r, const Cluster& cluster, int world, size_t most_units) {
  auto only = [](const std::vector<bool>& values, bool v) {
    return std::all_of(values.begin(), values.end(), [v](bool x) { return x == v; });
  };
  std::vector<ShardingStrategy> planned;
  for (const ShardingStrategy s : r.strategies())
    if ((world > 1 || s == ShardingStrategy::kFullShard) &&
        (s != ShardingStrategy::kHybridShard || !hybrid_factors(r, cluster, world).empty()))
      planned.push_back(s);
  if (planned.empty())
    return world == 1 ? "at one rank only FULL_SHARD is planned (every strategy is the same there); add it to "
                        "PlanRequest::strategies"
                      : "HYBRID_SHARD needs a sharding factor in PlanRequest::hybrid_factors that divides the " +
                            std::to_string(world) + " ranks and lies strictly between 1 and " + std::to_string(world);
  if (only(r.activation_checkpointing(), true) && most_units < 2)
    return "PlanRequest::activation_checkpointing holds only true, but every wrap policy plans the root alone "
           "(nothing to checkpoint); add a wrap policy with units, or false";
  if (only(r.cpu_offload(), true) && cluster.device_is_host)
    return "PlanRequest::cpu_offload holds only true, but this cluster's device is the host; add false";
  return "the request's lists leave no combination";
}

}  // namespace

Plan plan(torch::nn::Module& model, const Cluster& cluster, const PlanRequest& request) {
  planner::check_request(request, cluster);
  const int world = request.world() > 0 ? request.world() : cluster.world();
  FSDP_CHECK(request.seq_len() >= 1, "PlanRequest::seq_len must be >= 1");
  const int global = request.global_batch() > 0 ? request.global_batch() : world * request.batch_per_rank();
  FSDP_CHECK(global % world == 0, "the global batch ", global, " does not divide over ", world, " ranks");
  const int per_rank = global / world;
  if (!request.micro_batches().empty()) {
    bool any = false;
    for (const int m : request.micro_batches()) any = any || (m >= 1 && per_rank % m == 0);
    FSDP_CHECK(any, "no size in PlanRequest::micro_batches divides the ", per_rank,
               " sequences each rank takes per step (the global batch ", global, " over ", world,
               " ranks); give divisors of ", per_rank, ", or leave it empty for all of them");
  }

  Plan result;
  result.budget = request.memory_budget() > 0 ? request.memory_budget() : cluster.device.memory_bytes;
  FSDP_CHECK(request.memory_margin() >= 0, "PlanRequest::memory_margin must be >= 0 (a share of the peak), got ",
             request.memory_margin());
  result.memory_margin = request.memory_margin();
  if (result.budget > cluster.device.memory_bytes)
    result.notes.push_back("the budget " + format_bytes(result.budget) + " exceeds the device's memory (" +
                           format_bytes(cluster.device.memory_bytes) +
                           " per rank): a candidate that fits it may not fit the device");
  for (const int k : request.reshard_after_forward_sizes())
    FSDP_CHECK(k >= 0, "PlanRequest::reshard_after_forward_sizes holds ", k,
               "; a size is 0 (free completely) or a group size that divides the shard group");
  for (const auto& [q, what] : {std::pair{&request.all_gather_quantization(), "all_gather_quantization"},
                                std::pair{&request.reduce_quantization(), "reduce_quantization"}})
    FSDP_CHECK(!q->enabled() || q->block_size() >= 1, "PlanRequest::", what, ": block_size must be at least 1, got ",
               q->block_size());
  FSDP_CHECK(!request.deterministic() ||
                 (!request.all_gather_quantization().enabled() && !request.reduce_quantization().enabled()),
             "PlanRequest::deterministic sums gradients exactly and keeps every value the same at any world size, "
             "which quantized communication does not; drop the quantization or deterministic");
  const auto& strategies = request.strategies();
  if (world > 1 && !request.hybrid_factors().empty() && hybrid_factors(request, cluster, world).empty() &&
      std::find(strategies.begin(), strategies.end(), ShardingStrategy::kHybridShard) != strategies.end())
    result.notes.push_back("HYBRID_SHARD is not planned: no factor in PlanRequest::hybrid_factors divides the " +
                           std::to_string(world) + " ranks strictly between 1 and " + std::to_string(world));
  for (const int k : request.reshard_after_forward_sizes()) {  // an hpZ size no shard group of a candidate splits into
    bool used = k <= 1;
    for (const ShardingStrategy st : strategies) {
      std::vector<int> groups{world};
      if (st == ShardingStrategy::kHybridShard) groups = hybrid_factors(request, cluster, world);
      for (const int F : groups) used = used || (fsdp::reshards_after_forward(st) && k < F && F % k == 0);
    }
    if (!used)
      result.notes.push_back("PlanRequest::reshard_after_forward_sizes' " + std::to_string(k) +
                             " is planned nowhere: no candidate's shard group (" + std::to_string(world) +
                             " ranks, or a HYBRID_SHARD factor) splits into groups of " + std::to_string(k) +
                             " with a strategy that reshards after forward");
  }
  if (planner::parameter_elements(model) == 0)
    result.notes.push_back("the model has no parameters: FSDP has nothing to shard, gather or reduce in any candidate");
  if (std::find(request.activation_checkpointing().begin(), request.activation_checkpointing().end(), true) !=
      request.activation_checkpointing().end()) {
    bool wrapped = false;
    for (const auto& m : model.modules(/*include_self=*/true))
      wrapped = wrapped || dynamic_cast<const CheckpointedBase*>(m.get()) != nullptr;
    if (!wrapped)
      result.notes.push_back("the model holds no fsdp::Checkpointed module: a checkpointed candidate needs its units "
                             "wrapped (fsdp::Checkpointed<Block>, docs/usage.md) before "
                             "apply_activation_checkpointing can turn them on; without, leave activation_checkpointing "
                             "at {false}");
  }
  const double with_margin = 1.0 + request.memory_margin();
  result.cluster = cluster.describe();
  // Every wrap policy's units and costs (the searched ones first, then those only runtime timings
  // name), then what the runtime timings add to their replays.
  std::vector<NamedWrapPolicy> known = request.wrap_policies();
  const size_t searched = known.size();
  known.insert(known.end(), request.calibration_wrap_policies().begin(), request.calibration_wrap_policies().end());
  FSDP_CHECK(!request.trace_forward() || !request.module_cost(),
             "PlanRequest: set trace_forward or module_cost, not both (the trace counts every operator, the "
             "module's own ones included)");
  bool root_only = true;
  for (const NamedWrapPolicy& w : request.wrap_policies()) root_only = root_only && !w.policy;
  if (const planner::RepeatedBlock block = root_only ? planner::repeated_block(model) : planner::RepeatedBlock{};
      block.count > 0) {
    std::ostringstream o;
    o << "every wrap policy plans the whole model as one unit, gathered at once; " << block.type << " repeats "
      << block.count << " times and holds " << std::lround(100 * block.share)
      << "% of the parameters: PlanRequest::wrap_policies({{\"block\", fsdp::wrap::by_type<" << block.type
      << ">()}}) plans a unit per instance";
    result.notes.push_back(o.str());
  }
  note_calibration_gaps(model, request, result.notes);
  std::vector<planner::TracedSegment> traced;
  std::unordered_map<const CheckpointedBase*, uint64_t> runs;
  for (const auto& m : model.modules(/*include_self=*/true))
    if (const auto* c = dynamic_cast<const CheckpointedBase*>(m.get())) runs[c] = c->forward_calls();
  if (request.trace_forward()) {
    std::vector<at::Tensor> ignored = request.ignored_parameters();
    for (const auto& m : request.ignored_modules())
      if (m != nullptr)
        for (const at::Tensor& p : m->parameters()) ignored.push_back(p);
    traced = planner::trace_forward(model, request.trace_forward(), request.trace_sequences() * request.seq_len(),
                                    request.trace_probe_bytes(), ignored);
  }
  const std::string several_passes = checkpointed_passes(model, request.trace_forward() ? &runs : nullptr);
  const auto& stepping = request.step_in_backward();
  const auto& checkpointing = request.activation_checkpointing();
  if (!several_passes.empty() && std::find(stepping.begin(), stepping.end(), true) != stepping.end() &&
      std::find(checkpointing.begin(), checkpointing.end(), true) != checkpointing.end())
    result.notes.push_back(several_passes +
                           ": its gradients arrive in several recomputations' backwards, where the step in backward "
                           "cannot run on all of them; checkpointed candidates that step in backward are left out");
  if (const auto miscounted = request.trace_forward()
                                  ? std::vector<std::string>{}
                                  : planner::miscounted_modules(model, request.module_cost(), request.seq_len());
      !miscounted.empty()) {
    std::ostringstream names;
    for (size_t i = 0; i < miscounted.size() && i < 3; ++i) names << (i ? ", " : "") << miscounted[i];
    if (miscounted.size() > 3) names << " and " << miscounted.size() - 3 << " more";
    const std::string what = "the planner's rules cannot count the FLOPs and kept activations of " + names.str();
    // Without either, every time and activation figure would be silently wrong.
    FSDP_CHECK(request.module_cost(), what,
               "; give PlanRequest::trace_forward one forward of the model on meta tensors (docs/planner.md, The "
               "operator trace), or a module_cost that counts them");
    result.notes.push_back(what + ", and module_cost gives nothing for them: they are missing from every prediction");
  }
  // Per wrap policy, its units with mixed precision off and on (modules that keep full precision,
  // BatchNorm by default, have FlatParameters of their own under mixed precision only).
  struct Planned {
    UnitPlan units;
    planner::ModelCosts costs;
  };
  std::map<std::pair<size_t, bool>, Planned> planned;
  auto view_of = [&](size_t w, at::ScalarType precision) {
    const bool mixed = precision != at::kFloat;
    auto it = planned.find({w, mixed});
    if (it == planned.end()) {
      Options options = Options()
                            .auto_wrap_policy(known[w].policy)
                            .ignored_modules(request.ignored_modules())
                            .ignored_parameters(request.ignored_parameters());
      if (mixed) options.mixed_precision(MixedPrecision().param_dtype(precision));
      Planned p{plan_units(model, options, c10::Device(c10::kCPU)), {}};
      p.costs = request.trace_forward()
                    ? planner::model_costs(model, p.units, traced)
                    : planner::model_costs(model, p.units, request.module_cost(), request.seq_len());
      it = planned.emplace(std::pair{w, mixed}, std::move(p)).first;
    }
    return planner::ModelView{&it->second.units, &it->second.costs};
  };
  std::map<at::ScalarType, std::vector<planner::TimedConfiguration>> timed;
  for (const RuntimeTiming& timing : request.calibration().runtime) {
    if (timing.world != world) {
      result.notes.push_back("the calibration's " + std::string(c10::toString(timing.precision)) +
                             " runtime timing was made at world " + std::to_string(timing.world) + ", not " +
                             std::to_string(world) + ": FSDP's own work is not in these predictions");
      continue;
    }
    size_t w = 0;
    while (w < known.size() && known[w].name != timing.wrap) ++w;
    FSDP_CHECK(w < known.size(), "the calibration's runtime timing was made with the wrap policy \"", timing.wrap,
               "\", which neither PlanRequest::wrap_policies nor calibration_wrap_policies names; add it under that "
               "name, or calibrate again");
    timed[timing.precision].push_back({&timing, view_of(w, timing.precision), known[w]});
  }
  std::map<at::ScalarType, planner::RuntimeCorrection> corrections;
  for (const auto& [precision, configurations] : timed)
    corrections[precision] = planner::runtime_correction(configurations, cluster, world, request);
  for (size_t w = 0; w < searched; ++w) {
    const planner::ModelView fp32 = view_of(w, at::kFloat);
    const size_t units = fp32.units->units.size();
    // Some units only where none holds another (Note [Checkpointing some units]); 0: every unit.
    const std::vector<int>& ckpt = fp32.costs->checkpointable_units;
    const bool nested = std::any_of(ckpt.begin(), ckpt.end(), [&](int u) { return fp32.units->units[u].parent > 0; });
    const int checkpointable = nested ? 0 : static_cast<int>(ckpt.size());
    for (const Candidate& c :
         candidates(request, cluster, world, per_rank, known[w], units, checkpointable, !several_passes.empty())) {
      const auto corrected = corrections.find(c.precision);
      PlanEntry e = planner::evaluate(view_of(w, c.precision), c, cluster, world, request,
                                      corrected == corrections.end() ? nullptr : &corrected->second);
      e.fits = static_cast<double>(e.memory.peak) * with_margin <= static_cast<double>(result.budget) &&
               (e.memory.host == 0 || e.memory.host * cluster.ranks_per_node <= cluster.host_memory_bytes);
      result.entries.push_back(std::move(e));
    }
  }
  if (result.entries.empty()) {
    size_t most_units = 0;
    for (size_t w = 0; w < searched; ++w) most_units = std::max(most_units, view_of(w, at::kFloat).units->units.size());
    FSDP_FAIL("nothing to plan: ", why_empty(request, cluster, world, most_units));
  }
  // Steps equal to float precision (uncalibrated rules charge micro-batches nothing per pass):
  // fewer micro-batches first, then the lower peak.
  std::stable_sort(result.entries.begin(), result.entries.end(), [](const PlanEntry& a, const PlanEntry& b) {
    if (a.fits != b.fits) return a.fits;
    const auto ta = static_cast<float>(a.time.step_s), tb = static_cast<float>(b.time.step_s);
    if (ta != tb) return ta < tb;
    if (a.candidate.accumulation != b.candidate.accumulation)
      return a.candidate.accumulation < b.candidate.accumulation;
    return a.memory.peak < b.memory.peak;
  });
  return result;
}

}  // namespace fsdp
