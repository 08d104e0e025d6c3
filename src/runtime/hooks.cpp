#include "runtime/hooks.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/engine.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "comm/communicator_work.h"
#include "fsdp/check.h"
#include "internal_op_guard.h"
#include "runtime/checkpointed_forward.h"
#include "runtime/dtype_hint.h"
#include "runtime/embedding_renorm.h"
#include "runtime/operator_inputs.h"
#include "runtime/parameter_misuse.h"
#include "runtime/shard_norm_note.h"

namespace fsdp {

namespace {

// ---------------------------------------------------------------------------------------------
// The live models, replaced copy-on-write so the operator callback reads them without a lock: all
// of them (the explicit form looks its units up there), and those that intercept operators.

using HooksList = std::vector<Hooks*>;
std::mutex g_registry_mu;
std::shared_ptr<const HooksList> g_all = std::make_shared<HooksList>();
std::shared_ptr<const HooksList> g_intercepting = std::make_shared<HooksList>();
at::CallbackHandle g_callback = 0;

// How many backward passes the sentinel watch follows at most when no optimizer step is seen.
constexpr int kSentinelWatches = 32;

// Operators nest (conv2d calls convolution calls a kernel): per thread, the depth of the operator
// running now, and the hint of the outermost one in this nest whose inputs mix dtypes under mixed
// precision. Printed once, when that nest unwinds with an exception.
thread_local int t_operator_depth = 0;
thread_local std::string t_mixed_dtype_hint;
thread_local std::string t_escaped_dtype_hint;  // that hint, once its nest ended with an exception
// The depth of the embedding_renorm_ running on this thread, 0 if none: the operators nested in it
// write the parameter on its behalf (Note [Embedding max_norm]).
thread_local int t_renorm_depth = 0;

std::unique_ptr<at::ObserverContext> on_operator_start(const at::RecordFunction& fn) {
  if (t_operator_depth++ == 0) t_mixed_dtype_hint.clear();
  if (t_renorm_depth == 0 && is_embedding_renorm(fn.name())) t_renorm_depth = t_operator_depth;
  if (internal_op_flag() || in_communicator_work()) return nullptr;
  std::shared_ptr<const HooksList> list = std::atomic_load(&g_intercepting);
  for (Hooks* h : *list) h->on_operator(fn);
  if (t_mixed_dtype_hint.empty())
    for (Hooks* h : *list)
      if (std::string hint = mixed_precision_mismatch(h->state(), fn); !hint.empty()) {
        t_mixed_dtype_hint = std::move(hint);
        break;
      }
  return nullptr;
}

// The kernel's own error for a dtype mix names no unit and no fix: the hint goes to stderr beside
// it, when the outermost operator of the nest ends with an exception in flight.
void on_operator_end(const at::RecordFunction&, at::ObserverContext*) {
  if (t_renorm_depth == t_operator_depth) t_renorm_depth = 0;
  if (t_operator_depth > 0) --t_operator_depth;  // an operator that began before the callback: no start
  if (t_operator_depth > 0 || t_mixed_dtype_hint.empty()) return;
  if (std::uncaught_exceptions() > 0) {
    std::fprintf(stderr, "libfsdp: %s\n", t_mixed_dtype_hint.c_str());
    t_escaped_dtype_hint = t_mixed_dtype_hint;
  }
  t_mixed_dtype_hint.clear();
}

// An exception no handler catches ends the program without unwinding, so no operator's end runs:
// the terminate handler prints the pending hint, then hands over to the handler it replaced.
std::terminate_handler g_previous_terminate = nullptr;

[[noreturn]] void print_pending_hint_and_terminate() {
  if (t_operator_depth > 0 && !t_mixed_dtype_hint.empty())
    std::fprintf(stderr, "libfsdp: %s\n", t_mixed_dtype_hint.c_str());
  if (g_previous_terminate != nullptr) g_previous_terminate();
  std::abort();
}

std::shared_ptr<const HooksList> with(const std::shared_ptr<const HooksList>& list, Hooks* add, Hooks* remove) {
  auto next = std::make_shared<HooksList>();
  for (Hooks* h : *list)
    if (h != remove) next->push_back(h);
  if (add) next->push_back(add);
  return next;
}

// Adds `hooks` to, or removes it from, the models whose operators are intercepted; the global
// callback exists while any is.
void set_intercepting(Hooks* hooks, bool on) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  std::atomic_store(&g_intercepting, with(g_intercepting, on ? hooks : nullptr, hooks));
  if (!std::atomic_load(&g_intercepting)->empty() && g_callback == 0) {
    static std::once_flag terminate_installed;
    std::call_once(terminate_installed,
                   [] { g_previous_terminate = std::set_terminate(&print_pending_hint_and_terminate); });
    g_callback = at::addGlobalCallback(at::RecordFunctionCallback(&on_operator_start, &on_operator_end)
                                           .needsInputs(true)
                                           .scopes({at::RecordScope::FUNCTION}));
  } else if (std::atomic_load(&g_intercepting)->empty() && g_callback != 0) {
    at::removeCallback(g_callback);
    g_callback = 0;
  }
}

void register_model(Hooks* hooks, bool intercept) {
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    std::atomic_store(&g_all, with(g_all, hooks, nullptr));
  }
  if (intercept) set_intercepting(hooks, true);
}

