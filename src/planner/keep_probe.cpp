// The planner trace's probe (keep_probe.h).
#include "planner/keep_probe.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <exception>
#include <memory>
#include <unordered_set>

#include "deferred_init_impl.h"

namespace fsdp::planner {
namespace {

// The operator a probe runs for `name`: itself where autograd records it with a backward of its
// own, the out-of-place form of an in-place operator; none for views (their backward needs shapes
// only), out= forms and composite operators (autograd records their parts).
std::optional<c10::OperatorHandle> probe_target(const c10::OperatorName& name) {
  auto& dispatcher = c10::Dispatcher::singleton();
  auto op = dispatcher.findOp(name);
  if (!op) return std::nullopt;
  bool writes = false;
  for (const c10::Argument& r : op->schema().returns()) {
    if (r.alias_info() == nullptr) continue;
    if (!r.alias_info()->isWrite()) return std::nullopt;
    writes = true;
  }
  if (writes) {
    if (name.name.empty() || name.name.back() != '_') return std::nullopt;
    const size_t arguments = op->schema().arguments().size();
    op = dispatcher.findOp({name.name.substr(0, name.name.size() - 1), name.overload_name});
    if (!op || op->schema().arguments().size() != arguments) return std::nullopt;
  }
  if (!op->hasKernelForDispatchKey(c10::DispatchKey::Autograd) ||
      op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd))
    return std::nullopt;
  return *op;
}

// The values a probe's stand-ins hold (detail::fill_stand_in): floating ones one half, or that
// with every square matrix made positive definite, for operators that refuse a singular one.
enum class Fill { kHalf, kPositiveDefinite };

// A CPU tensor of meta tensor `t`'s layout, dtype and requires-grad, filled as `fill` says.
// Wrapped numbers and tensors not on meta stay as they are.
at::Tensor probe_stand_in(const at::Tensor& t, Fill fill) {
  if (!t.defined() || !t.is_meta()) return t;
  at::Tensor c = at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kCPU));
  detail::fill_stand_in(c, fill == Fill::kPositiveDefinite);
  if ((at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type())) && t.requires_grad())
    c.requires_grad_(true);
  return c;
}

// Runs `op` on `arguments`' stand-ins with grad and reads what its backward node keeps from
// reference counts (Note [Planner operator trace]); none where the operator fails on them.
std::optional<Probed> probe(const c10::OperatorHandle& op, const std::vector<c10::IValue>& arguments, Fill fill) {
  const detail::StandInScope scope;
  std::vector<c10::IValue> stand_ins;
  for (const c10::IValue& v : arguments)
    stand_ins.push_back(detail::with_stand_ins(v, [fill](const at::Tensor& t) { return probe_stand_in(t, fill); }));
  const std::vector<at::Tensor> in = flat_tensors(stand_ins);
  // A leaf's gradient accumulator holds it: made now, so it is not counted as kept.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  for (const at::Tensor& t : in)
    if (t.defined() && t.requires_grad()) accumulators.push_back(torch::autograd::impl::grad_accumulator(t));
  std::vector<size_t> before(in.size(), 0);
  for (size_t i = 0; i < in.size(); ++i) before[i] = in[i].defined() ? in[i].use_count() : 0;
  std::vector<at::Tensor> out;
  {
    torch::jit::Stack stack(stand_ins.begin(), stand_ins.end());
    try {
      op.callBoxed(&stack);
    } catch (const std::exception&) {
      return std::nullopt;
    }
    out = flat_tensors(stack);
  }
  Probed probed;
  // An argument is kept as itself: one more reference than the results account for (a result
  // that is the argument, a view of it).
  for (size_t i = 0; i < in.size(); ++i) {
    if (!in[i].defined() || in[i].unsafeGetTensorImpl()->is_wrapped_number()) continue;
    size_t accounted = before[i];
    for (const at::Tensor& r : out)
      if (r.defined() && (r.is_same(in[i]) || (r.is_view() && r._base().is_same(in[i])))) ++accounted;
    if (in[i].use_count() > accounted) probed.arguments.push_back(i);
  }
  // A result is kept as a new tensor over its storage (a differentiable result), or as itself (one
  // without a backward node): more references to the storage than the tensors in hand over it, or
  // to the result than the handles in hand. A result that is an argument is kept as one, above.
  for (size_t j = 0; j < out.size(); ++j) {
    const at::Tensor& r = out[j];
    if (!r.defined() || !r.has_storage() || r.is_view()) continue;
    if (std::any_of(in.begin(), in.end(), [&](const at::Tensor& t) { return t.is_same(r); })) continue;
    std::unordered_set<const c10::TensorImpl*> over_storage;
    size_t handles = 0;
    auto add_over_storage = [&](const std::vector<at::Tensor>& tensors) {
      for (const at::Tensor& t : tensors)
        if (t.defined() && t.has_storage() && t.storage().unsafeGetStorageImpl() == r.storage().unsafeGetStorageImpl())
          over_storage.insert(t.unsafeGetTensorImpl());
    };
    add_over_storage(out);
    add_over_storage(in);
    for (const at::Tensor& t : out) handles += t.is_same(r) ? 1 : 0;
    if (r.storage().use_count() > over_storage.size() || r.use_count() > handles) probed.results.push_back(j);
  }
  return probed;
}

}  // namespace

size_t stand_in_bytes(const std::vector<c10::IValue>& arguments) {
  size_t bytes = 0;
  for (const at::Tensor& t : flat_tensors(arguments))
    if (t.defined() && t.is_meta())
      bytes += at::detail::computeStorageNbytes(t.sizes(), t.strides(), t.dtype().itemsize());
  return bytes;
}

std::optional<Probed> probe_kept(const c10::OperatorName& name, const std::vector<c10::IValue>& arguments) {
  const std::optional<c10::OperatorHandle> op = probe_target(name);
  if (!op) return std::nullopt;
  if (auto probed = probe(*op, arguments, Fill::kHalf)) return probed;
  return probe(*op, arguments, Fill::kPositiveDefinite);  // e.g. a factorization that refused a singular matrix
}

}  // namespace fsdp::planner
