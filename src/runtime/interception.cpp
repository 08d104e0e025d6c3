// Seeing a unit's forward and backward without changing model code: a global RecordFunction
// callback sees every operator call with its inputs before the kernel runs. An input whose storage
// is a unit's flat storage means "this unit is needed now": the runtime unshards it in place
// (before the kernel reads it) and reshards units the computation has left.
#include <ATen/record_function.h>
#include <torch/csrc/autograd/graph_task.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "fsdp/check.h"
#include "runtime/internal_guard.h"
#include "runtime/runtime.h"

namespace fsdp {

bool& internal_op_flag() {
  thread_local bool flag = false;
  return flag;
}

namespace {

// The live runtimes, replaced copy-on-write so the callback reads them without a lock: all of
// them (the explicit form looks its units up there), and those that intercept operators. A
// runtime whose FlatParameters are never sharded (NO_SHARD, or a world of one) has nothing to
// gather, so, like DDP, it relies on autograd hooks alone and does not pay for the operator
// callback (which makes every operator box its inputs: about 4% of a compute-bound step).
using RuntimeList = std::vector<Runtime*>;
std::mutex g_registry_mu;
std::shared_ptr<const RuntimeList> g_runtimes = std::make_shared<RuntimeList>();
std::shared_ptr<const RuntimeList> g_intercepting = std::make_shared<RuntimeList>();
at::CallbackHandle g_callback = 0;

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  if (internal_op_flag()) return nullptr;
  std::shared_ptr<const RuntimeList> runtimes = std::atomic_load(&g_intercepting);
  for (Runtime* r : *runtimes) r->on_op(fn);
  return nullptr;
}

bool is_inplace_op(const char* name) {
  const size_t n = std::strlen(name);
  if (n < 2 || name[n - 1] != '_' || name[n - 2] == '_') return false;  // "add_" yes, "__iadd__" no
  // Ops that change autograd metadata only, not values.
  return std::strcmp(name, "aten::requires_grad_") != 0 && std::strcmp(name, "aten::detach_") != 0;
}

std::shared_ptr<const RuntimeList> with(const std::shared_ptr<const RuntimeList>& list, Runtime* add, Runtime* remove) {
  auto next = std::make_shared<RuntimeList>();
  for (Runtime* r : *list)
    if (r != remove) next->push_back(r);
  if (add) next->push_back(add);
  return next;
}

}  // namespace

void register_runtime(Runtime* runtime, bool intercept) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  std::atomic_store(&g_runtimes, with(g_runtimes, runtime, nullptr));
  if (!intercept) return;
  std::atomic_store(&g_intercepting, with(g_intercepting, runtime, nullptr));
  if (g_callback == 0)
    g_callback = at::addGlobalCallback(
        at::RecordFunctionCallback(&on_op_start).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
}

void unregister_runtime(Runtime* runtime) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  std::atomic_store(&g_runtimes, with(g_runtimes, nullptr, runtime));
  std::atomic_store(&g_intercepting, with(g_intercepting, nullptr, runtime));
  if (std::atomic_load(&g_intercepting)->empty() && g_callback != 0) {
    at::removeCallback(g_callback);
    g_callback = 0;
  }
}

// ---------------------------------------------------------------------------------------------
// The explicit form (fsdp::Sharded, include/fsdp/sharded.h).

namespace {
// The runtime and unit of a Sharded module, if fully_shard made it a unit.
std::pair<Runtime*, int> find_unit(const torch::nn::Module& module) {
  std::shared_ptr<const RuntimeList> runtimes = std::atomic_load(&g_runtimes);
  for (Runtime* r : *runtimes) {
    const int u = r->unit_of_module(&module);
    if (u >= 0) return {r, u};
  }
  return {nullptr, -1};
}
}  // namespace

namespace detail {

void enter_unit(const torch::nn::Module& module) {
  auto [runtime, unit] = find_unit(module);
  if (runtime) runtime->enter_unit(unit);
}

void exit_unit(const torch::nn::Module& module) {
  auto [runtime, unit] = find_unit(module);
  if (runtime) runtime->exit_unit(unit);
}

at::Tensor attach_pre_backward(const torch::nn::Module& module, at::Tensor output) {
  if (!output.defined() || !output.requires_grad() || !at::GradMode::is_enabled()) return output;
  if (find_unit(module).first == nullptr) return output;
  // The hook holds the module weakly: a graph may outlive the model.
  std::weak_ptr<const torch::nn::Module> weak;
  try {
    weak = module.shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    return output;  // not owned by a shared_ptr: the interception gathers it in backward
  }
  output.register_hook([weak](const at::Tensor& grad) {
    if (auto m = weak.lock()) {
      auto [runtime, unit] = find_unit(*m);
      if (runtime) runtime->pre_backward(unit);
    }
    return grad;
  });
  return output;
}

}  // namespace detail

