#include "fsdp/activation_checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/version.h>

#include <map>
#include <mutex>
#include <unordered_set>

#include "fsdp/check.h"
#include "internal_op_guard.h"
#include "runtime/checkpointed_forward.h"
#include "runtime/hooks.h"
#include "unit_plan.h"

namespace fsdp {
namespace detail {

namespace {

bool cuda_available() {
  static const bool available = torch::cuda::is_available();
  return available;
}

// A generator and a state of it.
using GeneratorState = std::pair<at::Generator, at::Tensor>;

// Sets each generator to its saved state and puts the caller's states back when it goes.
class RngReplay {
 public:
  explicit RngReplay(const std::vector<GeneratorState>& saved) {
    for (const auto& [generator, state] : saved) {
      at::Generator gen = generator;
      std::lock_guard<std::mutex> lock(gen.mutex());
      callers_.emplace_back(gen, gen.get_state());
      gen.set_state(state);
    }
  }
  ~RngReplay() {
    for (auto& [gen, state] : callers_) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }
  RngReplay(const RngReplay&) = delete;
  RngReplay& operator=(const RngReplay&) = delete;

 private:
  std::vector<GeneratorState> callers_;
};

// The autocast state (LibTorch's automatic mixed precision) of this thread, CPU and CUDA.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
// LibTorch 2.4 takes the device type and deprecates the per-device functions.
struct AutocastState {
  bool cpu = at::autocast::is_autocast_enabled(at::kCPU), gpu = at::autocast::is_autocast_enabled(at::kCUDA);
  at::ScalarType cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU),
                 gpu_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
  void apply() const {
    at::autocast::set_autocast_enabled(at::kCPU, cpu);
    at::autocast::set_autocast_enabled(at::kCUDA, gpu);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_dtype(at::kCUDA, gpu_dtype);
  }
};
#else
struct AutocastState {
  bool cpu = at::autocast::is_cpu_enabled(), gpu = at::autocast::is_enabled();
  at::ScalarType cpu_dtype = at::autocast::get_autocast_cpu_dtype(), gpu_dtype = at::autocast::get_autocast_gpu_dtype();
  void apply() const {
    at::autocast::set_cpu_enabled(cpu);
    at::autocast::set_enabled(gpu);
    at::autocast::set_autocast_cpu_dtype(cpu_dtype);
    at::autocast::set_autocast_gpu_dtype(gpu_dtype);
  }
};
#endif

// Sets a saved autocast state and puts the caller's back when it goes. Autocast's cache of cast
// weights is off meanwhile: entries made here would outlive the recompute (and the weights' values).
class AutocastReplay {
 public:
  explicit AutocastReplay(const AutocastState& saved) : cache_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
    saved.apply();
  }
  ~AutocastReplay() {
    caller_.apply();
    at::autocast::set_autocast_cache_enabled(cache_);
  }
  AutocastReplay(const AutocastReplay&) = delete;
  AutocastReplay& operator=(const AutocastReplay&) = delete;

 private:
  AutocastState caller_;
  bool cache_;
};

// While alive, each buffer of a module's tree computes on a copy of its data: whatever the
// recompute writes to a buffer (in place, or by set_data) lands in the copy, and the buffer gets its
// own data back when this goes. See Note [Activation checkpointing] in docs/design.md.
class BufferShield {
 public:
  explicit BufferShield(const torch::nn::Module& module) {
    InternalOpGuard internal;
    at::NoGradGuard no_grad;
    std::unordered_set<const c10::TensorImpl*> seen;
    for (const at::Tensor& b : module.buffers(/*recurse=*/true)) {
      if (!b.defined() || !seen.insert(b.unsafeGetTensorImpl()).second) continue;
      saved_.emplace_back(b, b.variable_data());
      b.set_data(b.clone());
    }
  }
  ~BufferShield() {
    InternalOpGuard internal;
    for (auto& [buffer, data] : saved_) buffer.set_data(data);
  }
  BufferShield(const BufferShield&) = delete;
  BufferShield& operator=(const BufferShield&) = delete;

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> saved_;  // {buffer, its own data}
};

// What backward needs to recompute one checkpointed forward, kept in the autograd context.
struct Recompute : torch::CustomClassHolder {
  std::shared_ptr<torch::nn::Module> module;
  CheckpointRun run;
  std::vector<char> defined;  // per tensor argument: defined (an autograd input) or not
  bool dummy = false;         // the last autograd input is a dummy that requires grad
  std::vector<GeneratorState> rng;
  AutocastState autocast;  // as the forward ran

  // The tensor arguments from the autograd inputs (undefined arguments are not inputs).
  std::vector<at::Tensor> arguments(at::TensorList inputs) const {
    std::vector<at::Tensor> args;
    size_t next = 0;
    for (const char d : defined) args.push_back(d ? inputs[next++] : at::Tensor());
    return args;
  }

