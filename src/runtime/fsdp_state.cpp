#include "runtime/fsdp_state.h"

#include <torch/version.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <sstream>
#include <unordered_set>

#include "block_quantization.h"
#include "deferred_init_impl.h"
#include "fsdp/check.h"
#include "internal_op_guard.h"
#include "runtime/cross_rank_check.h"

namespace fsdp {

FsdpState::FsdpState(std::shared_ptr<torch::nn::Module> module, ProcessGroupPtr pg, Options options)
    : module_(std::move(module)), pg_(std::move(pg)), options_(std::move(options)) {
  FSDP_CHECK(module_ != nullptr, "fully_shard: the module is null");
  FSDP_CHECK(pg_ != nullptr, "fully_shard: the process group is null; create one with ProcessGroup::from_env()");
  detail::check_not_deferring("fully_shard");
  pool_.set_enabled(options_.reuse_buffers());
  FSDP_CHECK(!options_.limit_all_gathers() || options_.all_gather_limit() >= 1,
             "all_gather_limit must be at least 1, got ", options_.all_gather_limit(),
             "; to turn the rate limiter off use limit_all_gathers(false)");
  FSDP_CHECK(options_.reductions_in_flight() >= 0, "reductions_in_flight must be 0 or more, got ",
             options_.reductions_in_flight());
  check_mixed_precision(options_.mixed_precision());
  check_offload(options_.offload(), pg_->world()->device());
  check_quantization(options_);
  ShardingGroups::check(*pg_, options_);  // local: fails on every rank alike, before rank 0's store is needed
  check_same_options_on_all_ranks();      // before any group: a difference must not hang in their creation
  groups_ = ShardingGroups::create(*pg_, options_);
  if (options_.reduce_quantization().enabled())  // the quantized reductions exchange through all-to-alls
    for (const CommunicatorPtr& c : {groups_.shard_comm, groups_.replicate_comm, groups_.world_comm})
      FSDP_CHECK(!c || c->size() < 2 || c->has_all_to_all(), "Options::reduce_quantization needs a transport with an ",
                 "all-to-all, and ", c->name(), " (", c->transport(), ") has none; use the shared-memory or Gloo ",
                 "transport, or turn reduce quantization off");

  UnitPlan plan = plan_units(*module_, options_, pg_->world()->device());
  {
    std::unordered_set<const c10::TensorImpl*> ignored;
    for (const auto& [name, b] : plan.ignored_buffers) ignored.insert(b.unsafeGetTensorImpl());
    for (const auto& kv : module_->named_buffers(/*recurse=*/true))
      if (!ignored.count(kv.value().unsafeGetTensorImpl())) buffers_.emplace_back(kv.key(), kv.value());
  }
  for (const auto& pu : plan.units) reshard_after_forward_.push_back(reshards_after_forward(pu, options_));
  check_same_model_on_all_ranks(plan);
  groups_.create_post_forward_group(*pg_, options_);
  if (options_.offload().enabled())
    offloader_ = std::make_unique<CpuOffloader>(pg_->world()->device(), options_.offload().pin_memory());
  build_flat_params(plan);
  intercepting_ =
      std::any_of(flat_params_.begin(), flat_params_.end(), [](const auto& fp) { return !fp->keep_unsharded(); });
  if (const auto dtype = options_.mixed_precision().buffer_dtype()) {
    // Every managed floating-point buffer but those of modules that keep full precision.
    InternalOpGuard internal;
    at::NoGradGuard no_grad;
    std::unordered_set<const c10::TensorImpl*> kept;
    for (const auto& m : module_->modules(/*include_self=*/true))
      if (options_.mixed_precision().keeps_full_precision(*m))
        for (const auto& b : m->buffers(/*recurse=*/false)) kept.insert(b.unsafeGetTensorImpl());
    for (const auto& [name, b] : buffers_)
      if (b.is_floating_point() && !kept.count(b.unsafeGetTensorImpl())) b.set_data(b.to(*dtype));
  }
  for (const auto& [name, b] : buffers_) whole_tensors_.push_back({name, {}, b, "buffer"});
  for (const auto& [name, b] : plan.ignored_buffers) whole_tensors_.push_back({name, {}, b, "buffer"});
  for (const auto& p : plan.ignored_params) whole_tensors_.push_back({p.name, p.aliases, p.param, "ignored parameter"});
  tracer_.enable(options_.trace());
  reducer_ = std::make_unique<GradientReducer>(units_, flat_params_, options_, /*every_param_expected=*/!intercepting(),
                                               groups_.world_comm, tracer_, memory_);
  scheduler_ = std::make_unique<Scheduler>(units_, options_, pg_->rank(), tracer_, *reducer_);
  for (const auto& p : module_->parameters(/*recurse=*/true)) parameters_at_shard_.push_back(p.unsafeGetTensorImpl());
  for (auto& r : retiring_)
    if (auto alive = r.storage.lock()) retired_storage_.emplace(alive.get(), std::move(r));
  retiring_.clear();
}

const std::string* FsdpState::retired_parameter(const c10::StorageImpl* storage) const {
  if (retired_storage_.empty()) return nullptr;
  auto it = retired_storage_.find(storage);
  return it == retired_storage_.end() || it->second.storage.expired() ? nullptr : &it->second.name;
}

void FsdpState::check_parameters_unchanged() const {
  const auto now = module_->named_parameters(/*recurse=*/true);
  bool same = now.size() == parameters_at_shard_.size();
  for (size_t i = 0; same && i < now.size(); ++i)
    same = now[i].value().unsafeGetTensorImpl() == parameters_at_shard_[i];
  if (same) return;
  std::unordered_set<const c10::TensorImpl*> before(parameters_at_shard_.begin(), parameters_at_shard_.end());
  std::string changed;
  for (const auto& kv : now)
    if (!before.count(kv.value().unsafeGetTensorImpl())) {
      changed = "parameter '" + kv.key() + "' is not one fully_shard() found (added or replaced since)";
      break;
    }
  if (changed.empty())
    changed = "it has " + std::to_string(now.size()) + " parameters where fully_shard() found " +
              std::to_string(parameters_at_shard_.size()) + " (one was removed)";
  FSDP_FAIL("the model's parameters changed after fully_shard(): ", changed,
            ". FSDP manages the parameters it found when it was called; build the model completely (every "
            "register_parameter / register_module) before fully_shard()");
}

void FsdpState::check_mixed_precision(const MixedPrecision& mp) {
  const std::pair<const char*, c10::optional<at::ScalarType>> dtypes[] = {{"param_dtype", mp.param_dtype()},
                                                                          {"reduce_dtype", mp.reduce_dtype()},
                                                                          {"buffer_dtype", mp.buffer_dtype()},
                                                                          {"output_dtype", mp.output_dtype()}};
  for (const auto& [what, dtype] : dtypes)
    FSDP_CHECK(!dtype || at::isFloatingType(*dtype), "MixedPrecision: ", what, " must be a floating-point dtype, got ",
               *dtype, "; use torch::kBFloat16, torch::kFloat16, torch::kFloat32 or torch::kFloat64");
}

void FsdpState::check_offload(const CpuOffload& offload, const at::Device& device) {
  if (!offload.enabled()) return;
  FSDP_CHECK(!device.is_cpu(),
             "Options::offload: this process group computes on the CPU, so the sharded "
             "parameters, their gradients and the optimizer state are in host memory already and there is nothing "
             "to offload; remove .offload(...) for CPU process groups (it applies to CUDA ones)");
}

void FsdpState::check_quantization(const Options& options) {
  for (const auto& [what, q] :
       {std::pair<const char*, const Quantization&>{"all_gather_quantization", options.all_gather_quantization()},
        {"reduce_quantization", options.reduce_quantization()}}) {
    if (!q.enabled()) {
      FSDP_CHECK(!q.error_feedback() && !q.units() && q.block_size() == Quantization().block_size(), "Options::", what,
                 " sets error_feedback, units or block_size but is not enabled, so nothing would be quantized; start "
                 "from Quantization::int8() (or float8(), or enabled(true)), or drop the settings");
      continue;
    }
    FSDP_CHECK(q.block_size() >= 1, "Options::", what, ": block_size must be at least 1, got ", q.block_size());
    FSDP_CHECK(q.dtype() != QuantizedDtype::kFloat8E4M3 || has_float8(), "Options::", what,
               ": fp8 needs LibTorch 2.1 or later (this is ", TORCH_VERSION, "); use int8");
    FSDP_CHECK(!options.offload().enabled(), "Options::", what,
               " does not work with CPU offload yet; turn one of them off");
    const bool reduce = std::string(what) == "reduce_quantization";
    FSDP_CHECK(reduce || !q.error_feedback(), "Options::", what,
               ": error_feedback applies to reduce_quantization only (gathers start from the full-precision "
               "shards every time)");
    FSDP_CHECK(!options.deterministic(), "Options::", what, " and deterministic(true) exclude each other: ",
               reduce ? "deterministic training sums exact integers, which quantization would round"
                      : "the codes' blocks start at each rank's shard, so the gathered values, and the results with "
                        "them, would change with the world size",
               "; turn one of them off");
  }
}

void FsdpState::check_same_model_on_all_ranks(const UnitPlan& plan) const {
  check_same_on_all_ranks(*pg_, describe_model(options_, groups_.sharding_factor, reshard_after_forward_, plan),
                          "built different models",
                          "Every rank must construct the same model (same sizes, dtypes, frozen parameters) and pass "
                          "the same Options, whose predicates (wrap and reshard policies, Quantization::units) choose "
                          "alike for each module");
}

void FsdpState::check_same_options_on_all_ranks() const {
  check_same_on_all_ranks(*pg_, describe_options(options_), "passed different Options to fully_shard()",
                          "Every rank must pass the same Options (those that decide which collectives run)");
}

void FsdpState::build_flat_params(UnitPlan& plan) {
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  const bool sync = options_.sync_module_states() && pg_->size() > 1;
  auto broadcast_from_rank0 = [&](const at::Tensor& t) {
    if (!t.defined() || t.numel() == 0) return;
    at::Tensor c = t.detach().contiguous();
    pg_->world()->broadcast(c, 0, CollectiveOptions::labeled("sync_module_states broadcast"))->wait();
    if (!c.is_same(t)) t.detach().copy_(c);
  };

  // Flattens and shards one FlatParameter, then frees its unsharded storage at once, so building
  // the model's FlatParameters never holds more than one unsharded copy.
  flat_params_.resize(plan.flat_params.size());
  auto build = [&](size_t id) {
    std::vector<ParamSlot> slots;
    for (int i : plan.flat_params[id].params) {
      ParamSlot slot;
      slot.name = plan.params[i].name;
      slot.aliases = plan.params[i].aliases;
      slot.param = plan.params[i].param;
      if (sync) broadcast_from_rank0(slot.param);
      if (slot.param.has_storage()) retiring_.push_back({slot.param.storage().getWeakStorageImpl(), slot.name});
      slots.push_back(std::move(slot));
    }
    flat_params_[id] =
        std::make_unique<FlatParam>(static_cast<int>(id), plan.flat_params[id].unit, std::move(slots), groups_,
                                    plan.flat_params[id].full_precision ? MixedPrecision() : options_.mixed_precision(),
                                    &memory_, &pool_, offloader_.get());
    FlatParam& fp = *flat_params_[id];
    // Blocks end where each original parameter (and the padding) starts.
    std::vector<int64_t> starts{fp.numel()};
    for (const ParamSlot& slot : fp.slots()) starts.push_back(slot.offset);
    const auto cuts = parameter_cuts(std::move(starts), fp.padded_numel());
    const Quantization& q = options_.all_gather_quantization();
    const UnitPlan::Unit& pu = plan.units[plan.flat_params[id].unit];
    if (q.applies_to(pu.name, *pu.module) && fp.sharded_over_peers() && at::isFloatingType(fp.dtype()))
      fp.quantize_gathers(BlockFormat{q.dtype(), q.block_size(), cuts});
    const Quantization& rq = options_.reduce_quantization();
    if (rq.applies_to(pu.name, *pu.module) && groups_.world_size > 1 && at::isFloatingType(fp.dtype())) {
      fp.quantize_reductions(BlockFormat{rq.dtype(), rq.block_size(), cuts});
      fp.residuals().enabled = rq.error_feedback();
    }
    flat_param_of_storage_[fp.storage()] = static_cast<int>(id);
    if (!fp.keep_unsharded())
      flat_param_of_shard_storage_[fp.shard().storage().unsafeGetStorageImpl()] = static_cast<int>(id);
    for (size_t s = 0; s < fp.slots().size(); ++s)
      slot_of_param_[fp.slots()[s].param.unsafeGetTensorImpl()] = {static_cast<int>(id), static_cast<int>(s)};
    const auto& sentinels = fp.grad().sentinels();
    for (size_t s = 0; s < sentinels.size(); ++s)
      sentinel_of_storage_[sentinels[s].storage().unsafeGetStorageImpl()] = {static_cast<int>(id), static_cast<int>(s)};
    fp.reshard();
  };

  if (!has_deferred_tensors(*module_)) {
    for (size_t id = 0; id < plan.flat_params.size(); ++id) build(id);
  } else {
    // Deferred initialization (Note [Deferred initialization]): visit the modules in pre-order,
    // materializing and initializing each one's own meta tensors, and build each FlatParameter
    // right after the last module registering one of its parameters, so no later initializer can
    // write into it once sharded.
    const auto visits = detail::modules_in_preorder(*module_);
    std::unordered_map<const c10::TensorImpl*, size_t> flat_of_param;
    for (size_t id = 0; id < plan.flat_params.size(); ++id)
      for (int i : plan.flat_params[id].params) flat_of_param[plan.params[i].param.unsafeGetTensorImpl()] = id;
    std::vector<size_t> last_registrant(plan.flat_params.size(), 0);
    for (size_t i = 0; i < visits.size(); ++i)
      for (const auto& p : visits[i].module->parameters(/*recurse=*/false)) {
        auto it = flat_of_param.find(p.unsafeGetTensorImpl());
        if (it != flat_of_param.end()) last_registrant[it->second] = i;
      }
    std::vector<std::vector<size_t>> ready_after(visits.size());
    for (size_t id = 0; id < plan.flat_params.size(); ++id) ready_after[last_registrant[id]].push_back(id);
    for (size_t i = 0; i < visits.size(); ++i) {
      detail::materialize_own_tensors(visits[i], options_.param_init_fn(), pg_->world()->device());
      for (size_t id : ready_after[i]) build(id);
    }
  }
  if (sync)
    for (const auto& [name, b] : buffers_) broadcast_from_rank0(b);

  units_.reserve(plan.units.size());
  for (size_t u = 0; u < plan.units.size(); ++u) {
    const UnitPlan::Unit& pu = plan.units[u];
    std::vector<FlatParam*> fps;
    for (int id : pu.flat_params) fps.push_back(flat_params_[id].get());
    units_.emplace_back(static_cast<int>(u), pu.name, pu.parent, pu.ancestors, std::move(fps),
                        reshard_after_forward_[u], &tracer_);
    unit_of_module_[pu.module] = static_cast<int>(u);
  }
}

std::vector<std::pair<std::string, at::Tensor>> FsdpState::ignored_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& w : whole_tensors_)
    if (w.kind == std::string("ignored parameter")) out.emplace_back(w.name, w.tensor);
  return out;
}

