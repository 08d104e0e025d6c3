// fully_shard() and the handle the user keeps: builds the model's FsdpState, registers its
// hooks, and answers the user's questions through it.
#include "fsdp/fully_shard.h"

#include <iomanip>
#include <sstream>

#include "clip_grad_norm.h"
#include "fsdp/check.h"
#include "internal_op_guard.h"
#include "mixed_precision.h"
#include "runtime/fsdp_state.h"
#include "runtime/hooks.h"
#include "state_dict.h"

namespace fsdp {

namespace {
std::vector<UnitInfo> describe_units(const FsdpState& state) {
  std::vector<UnitInfo> infos;
  for (const Unit& unit : state.units()) {
    UnitInfo info;
    info.name = unit.name();
    info.parent = unit.parent();
    for (const FlatParam* fp : unit.flat_params()) {
      for (const auto& slot : fp->slots()) info.parameters.push_back(slot.name);
      info.numel += fp->numel();
      info.padded_numel += fp->padded_numel();
      info.padded_bytes += fp->padded_numel() * fp->compute_element_size();
      info.shard_bytes += fp->shard_numel() * fp->element_size();
      info.quantized_gathers = info.quantized_gathers || fp->gather_format().has_value();
      info.quantized_reductions = info.quantized_reductions || fp->reduce_format().has_value();
    }
    infos.push_back(info);
  }
  return infos;
}
}  // namespace

namespace {
// The module, refused if null or already sharded by a live handle.
std::shared_ptr<torch::nn::Module> unsharded_module(std::shared_ptr<torch::nn::Module> module) {
  FSDP_CHECK(module != nullptr, "fully_shard: the module is null");
  const std::string managed = Hooks::managed_parameter(*module);
  FSDP_CHECK(managed.empty(), "fully_shard: parameter '", managed,
             "' is already sharded by an earlier fully_shard() "
             "whose handle is still alive; call fully_shard() once per model and keep the handle it returned (or "
             "drop that handle first)");
  return module;
}
}  // namespace

FullyShardedModule::FullyShardedModule(std::shared_ptr<torch::nn::Module> module, ProcessGroupPtr pg, Options options)
    : state_(std::make_unique<FsdpState>(unsharded_module(std::move(module)), std::move(pg), std::move(options))),
      hooks_(std::make_unique<Hooks>(*state_)),
      units_(describe_units(*state_)) {}

FullyShardedModule::~FullyShardedModule() = default;

std::shared_ptr<FullyShardedModule> fully_shard(std::shared_ptr<torch::nn::Module> module, ProcessGroupPtr pg,
                                                Options options) {
  return std::shared_ptr<FullyShardedModule>(
      new FullyShardedModule(std::move(module), std::move(pg), std::move(options)));
}

std::vector<std::pair<std::string, at::Tensor>> FullyShardedModule::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& fp : state_->flat_params())
    for (const auto& s : fp->slots())
      if (s.piece.defined()) out.emplace_back(s.name, s.piece);
  return out;
}