void unregister_model(Hooks* hooks) {
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    std::atomic_store(&g_all, with(g_all, nullptr, hooks));
  }
  set_intercepting(hooks, false);
}

// The parameter whose elements a tensor starting at `storage_offset` of fp's storage shows.
std::string parameter_at(const FlatParam& fp, int64_t storage_offset) {
  for (const auto& s : fp.slots())
    if (storage_offset >= s.offset && storage_offset < s.offset + s.numel) return s.name;
  return fp.slots().empty() ? std::string("?") : fp.slots().front().name;
}

}  // namespace

std::string Hooks::managed_parameter(torch::nn::Module& module) {
  std::shared_ptr<const HooksList> list = std::atomic_load(&g_all);
  for (Hooks* h : *list)
    for (const auto& kv : module.named_parameters(/*recurse=*/true))
      if (h->state().slot_of_param(kv.value().unsafeGetTensorImpl())) return kv.key();
  return "";
}

std::pair<Hooks*, int> Hooks::find_unit(const torch::nn::Module& module) {
  std::shared_ptr<const HooksList> list = std::atomic_load(&g_all);
  for (Hooks* h : *list) {
    const int u = h->state().unit_of_module(&module);
    if (u >= 0) return {h, u};
  }
  return {nullptr, -1};
}

Hooks::Hooks(FsdpState& state) : state_(state), watches_left_(state.intercepting() ? 0 : kSentinelWatches) {
  add_grad_hooks();
  const CommunicatorPtr& world = state_.groups().world_comm;
  renorm_watch_ = !state_.intercepting() && world && world->size() > 1 && has_max_norm_embedding(*state_.module());
  unfreeze_watch_ = !state_.intercepting() && !any_hooked();
  register_model(this, state_.intercepting() || renorm_watch_ || unfreeze_watch_);
  if (state_.intercepting()) return;
  // The first watch: parameters replaced before training (Note [Replaced parameter data]).
  for (const auto& fp : state_.flat_params()) {
    reads_in_first_watch_.emplace_back(fp->slots().size(), 0);
    slots_to_read_ += fp->slots().size();
  }
  if (slots_to_read_ == 0) return;
  watching_ = first_watch_ = true;
  set_intercepting(this, true);
}

Hooks::~Hooks() {
  unregister_model(this);
  remove_grad_hooks();
}

// ---------------------------------------------------------------------------------------------
// The operator hook.

void Hooks::on_operator(const at::RecordFunction& fn) {
  // RecordFunction catches and only logs what a callback throws, so errors found here are kept
  // and rethrown from the next autograd hook or API call.
  try {
    if (state_.intercepting()) {
      intercept(fn);
      return;
    }
    if (t_renorm_depth == t_operator_depth && renorm_unsharded(fn)) renorm_watch_ = true;
    if (watching_ && t_renorm_depth == 0) watch_sentinels(fn);
    if (unfreeze_watch_) watch_unfreezing(fn);
  } catch (const std::exception& e) {
    state_.set_pending_error(e.what(), /*print_now=*/true);
  }
}

