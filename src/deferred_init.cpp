#include "fsdp/deferred_init.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>
#include <torch/version.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <set>
#include <vector>

#include "deferred_init_impl.h"
#include "fsdp/check.h"
#include "fsdp/explicit_unit.h"
#include "fsdp/wrap_policy.h"

namespace fsdp {

#ifdef FSDP_HAVE_DEFERRED_INIT_KEY
namespace {

// A dispatch key nothing else uses in this process (PyTorch reserves it for out-of-core deferred
// initialization). Included in the thread's dispatch key set, it routes every operation through
// the fallback below first.
constexpr c10::DispatchKey kDeferredKey = c10::DispatchKey::DeferredInit;

// Per thread: MetaShapePass scopes open, and operators running on CPU stand-ins now.
thread_local int t_shape_passes = 0;
thread_local int t_stand_in_depth = 0;

// A CPU tensor of `t`'s shape and dtype: integers and booleans zero (indices stay in range), the
// rest uninitialized (its pages are never touched unless the kernel reads them), or, where
// `positive_definite`, filled as detail::fill_stand_in does.
at::Tensor cpu_stand_in(const at::Tensor& t, bool positive_definite) {
  if (!t.defined() || !t.is_meta()) return t;
  at::Tensor c = at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kCPU));
  if (positive_definite)
    fsdp::detail::fill_stand_in(c, true);
  else if (!at::isFloatingType(t.scalar_type()) && !at::isComplexType(t.scalar_type()))
    c.zero_();
  return c;
}

// A meta tensor like CPU tensor `t`, over a storage of as many bytes as `t`'s (which a kernel may
// have made larger than its view).
at::Tensor meta_like(const at::Tensor& t) {
  if (!t.defined() || t.is_meta() || t.device().type() != c10::kCPU) return t;
  at::Tensor m = at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
  if (t.has_storage() && t.storage().nbytes() > m.storage().nbytes())
    m.storage().unsafeGetStorageImpl()->set_nbytes(t.storage().nbytes());
  return m;
}

bool tensor_typed(const c10::TypePtr& type) {
  if (type->kind() == c10::TypeKind::TensorType) return true;
  if (auto list = type->cast<c10::ListType>()) return tensor_typed(list->getElementType());
  if (auto optional = type->cast<c10::OptionalType>()) return tensor_typed(optional->getElementType());
  return false;
}

// Fails where a stand-in's values would decide what the shape pass sees: a result that is not a
// tensor (a number read from one), or a result shape that depends on the arguments' values.
void check_shape_only(const c10::OperatorHandle& op, const torch::jit::Stack& arguments) {
  const std::string& name = op.schema().name();
  for (const c10::Argument& r : op.schema().returns())
    TORCH_CHECK(tensor_typed(r.type()), "libfsdp: ", name,
                " reads a tensor's value, which a pass on the meta device does not have; keep value reads "
                "(item, comparisons, printing) out of the traced forward");
  static const std::set<std::string> data_dependent = {"aten::nonzero",
                                                       "aten::nonzero_numpy",
                                                       "aten::argwhere",
                                                       "aten::masked_select",
                                                       "aten::_unique",
                                                       "aten::_unique2",
                                                       "aten::unique_dim",
                                                       "aten::unique_consecutive",
                                                       "aten::unique_dim_consecutive",
                                                       "aten::bincount",
                                                       "aten::repeat_interleave"};
  bool bool_index = false;
  if (name == "aten::index")
    for (const c10::IValue& v : arguments)
      if (v.isList())
        for (const c10::IValue& e : v.toListRef())
          bool_index =
              bool_index ||
              (e.isTensor() && (e.toTensor().scalar_type() == at::kBool || e.toTensor().scalar_type() == at::kByte));
  TORCH_CHECK(data_dependent.count(name) == 0 && !bool_index, "libfsdp: ", name,
              " gives a result whose shape depends on its arguments' values, which a pass on the meta device "
              "does not have; keep it out of the traced forward");
}

// The argument an operator's result `index` is written into (in-place and out= operators), or -1.
int written_argument(const c10::FunctionSchema& schema, size_t index) {
  const c10::AliasInfo* result = schema.returns()[index].alias_info();
  if (result == nullptr || !result->isWrite()) return -1;
  const auto& arguments = schema.arguments();
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::AliasInfo* a = arguments[i].alias_info();
    if (a != nullptr && a->isWrite() && a->beforeSets() == result->beforeSets()) return static_cast<int>(i);
  }
  return -1;
}