int Runtime::unit_of_module(const torch::nn::Module* module) const {
  auto it = unit_of_module_.find(module);
  return it == unit_of_module_.end() ? -1 : it->second;
}

void Runtime::enter_unit(int u) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  rethrow_pending_error();
  touch(u);
}

void Runtime::exit_unit(int u) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (!reshard_after_forward_ || units_[u].parent < 0 || in_backward()) return;
  InternalOpGuard internal;
  tracer_.leave_compute();
  reshard(u);
  if (last_touched_ == u) last_touched_ = -1;
}

void Runtime::pre_backward(int u) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  touch(u);
}

void Runtime::on_op(const at::RecordFunction& fn) {
  // RecordFunction catches and only logs what a callback throws, so errors found here are kept
  // and rethrown from the next autograd hook or API call (rethrow_pending_error).
  try {
    intercept(fn);
  } catch (const std::exception& e) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (pending_error_.empty()) pending_error_ = e.what();
  }
}

void Runtime::rethrow_pending_error() {
  if (pending_error_.empty()) return;
  const std::string message = pending_error_;
  pending_error_.clear();
  throw Error(message);
}

void Runtime::intercept(const at::RecordFunction& fn) {
  auto inputs = fn.inputs();
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto visit = [&](const at::Tensor& t) {
      if (!t.defined() || !t.has_storage()) return;
      auto it = flat_param_of_storage_.find(t.storage().unsafeGetStorageImpl());
      if (it == flat_param_of_storage_.end()) return;
      std::lock_guard<std::recursive_mutex> lock(mu_);
      auto slot = slot_of_param_.find(t.unsafeGetTensorImpl());
      if (slot != slot_of_param_.end()) {
        ParamSlot& s = flat_params_[slot->second.first]->slots()[slot->second.second];
        if (i == 0 && is_inplace_op(fn.name()) && pending_error_.empty()) {
          pending_error_ = detail::compose(
              "libfsdp: in-place operation ", fn.name(), " on parameter '", s.name,
              "' of a sharded module: the change is lost at the next reshard. If this is an optimizer step, build "
              "the optimizer over FullyShardedModule::parameters() (the shards), not module->parameters(); to set "
              "values use load_full_state_dict(); to initialize, do it before fully_shard().");
        }
        if (at::GradMode::is_enabled() && s.param.requires_grad()) s.used = true;
      }
      // Unshard even for a refused in-place op, so its kernel writes valid memory.
      touch(flat_params_[it->second]->unit());
    };
    const c10::IValue& v = inputs[i];
    if (v.isTensor()) {
      visit(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) visit(t);
    }
  }
}

bool Runtime::in_backward() const {
  // The autograd engine sets a current graph task on the thread that runs backward functions.
  return torch::autograd::get_current_graph_task_exec_info() != nullptr;
}

void Runtime::begin_backward() {
  // Units' backward runs in the reverse of the order in which their forward finished.
  backward_started_ = true;
  backward_order_.assign(forward_post_order_.rbegin(), forward_post_order_.rend());
}

void Runtime::touch(int u) {
  InternalOpGuard internal;
  const bool backward = in_backward();
  // The common case: another op of the current unit. The first op of backward takes the full
  // path even in the unit forward ended in, so that backward prefetching starts there.
  if (u == last_touched_ && (backward_started_ || !backward)) {
    if (unit_needs_gather(u)) issue_unshard(u, "on demand");
    wait_unshard(u);
    return;
  }
  if (backward && !backward_started_) begin_backward();
  tracer_.leave_compute();
  // The computation moved to unit u: units it left, other than u's ancestors (whose forward
  // may still be running), the root (kept until backward, paper 3.3.1) and units gathered
  // ahead of use, are resharded.
  if (reshard_after_forward_) {
    const auto& anc = units_[u].ancestors;
    for (int v = 1; v < static_cast<int>(units_.size()); ++v) {
      if (v == u || units_[v].prefetched || !unit_unsharded(v)) continue;
      if (std::find(anc.begin(), anc.end(), v) != anc.end()) continue;
      reshard(v);
    }
  }
  if (!backward && at::GradMode::is_enabled()) {
    if (!units_[u].forward_seen) {
      units_[u].forward_seen = true;
      forward_first_order_.push_back(u);
    }
    forward_post_order_.erase(std::remove(forward_post_order_.begin(), forward_post_order_.end(), u),
                              forward_post_order_.end());
    forward_post_order_.push_back(u);
  }
  last_touched_ = u;
  units_[u].prefetched = false;
  if (deferred_prefetch_ == u) deferred_prefetch_ = -1;
  if (unit_needs_gather(u)) issue_unshard(u, "on demand");
  // Issue the next unit's gather before waiting for this one, so it overlaps this unit's compute.
  if (backward) {
    if (options_.backward_prefetch() == BackwardPrefetch::kBackwardPre) prefetch(next_pending_in_backward(u), "prefetch backward pre");
  } else if (options_.forward_prefetch()) {
    // Only units this forward has not run yet: a unit used again later (e.g. the root's output
    // layer) must not re-gather what already ran.
    const int next = next_in(previous_forward_order_, u);
    if (next >= 0 && !units_[next].forward_seen) prefetch(next, "prefetch forward");
  }
  wait_unshard(u);
  tracer_.enter_compute(u);
}

