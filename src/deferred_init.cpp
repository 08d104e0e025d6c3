#include "fsdp/deferred_init.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>
#include <torch/version.h>

#include <functional>
#include <set>

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

// Factory operations take a `device` argument: point it at the meta device, then continue with
// the keys below ours. Other operations pass through unchanged (on meta inputs they run their meta
// kernels, which allocate nothing and draw no random numbers).
void to_meta_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t n = args.size();
  for (size_t i = 0; i < n; ++i)
    if (args[i].name() == "device") (*stack)[stack->size() - n + i] = c10::IValue(c10::Device(c10::kMeta));
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kDeferredKey), stack);
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
