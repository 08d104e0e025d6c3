// The planner's operator trace (op_trace.h).
#include "planner/op_trace.h"

#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/version.h>

#include <exception>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "deferred_init_impl.h"
#include "fsdp/activation_checkpoint.h"
#include "fsdp/check.h"
#include "fsdp/deferred_init.h"

namespace fsdp::planner {
namespace {

// Which of an operator's tensor arguments its backward keeps (parameters and buffers aside).
enum class KeepArgs {
  kNone,
  kAll,
  kCrosswise,  // a product's factors `argument` and the next: each where the other requires grad
  kDivisor,    // a quotient's: the divisor, and the dividend too where the divisor requires grad
  kOne,        // argument `argument` only (an index, a mask, a target)
  kAllBut,     // every argument but `argument` (a normalization's bias)
};

// What autograd keeps for an operator it records (composite operators keep nothing of their own:
// their parts do), by rule: arguments, and its results from `results_from` on (-1: none).
struct KeepRule {
  KeepArgs arguments = KeepArgs::kNone;
  size_t argument = 0;
  int results_from = -1;
  size_t min_arguments = 0;  // the overload it applies to: one with at least this many arguments
};

const std::unordered_map<std::string_view, KeepRule>& keep_rules() {
  static const std::unordered_map<std::string_view, KeepRule> rules = [] {
    std::unordered_map<std::string_view, KeepRule> r;
    for (const char* op : {"convolution",
                           "_convolution",
                           "pow",
                           "gelu",
                           "silu",
                           "mish",
                           "softplus",
                           "leaky_relu",
                           "hardswish",
                           "elu",
                           "sin",
                           "cos",
                           "log",
                           "erf",
                           "avg_pool1d",
                           "avg_pool2d",
                           "avg_pool3d",
                           "_adaptive_avg_pool2d",
                           "_adaptive_avg_pool3d",
                           "upsample_nearest2d",
                           "upsample_bilinear2d",
                           "prelu",
                           "_prelu_kernel",
                           "hardtanh",
                           "threshold",
                           "gather",
                           "clamp",
                           "clamp_min",
                           "clamp_max",
                           "abs",
                           "log1p",
                           "log2",
                           "log10",
                           "atan",
                           "sinh",
                           "cosh",
                           "hardsigmoid",
                           "hardshrink",
                           "softshrink",
                           "glu",
                           "maximum",
                           "minimum",
                           "atan2",
                           "grid_sampler_2d",
                           "reflection_pad2d",
                           "var",
                           "var_mean",
                           "celu",
                           "logit",
                           "renorm",
                           "linalg_cross",
                           "soft_margin_loss",
                           "multi_margin_loss",
                           "mse_loss",
                           "l1_loss",
                           "smooth_l1_loss",
                           "huber_loss",
                           "binary_cross_entropy",
                           "binary_cross_entropy_with_logits"})
      r[op] = {KeepArgs::kAll, 0, -1};
    for (const char* op : {"mul", "mm", "bmm", "mv", "dot", "vdot"}) r[op] = {KeepArgs::kCrosswise, 0, -1};
    for (const char* op : {"addmm", "baddbmm", "addbmm", "addcmul"}) r[op] = {KeepArgs::kCrosswise, 1, -1};
    r["div"] = {KeepArgs::kDivisor, 0, -1};
    r["masked_fill"] = {KeepArgs::kOne, 1, -1};
    r["where"] = {KeepArgs::kOne, 0, -1};  // the condition
    r["embedding"] = {KeepArgs::kOne, 1, -1};
    r["index_select"] = {KeepArgs::kOne, 2, -1};
    r["nll_loss_forward"] = {KeepArgs::kOne, 1, 1};  // the target; the total weight
    r["nll_loss2d_forward"] = {KeepArgs::kOne, 1, 1};
    for (const char* op :
         {"relu", "sigmoid", "tanh", "tan", "exp", "expm1", "reciprocal", "sqrt", "rsqrt", "_softmax", "_log_softmax"})
      r[op] = {KeepArgs::kNone, 0, 0};
    for (const char* op :
         {"logsumexp", "linalg_vector_norm", "norm", "std", "amax", "cumprod", "prod", "sgn", "logcumsumexp"})
      r[op] = {KeepArgs::kAll, 0, 0};
    for (const char* op : {"scatter", "scatter_add", "index_fill"}) r[op] = {KeepArgs::kOne, 2, -1};  // the index
    for (const char* op : {"index_add", "index_copy", "addcdiv"}) r[op] = {KeepArgs::kAllBut, 0, -1};
    for (const char* op : {"sort", "topk", "kthvalue"}) r[op] = {KeepArgs::kNone, 0, 1};  // the indices
    // Their first result is the output; what follows (statistics, indices) is kept.
    for (const char* op : {"native_layer_norm", "_embedding_bag", "adaptive_max_pool2d", "cummax",
                           "max_pool1d_with_indices", "max_pool2d_with_indices", "max_pool3d_with_indices"})
      r[op] = {KeepArgs::kAll, 0, 1};
    for (const char* op : {"native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update",
                           "_batch_norm_no_update", "native_group_norm"})
      r[op] = {KeepArgs::kAllBut, 2, 1};
    // Fused attention keeps its inputs, its output and the log-sum-exp (and a generator's state).
    for (const char* op : {"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"})
      r[op] = {KeepArgs::kAll, 0, 0};
    r["native_dropout"] = {KeepArgs::kNone, 0, 1};  // the mask
#if TORCH_VERSION_MAJOR < 2
    r["mean"] = {KeepArgs::kOne, 0, -1, 3};  // LibTorch 1.13's mean over dimensions keeps its input
#endif
    return r;
  }();
  return rules;
}

bool is_in_place(std::string_view op) { return !op.empty() && op.back() == '_'; }
bool is_attention(std::string_view op) { return op.rfind("_scaled_dot_product_", 0) == 0; }
bool is_convolution(std::string_view op) { return op == "convolution" || op == "_convolution"; }
bool counts_flops(std::string_view op) {
  return op == "mm" || op == "addmm" || op == "bmm" || op == "baddbmm" || op == "addbmm" || is_convolution(op) ||
         (is_attention(op) && keep_rules().count(op) != 0);
}

std::string_view base_name(const char* name) {
  std::string_view n(name);
  if (n.rfind("aten::", 0) == 0) n.remove_prefix(6);
  return n;
}

const void* storage_key(const at::Tensor& t) {
  return t.has_storage() ? static_cast<const void*>(t.storage().unsafeGetStorageImpl())
                         : static_cast<const void*>(t.unsafeGetTensorImpl());
}

// Every defined tensor among values[from...] (RecordFunction's inputs and outputs differ in type
// between LibTorch versions).
template <class Values, class F>
void each_tensor(const Values& values, size_t from, F&& f) {
  for (size_t i = from; i < values.size(); ++i) {
    const c10::IValue& v = values[i];
    if (v.isTensor()) {
      if (v.toTensor().defined()) f(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector())
        if (t.defined()) f(t);
    }
  }
}

// What an operator's end needs from its start: RecordFunction's inputs may be gone by then.
struct Frame {
  std::string_view op;
  bool traced = false;             // not inside a stand-in
  bool counted = false;            // its products are counted here (not by an enclosing operator)
  bool recorded = false;           // autograd records it (not under no_grad, not inside another's kernel)
  std::vector<at::Tensor> inputs;  // by position; undefined where the argument is not a tensor
  bool transposed = false;         // a convolution's flag
  bool cloned_self = false;        // an in-place operator whose original `self` autograd keeps as a clone
};

struct Tracer {
  std::unordered_map<const void*, std::string> owner;  // parameter and buffer storage -> module
  std::unordered_set<const void*> kept;
  std::vector<at::Tensor> held;  // the kept tensors, alive so their storage's address is not reused
  std::vector<TracedSegment> segments{TracedSegment{}};
  std::vector<Frame> frames;
  bool counting = false;  // an enclosing operator counts its products
  size_t operators = 0;

