#include "fsdp/fully_shard.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <functional>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>

#include "deferred_init_impl.h"
#include "fsdp/check.h"
#include "fsdp/sharded.h"
#include "runtime/internal_guard.h"
#include "runtime/runtime.h"

namespace fsdp {

void register_runtime(Runtime* runtime, bool intercept);
void unregister_runtime(Runtime* runtime);

std::string to_string(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kFullShard: return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp: return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard: return "NO_SHARD";
    case ShardingStrategy::kHybridShard: return "HYBRID_SHARD";
  }
  return "?";
}

namespace {
// "backward-pre" -> "BACKWARD_PRE": option names are accepted in any case, with '-' or '_'.
std::string normalize_option_name(const std::string& name) {
  std::string n;
  for (char c : name) n += (c == '-') ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return n;
}
}  // namespace

ShardingStrategy parse_sharding_strategy(const std::string& name) {
  const std::string n = normalize_option_name(name);
  for (auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard,
                 ShardingStrategy::kHybridShard})
    if (n == to_string(s)) return s;
  FSDP_FAIL("unknown sharding strategy '", name, "'; use FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD");
}

std::string to_string(BackwardPrefetch p) {
  switch (p) {
    case BackwardPrefetch::kBackwardPre: return "BACKWARD_PRE";
    case BackwardPrefetch::kBackwardPost: return "BACKWARD_POST";
    case BackwardPrefetch::kNone: return "NONE";
  }
  return "?";
}

BackwardPrefetch parse_backward_prefetch(const std::string& name) {
  const std::string n = normalize_option_name(name);
  for (auto p : {BackwardPrefetch::kBackwardPre, BackwardPrefetch::kBackwardPost, BackwardPrefetch::kNone})
    if (n == to_string(p)) return p;
  FSDP_FAIL("unknown backward prefetch '", name, "'; use BACKWARD_PRE, BACKWARD_POST or NONE");
}

namespace {

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

// One module of the tree, in pre-order.
struct Node {
  torch::nn::Module* module;
  std::string name;
  int parent;
  std::vector<int> children;
};

}  // namespace

Runtime::Runtime(std::shared_ptr<torch::nn::Module> module, ProcessGroupPtr pg, Options options)
    : module_(std::move(module)), pg_(std::move(pg)), options_(std::move(options)) {
  FSDP_CHECK(module_ != nullptr, "fully_shard: the module is null");
  FSDP_CHECK(pg_ != nullptr, "fully_shard: the process group is null; create one with ProcessGroup::from_env()");
  detail::check_not_deferring("fully_shard");
  const int W = pg_->size();
  pool_.set_enabled(options_.reuse_buffers());
  const auto strategy = options_.sharding_strategy();
  FSDP_CHECK(!options_.limit_all_gathers() || options_.all_gather_limit() >= 1, "all_gather_limit must be at least 1, got ",
             options_.all_gather_limit(), "; to turn the rate limiter off use limit_all_gathers(false)");
  FSDP_CHECK(options_.reductions_in_flight() >= 0, "reductions_in_flight must be 0 or more, got ",
             options_.reductions_in_flight());
  reshard_after_forward_ = strategy == ShardingStrategy::kFullShard || strategy == ShardingStrategy::kHybridShard;
  group_.world_size = W;
  group_.world_comm = pg_->world();
  switch (strategy) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      FSDP_CHECK(options_.sharding_factor() == 0 || options_.sharding_factor() == W, to_string(strategy),
                 " shards over the whole world (", W, " ranks), so sharding_factor must be 0 or ", W, ", got ",
                 options_.sharding_factor(), "; use HYBRID_SHARD to shard over fewer ranks");
      sharding_factor_ = W;
      group_.shard_comm = pg_->world();
      break;
    case ShardingStrategy::kNoShard:
      FSDP_CHECK(options_.sharding_factor() == 0 || options_.sharding_factor() == 1,
                 "NO_SHARD replicates parameters, so sharding_factor must be 0 or 1, got ", options_.sharding_factor());
      sharding_factor_ = 1;
      break;
    case ShardingStrategy::kHybridShard: {
      const int F = options_.sharding_factor() ? options_.sharding_factor() : pg_->env().local_world_size;
      FSDP_CHECK(F >= 1 && F <= W, "HYBRID_SHARD sharding_factor ", F, " must be between 1 and the world size ", W);
      FSDP_CHECK(W % F == 0, "HYBRID_SHARD: world size ", W, " is not divisible by the sharding factor ", F,
                 "; choose a sharding_factor that divides ", W, " (shard groups are F consecutive ranks)");
      sharding_factor_ = F;
      const int r = pg_->rank();
      if (F > 1 && F < W) {
        std::vector<int> shard_ranks, replica_ranks;
        for (int i = 0; i < F; ++i) shard_ranks.push_back(r / F * F + i);
        for (int i = r % F; i < W; i += F) replica_ranks.push_back(i);
        group_.shard_comm = pg_->new_group(shard_ranks, "shard");
        group_.replicate_comm = pg_->new_group(replica_ranks, "replicate");
      } else if (F == W) {
        group_.shard_comm = pg_->world();
      }
      break;
    }
  }
  group_.keep_unsharded = sharding_factor_ == 1;

  build_units();
  check_same_model_on_all_ranks();
  build_flat_params();
  for (const auto& kv : module_->named_buffers(/*recurse=*/true)) buffers_.emplace_back(kv.key(), kv.value());
  register_hooks();
  tracer_.enable(options_.trace());
  // Only sharded FlatParameters need gathering when an operator reads them.
  intercepting_ = !group_.keep_unsharded;
  register_runtime(this, intercepting_);
}