// Runs `op` on CPU stand-ins of the meta tensors among its arguments and hands back its results
// as meta tensors (Note [Meta shape pass] in docs/design.md).
void run_on_stand_ins(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const detail::StandInScope scope;  // open before the stand-ins are made, so their factories stay on the CPU
  const size_t n = op.schema().arguments().size();
  const torch::jit::Stack originals(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
  bool needs_grad = false;  // the results of an operator on a tensor that requires grad do too
  const size_t base = stack->size() - n;
  auto call = [&](bool positive_definite) {
    auto stand_in = [&needs_grad, positive_definite](const at::Tensor& t) {
      needs_grad = needs_grad || (t.defined() && t.requires_grad());
      return cpu_stand_in(t, positive_definite);
    };
    stack->resize(base);
    for (const c10::IValue& v : originals) stack->push_back(detail::with_stand_ins(v, stand_in));
    op.callBoxed(stack);
  };
  try {
    call(false);
  } catch (const c10::Error&) {
    // Values a factorization refuses (a singular matrix): once more, positive definite; else the
    // first failure, as it was.
    const std::exception_ptr first = std::current_exception();
    try {
      call(true);
    } catch (const c10::Error&) {
      std::rethrow_exception(first);
    }
  }
  needs_grad = needs_grad && at::GradMode::is_enabled();
  auto to_meta = [needs_grad](const at::Tensor& t) {
    at::Tensor m = meta_like(t);
    if (needs_grad && m.defined() && at::isFloatingType(m.scalar_type())) m.requires_grad_(true);
    return m;
  };
  const size_t r = op.schema().returns().size();
  for (size_t i = stack->size() - r; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    const int written = written_argument(op.schema(), i - (stack->size() - r));
    if (written >= 0 && v.isTensor() && originals[static_cast<size_t>(written)].isTensor()) {
      // An in-place or out= operator returns the argument it wrote: the meta one, at the result's shape.
      at::Tensor target = originals[static_cast<size_t>(written)].toTensor();
      if (target.sizes() != v.toTensor().sizes()) {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        target.resize_(v.toTensor().sizes());
      }
      v = target;
    } else if (v.isTensor()) {
      v = to_meta(v.toTensor());
    } else if (v.isTensorList()) {
      std::vector<at::Tensor> list = v.toTensorVector();
      for (at::Tensor& t : list) t = to_meta(t);
      v = c10::IValue(list);
    }
  }
}

// CPU flash attention's results (output, log-sum-exp per query row), laid out as its kernel lays them out.
void flash_attention_results(const torch::jit::Stack& args, torch::jit::Stack* results) {
  const at::Tensor q = args[0].toTensor(), k = args[1].toTensor(), v = args[2].toTensor();
  TORCH_CHECK(q.dim() == 4 && v.dim() == 4, "libfsdp: flash attention on the meta device takes 4-d inputs");
  const int64_t batch = q.size(0), heads = q.size(1), rows = q.size(2);
  const at::TensorOptions meta = q.options().device(c10::kMeta);
  at::Tensor out = at::empty({batch, rows, heads, v.size(3)}, meta).transpose(1, 2);
  at::Tensor lse =
      at::empty({batch, rows, heads}, meta.dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat))
          .transpose(1, 2);
  if (at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad()))
    out.requires_grad_(true);
  torch::jit::push(*results, out, lse);
}

// Batch normalization's results (output; the batch's mean and inverse deviation per channel when
// training, empty otherwise), as its CPU kernel makes them.
void batch_norm_results(const torch::jit::Stack& args, torch::jit::Stack* results) {
  const at::Tensor x = args[0].toTensor();
  const bool training = args[5].toBool();
  bool grad = x.requires_grad();
  for (size_t i = 1; i < 3; ++i) grad = grad || (args[i].isTensor() && args[i].toTensor().requires_grad());
  at::Tensor out = at::empty_like(x, x.options().device(c10::kMeta));
  const at::ScalarType stat =
      x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16 ? at::kFloat : x.scalar_type();
  const at::TensorOptions meta = x.options().dtype(stat).device(c10::kMeta);
  at::Tensor mean = at::empty({training && x.dim() > 1 ? x.size(1) : 0}, meta);
  at::Tensor invstd = at::empty({training && x.dim() > 1 ? x.size(1) : 0}, meta);
  if (at::GradMode::is_enabled() && grad) out.requires_grad_(true);
  torch::jit::push(*results, out, mean, invstd);
}