int FsdpState::flat_param_of_storage(const c10::StorageImpl* storage) const {
  auto it = flat_param_of_storage_.find(storage);
  return it == flat_param_of_storage_.end() ? -1 : it->second;
}

const std::pair<int, int>* FsdpState::slot_of_param(const c10::TensorImpl* param) const {
  auto it = slot_of_param_.find(param);
  return it == slot_of_param_.end() ? nullptr : &it->second;
}

int FsdpState::flat_param_of_shard_storage(const c10::StorageImpl* storage) const {
  auto it = flat_param_of_shard_storage_.find(storage);
  return it == flat_param_of_shard_storage_.end() ? -1 : it->second;
}

const std::pair<int, int>* FsdpState::sentinel_of_storage(const c10::StorageImpl* storage) const {
  auto it = sentinel_of_storage_.find(storage);
  return it == sentinel_of_storage_.end() ? nullptr : &it->second;
}

int FsdpState::unit_of_module(const torch::nn::Module* module) const {
  auto it = unit_of_module_.find(module);
  return it == unit_of_module_.end() ? -1 : it->second;
}

FsdpState::~FsdpState() {
  if (pending_error_.empty() || std::uncaught_exceptions() > 0) return;
  std::fprintf(stderr,
               "[fsdp] rank %d: %s\n[fsdp] exiting with status 1: this error was found inside an operator "
               "and no later FSDP call (backward, state dict, ...) reported it\n",
               pg_->rank(), pending_error_.c_str());
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(1);
}