std::vector<at::Tensor> FullyShardedModule::parameters() const {
  std::vector<at::Tensor> out;
  for (auto& kv : named_parameters()) out.push_back(kv.second);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> FullyShardedModule::ignored_parameters() const {
  return state_->ignored_parameters();
}

void FullyShardedModule::all_reduce_ignored_gradients() {
  RuntimeCall call(*state_);
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  const CommunicatorPtr& world = state_->groups().world_comm;
  const int n = world->size();
  for (const auto& [name, p] : state_->ignored_parameters()) {
    if (!p.requires_grad()) continue;
    at::Tensor& g = p.mutable_grad();
    if (!g.defined()) g = at::zeros_like(p, at::MemoryFormat::Contiguous);
    FSDP_CHECK(g.layout() == at::kStrided, "all_reduce_ignored_gradients: the gradient of '", name,
               "' is not dense; reduce it yourself");
    at::Tensor sum = g.is_contiguous() ? g : g.contiguous();
    if (n > 1) world->all_reduce(sum, CollectiveOptions::labeled("ignored gradient " + name))->wait();
    sum.div_(n);
    if (!sum.is_same(g)) g.copy_(sum);
  }
}

void FullyShardedModule::check_optimizer_parameters(const std::vector<at::Tensor>& params) const {
  for (const auto& p : params)
    FSDP_CHECK(state_->slot_of_param(p.unsafeGetTensorImpl()) == nullptr,
               "the optimizer holds an original parameter of the sharded module (shape ", p.sizes(),
               "); its gradient is not kept and stepping it would be lost. Build the optimizer over "
               "FullyShardedModule::parameters()");
}

void FullyShardedModule::check_optimizer(const torch::optim::Optimizer& optimizer) const {
  for (const auto& group : optimizer.param_groups()) check_optimizer_parameters(group.params());
  FSDP_CHECK(
      world_size() == 1 || dynamic_cast<const torch::optim::LBFGS*>(&optimizer) == nullptr,
      "torch::optim::LBFGS over the shard pieces would take its inner products over this rank's pieces and "
      "its loss from this rank's batch alone: the ranks would each run another L-BFGS. Use fsdp::LBFGS(*sharded, "
      "options), which is L-BFGS over the whole model and the global batch");
}

std::unordered_map<std::string, at::Tensor> FullyShardedModule::full_state_dict() {
  return fsdp::full_state_dict(*state_);
}

std::vector<std::string> FullyShardedModule::full_state_names() const { return fsdp::full_state_names(*state_); }

void FullyShardedModule::visit_full_state(
    const std::vector<std::string>& names,
    const std::function<void(const std::string& name, const at::Tensor& value)>& visit) {
  fsdp::visit_full_state(*state_, names, visit);
}

void FullyShardedModule::load_full_state_dict(const std::unordered_map<std::string, at::Tensor>& state) {
  fsdp::load_full_state_dict(*state_, state);
}

double FullyShardedModule::clip_grad_norm_(double max_norm, double norm_type) {
  return clip_grad_norm(*state_, max_norm, norm_type);
}

void FullyShardedModule::set_requires_gradient_sync(bool sync) {
  std::lock_guard<std::recursive_mutex> lock(state_->mutex());
  state_->reducer().set_sync(sync);
}

void FullyShardedModule::set_step_in_backward(torch::optim::Optimizer* optimizer, StepThread thread) {
  std::lock_guard<std::recursive_mutex> lock(state_->mutex());
  if (optimizer) check_optimizer(*optimizer);
  state_->reducer().stepper().set(optimizer, thread, state_->flat_params());
}

void FullyShardedModule::set_requires_all_reduce(bool on) {
  std::lock_guard<std::recursive_mutex> lock(state_->mutex());
  state_->reducer().set_all_reduce(on);
}

void FullyShardedModule::set_backward_counted(bool counted) {
  std::lock_guard<std::recursive_mutex> lock(state_->mutex());
  FSDP_CHECK(counted || state_->options().deterministic(),
             "set_backward_counted(false) needs Options::deterministic(true): only exact sums can leave a "
             "backward's gradients out");
  state_->reducer().set_counted(counted);
}

void FullyShardedModule::set_reshard_after_backward(bool on) {
  std::lock_guard<std::recursive_mutex> lock(state_->mutex());
  state_->scheduler().set_reshard_after_backward(on);
}

bool FullyShardedModule::requires_gradient_sync() const {
  std::lock_guard<std::recursive_mutex> lock(state_->mutex());
  return state_->reducer().sync();
}

MemoryStats FullyShardedModule::memory_stats() const { return state_->memory_stats(); }
void FullyShardedModule::reset_peak_memory_stats() { state_->reset_peak_memory_stats(); }
void FullyShardedModule::release_cached_memory() { state_->release_cached_memory(); }

void FullyShardedModule::begin_root_forward() { detail::clear_escaped_dtype_hint(); }

void FullyShardedModule::rethrow_with_dtype_hint(const std::exception& e) {
  const std::string hint = detail::take_escaped_dtype_hint();
  if (hint.empty()) return;
  // The hint first: LibTorch's message names neither the unit nor the fix, and its backtrace is long.
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  throw Error(detail::compose(
      "libfsdp: ", hint, ". (LibTorch's error: ", c10_error ? c10_error->what_without_backtrace() : e.what(), ")"));
}

at::Tensor FullyShardedModule::cast_forward_input(at::Tensor input) const {
  return fsdp::cast_forward_input(state_->options().mixed_precision(), std::move(input));
}
const std::vector<UnitInfo>& FullyShardedModule::units() const { return units_; }
ShardingStrategy FullyShardedModule::sharding_strategy() const { return state_->options().sharding_strategy(); }
int FullyShardedModule::sharding_factor() const { return state_->groups().sharding_factor; }
int FullyShardedModule::world_size() const { return state_->process_group().size(); }
std::shared_ptr<torch::nn::Module> FullyShardedModule::module() const { return state_->module(); }

void FullyShardedModule::set_trace(bool on) {
  std::lock_guard<std::recursive_mutex> lock(state_->mutex());
  state_->scheduler().enable_trace(on);
}

IterationTrace FullyShardedModule::last_trace() const {
  std::lock_guard<std::recursive_mutex> lock(state_->mutex());
  return state_->scheduler().last_trace();
}

std::string FullyShardedModule::describe() const {
  std::ostringstream o;
  o << "FSDP " << to_string(sharding_strategy()) << ", world " << world_size() << ", sharding factor "
    << sharding_factor() << ", " << units().size() << " units\n";
  o << "  " << std::left << std::setw(28) << "unit" << std::right << std::setw(8) << "params" << std::setw(14)
    << "numel" << std::setw(14) << "padded" << std::setw(14) << "shard bytes"
    << "  quantized"
    << "\n";
  for (const auto& u : units())
    o << "  " << std::left << std::setw(28) << (u.name.empty() ? "<root>" : u.name) << std::right << std::setw(8)
      << u.parameters.size() << std::setw(14) << u.numel << std::setw(14) << u.padded_numel << std::setw(14)
      << u.shard_bytes << "  "
      << (u.quantized_gathers && u.quantized_reductions ? "gathers, reductions"
          : u.quantized_gathers                         ? "gathers"
          : u.quantized_reductions                      ? "reductions"
                                                        : "no")
      << "\n";
  o << state_->describe_communicators();
  return o.str();
}

}  // namespace fsdp