Runtime::~Runtime() {
  unregister_runtime(this);
  remove_hooks();
}

void Runtime::build_units() {
  // The module tree in pre-order; a module registered twice is visited once.
  std::vector<Node> nodes;
  std::map<torch::nn::Module*, int> index;
  std::function<void(torch::nn::Module&, const std::string&, int)> walk = [&](torch::nn::Module& m,
                                                                               const std::string& name, int parent) {
    const int i = static_cast<int>(nodes.size());
    index[&m] = i;
    nodes.push_back({&m, name, parent, {}});
    if (parent >= 0) nodes[parent].children.push_back(i);
    for (const auto& kv : m.named_children()) {
      if (index.count(kv.value().get())) continue;
      walk(*kv.value(), name.empty() ? kv.key() : name + "." + kv.key(), i);
    }
  };
  walk(*module_, "", -1);

  std::set<torch::nn::Module*> annotated;
  for (const auto& m : options_.wrap_modules()) {
    FSDP_CHECK(m && index.count(m.get()), "Options::wrap_modules lists a module that is not part of the model");
    annotated.insert(m.get());
  }

  // Bottom-up: a module becomes a unit if annotated or the policy says so, given the parameter
  // elements of its subtree that no nested unit took.
  std::vector<char> is_unit(nodes.size(), 0);
  std::set<const c10::TensorImpl*> counted;
  std::function<int64_t(int)> decide = [&](int i) -> int64_t {
    int64_t unwrapped = 0;
    for (int c : nodes[i].children) unwrapped += decide(c);
    for (const auto& kv : nodes[i].module->named_parameters(/*recurse=*/false))
      if (counted.insert(kv.value().unsafeGetTensorImpl()).second) unwrapped += kv.value().numel();
    if (i == 0) {
      is_unit[i] = 1;
      return 0;
    }
    const bool policy = options_.auto_wrap_policy() && options_.auto_wrap_policy()(nodes[i].name, *nodes[i].module, unwrapped);
    const bool explicit_unit = dynamic_cast<const ExplicitUnit*>(nodes[i].module) != nullptr;
    if (policy || explicit_unit || annotated.count(nodes[i].module)) {
      is_unit[i] = 1;
      return 0;
    }
    return unwrapped;
  };
  decide(0);

  // Owning unit of every module: its nearest unit ancestor-or-self.
  std::vector<int> owner(nodes.size());
  std::vector<int> unit_node;  // unit index -> node
  std::vector<int> unit_parent;
  std::map<int, int> unit_of_node;
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (is_unit[i]) {
      const int u = static_cast<int>(unit_node.size());
      unit_of_node[i] = u;
      unit_node.push_back(static_cast<int>(i));
      unit_parent.push_back(i == 0 ? -1 : owner[nodes[i].parent]);
      owner[i] = u;
    } else {
      owner[i] = owner[nodes[i].parent];
    }
  }
  auto ancestors_or_self = [&](int u) {
    std::vector<int> chain;
    for (int v = u; v >= 0; v = unit_parent[v]) chain.push_back(v);
    return chain;
  };

  // Every distinct parameter goes to the unit owning the module(s) that register it; a parameter
  // registered in modules of several units goes to their lowest common ancestor unit.
  struct Seen {
    std::string name;
    at::Tensor param;
    std::vector<int> units;
    std::vector<std::string> names;
  };
  std::vector<Seen> seen;
  std::map<const c10::TensorImpl*, size_t> seen_index;
  for (size_t i = 0; i < nodes.size(); ++i) {
    for (const auto& kv : nodes[i].module->named_parameters(/*recurse=*/false)) {
      const std::string full = nodes[i].name.empty() ? kv.key() : nodes[i].name + "." + kv.key();
      const at::Tensor& p = kv.value();
      FSDP_CHECK(p.defined(), "parameter '", full, "' is undefined; register defined tensors only");
      auto [it, fresh] = seen_index.emplace(p.unsafeGetTensorImpl(), seen.size());
      if (fresh) seen.push_back({full, p, {}, {}});
      Seen& s = seen[it->second];
      s.names.push_back(full);
      if (std::find(s.units.begin(), s.units.end(), owner[i]) == s.units.end()) s.units.push_back(owner[i]);
    }
  }
  for (auto& s : seen) {
    int unit = s.units[0];
    if (s.units.size() > 1) {
      std::ostringstream where;
      for (size_t k = 0; k < s.names.size(); ++k) where << (k ? ", " : "") << "'" << s.names[k] << "'";
      FSDP_CHECK(options_.shared_parameters() != SharedParameterPolicy::kError, "parameter ", where.str(),
                 " is shared by modules of different FSDP units; set Options::shared_parameters(",
                 "SharedParameterPolicy::kLowestCommonAncestor) to place it in their common unit, or wrap the "
                 "modules that share it in one unit");
      std::vector<int> common = ancestors_or_self(s.units[0]);
      for (size_t k = 1; k < s.units.size(); ++k) {
        auto chain = ancestors_or_self(s.units[k]);
        common.erase(std::remove_if(common.begin(), common.end(),
                                    [&](int v) { return std::find(chain.begin(), chain.end(), v) == chain.end(); }),
                     common.end());
      }
      unit = common.front();  // nearest first: the lowest common ancestor
    }
    const at::Tensor& p = s.param;
    FSDP_CHECK(p.layout() == at::kStrided && !p.is_quantized(), "parameter '", s.name,
               "' is not a dense tensor; FSDP shards dense parameters only");
    FSDP_CHECK(!p.requires_grad() || p.is_floating_point() || p.is_complex(), "parameter '", s.name,
               "' requires grad but has dtype ", p.scalar_type());
    // Meta parameters (built under fsdp::DeferredInit) are materialized on the communicators' device below.
    const c10::Device comm_device = pg_->world()->device();
    FSDP_CHECK(p.device() == comm_device || p.is_meta(), "parameter '", s.name, "' is on ", p.device(),
               " but the process group's communicators move tensors of ", comm_device,
               comm_device.is_cpu() ? "; move the model to the CPU before fully_shard, or create the process group "
                                      "with ProcessGroupOptions::device set to the model's CUDA device"
                                    : "; move the model to that device (module->to(device)) before fully_shard");
    planned_.push_back({s.name, std::vector<std::string>(s.names.begin() + 1, s.names.end()), p, unit});
  }

  // Units without parameters add nothing; drop them (their children move up), keeping the root.
  std::vector<int> count(unit_node.size(), 0);
  for (const auto& pp : planned_) count[pp.unit]++;
  std::vector<int> new_index(unit_node.size(), -1);
  for (size_t u = 0; u < unit_node.size(); ++u) {
    if (u != 0 && count[u] == 0) continue;
    new_index[u] = static_cast<int>(units_.size());
    unit_of_module_[nodes[unit_node[u]].module] = new_index[u];
    Unit unit;
    unit.name = nodes[unit_node[u]].name;
    int p = unit_parent[u];
    while (p > 0 && new_index[p] < 0) p = unit_parent[p];
    unit.parent = p < 0 ? -1 : new_index[p];
    units_.push_back(unit);
  }
  for (auto& pp : planned_) pp.unit = new_index[pp.unit];
  for (size_t u = 0; u < units_.size(); ++u)
    for (int v = units_[u].parent; v >= 0; v = units_[v].parent) units_[u].ancestors.push_back(v);
}