void FsdpState::set_pending_error(const std::string& message, bool print_now) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (!pending_error_.empty()) return;
  pending_error_ = message;
  if (!print_now) return;
  std::fprintf(stderr,
               "[fsdp] rank %d: %s\n[fsdp] (found inside an operator; thrown by the next backward or FSDP call)\n",
               pg_->rank(), message.c_str());
  std::fflush(stderr);
}

void FsdpState::settle_failed_backward() {
  if (!backward_begun_ || !backward_token_.expired()) return;
  backward_begun_ = false;
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  scheduler_->abandon_backward();
}

void FsdpState::rethrow_pending_error() {
  if (pending_error_.empty()) return;
  const std::string message = pending_error_;
  pending_error_.clear();
  throw Error(message);
}

MemoryStats FsdpState::memory_stats() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  reducer_->update_sharded_grad_bytes();
  MemoryStats stats = memory_.stats();
  stats.cached_bytes = pool_.cached_bytes();
  stats.system_allocations = pool_.system_allocations();
  std::vector<const Communicator*> seen;
  for (const auto* comm : {groups_.shard_comm.get(), groups_.replicate_comm.get(), groups_.world_comm.get()}) {
    if (!comm || std::find(seen.begin(), seen.end(), comm) != seen.end()) continue;
    seen.push_back(comm);
    stats.comm_scratch_bytes += comm->scratch_bytes();
    stats.comm_shared_bytes += comm->shared_memory_bytes();
  }
  for (const auto& fp : flat_params_)
    for (const at::Tensor* t : {&fp->residuals().scatter, &fp->residuals().sent, &fp->residuals().summed})
      if (t->defined()) stats.feedback_bytes += static_cast<int64_t>(t->nbytes());
  return stats;
}

void FsdpState::drop_feedback_residuals() {
  for (auto& fp : flat_params_) fp->residuals().clear();
}

void FsdpState::reset_peak_memory_stats() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  memory_.reset_peaks();
}

std::string FsdpState::describe_communicators() const {
  std::ostringstream o;
  std::vector<const Communicator*> seen;
  const std::pair<const char*, const Communicator*> roles[] = {{"world", groups_.world_comm.get()},
                                                               {"shard group", groups_.shard_comm.get()},
                                                               {"replica group", groups_.replicate_comm.get()},
                                                               {"post-forward group", groups_.post_forward_comm.get()}};
  for (const auto& [role, comm] : roles) {
    if (!comm || (comm->size() < 2 && comm->device().is_cpu()) ||
        std::find(seen.begin(), seen.end(), comm) != seen.end())
      continue;
    seen.push_back(comm);
    o << "  " << role << " " << comm->name() << ": " << comm->transport() << "\n";
  }
  return o.str();
}

}  // namespace fsdp