void Hooks::intercept(const at::RecordFunction& fn) {
  int inplace_op = -1;  // is_inplace_op(fn.name()), worked out when first needed
  auto inplace = [&] {
    if (inplace_op < 0) inplace_op = is_inplace_op(fn.name()) ? 1 : 0;
    return inplace_op == 1;
  };
  // An embedding's renormalization writes its parameter for every rank (Note [Embedding max_norm]).
  const bool renorm = t_renorm_depth > 0 && t_renorm_depth == t_operator_depth;
  const bool in_renorm = t_renorm_depth > 0 && t_operator_depth > t_renorm_depth;
  const std::pair<int, int>* renormed = nullptr;
  const bool norm = !shard_norm_noted_.load(std::memory_order_relaxed) && is_norm_op(fn.name());
  for_each_input_tensor(fn, [&](size_t i, const at::Tensor& t) {
    const int f = state_.flat_param_of_storage(t.storage().unsafeGetStorageImpl());
    if (f < 0) {
      if (i == 0 && inplace()) {  // Note [Shard writes]
        const int s = state_.flat_param_of_shard_storage(t.storage().unsafeGetStorageImpl());
        if (s >= 0) {
          state_.flat_params()[s]->note_shard_written();
          return;
        }
      }
      check_replaced_param(t);
      check_sentinel_read(fn, t, i);
      check_retired_read(fn, t);
      if (norm)
        if (std::string note = shard_norm_note(state_, fn, t); !note.empty() && !shard_norm_noted_.exchange(true))
          std::fprintf(stderr, "%s\n", note.c_str());
      return;
    }
    const auto* slot = state_.slot_of_param(t.unsafeGetTensorImpl());
    // Storage that is never freed, read without grad through another tensor than the module's
    // parameter (the optimizer stepping its pieces): no use of the unit, so nothing is scheduled
    // (Note [Shard writes]).
    if (!slot && state_.flat_params()[f]->keep_unsharded() && !at::GradMode::is_enabled()) return;
    std::lock_guard<std::recursive_mutex> lock(state_.mutex());
    const bool writes = i == 0 && inplace() && !in_renorm && !state_.has_pending_error();
    if (slot) {
      ParamSlot& s = state_.flat_params()[slot->first]->slots()[slot->second];
      if (i == 0 && renorm)
        renormed = slot;
      else if (writes)
        state_.set_pending_error(in_place_write_error(fn.name(), "parameter '" + s.name + "' of a sharded module"),
                                 /*print_now=*/true);
      if (s.param.requires_grad() != s.requires_grad_seen ||
          (s.piece.defined() && s.piece.requires_grad() != s.requires_grad_seen))
        sync_requires_grad(slot->first, slot->second);
      if (detail::forward_with_grad() && s.param.requires_grad()) s.used = true;
    } else if (writes && !state_.flat_params()[f]->keep_unsharded()) {
      // Another tensor over the same storage: p.data(), p.detach(), a view of a parameter.
      state_.set_pending_error(
          in_place_write_error(fn.name(), "a tensor sharing the storage of parameter '" +
                                              parameter_at(*state_.flat_params()[f], t.storage_offset()) +
                                              "' of a sharded module (its .data(), .detach() or a view of it)"),
          /*print_now=*/true);
    }
    state_.settle_failed_backward();
    // Unshard even for a refused in-place op, so its kernel writes valid memory.
    state_.scheduler().use(state_.flat_params()[f]->unit());
    if (!state_.backward_running() && gradless_watch_.expired() && Scheduler::in_backward())
      watch_backward_without_gradients();
  });
  if (!renormed) return;
  std::lock_guard<std::recursive_mutex> lock(state_.mutex());
  FlatParam& fp = *state_.flat_params()[renormed->first];
  renorm_rows_of_every_rank(fn, fp, fp.slots()[renormed->second]);
}

bool Hooks::renorm_unsharded(const at::RecordFunction& fn) {
  const auto inputs = fn.inputs();
  if (inputs.empty() || !inputs[0].isTensor()) return false;
  const auto* slot = state_.slot_of_param(inputs[0].toTensor().unsafeGetTensorImpl());
  const CommunicatorPtr& world = state_.groups().world_comm;
  if (!slot || !world || world->size() == 1) return false;
  std::lock_guard<std::recursive_mutex> lock(state_.mutex());
  FlatParam& fp = *state_.flat_params()[slot->first];
  renorm_rows_of_every_rank(fn, fp, fp.slots()[slot->second]);
  if (!renorm_watch_) set_intercepting(this, true);  // from now on, also outside the sentinel watch
  return true;
}