void Runtime::check_same_model_on_all_ranks() {
  // Every rank publishes a description of the parameters and their units; each rank compares
  // all of them, so a rank with a different model fails here instead of hanging in a collective.
  std::ostringstream d;
  d << "strategy " << to_string(options_.sharding_strategy()) << " factor " << sharding_factor_ << "\n";
  for (const auto& pp : planned_)
    d << pp.name << " " << shape_str(pp.param.sizes()) << " " << pp.param.scalar_type()
      << (pp.param.requires_grad() ? "" : " frozen") << " unit '" << units_[pp.unit].name << "'\n";
  const std::string mine = d.str();
  if (pg_->size() == 1) return;
  const std::string key = "fsdp/model/" + std::to_string(pg_->next_sequence()) + "/";
  auto store = pg_->store();
  store->set(key + std::to_string(pg_->rank()), std::vector<uint8_t>(mine.begin(), mine.end()));
  for (int r = 0; r < pg_->size(); ++r) {
    if (r == pg_->rank()) continue;
    std::vector<uint8_t> raw;
    try {
      raw = store->get(key + std::to_string(r));
    } catch (const std::exception& e) {
      FSDP_FAIL("fully_shard: rank ", r, " did not publish its model within the timeout (", e.what(),
                "); every rank must call fully_shard() on the same model");
    }
    const std::string theirs(raw.begin(), raw.end());
    if (theirs == mine) continue;
    std::istringstream a(mine), b(theirs);
    std::string la, lb;
    int line = 0;
    while (true) {
      const bool ga = static_cast<bool>(std::getline(a, la)), gb = static_cast<bool>(std::getline(b, lb));
      ++line;
      if (!ga && !gb) break;
      if (!ga) la = "<nothing>";
      if (!gb) lb = "<nothing>";
      if (la != lb)
        FSDP_FAIL("fully_shard: rank ", pg_->rank(), " and rank ", r, " built different models; first difference "
                  "(line ", line, "): this rank has '", la, "', rank ", r, " has '", lb,
                  "'. Every rank must construct the same model (same sizes, dtypes, frozen parameters) and pass the "
                  "same Options");
    }
  }
}