  // A tensor autograd keeps: charged once per storage, to the current segment.
  void keep(const at::Tensor& t) {
    if (t.unsafeGetTensorImpl()->is_wrapped_number()) return;  // a number, which autograd keeps as one
    const void* key = storage_key(t);
    if (owner.count(key) != 0 || !kept.insert(key).second) return;
    held.push_back(t);
    const double bytes = static_cast<double>(t.has_storage() ? t.storage().nbytes() : t.nbytes());
    const bool floating = at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type());
    segments.back().activation_values += floating ? bytes / static_cast<double>(t.element_size()) : bytes / 4.0;
  }

  void start(const at::RecordFunction& fn) {
    frames.emplace_back();
    Frame& f = frames.back();
    if (detail::in_stand_in()) return;
    f.traced = true;
    ++operators;
    f.op = base_name(fn.name());
    const auto& inputs = fn.inputs();
    each_tensor(inputs, 0, [&](const at::Tensor& t) {
      auto it = owner.find(storage_key(t));
      if (it == owner.end() || it->second == segments.back().module) return;
      TracedSegment next;
      next.module = it->second;
      segments.push_back(std::move(next));
    });
    if (segments.back().input_values == 0)
      each_tensor(inputs, 0, [&](const at::Tensor& t) {
        if (segments.back().input_values == 0 && owner.count(storage_key(t)) == 0 &&
            at::isFloatingType(t.scalar_type()))
          segments.back().input_values = static_cast<double>(t.numel());
      });
    f.recorded =
        at::GradMode::is_enabled() && !c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::AutogradFunctionality);
    f.counted = !counting && counts_flops(f.op);
    counting = counting || f.counted;
    if (!f.counted && keep_rule(f.op) == nullptr) return;
    f.inputs.resize(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].isTensor()) f.inputs[i] = inputs[i].toTensor();
    f.transposed = is_convolution(f.op) && inputs.size() > 6 && inputs[6].isBool() && inputs[6].toBool();
  }

  void end(const at::RecordFunction& fn) {
    if (frames.empty()) return;  // an operator that began before the trace
    const Frame f = std::move(frames.back());
    frames.pop_back();
    if (!f.traced) return;
    const auto& outputs = fn.outputs();
    if (f.counted) {
      counting = false;
      const at::Tensor y = !outputs.empty() && outputs[0].isTensor() ? outputs[0].toTensor() : at::Tensor();
      segments.back().forward_flops += products(f, y);
    }
    if (!f.recorded) return;
    // Autograd keeps what an in-place operator overwrites as a clone, made inside that operator.
    if (f.op == "clone" && !frames.empty() && frames.back().traced && is_in_place(frames.back().op)) {
      frames.back().cloned_self = true;
      each_tensor(outputs, 0, [&](const at::Tensor& t) { keep(t); });
      return;
    }
    const KeepRule* rule = keep_rule(f.op);
    if (rule == nullptr || f.inputs.size() < rule->min_arguments) return;
    // Only what backward will need: an operator on tensors none of which requires grad keeps nothing.
    bool any_grad = false;
    for (const at::Tensor& t : f.inputs) any_grad = any_grad || (t.defined() && t.requires_grad());
    if (!any_grad) return;
    auto grad = [&](size_t i) {
      return i < f.inputs.size() && f.inputs[i].defined() && f.inputs[i].requires_grad();
    };
    auto keep_input = [&](size_t i) {
      if (i < f.inputs.size() && f.inputs[i].defined() && !(i == 0 && f.cloned_self)) keep(f.inputs[i]);
    };
    switch (rule->arguments) {
      case KeepArgs::kNone: break;
      case KeepArgs::kAll:
        for (size_t i = 0; i < f.inputs.size(); ++i) keep_input(i);
        break;
      case KeepArgs::kCrosswise:
        if (grad(rule->argument + 1)) keep_input(rule->argument);
        if (grad(rule->argument)) keep_input(rule->argument + 1);
        break;
      case KeepArgs::kDivisor:
        keep_input(1);
        if (grad(1)) keep_input(0);
        break;
      case KeepArgs::kOne: keep_input(rule->argument); break;
      case KeepArgs::kAllBut:
        for (size_t i = 0; i < f.inputs.size(); ++i)
          if (i != rule->argument) keep_input(i);
        break;
    }
    if (rule->results_from >= 0)
      each_tensor(outputs, static_cast<size_t>(rule->results_from), [&](const at::Tensor& t) { keep(t); });
  }

  static const KeepRule* keep_rule(std::string_view op) {
    auto rule = keep_rules().find(op);
    if (rule == keep_rules().end() && !op.empty() && op.back() == '_')
      rule = keep_rules().find(op.substr(0, op.size() - 1));
    return rule == keep_rules().end() ? nullptr : &rule->second;
  }

  static double products(const Frame& f, const at::Tensor& y) {
    auto n = [](const at::Tensor& t) {
      return static_cast<double>(t.numel());
    };
    auto in = [&](size_t i) {
      return i < f.inputs.size() ? f.inputs[i] : at::Tensor();
    };
    const std::string_view op = f.op;
    if (op == "mm" || op == "bmm" || op == "addmm" || op == "baddbmm" || op == "addbmm") {
      const size_t first = op == "mm" || op == "bmm" ? 0 : 1;
      const at::Tensor a = in(first), b = in(first + 1);
      return a.defined() && b.defined() ? 2.0 * n(a) * static_cast<double>(b.size(-1)) : 0.0;
    }
    if (is_convolution(op)) {
      // Each output value (each input value, transposed) meets weight.numel() / weight.size(0) weights.
      const at::Tensor x = in(0), w = in(1);
      if (!x.defined() || !w.defined() || !y.defined() || w.size(0) == 0) return 0.0;
      return 2.0 * n(f.transposed ? x : y) * n(w) / static_cast<double>(w.size(0));
    }
    // Attention: the scores q k^T and their product with v.
    const at::Tensor q = in(0), k = in(1), v = in(2);
    if (!q.defined() || !k.defined() || !v.defined() || q.dim() < 2) return 0.0;
    const double rows = n(q) / static_cast<double>(q.size(-1));
    return 2.0 * n(q) * static_cast<double>(k.size(-2)) +
           2.0 * rows * static_cast<double>(k.size(-2)) * static_cast<double>(v.size(-1));
  }
};