void Hooks::watch_sentinels(const at::RecordFunction& fn) {
  for_each_input_tensor(fn, [&](size_t i, const at::Tensor& t) {
    const int f = state_.flat_param_of_storage(t.storage().unsafeGetStorageImpl());
    if (f < 0) {
      check_replaced_param(t);
      check_sentinel_read(fn, t, i);
      check_retired_read(fn, t);
    } else {
      if (i == 0 && is_inplace_op(fn.name())) state_.flat_params()[f]->note_shard_written();  // an optimizer step
      // Outermost operators only (nested ones read it again); set_data's own check reads no values.
      if (first_watch_ && t_operator_depth == 1 &&
          std::strcmp(fn.name(), "aten::_has_compatible_shallow_copy_type") != 0)
        note_read_in_first_watch(t);
    }
  });
}

void Hooks::note_read_in_first_watch(const at::Tensor& t) {
  const auto* slot = state_.slot_of_param(t.unsafeGetTensorImpl());
  if (!slot) return;
  std::lock_guard<std::recursive_mutex> lock(state_.mutex());
  char& reads = reads_in_first_watch_[slot->first][slot->second];
  if (!first_watch_ || reads >= 2) return;
  if (++reads == 2 && --slots_to_read_ == 0) end_sentinel_watch();
}

int64_t Hooks::shard_versions() const {
  int64_t v = 0;
  for (const auto& fp : state_.flat_params()) v += fp->shard_version();
  return v;
}

void Hooks::begin_sentinel_watch() {
  if (watching_ || watches_left_ <= 0) return;
  versions_at_watch_ = shard_versions();
  set_intercepting(this, true);
  watching_ = true;
}

void Hooks::end_sentinel_watch() {
  if (!watching_) return;
  set_intercepting(this, renorm_watch_ || unfreeze_watch_);
  watching_ = false;
  if (first_watch_) {  // no optimizer step to tell from a load before the first backward
    first_watch_ = false;
    return;
  }
  // The shards changed since the last backward: an optimizer over them stepped, so one over the
  // module's parameters would have been caught already.
  if (shard_versions() != versions_at_watch_) watches_left_ = 0;
  --watches_left_;
}

void Hooks::check_sentinel_read(const at::RecordFunction& fn, const at::Tensor& t, size_t input) {
  const auto* slot = state_.sentinel_of_storage(t.storage().unsafeGetStorageImpl());
  // Zeroing it and detaching it (zero_grad) are fine; reading it as a gradient is not, also as
  // another input of an in-place operator (exp_avg.add_(grad)).
  const char* op = fn.name();
  // Named with or without the namespace: Module::zero_grad()'s detach() records "detach".
  const char* bare = std::strncmp(op, "aten::", 6) == 0 ? op + 6 : op;
  if (!slot || (input == 0 && is_inplace_op(op)) || std::strcmp(bare, "detach") == 0 ||
      std::strcmp(bare, "detach_") == 0 || std::strcmp(bare, "requires_grad_") == 0)
    return;
  std::lock_guard<std::recursive_mutex> lock(state_.mutex());
  if (state_.has_pending_error()) return;
  const ParamSlot& s = state_.flat_params()[slot->first]->slots()[slot->second];
  state_.set_pending_error(placeholder_read_error(fn.name(), s.name), /*print_now=*/true);
}

void Hooks::check_retired_read(const at::RecordFunction& fn, const at::Tensor& t) {
  const std::string* name = state_.retired_parameter(t.storage().unsafeGetStorageImpl());
  if (!name) return;
  std::lock_guard<std::recursive_mutex> lock(state_.mutex());
  if (!state_.has_pending_error())
    state_.set_pending_error(retired_storage_error(fn.name(), *name), /*print_now=*/true);
}

void Hooks::watch_unfreezing(const at::RecordFunction& fn) {
  for_each_input_tensor(fn, [&](size_t, const at::Tensor& t) {
    const auto* slot = state_.slot_of_param(t.unsafeGetTensorImpl());
    if (!slot || !t.requires_grad()) return;
    std::lock_guard<std::recursive_mutex> lock(state_.mutex());
    sync_requires_grad(slot->first, slot->second);
    if (!unfreeze_watch_ || !any_hooked()) return;
    unfreeze_watch_ = false;  // from now on every backward begins through a hook
    set_intercepting(this, watching_ || renorm_watch_);
  });
}