void Runtime::build_flat_params() {
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  const bool sync = options_.sync_module_states() && pg_->size() > 1;
  auto broadcast_from_rank0 = [&](const at::Tensor& t) {
    if (!t.defined() || t.numel() == 0) return;
    at::Tensor c = t.detach().contiguous();
    pg_->world()->broadcast(c, 0)->wait();
    if (!c.is_same(t)) t.detach().copy_(c);
  };

  // Plan every FlatParameter first (ids in unit order): one per (dtype, requires_grad) group of a
  // unit's parameters, in module order.
  struct PlannedFlat {
    int unit;
    std::vector<ParamSlot> slots;
  };
  std::vector<PlannedFlat> plan;
  for (size_t u = 0; u < units_.size(); ++u) {
    const size_t first = plan.size();
    for (const auto& pp : planned_) {
      if (pp.unit != static_cast<int>(u)) continue;
      auto it = std::find_if(plan.begin() + first, plan.end(), [&](const PlannedFlat& f) {
        const at::Tensor& q = f.slots[0].param;
        return q.scalar_type() == pp.param.scalar_type() && q.requires_grad() == pp.param.requires_grad();
      });
      if (it == plan.end()) {
        plan.push_back({static_cast<int>(u), {}});
        it = plan.end() - 1;
      }
      ParamSlot slot;
      slot.name = pp.name;
      slot.aliases = pp.aliases;
      slot.param = pp.param;
      it->slots.push_back(std::move(slot));
    }
    for (size_t id = first; id < plan.size(); ++id) units_[u].flat_params.push_back(static_cast<int>(id));
  }
  flat_params_.resize(plan.size());

  // Flattens and shards one FlatParameter, then frees its unsharded storage at once, so building
  // the model's FlatParameters never holds more than one unsharded copy.
  auto build = [&](size_t id) {
    if (sync)
      for (const auto& slot : plan[id].slots) broadcast_from_rank0(slot.param);
    flat_params_[id] = std::make_unique<FlatParam>(static_cast<int>(id), plan[id].unit, std::move(plan[id].slots),
                                                   group_, &memory_, &pool_);
    FlatParam& fp = *flat_params_[id];
    flat_param_of_storage_[fp.storage()] = static_cast<int>(id);
    for (size_t s = 0; s < fp.slots().size(); ++s)
      slot_of_param_[fp.slots()[s].param.unsafeGetTensorImpl()] = {static_cast<int>(id), static_cast<int>(s)};
    fp.reshard();
  };

  if (!has_deferred_tensors(*module_)) {
    for (size_t id = 0; id < plan.size(); ++id) build(id);
  } else {
    // Deferred initialization: visit the modules in pre-order, materializing and initializing each
    // one's own meta tensors, and build each FlatParameter right after the last module that
    // registers one of its parameters (so no later initializer can write into it once sharded).
    const auto visits = detail::modules_in_preorder(*module_);
    std::unordered_map<const c10::TensorImpl*, size_t> flat_of_param;
    for (size_t id = 0; id < plan.size(); ++id)
      for (const auto& slot : plan[id].slots) flat_of_param[slot.param.unsafeGetTensorImpl()] = id;
    std::vector<size_t> last_registrant(plan.size(), 0);
    for (size_t i = 0; i < visits.size(); ++i)
      for (const auto& p : visits[i].module->parameters(/*recurse=*/false)) {
        auto it = flat_of_param.find(p.unsafeGetTensorImpl());
        if (it != flat_of_param.end()) last_registrant[it->second] = i;
      }
    std::vector<std::vector<size_t>> ready_after(visits.size());
    for (size_t id = 0; id < plan.size(); ++id) ready_after[last_registrant[id]].push_back(id);
    for (size_t i = 0; i < visits.size(); ++i) {
      detail::materialize_own_tensors(visits[i], options_.param_init_fn(), pg_->world()->device());
      for (size_t id : ready_after[i]) build(id);
    }
  }
  if (sync)
    for (const auto& kv : module_->named_buffers(/*recurse=*/true)) broadcast_from_rank0(kv.value());

  for (size_t u = 0; u < units_.size(); ++u) {
    UnitInfo info;
    info.name = units_[u].name;
    info.parent = units_[u].parent;
    for (int id : units_[u].flat_params) {
      const FlatParam& fp = *flat_params_[id];
      for (const auto& slot : fp.slots()) info.parameters.push_back(slot.name);
      info.numel += fp.numel();
      info.padded_numel += fp.padded_numel();
      info.padded_bytes += fp.padded_numel() * fp.element_size();
      info.shard_bytes += fp.shard_numel() * fp.element_size();
    }
    unit_infos_.push_back(info);
  }
  // Start sharded: the flat storages exist only while a unit is needed.
  reshard_all();
}