// An elementwise operator's result: a tensor like its input.
void elementwise_results(const torch::jit::Stack& args, torch::jit::Stack* results) {
  const at::Tensor x = args[0].toTensor();
  at::Tensor out = at::empty_like(x, x.options().device(c10::kMeta));
  if (at::GradMode::is_enabled() && x.requires_grad()) out.requires_grad_(true);
  torch::jit::push(*results, out);
}

// An in-place operator's result: its input itself.
void in_place_results(const torch::jit::Stack& args, torch::jit::Stack* results) {
  torch::jit::push(*results, args[0]);
}

// Whether two tensors are equal, from what a pass on the meta device knows: the same view of the
// same storage is; tensors of different shapes or dtypes are not; distinct tensors are taken to
// differ (Note [Meta shape pass]).
void equal_results(const torch::jit::Stack& args, torch::jit::Stack* results) {
  const at::Tensor a = args[0].toTensor(), b = args[1].toTensor();
  const bool same =
      a.is_same(b) || (a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && a.strides() == b.strides() &&
                       a.storage_offset() == b.storage_offset() && a.has_storage() && b.has_storage() &&
                       a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl());
  torch::jit::push(*results, same);
}

// The results of an operator without a meta kernel whose stand-in would do work in proportion to
// its activations (Note [Meta shape pass]), from its arguments' shapes; false for any other.
bool shape_rule(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const std::string& name = op.schema().name();
  void (*rule)(const torch::jit::Stack&, torch::jit::Stack*) = nullptr;
  if (name == "aten::_scaled_dot_product_flash_attention_for_cpu") rule = &flash_attention_results;
  if (name == "aten::native_batch_norm" && op.schema().arguments().size() == 8) rule = &batch_norm_results;
  if (name == "aten::relu") rule = &elementwise_results;
  if (name == "aten::relu_") rule = &in_place_results;
  if (name == "aten::equal") rule = &equal_results;
  if (rule == nullptr) return false;
  const size_t n = op.schema().arguments().size();
  const torch::jit::Stack args(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
  torch::jit::drop(*stack, n);
  rule(args, stack);
  return true;
}

// LibTorch 2.x's scaled_dot_product_attention takes its unfused path on the meta device; where
// the CPU would choose flash attention, runs that instead (true), as a real run would.
bool as_the_cpu_would(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  static const auto choice = c10::Dispatcher::singleton().findSchema({"aten::_fused_sdp_choice", ""});
  static const auto flash =
      c10::Dispatcher::singleton().findSchema({"aten::_scaled_dot_product_flash_attention_for_cpu", ""});
  const size_t n = op.schema().arguments().size();  // query, key, value, mask, dropout, causal, scale, gqa
  if (!choice || !flash || choice->schema().arguments().size() != n || n < 7 || flash->schema().arguments().size() != 7)
    return false;
  torch::jit::Stack ask(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
  run_on_stand_ins(*choice, &ask);
  constexpr int64_t kFlashAttention = 1;  // sdp::SDPBackend::flash_attention
  if (ask.empty() || !ask.back().isInt() || ask.back().toInt() != kFlashAttention) return false;
  const auto arg = [&](size_t i) {
    return (*stack)[stack->size() - n + i];
  };
  torch::jit::Stack call{arg(0), arg(1), arg(2), arg(4), arg(5), arg(3), arg(6)};
  flash->callBoxed(&call);
  const c10::IValue out = call.front();
  torch::jit::drop(*stack, n);
  torch::jit::push(*stack, out);
  return true;
}

// Factory operations take a `device` argument: point it at the meta device, then continue with
// the keys below ours. Other operations pass through unchanged (on meta inputs they run their meta
// kernels, which allocate nothing and draw no random numbers). In a shape pass, an operator whose
// meta kernel is missing runs on CPU stand-ins instead.
void to_meta_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t n = args.size();
  if (t_stand_in_depth == 0)
    for (size_t i = 0; i < n; ++i)
      if (args[i].name() == "device") (*stack)[stack->size() - n + i] = c10::IValue(c10::Device(c10::kMeta));
  const c10::DispatchKeySet below = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kDeferredKey);
  if (t_shape_passes == 0 || t_stand_in_depth > 0) {
    op.redispatchBoxed(below, stack);
    return;
  }
  if (op.schema().name() == "aten::scaled_dot_product_attention" && as_the_cpu_would(op, stack)) return;
  const torch::jit::Stack arguments(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
  try {
    op.redispatchBoxed(below, stack);
  } catch (const c10::NotImplementedError&) {
    stack->erase(stack->end() - static_cast<std::ptrdiff_t>(std::min(stack->size(), n)), stack->end());
    stack->insert(stack->end(), arguments.begin(), arguments.end());
    if (shape_rule(op, stack)) return;
    check_shape_only(op, arguments);
    run_on_stand_ins(op, stack);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(_, DeferredInit, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&to_meta_fallback>()); }

DeferredInit::DeferredInit() : previous_(c10::impl::tls_is_dispatch_key_included(kDeferredKey)) {
  c10::impl::tls_set_dispatch_key_included(kDeferredKey, true);
}

DeferredInit::~DeferredInit() { c10::impl::tls_set_dispatch_key_included(kDeferredKey, previous_); }
bool DeferredInit::supported() { return true; }

namespace detail {
bool deferring() { return c10::impl::tls_is_dispatch_key_included(kDeferredKey); }

DeferralPause::DeferralPause() : previous_(deferring()) {
  c10::impl::tls_set_dispatch_key_included(kDeferredKey, false);
}
DeferralPause::~DeferralPause() { c10::impl::tls_set_dispatch_key_included(kDeferredKey, previous_); }

MetaShapePass::MetaShapePass() { ++t_shape_passes; }
MetaShapePass::~MetaShapePass() { --t_shape_passes; }
bool in_stand_in() { return t_stand_in_depth > 0; }
StandInScope::StandInScope() { ++t_stand_in_depth; }
StandInScope::~StandInScope() { --t_stand_in_depth; }
}  // namespace detail
#else
DeferredInit::DeferredInit() : previous_(false) {
  FSDP_FAIL("fsdp::DeferredInit needs LibTorch's DispatchKey::DeferredInit, which this LibTorch (", TORCH_VERSION,
            ") does not have; construct the model without DeferredInit");
}
DeferredInit::~DeferredInit() = default;
bool DeferredInit::supported() { return false; }

namespace detail {
bool deferring() { return false; }

DeferralPause::DeferralPause() : previous_(false) {}
DeferralPause::~DeferralPause() = default;

MetaShapePass::MetaShapePass() = default;
MetaShapePass::~MetaShapePass() = default;
bool in_stand_in() { return false; }
StandInScope::StandInScope() = default;
StandInScope::~StandInScope() = default;
}  // namespace detail
#endif  // FSDP_HAVE_DEFERRED_INIT_KEY

void reset_parameters(const std::string& name, torch::nn::Module& module) {
  namespace nn = torch::nn;
// The LibTorch modules whose reset_parameters() initializes everything they register.
#define FSDP_RESET_IF(Type)              \
  if (auto* m = module.as<nn::Type>()) { \
    m->reset_parameters();               \
    return;                              \
  }
  FSDP_RESET_IF(Linear)
  FSDP_RESET_IF(Bilinear)
  FSDP_RESET_IF(Embedding)
  FSDP_RESET_IF(EmbeddingBag)
  FSDP_RESET_IF(Conv1d)
  FSDP_RESET_IF(Conv2d)
  FSDP_RESET_IF(Conv3d)
  FSDP_RESET_IF(ConvTranspose1d)
  FSDP_RESET_IF(ConvTranspose2d)
  FSDP_RESET_IF(ConvTranspose3d)
  FSDP_RESET_IF(LayerNorm)
  FSDP_RESET_IF(GroupNorm)
  FSDP_RESET_IF(BatchNorm1d)
  FSDP_RESET_IF(BatchNorm2d)
  FSDP_RESET_IF(BatchNorm3d)
  FSDP_RESET_IF(InstanceNorm1d)
  FSDP_RESET_IF(InstanceNorm2d)
  FSDP_RESET_IF(InstanceNorm3d)
  FSDP_RESET_IF(RNN)
  FSDP_RESET_IF(LSTM)
  FSDP_RESET_IF(GRU)
#undef FSDP_RESET_IF
  FSDP_FAIL("deferred initialization: module '", name, "' (", module.name(),
            ") has parameters or buffers on the meta device and fsdp::reset_parameters does not know how to "
            "initialize this type; pass Options::param_init_fn (or the init argument of fsdp::materialize) with a "
            "function that initializes it");
}

bool has_deferred_tensors(const torch::nn::Module& module) {
  for (const auto& p : module.parameters(/*recurse=*/true))
    if (p.defined() && p.is_meta()) return true;
  for (const auto& b : module.buffers(/*recurse=*/true))
    if (b.defined() && b.is_meta()) return true;
  return false;
}

void materialize(torch::nn::Module& module, const ParamInitFn& init, c10::Device device) {
  detail::check_not_deferring("fsdp::materialize");
  for (const auto& visit : detail::modules_in_preorder(module)) detail::materialize_own_tensors(visit, init, device);
}

namespace detail {

void fill_stand_in(const at::Tensor& c, bool positive_definite) {
  const bool floating = at::isFloatingType(c.scalar_type()) || at::isComplexType(c.scalar_type());
  {
    // Through a tensor over the whole storage: a layout with overlapping elements cannot be filled.
    at::Tensor whole = at::empty({0}, c.options());
    whole.set_(c.storage(), 0, {static_cast<int64_t>(c.storage().nbytes() / c.element_size())}, {1});
    whole.fill_(floating ? 0.5 : 0.0);
  }
  if (floating && positive_definite && c.dim() >= 2 && c.size(-1) == c.size(-2) && c.size(-1) > 0)
    c.diagonal(0, -2, -1).add_(static_cast<double>(c.size(-1)));
}

void check_not_deferring(const char* what) {
  FSDP_CHECK(!deferring(), what,
             " was called inside a fsdp::DeferredInit scope, where every new tensor is a meta "
             "tensor; end the scope after constructing the model and call it outside");
}

std::vector<ModuleVisit> modules_in_preorder(torch::nn::Module& root) {
  std::vector<ModuleVisit> out;
  std::set<const torch::nn::Module*> seen;
  std::function<void(torch::nn::Module&, const std::string&)> walk = [&](torch::nn::Module& m,
                                                                         const std::string& name) {
    if (!seen.insert(&m).second) return;
    out.push_back({&m, name});
    for (const auto& kv : m.named_children()) walk(*kv.value(), name.empty() ? kv.key() : name + "." + kv.key());
  };
  walk(root, "");
  return out;
}

bool materialize_own_tensors(const ModuleVisit& visit, const ParamInitFn& init, c10::Device device) {
  torch::nn::Module& module = *visit.module;
  struct Fresh {
    std::string kind, name;
    at::Tensor tensor;
    int64_t version;
  };
  std::vector<Fresh> fresh;
  auto collect = [&](const char* kind, const torch::OrderedDict<std::string, at::Tensor>& tensors) {
    for (const auto& kv : tensors) {
      const at::Tensor& t = kv.value();
      if (!t.defined() || !t.is_meta()) continue;
      // Same TensorImpl (identity, name, requires_grad, version counter), now over real memory.
      at::Tensor real = at::empty_strided(t.sizes(), t.strides(), t.options().device(device));
      t.unsafeGetTensorImpl()->shallow_copy_from(real.getIntrusivePtr());
      fresh.push_back({kind, visit.name.empty() ? kv.key() : visit.name + "." + kv.key(), t, t._version()});
    }
  };
  collect("parameter", module.named_parameters(/*recurse=*/false));
  collect("buffer", module.named_buffers(/*recurse=*/false));
  if (fresh.empty()) return false;
  {
    // fsdp::Sharded<M> and fsdp::Checkpointed<M> register M's tensors as their own: initialize
    // them as M's (through nested wrappers, e.g. Sharded<Checkpointed<Linear>>).
    torch::nn::Module* target = &module;
    for (;;) {
      auto* unit = dynamic_cast<ExplicitUnit*>(target);
      auto* wrapper = dynamic_cast<ModuleWrapper*>(target);
      if (unit && unit->wrapped_module())
        target = unit->wrapped_module();
      else if (wrapper)
        target = &wrapper->wrapped();
      else
        break;
    }
    at::NoGradGuard no_grad;
    if (init)
      init(visit.name, *target);
    else
      reset_parameters(visit.name, *target);
  }
  for (const auto& f : fresh)
    FSDP_CHECK(f.tensor._version() != f.version, "deferred initialization: the init function left ", f.kind, " '",
               f.name, "' of module '", visit.name, "' (", module.name(),
               ") unwritten; it must initialize every parameter and buffer the module registers itself, in place "
               "(e.g. normal_, zero_, copy_)");
  return true;
}

}  // namespace detail
}  // namespace fsdp