thread_local Tracer* t_tracer = nullptr;

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (t_tracer != nullptr) t_tracer->start(fn);
  return nullptr;
}
void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (t_tracer != nullptr) t_tracer->end(fn);
}

class TracerScope {
 public:
  explicit TracerScope(Tracer* tracer) {
    t_tracer = tracer;
    handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&on_start, &on_end)
                                             .needsInputs(true)
                                             .needsOutputs(true)
                                             .scopes({at::RecordScope::FUNCTION}));
  }
  ~TracerScope() {
    at::removeCallback(handle_);
    t_tracer = nullptr;
  }
  TracerScope(const TracerScope&) = delete;
  TracerScope& operator=(const TracerScope&) = delete;

 private:
  at::CallbackHandle handle_ = 0;
};

}  // namespace

std::vector<TracedSegment> trace_forward(torch::nn::Module& root, const std::function<void()>& forward,
                                         int64_t tokens) {
  FSDP_CHECK(tokens > 0, "PlanRequest: the trace needs seq_len and trace_sequences >= 1");
  FSDP_CHECK(DeferredInit::supported(),
             "PlanRequest::trace_forward needs LibTorch's DispatchKey::DeferredInit, which this LibTorch does not "
             "have; leave trace_forward unset (the planner's rules and module_cost count the model)");
  Tracer tracer;
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      FSDP_CHECK(p.value().is_meta(), "PlanRequest::trace_forward runs forward on the meta device, but parameter ",
                 item.key().empty() ? p.key() : item.key() + "." + p.key(), " is on ", p.value().device(),
                 "; build the model inside fsdp::DeferredInit (or leave trace_forward unset)");
      tracer.owner.emplace(storage_key(p.value()), item.key());
    }
    for (const auto& b : item.value()->named_buffers(/*recurse=*/false))
      if (b.value().defined()) tracer.owner.emplace(storage_key(b.value()), item.key());
  }
  // Checkpointing off for the trace: the planner decides it per candidate from the full costs.
  std::vector<CheckpointedBase*> checkpointed;
  for (const auto& m : root.modules(/*include_self=*/true))
    if (auto* c = dynamic_cast<CheckpointedBase*>(m.get()); c != nullptr && c->enabled()) checkpointed.push_back(c);
  struct Reenable {
    std::vector<CheckpointedBase*>& modules;
    ~Reenable() {
      for (CheckpointedBase* c : modules) c->set_enabled(true);
    }
  } reenable{checkpointed};
  for (CheckpointedBase* c : checkpointed) c->set_enabled(false);
  {
    DeferredInit meta;
    detail::MetaShapePass pass;
    torch::AutoGradMode grad(true);
    TracerScope scope(&tracer);
    try {
      forward();
    } catch (const std::exception& e) {
      FSDP_FAIL("PlanRequest::trace_forward failed on the meta device (its inputs must be meta tensors, or made "
                "inside it; nothing may read values): ",
                e.what());
    }
  }
  FSDP_CHECK(tracer.operators > 0, "PlanRequest::trace_forward ran no operator; it must run the model's forward");
  std::vector<TracedSegment> out;
  const auto per = static_cast<double>(tokens);
  for (TracedSegment& s : tracer.segments) {
    if (s.forward_flops == 0 && s.activation_values == 0 && s.input_values == 0 && s.module.empty()) continue;
    s.forward_flops /= per;
    s.activation_values /= per;
    s.input_values /= per;
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace fsdp::planner