bool Runtime::unit_unsharded(int u) const {
  for (int f : units_[u].flat_params)
    if (!flat_params_[f]->keep_unsharded() && flat_params_[f]->is_unsharded()) return true;
  return false;
}

bool Runtime::unit_needs_gather(int u) const {
  for (int f : units_[u].flat_params) {
    const FlatParam& fp = *flat_params_[f];
    if (!fp.keep_unsharded() && (!fp.is_unsharded() || fp.unsharded_is_stale())) return true;
  }
  return false;
}

int Runtime::unsharded_unit_count() const {
  // Under SHARD_GRAD_OP, units stay unsharded from their forward until backward by design; only
  // those gathered ahead of use count against the limit.
  const bool keeps_after_forward = !reshard_after_forward_;
  int n = 0;
  for (int v = 1; v < static_cast<int>(units_.size()); ++v) {
    if (!unit_unsharded(v)) continue;
    if (keeps_after_forward && units_[v].forward_seen && !units_[v].prefetched) continue;
    ++n;
  }
  return n;
}

void Runtime::issue_unshard(int u, const char* why) {
  bool issued = false;
  for (int f : units_[u].flat_params) {
    FlatParam& fp = *flat_params_[f];
    if (fp.keep_unsharded() || (fp.is_unsharded() && !fp.unsharded_is_stale())) continue;
    WorkPtr work = fp.start_unshard();
    tracer_.collective(TraceEvent::Kind::kUnshard, u, "all-gather", fp.gather_track(), work);
    issued = true;
  }
  if (issued && tracer_.enabled()) {
    tracer_.instant(TraceEvent::Kind::kUnshardIssued, u, why);
    tracer_.note_unsharded_units(unsharded_unit_count());
  }
}

void Runtime::wait_unshard(int u) {
  for (int f : units_[u].flat_params) {
    FlatParam& fp = *flat_params_[f];
    if (!fp.unshard_pending()) continue;
    const bool done = fp.gather_work()->completed();
    const auto start = Tracer::Clock::now();
    fp.wait_unshard();
    if (!done) tracer_.wait(u, "all-gather", start, Tracer::Clock::now());
  }
}

int Runtime::next_pending_in_backward(int u) const {
  auto it = std::find(backward_order_.begin(), backward_order_.end(), u);
  if (it == backward_order_.end()) return -1;
  for (++it; it != backward_order_.end(); ++it)
    if (!units_[*it].backward_done) return *it;
  return -1;
}

int Runtime::next_in(const std::vector<int>& order, int u) {
  auto it = std::find(order.begin(), order.end(), u);
  if (it == order.end() || ++it == order.end()) return -1;
  return *it;
}

void Runtime::prefetch(int v, const char* why) {
  if (v < 0 || !unit_needs_gather(v)) return;
  if (backward_started_ && units_[v].backward_done) return;  // e.g. a deferred prefetch overtaken by events
  if (options_.limit_all_gathers() && unsharded_unit_count() >= options_.all_gather_limit()) {
    deferred_prefetch_ = v;  // issued by the next reshard that makes room
    deferred_why_ = why;
    return;
  }
  if (deferred_prefetch_ == v) deferred_prefetch_ = -1;
  issue_unshard(v, why);
  units_[v].prefetched = true;
}

void Runtime::reshard(int u) {
  bool freed = false;
  for (int f : units_[u].flat_params) {
    FlatParam& fp = *flat_params_[f];
    if (fp.keep_unsharded() || !fp.is_unsharded()) continue;
    if (fp.unshard_pending() && !fp.gather_work()->completed()) {  // a prefetch nobody used
      const auto start = Tracer::Clock::now();
      fp.wait_unshard();
      tracer_.wait(u, "all-gather (unused prefetch)", start, Tracer::Clock::now());
    }
    fp.reshard();
    freed = true;
  }
  units_[u].prefetched = false;
  if (!freed) return;
  tracer_.instant(TraceEvent::Kind::kReshard, u, "");
  if (deferred_prefetch_ >= 0) {
    const int v = deferred_prefetch_;
    deferred_prefetch_ = -1;
    prefetch(v, deferred_why_);
  }
}

}  // namespace fsdp
