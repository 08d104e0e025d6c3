// The planner's operator trace (op_trace.h).
#include "planner/op_trace.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/version.h>

#include <exception>
#include <mutex>
#include <optional>
#include <sstream>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "deferred_init_impl.h"
#include "fsdp/activation_checkpoint.h"
#include "fsdp/check.h"
#include "fsdp/deferred_init.h"
#include "planner/keep_probe.h"
#include "planner/keep_table.h"

namespace fsdp::planner {

const void* storage_key(const at::Tensor& t) {
  return t.has_storage() ? static_cast<const void*>(t.storage().unsafeGetStorageImpl())
                         : static_cast<const void*>(t.unsafeGetTensorImpl());
}

namespace {

bool is_in_place(std::string_view op) { return !op.empty() && op.back() == '_'; }
bool is_attention(std::string_view op) { return op.rfind("_scaled_dot_product_", 0) == 0; }
bool is_convolution(std::string_view op) { return op == "convolution" || op == "_convolution"; }
bool counts_flops(std::string_view op) {
  return op == "mm" || op == "addmm" || op == "bmm" || op == "baddbmm" || op == "addbmm" || is_convolution(op) ||
         (is_attention(op) && keep_rule(op) != nullptr);
}

std::string_view base_name(const char* name) {
  std::string_view n(name);
  if (n.rfind("aten::", 0) == 0) n.remove_prefix(6);
  return n;
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

// Which floating tensors keep their width under mixed precision: those the program casts to
// float32 or float64 itself, and what operators make of them (Note [Planner operator trace]).
class WidthTracker {
 public:
  // Whether the floating results of an operator (`program`: called by the program, not from
  // inside another operator) keep their width.
  template <class Values>
  bool widens(const at::RecordFunction& fn, const Values& inputs, bool program) const {
    if (!program && width_.empty()) return false;  // nothing cast yet: the common case costs nothing
    decltype(fn.operator_name()) name;
    if (program) name = fn.operator_name();
    if (name) {
      if (name->name == "aten::type_as" || (name->name == "aten::to" && name->overload_name == "other"))
        return inputs.size() > 1 && inputs[1].isTensor() && of(inputs[1].toTensor()) == kWide;
      size_t at = 0;  // the dtype's position
      if (name->name == "aten::_to_copy" ||
          (name->name == "aten::to" && (name->overload_name == "dtype" || name->overload_name == "dtype_layout")))
        at = 1;
      else if (name->name == "aten::to" && name->overload_name == "device")
        at = 2;
      if (at != 0 && at < inputs.size() && inputs[at].isInt()) {
        const auto dtype = static_cast<at::ScalarType>(inputs[at].toInt());
        return dtype == at::kFloat || dtype == at::kDouble;
      }
    }
    // As type promotion: a wide tensor widens; a cast one (the trace's cast returned the program's
    // tensor itself, which its other uses see too) widens where no narrow one is beside it.
    bool wide = false, cast = false, narrow = false;
    each_tensor(inputs, 0, [&](const at::Tensor& t) {
      if (!at::isFloatingType(t.scalar_type()) || t.dim() == 0) return;  // a 0-dim tensor does not promote
      const Width w = of(t);
      wide = wide || w == kWide;
      cast = cast || w == kCast;
      narrow = narrow || w == kNarrow;
    });
    return wide || (cast && !narrow);
  }

  // Records an operator's floating results as wide or not (an outer operator decides last).
  template <class Inputs, class Outputs>
  void record(bool widens, const Inputs& inputs, const Outputs& outputs) {
    if (!widens && width_.empty()) return;
    each_tensor(outputs, 0, [&](const at::Tensor& t) {
      if (!at::isFloatingType(t.scalar_type())) return;
      const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
      if (!widens) {
        width_.erase(impl);
        return;
      }
      // The input itself (a cast to its own dtype), or a view of a cast one, stays a cast tensor.
      Width w = kWide;
      each_tensor(inputs, 0, [&](const at::Tensor& in) {
        if ((in.unsafeGetTensorImpl() == impl && of(in) == kNarrow) ||
            (of(in) == kCast && storage_key(in) == storage_key(t)))
          w = kCast;
      });
      if (width_.insert_or_assign(impl, w).second) held_.push_back(t);
    });
  }

  bool wide(const at::Tensor& t) const { return of(t) != kNarrow; }

 private:
  enum Width { kNarrow, kCast, kWide };
  Width of(const at::Tensor& t) const {
    const auto it = width_.find(t.unsafeGetTensorImpl());
    return it == width_.end() ? kNarrow : it->second;
  }
  std::unordered_map<const c10::TensorImpl*, Width> width_;
  std::vector<at::Tensor> held_;  // alive, so their addresses are not reused
};

// What an operator's end needs from its start: RecordFunction's inputs may be gone by then.
struct Frame {
  std::string_view op;
  bool traced = false;                      // not inside a stand-in
  bool counted = false;                     // its products are counted here (not by an enclosing operator)
  bool recorded = false;                    // autograd records it (not under no_grad, not inside another's kernel)
  std::vector<at::Tensor> inputs;           // by position; undefined where the argument is not a tensor
  bool transposed = false;                  // a convolution's flag
  bool cloned_self = false;                 // an in-place operator whose original `self` autograd keeps as a clone
  bool widens = false;                      // its floating results keep their width under mixed precision
  std::vector<c10::IValue> all_inputs;      // where it widens: its arguments, for WidthTracker::record
  std::optional<c10::OperatorName> probed;  // a recorded operator to probe at its end (not a product)
  std::vector<c10::IValue> arguments;       // its arguments, for the probe
};

struct Tracer {
  std::unordered_map<const void*, std::string> owner;  // parameter and buffer storage -> module
  std::unordered_set<const void*> params, trainable;   // the storage of parameters, and of those requiring grad
  std::unordered_set<const void*> trainable_read;      // those of the trainable ones read so far
  std::unordered_set<const void*> kept;
  std::vector<at::Tensor> held;  // the kept tensors, alive so their storage's address is not reused
  WidthTracker widths;
  std::vector<TracedSegment> segments{TracedSegment{}};
  std::vector<Frame> frames;
  bool counting = false;  // an enclosing operator counts its products
  size_t operators = 0;
  size_t probe_bytes = 0;                                         // the most stand-in bytes of one probe
  std::unordered_map<std::string, std::optional<Probed>> probes;  // by operator, arguments' grads and non-tensors

  // A tensor autograd keeps: charged once per storage, to the current segment.
  void keep(const at::Tensor& t) {
    if (t.unsafeGetTensorImpl()->is_wrapped_number()) return;  // a number, which autograd keeps as one
    const void* key = storage_key(t);
    if (params.count(key) != 0) segments.back().backward_reads = true;  // backward reads it: enters its unit
    if (owner.count(key) != 0 || !kept.insert(key).second) return;
    held.push_back(t);
    const double bytes = static_cast<double>(t.has_storage() ? t.storage().nbytes() : t.nbytes());
    const bool floating = at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type());
    if (floating && !widths.wide(t))
      segments.back().activation_values += bytes / static_cast<double>(t.element_size());
    else
      segments.back().activation_fixed_bytes += bytes;
  }

  void start(const at::RecordFunction& fn) {
    frames.emplace_back();
    Frame& f = frames.back();
    if (detail::in_stand_in()) return;
    f.traced = true;
    ++operators;
    f.op = base_name(fn.name());
    const auto& inputs = fn.inputs();
    // The program's own casts only: an operator casts to its input's dtype within (cross_entropy).
    f.widens = widths.widens(fn, inputs, /*program=*/frames.size() == 1);
    if (f.widens) f.all_inputs.assign(inputs.begin(), inputs.end());
    each_tensor(inputs, 0, [&](const at::Tensor& t) {
      auto it = owner.find(storage_key(t));
      if (it == owner.end()) return;
      if (it->second != segments.back().module) {
        TracedSegment next;
        next.module = it->second;
        segments.push_back(std::move(next));
      }
      if (params.count(it->first) != 0) segments.back().reads_params = true;
      if (trainable.count(it->first) != 0 && trainable_read.insert(it->first).second) {
        segments.back().grads_arrive = true;
        segments.back().arriving.push_back(it->first);
      }
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
    if (f.recorded && probe_bytes > 0 && !counts_flops(f.op)) {
      if (const auto name = fn.operator_name()) {
        f.probed = *name;
        f.arguments.assign(inputs.begin(), inputs.end());
      }
    }
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
    widths.record(f.widens, f.all_inputs, outputs);
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
    if (f.probed && keep_probed(f, outputs)) return;
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

  // Keeps what a probe of the operator on stand-ins found its backward keeps (probed once per
  // operator, pattern of arguments requiring grad and non-tensor arguments); false where it could
  // not be probed.
  template <class Values>
  bool keep_probed(const Frame& f, const Values& outputs) {
    const std::vector<at::Tensor> in = flat_tensors(f.arguments);
    std::ostringstream key;
    key << f.probed->name << '.' << f.probed->overload_name << '|';
    bool any_grad = false;
    for (const at::Tensor& t : in) {
      any_grad = any_grad || (t.defined() && t.requires_grad());
      key << (!t.defined() ? 'u' : t.requires_grad() ? 'g' : 'n');
    }
    if (!any_grad) return true;
    for (const c10::IValue& v : f.arguments) {
      bool tensors = v.isTensor() || v.isTensorList();
      if (v.isList())
        for (const c10::IValue& e : v.toListRef()) tensors = tensors || e.isTensor();
      if (!tensors) key << '|' << v;
    }
    auto it = probes.find(key.str());
    if (it == probes.end()) {
      // What the probe makes counts against the limit, its results too (a copy of an expanded
      // tensor is larger than it); too large here, the operator may be probed where it is smaller.
      size_t bytes = stand_in_bytes(f.arguments);
      for (const at::Tensor& t : flat_tensors(outputs))
        bytes += t.defined() && t.has_storage() ? t.storage().nbytes() : 0;
      if (bytes > probe_bytes) return false;
      it = probes.emplace(key.str(), probe_kept(*f.probed, f.arguments)).first;
    }
    if (!it->second) return false;
    for (size_t i : it->second->arguments)
      if (i < in.size() && in[i].defined() && !(i == 0 && f.cloned_self)) keep(in[i]);
    const std::vector<at::Tensor> out = flat_tensors(outputs);
    for (size_t j : it->second->results)
      if (j < out.size() && out[j].defined()) keep(out[j]);
    return true;
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

// While alive: the CPU generator's state as it was when it began, restored at its end.
class CpuRandomState {
 public:
  CpuRandomState() {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    const std::lock_guard<std::mutex> lock(cpu.mutex());
    saved_ = cpu.get_state();
  }
  ~CpuRandomState() {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    const std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_state(saved_);
  }
  CpuRandomState(const CpuRandomState&) = delete;
  CpuRandomState& operator=(const CpuRandomState&) = delete;

 private:
  at::Tensor saved_;
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

std::vector<TracedSegment> trace_forward(torch::nn::Module& root, const std::function<void()>& forward, int64_t tokens,
                                         int64_t probe_bytes, const std::vector<at::Tensor>& ignored) {
  FSDP_CHECK(tokens > 0, "PlanRequest: the trace needs seq_len and trace_sequences >= 1");
  FSDP_CHECK(probe_bytes >= 0, "PlanRequest::trace_probe_bytes is ", probe_bytes, "; give 0 or more bytes");
  FSDP_CHECK(DeferredInit::supported(),
             "PlanRequest::trace_forward needs LibTorch's DispatchKey::DeferredInit, which this LibTorch does not "
             "have; leave trace_forward unset (the planner's rules and module_cost count the model)");
  Tracer tracer;
  tracer.probe_bytes = static_cast<size_t>(probe_bytes);
  std::unordered_set<const c10::TensorImpl*> left_alone;
  for (const at::Tensor& t : ignored) left_alone.insert(t.unsafeGetTensorImpl());
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      FSDP_CHECK(p.value().is_meta(), "PlanRequest::trace_forward runs forward on the meta device, but parameter ",
                 item.key().empty() ? p.key() : item.key() + "." + p.key(), " is on ", p.value().device(),
                 "; build the model inside fsdp::DeferredInit (or leave trace_forward unset)");
      tracer.owner.emplace(storage_key(p.value()), item.key());
      if (left_alone.count(p.value().unsafeGetTensorImpl()) != 0) continue;
      tracer.params.insert(storage_key(p.value()));
      if (p.value().requires_grad()) tracer.trainable.insert(storage_key(p.value()));
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
    const CpuRandomState random;  // operators run on CPU stand-ins draw from the CPU generator
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
    if (s.forward_flops == 0 && s.activation_values == 0 && s.activation_fixed_bytes == 0 && s.input_values == 0 &&
        s.module.empty() && !s.reads_params)
      continue;
    s.forward_flops /= per;
    s.activation_values /= per;
    s.activation_fixed_bytes /= per;
    s.input_values /= per;
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace fsdp::planner