std::vector<std::pair<std::string, at::Tensor>> Runtime::named_shard_pieces() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& fp : flat_params_)
    for (const auto& s : fp->slots())
      if (s.piece.defined()) out.emplace_back(s.name, s.piece);
  return out;
}

bool Runtime::is_original_parameter(const at::Tensor& t) const {
  return slot_of_param_.count(t.unsafeGetTensorImpl()) > 0;
}

std::unordered_map<std::string, at::Tensor> Runtime::full_state_dict() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  rethrow_pending_error();
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  std::unordered_map<std::string, at::Tensor> out;
  for (size_t u = 0; u < units_.size(); ++u) {
    const bool was_unsharded = unit_unsharded(static_cast<int>(u));
    unshard(static_cast<int>(u));
    for (int f : units_[u].flat_params)
      for (const auto& s : flat_params_[f]->slots()) {
        out[s.name] = s.param.detach().clone();
        for (const auto& alias : s.aliases) out[alias] = out[s.name];
      }
    if (!was_unsharded) reshard(static_cast<int>(u));
  }
  for (const auto& kv : buffers_) out[kv.first] = kv.second.detach().clone();
  return out;
}

void Runtime::load_full_state_dict(const std::unordered_map<std::string, at::Tensor>& state) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  reshard_all();
  last_touched_ = -1;
  for (auto& fp : flat_params_) {
    at::Tensor full = at::zeros({fp->padded_numel()}, at::TensorOptions().dtype(fp->dtype()));
    for (const auto& s : fp->slots()) {
      auto it = state.find(s.name);
      FSDP_CHECK(it != state.end(), "load_full_state_dict: parameter '", s.name, "' is missing from the state");
      FSDP_CHECK(it->second.sizes().vec() == s.shape, "load_full_state_dict: parameter '", s.name, "' has shape ",
                 shape_str(it->second.sizes()), " in the state but ", shape_str(s.shape), " in the model");
      full.narrow(0, s.offset, s.numel).copy_(it->second.reshape({-1}));
    }
    fp->copy_full_into_shard(full);
  }
  for (auto& kv : buffers_) {
    auto it = state.find(kv.first);
    FSDP_CHECK(it != state.end(), "load_full_state_dict: buffer '", kv.first, "' is missing from the state");
    kv.second.copy_(it->second);
  }
}