  // The default generators the forward may draw from, with their states now: the CPU one, and
  // with CUDA the current device's and those of the arguments' and parameters' devices.
  void save_rng(const std::vector<at::Tensor>& tensors) {
    std::vector<at::Generator> gens{at::detail::getDefaultCPUGenerator()};
    if (cuda_available()) {
      std::vector<c10::Device> devices{c10::Device(c10::kCUDA)};
      for (const auto& t : tensors)
        if (t.defined() && t.is_cuda()) devices.push_back(t.device());
      for (const auto& p : module->parameters())
        if (p.is_cuda()) devices.push_back(p.device());
      for (const auto& d : devices) gens.push_back(at::globalContext().defaultGenerator(d));
    }
    std::unordered_set<const c10::GeneratorImpl*> seen;
    for (auto& gen : gens) {
      if (!seen.insert(gen.unsafeGetGeneratorImpl()).second) continue;
      std::lock_guard<std::mutex> lock(gen.mutex());
      rng.emplace_back(gen, gen.get_state());
    }
  }
};

c10::intrusive_ptr<Recompute> recompute_of(torch::autograd::AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data.at("recompute").toCapsule());
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const c10::intrusive_ptr<Recompute>& rc, at::TensorList inputs) {
    ctx->set_materialize_grads(false);
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(rc);
    ctx->save_for_backward(inputs.vec());
    std::vector<at::Tensor> args = rc->arguments(inputs);
    at::Tensor out;
    {
      CheckpointedForwardScope checkpointed;
      out = rc->run(args);
    }
    FSDP_CHECK(out.defined(), "fsdp::Checkpointed: the wrapped forward returned an undefined tensor");
    return {out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    FSDP_CHECK(!at::GradMode::is_enabled(),
               "fsdp::Checkpointed: backward with create_graph (higher-order gradients) is not supported; disable "
               "checkpointing (set_enabled(false)) for it");
    const c10::intrusive_ptr<Recompute> rc = recompute_of(ctx);
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    torch::autograd::variable_list grads(1 + saved.size());  // the first for the Recompute argument
    if (grad_outputs.empty() || !grad_outputs[0].defined()) return grads;
    // Leaves of the recomputed graph: backward stops at them, and their .grad is the result.
    std::vector<at::Tensor> inputs;
    for (const auto& t : saved) inputs.push_back(t.detach().requires_grad_(t.requires_grad()));
    before_recompute(*rc->module);
    BufferShield shield(*rc->module);  // through the nested backward, which may read the buffers
    at::Tensor out;
    {
      RngReplay replay(rc->rng);
      AutocastReplay autocast(rc->autocast);
      at::AutoGradMode grad_mode(true);
      std::vector<at::Tensor> args = rc->arguments(inputs);
      out = rc->run(args);
    }
    // The parameters get their gradients here, through their own AccumulateGrad nodes.
    if (out.requires_grad()) torch::autograd::backward({out}, {grad_outputs[0]});
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].requires_grad()) grads[1 + i] = inputs[i].grad();
    return grads;
  }
};

}  // namespace

at::Tensor checkpoint(std::shared_ptr<torch::nn::Module> module, CheckpointRun run, std::vector<at::Tensor> tensors) {
  auto rc = c10::make_intrusive<Recompute>();
  rc->module = std::move(module);
  rc->run = std::move(run);
  std::vector<at::Tensor> inputs;
  bool input_requires_grad = false;
  for (const auto& t : tensors) {
    rc->defined.push_back(t.defined());
    if (!t.defined()) continue;
    inputs.push_back(t);
    input_requires_grad = input_requires_grad || t.requires_grad();
  }
  if (!input_requires_grad) {
    // The parameters must get gradients even when no input requires grad: a dummy input that does
    // makes autograd call backward.
    bool param_requires_grad = false;
    for (const auto& p : rc->module->parameters()) param_requires_grad = param_requires_grad || p.requires_grad();
    if (!param_requires_grad) return rc->run(tensors);  // nothing to differentiate: keep nothing
    inputs.push_back(at::empty({0}).requires_grad_());
    rc->dummy = true;
  }
  rc->save_rng(tensors);
  return CheckpointFunction::apply(rc, at::TensorList(inputs))[0];
}

}  // namespace detail

int apply_activation_checkpointing(torch::nn::Module& root, const WrapPolicy& policy) {
  FSDP_CHECK(static_cast<bool>(policy), "apply_activation_checkpointing: the policy is empty");
  int enabled = 0;
  const std::map<const torch::nn::Module*, int64_t> counts = unwrapped_counts(root, policy);
  auto visit = [&](const std::string& name, torch::nn::Module& module) {
    const auto count = counts.find(&module);
    // A wrapper is not in the module tree when another one stands in for it (fsdp::Sharded<
    // fsdp::Checkpointed<M>>): follow the chain of wrapped modules.
    for (torch::nn::Module* m = &module; m != nullptr;) {
      if (auto* wrapper = dynamic_cast<CheckpointedBase*>(m)) {
        // The count fully_shard's wrap policy is given for the module: what no nested unit takes.
        const int64_t numel = count != counts.end() ? count->second : 0;
        const bool on = policy(name, *m, numel) || policy(name, wrapper->wrapped(), numel);
        wrapper->set_enabled(on);
        enabled += on;
      }
      if (auto* wrapper = dynamic_cast<ModuleWrapper*>(m))
        m = &wrapper->wrapped();
      else if (auto* unit = dynamic_cast<ExplicitUnit*>(m))
        m = unit->wrapped_module();
      else
        m = nullptr;
    }
  };
  visit("", root);
  for (const auto& kv : root.named_modules(/*name_prefix=*/"", /*include_self=*/false)) visit(kv.key(), *kv.value());
  return enabled;
}

}  // namespace fsdp