void Hooks::check_replaced_param(const at::Tensor& t) {
  if (!t.is_leaf() || state_.full_params_summoned()) return;
  const auto* found = state_.slot_of_param(t.unsafeGetTensorImpl());
  if (!found) return;
  std::lock_guard<std::recursive_mutex> lock(state_.mutex());
  if (!state_.has_pending_error()) {
    const ParamSlot& found_slot = state_.flat_params()[found->first]->slots()[found->second];
    state_.set_pending_error("libfsdp: " + replaced_parameter_error(found_slot.name), /*print_now=*/true);
  }
  // Also where an earlier error (a refused set_) came first: the next backward throws it.
  hook_replaced_params();
}

// ---------------------------------------------------------------------------------------------
// Backward.

void Hooks::on_grad_pre(int f, int s) {
  std::lock_guard<std::recursive_mutex> lock(state_.mutex());
  InternalOpGuard internal;
  state_.rethrow_pending_error();
  const FlatParam& fp = *state_.flat_params()[f];
  const ParamSlot& slot = fp.slots()[s];
  FSDP_CHECK(slot.param.storage().unsafeGetStorageImpl() == fp.storage(), replaced_parameter_error(slot.name));
  begin_backward();
  state_.reducer().prepare_grad(f, s);
}

void Hooks::begin_backward() {
  state_.settle_failed_backward();
  if (state_.backward_running()) return;
  end_sentinel_watch();
  // Queued on the backward this thread runs now; it runs when that backward ends. The token dies
  // with the backward's graph task, also when an exception ends it (Note [Failed backward]).
  auto token = std::make_shared<char>(0);
  state_.begin_backward_pass(token);
  torch::autograd::Engine::get_default_engine().queue_callback([this, token] { on_backward_end(); });
  sync_requires_grad();
  state_.scheduler().begin_backward();
  state_.reducer().begin_backward();
}

void Hooks::watch_backward_without_gradients() {
  auto token = std::make_shared<char>(0);
  gradless_watch_ = token;
  torch::autograd::Engine::get_default_engine().queue_callback([this, token] {
    std::lock_guard<std::recursive_mutex> lock(state_.mutex());
    InternalOpGuard internal;
    if (!state_.backward_running()) state_.scheduler().end_backward_without_gradients();
  });
}

void Hooks::on_recompute() {
  std::lock_guard<std::recursive_mutex> lock(state_.mutex());
  InternalOpGuard internal;
  state_.rethrow_pending_error();
  begin_backward();
}

void Hooks::on_grad_post(int f, int s) {
  std::lock_guard<std::recursive_mutex> lock(state_.mutex());
  InternalOpGuard internal;
  if (state_.reducer().take_grad(f, s)) state_.scheduler().post_backward(state_.flat_params()[f]->unit());
}

void Hooks::on_backward_end() {
  std::lock_guard<std::recursive_mutex> lock(state_.mutex());
  InternalOpGuard internal;
  state_.end_backward_pass();
  state_.rethrow_pending_error();
  take_late_grads();
  state_.scheduler().finalize_backward(state_.buffers());
  state_.check_parameters_unchanged();
  if (!state_.intercepting()) begin_sentinel_watch();
}

namespace detail {

std::string take_escaped_dtype_hint() { return std::exchange(t_escaped_dtype_hint, std::string()); }

void clear_escaped_dtype_hint() { t_escaped_dtype_hint.clear(); }

void before_recompute(const torch::nn::Module& module) {
  // Only the runtimes this module's parameters belong to: another model may be between its forward
  // and its backward.
  const auto params = module.parameters(/*recurse=*/true);
  std::shared_ptr<const HooksList> list = std::atomic_load(&g_all);
  for (Hooks* h : *list)
    for (const auto& p : params)
      if (p.requires_grad() && h->state().slot_of_param(p.unsafeGetTensorImpl())) {
        h->on_recompute();
        break;
      }
}

}  // namespace detail

}  // namespace fsdp