MemoryStats Runtime::memory_stats() const {
  auto* self = const_cast<Runtime*>(this);
  std::lock_guard<std::recursive_mutex> lock(self->mu_);
  self->update_sharded_grad_bytes();
  MemoryStats stats = memory_.stats();
  stats.cached_bytes = pool_.cached_bytes();
  stats.system_allocations = pool_.system_allocations();
  std::vector<const Communicator*> seen;
  for (const auto* comm : {group_.shard_comm.get(), group_.replicate_comm.get(), group_.world_comm.get()}) {
    if (!comm || std::find(seen.begin(), seen.end(), comm) != seen.end()) continue;
    seen.push_back(comm);
    stats.comm_scratch_bytes += comm->scratch_bytes();
    stats.comm_shared_bytes += comm->shared_memory_bytes();
  }
  return stats;
}

std::string Runtime::describe_communicators() const {
  std::ostringstream o;
  std::vector<const Communicator*> seen;
  const std::pair<const char*, const Communicator*> roles[] = {{"world", group_.world_comm.get()},
                                                               {"shard group", group_.shard_comm.get()},
                                                               {"replica group", group_.replicate_comm.get()}};
  for (const auto& [role, comm] : roles) {
    if (!comm || (comm->size() < 2 && comm->device().is_cpu()) || std::find(seen.begin(), seen.end(), comm) != seen.end()) continue;
    seen.push_back(comm);
    o << "  " << role << " " << comm->name() << ": "
      << comm->transport() << "\n";
  }
  return o.str();
}

void Runtime::release_cached_memory() { pool_.release_cached(); }

void Runtime::reset_peak_memory_stats() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  memory_.reset_peaks();
}

// ---------------------------------------------------------------------------------------------
// The public handle.

FullyShardedModule::FullyShardedModule(std::shared_ptr<Runtime> runtime) : runtime_(std::move(runtime)) {}
FullyShardedModule::~FullyShardedModule() = default;

std::vector<at::Tensor> FullyShardedModule::parameters() const {
  std::vector<at::Tensor> out;
  for (auto& kv : runtime_->named_shard_pieces()) out.push_back(kv.second);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> FullyShardedModule::named_parameters() const {
  return runtime_->named_shard_pieces();
}

void FullyShardedModule::check_optimizer_parameters(const std::vector<at::Tensor>& params) const {
  for (const auto& p : params)
    FSDP_CHECK(!runtime_->is_original_parameter(p),
               "the optimizer holds an original parameter of the sharded module (shape ", shape_str(p.sizes()),
               "); its gradient is not kept and stepping it would be lost. Build the optimizer over "
               "FullyShardedModule::parameters()");
}

void FullyShardedModule::check_optimizer(const torch::optim::Optimizer& optimizer) const {
  for (const auto& group : optimizer.param_groups()) check_optimizer_parameters(group.params());
}

std::unordered_map<std::string, at::Tensor> FullyShardedModule::full_state_dict() {
  return runtime_->full_state_dict();
}
void FullyShardedModule::load_full_state_dict(const std::unordered_map<std::string, at::Tensor>& state) {
  runtime_->load_full_state_dict(state);
}
MemoryStats FullyShardedModule::memory_stats() const { return runtime_->memory_stats(); }
void FullyShardedModule::reset_peak_memory_stats() { runtime_->reset_peak_memory_stats(); }
void FullyShardedModule::release_cached_memory() { runtime_->release_cached_memory(); }
const std::vector<UnitInfo>& FullyShardedModule::units() const { return runtime_->unit_infos(); }
ShardingStrategy FullyShardedModule::sharding_strategy() const { return runtime_->options().sharding_strategy(); }
int FullyShardedModule::sharding_factor() const { return runtime_->sharding_factor(); }
int FullyShardedModule::world_size() const { return runtime_->world_size(); }
std::shared_ptr<torch::nn::Module> FullyShardedModule::module() const { return runtime_->module(); }
void FullyShardedModule::set_trace(bool on) { runtime_->enable_trace(on); }
IterationTrace FullyShardedModule::last_trace() const { return runtime_->last_trace(); }

std::string FullyShardedModule::describe() const {
  std::ostringstream o;
  o << "FSDP " << to_string(sharding_strategy()) << ", world " << world_size() << ", sharding factor "
    << sharding_factor() << ", " << units().size() << " units\n";
  o << "  " << std::left << std::setw(28) << "unit" << std::right << std::setw(8) << "params" << std::setw(14)
    << "numel" << std::setw(14) << "padded" << std::setw(14) << "shard bytes" << "\n";
  for (const auto& u : units())
    o << "  " << std::left << std::setw(28) << (u.name.empty() ? "<root>" : u.name) << std::right << std::setw(8)
      << u.parameters.size() << std::setw(14) << u.numel << std::setw(14) << u.padded_numel << std::setw(14)
      << u.shard_bytes << "\n";
  o << runtime_->describe_communicators();
  return o.str();
}

std::shared_ptr<FullyShardedModule> fully_shard(std::shared_ptr<torch::nn::Module> module, ProcessGroupPtr pg,
                                                Options options) {
  return std::make_shared<FullyShardedModule>(
      std::make_shared<Runtime>(std::move(module), std::move(pg), std::move(options)));
}

}  // namespace fsdp
