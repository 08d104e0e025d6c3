#include "runtime/gradient_reducer.h"

#include <algorithm>

#include "flat_param_collectives.h"
#include "fsdp/check.h"
#include "internal_op_guard.h"

namespace fsdp {

GradientReducer::GradientReducer(std::vector<Unit>& units, std::vector<std::unique_ptr<FlatParam>>& flat_params,
                                 const Options& options, bool every_param_expected, CommunicatorPtr world,
                                 Tracer& tracer, MemoryTracker& memory)
    : units_(units),
      flat_params_(flat_params),
      options_(options),
      every_param_expected_(every_param_expected),
      world_(std::move(world)),
      tracer_(tracer),
      memory_(memory) {}

void GradientReducer::begin_backward() {
  stepper_.wait_all(tracer_);  // a backward that failed may have left steps running
  apply_module_zero_grad();
  update_sharded_grad_bytes();
  // A piece whose gradient is gone, replaced or written since the last backward: the user zeroed
  // (or dropped) gradients, so this backward starts a new sum.
  bool zeroed = held_.size() != flat_params_.size();
  for (size_t f = 0; f < held_.size() && !zeroed; ++f) zeroed = piece_grads_changed(f);
  // Every member of a shard group must be able to see the zeroing: one whose shard is all padding
  // in every FlatParameter holds no piece, so the count is left out on every rank (the sharding is
  // the same on all of them).
  bool observable = false;
  for (const auto& fp : flat_params_)
    observable = observable || (fp->requires_grad() && fp->padded_numel() - fp->shard_numel() < fp->numel());
  drop_or_resync_held(observable);
  // A rank none of whose pieces got a gradient holds nothing to add: it counts the user's zeroing,
  // which it cannot see (Note [Backward passes held]).
  bool sees = false;
  for (const auto& slots : held_)
    for (const HeldGrad& h : slots) sees = sees || h.impl != nullptr;
  if (zeroed || !observable || !sees) backwards_held_ = 0;
  if (counted_) ++backwards_since_sync_;
  for (auto& fp : flat_params_) {
    fp->grad().set_backwards_held(backwards_held_);
    fp->grad().set_backward_count(backwards_since_sync_, counted_);
  }
}

void GradientReducer::drop_or_resync_held(bool observable) {
  // The optimizer stepped while gradients were held: that step took none of them.
  for (size_t f = 0; f < held_shard_versions_.size() && f < flat_params_.size(); ++f)
    FSDP_CHECK(flat_params_[f]->optimizer_writes() == held_shard_versions_[f],
               "the optimizer stepped the shards after a backward without gradient synchronization and before one "
               "with it: that step used none of the gradients held since, which no rank has reduced. Turn "
               "synchronization back on for the last micro-batch before optimizer.step() "
               "(leave no_sync(), or set_requires_gradient_sync(true) / set_requires_all_reduce(true))");
  held_shard_versions_.clear();
  bool holding = false, changed = false;
  for (size_t f = 0; f < flat_params_.size(); ++f) {
    FlatGrad& grad = flat_params_[f]->grad();
    if (!grad.holds_any()) continue;
    if (grad.holds_in_store()) {
      grad.resync_store();
      continue;
    }
    holding = true;
    changed = changed || (f < held_.size() && piece_grads_changed(f));
  }
  if (!holding) return;
  // A rank whose shards are all padding sees no piece: it takes its peers' view.
  if (!observable && world_ && world_->size() > 1) {
    at::Tensor flag =
        at::full({1}, changed ? 1.0 : 0.0, at::TensorOptions().dtype(at::kFloat).device(world_->device()));
    world_->all_reduce(flag, CollectiveOptions::labeled("gradients zeroed since a backward without sync"))->wait();
    changed = flag.cpu().item<float>() > 0;
  }
  if (!changed) return;
  for (auto& fp : flat_params_) fp->grad().drop_held();
  backwards_since_sync_ = 0;
}

void GradientReducer::prepare_grad(int f, int s) {
  FlatParam& fp = *flat_params_[f];
  if (stepper_.on()) {
    FSDP_CHECK(!fp.grad().reduce_pending() && !stepper_.stepped(fp), "set_step_in_backward: a gradient of unit '",
               units_[fp.unit()].name().empty() ? "<root>" : units_[fp.unit()].name(),
               "' arrived after that unit's gradients were reduced in this backward (its parameters were used "
               "again, e.g. by two forwards before one backward), so its step cannot run on all of them. Turn the "
               "step in backward off for this model (set_step_in_backward(nullptr)) and call the optimizer's "
               "step() after backward");
  }
  if (fp.grad().reduce_pending()) {
    finish_reduction(f);
    reduce_order_.erase(std::remove(reduce_order_.begin(), reduce_order_.end(), f), reduce_order_.end());
  }
  if (fp.grad().ensure_buffer()) update_sharded_grad_bytes();
  fp.slots()[s].param.mutable_grad().reset();
}

bool GradientReducer::take_grad(int f, int s) {
  FlatParam& fp = *flat_params_[f];
  fp.grad().take(s);
  ParamSlot& slot = fp.slots()[s];
  const bool complete = units_[fp.unit()].note_grad(every_param_expected_, !slot.used);
  slot.used = true;
  slot.got_grad = true;
  return complete;
}

bool GradientReducer::has_unreduced(int u) const {
  for (const FlatParam* fp : units_[u].flat_params()) {
    const FlatGrad& grad = fp->grad();
    if ((grad.has_buffer() || (all_reduce_ && grad.has_partial())) && !grad.reduce_pending()) return true;
  }
  return false;
}

bool GradientReducer::holds_unreduced() const {
  return std::any_of(flat_params_.begin(), flat_params_.end(), [](const auto& fp) { return fp->grad().holds_any(); });
}

bool GradientReducer::piece_grads_changed(size_t f) const {
  const auto& slots = flat_params_[f]->slots();
  for (size_t s = 0; s < slots.size() && s < held_[f].size(); ++s) {
    const HeldGrad& h = held_[f][s];
    if (!h.impl) continue;
    const at::Tensor& g = slots[s].piece.grad();
    if (!g.defined() || g.unsafeGetTensorImpl() != h.impl || g._version() != h.version) return true;
  }
  return false;
}

std::string GradientReducer::unreduced_error(const std::string& what) {
  return detail::compose(
      what, ": the last backward ran without gradient synchronization (no_sync, set_requires_gradient_sync(false) or "
            "set_requires_all_reduce(false)), so its gradients are not reduced yet and the pieces' .grad do not hold "
            "them; call it after the backward that reduces them");
}

void GradientReducer::reduce(int u) {
  if (!sync_) return;  // accumulation without communication: the buffers stay for the next backward
  // Waiting before issuing (not after) frees the oldest buffer before this reduction's output is
  // allocated; the communicator would run this reduction only after the older ones anyway.
  const size_t in_flight = static_cast<size_t>(options_.reductions_in_flight());
  for (FlatParam* fp : units_[u].flat_params()) {
    FlatGrad& grad = fp->grad();
    if (grad.reduce_pending()) continue;
    if (!grad.has_buffer()) {
      if (!(all_reduce_ && grad.has_partial())) continue;
      grad.ensure_buffer();  // no gradient in this backward: zeros join the kept partial sums
    }
    finish_reductions(in_flight > 0 ? in_flight - 1 : 0);
    start_reduction(*fp, all_reduce_);
    if (grad.reduced_across_replicas())
      tracer_.instant(TraceEvent::Kind::kReduceIssued, u, "all-reduce across replicas");
    const char* op = fp->keep_unsharded() ? "all-reduce" : "reduce-scatter";
    tracer_.collective(TraceEvent::Kind::kReduce, u, op, fp->reduce_track(), grad.reduce_work());
    tracer_.instant(TraceEvent::Kind::kReduceIssued, u, op);
    reduce_order_.push_back(fp->id());
  }
  finish_reductions(in_flight);
}

void GradientReducer::finish_reduction(int f) {
  FlatParam& fp = *flat_params_[f];
  const FlatGrad& grad = fp.grad();
  const bool done = !grad.reduce_pending() || !grad.reduce_work() || grad.reduce_work()->completed();
  const auto start = Tracer::Clock::now();
  // With the step on its own thread, that thread writes the pieces' gradients (Note [Step on its
  // own thread]); under CPU offload they land on the host as their copies arrive, and backward's
  // thread lands and steps them at the end of backward (finish_all).
  const bool grads_in = fsdp::finish_reduction(fp, /*defer_landing=*/stepper_.own_thread());
  if (!done)
    tracer_.wait(fp.unit(), fp.keep_unsharded() ? "all-reduce" : "reduce-scatter", start, Tracer::Clock::now());
  if (grads_in || (stepper_.own_thread() && grad.landing_pending())) step(fp);
  if (fp.offloaded()) {
    // Its copy to the host overlaps the next reductions' compute; the oldest copies' device
    // buffers are let go in stream order once more than the reductions in flight are pending.
    to_host_order_.push_back(f);
    const size_t keep = static_cast<size_t>(std::max(1, options_.reductions_in_flight()));
    while (to_host_order_.size() > keep) {
      flat_params_[to_host_order_.front()]->grad().release_device_grad();
      to_host_order_.erase(to_host_order_.begin());
    }
  }
}

void GradientReducer::finish_reductions(size_t keep_in_flight) {
  // By count only, not as soon as one completes: gradient memory must not depend on timing.
  while (reduce_order_.size() > keep_in_flight) {
    const int f = reduce_order_.front();
    reduce_order_.erase(reduce_order_.begin());
    finish_reduction(f);
  }
}

void GradientReducer::finish_all() {
  finish_reductions(0);
  stepper_.wait_all(tracer_);
  for (auto& fp : flat_params_)
    if (fp->grad().land()) step(*fp);
  stepper_.wait_all(tracer_);
  for (int f : to_host_order_) flat_params_[f]->grad().release_device_grad();  // their copies have landed
  to_host_order_.clear();
}

void GradientReducer::abandon_backward() {
  // Reductions issued complete (every rank issued them) but do not land: the user zeroes the
  // gradients after a failed backward, and a landing after that would bring them back.
  while (!reduce_order_.empty()) {
    const int f = reduce_order_.front();
    reduce_order_.erase(reduce_order_.begin());
    fsdp::finish_reduction(*flat_params_[f], /*defer_landing=*/true);
  }
  stepper_.wait_all(tracer_);
  for (auto& fp : flat_params_) {
    fp->grad().discard_landing();
    fp->grad().abandon_unreduced();
  }
  to_host_order_.clear();
  backwards_since_sync_ = 0;
  end_backward();
  backwards_held_ = 0;  // it holds nothing for the next reduction to add to
}

void GradientReducer::step(FlatParam& fp) {
  if (!stepper_.on()) return;
  const auto start = Tracer::Clock::now();
  stepper_.step(fp, units_[fp.unit()].name());
  if (!stepper_.own_thread()) tracer_.step(fp.unit(), start, Tracer::Clock::now());  // else: wait_all traces it
}

void GradientReducer::broadcast_buffers(const std::vector<std::pair<std::string, at::Tensor>>& buffers) {
  if (world_->size() == 1) return;
  for (const auto& kv : buffers) {
    at::Tensor b = kv.second;
    if (!b.defined() || b.numel() == 0) continue;
    const auto start = Tracer::Clock::now();
    at::Tensor sent = b.is_contiguous() ? b : b.contiguous();
    auto work = world_->broadcast(sent, 0, CollectiveOptions::labeled("buffer broadcast: " + kv.first));
    tracer_.collective(TraceEvent::Kind::kReduce, -1, "broadcast " + kv.first, world_->name(), work);
    work->wait();
    if (!sent.is_same(b)) b.copy_(sent);
    tracer_.wait(-1, "broadcast buffers", start, Tracer::Clock::now());
  }
}

void GradientReducer::end_backward() {
  if (!sync_)
    for (auto& fp : flat_params_) fp->grad().keep_unreduced();
  else
    backwards_since_sync_ = 0;
  for (auto& fp : flat_params_) fp->grad().mark_held_pieces();
  held_shard_versions_.clear();
  if (holds_unreduced())
    for (const auto& fp : flat_params_) held_shard_versions_.push_back(fp->optimizer_writes());
  for (auto& unit : units_) unit.reset_grad_count();
  for (auto& fp : flat_params_)
    for (auto& s : fp->slots()) s.used = s.got_grad = false;
  // A backward that stepped consumed its gradients: the next one holds none.
  backwards_held_ = stepper_.stepped_any() ? 0 : backwards_held_ + 1;
  stepper_.end_backward();
  held_.assign(flat_params_.size(), {});
  for (size_t f = 0; f < flat_params_.size(); ++f) {
    for (const auto& s : flat_params_[f]->slots()) {
      HeldGrad h;
      if (s.piece.defined() && s.piece.grad().defined()) {
        h.impl = s.piece.grad().unsafeGetTensorImpl();
        h.version = s.piece.grad()._version();
      }
      h.param_grad = s.param.grad();
      if (h.param_grad.defined()) h.param_grad_version = h.param_grad._version();
      held_[f].push_back(h);
    }
  }
}

void GradientReducer::apply_module_zero_grad() {
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  for (size_t f = 0; f < held_.size() && f < flat_params_.size(); ++f) {
    auto& slots = flat_params_[f]->slots();
    for (size_t s = 0; s < slots.size() && s < held_[f].size(); ++s) {
      const HeldGrad& h = held_[f][s];
      if (!h.param_grad.defined()) continue;  // it had no gradient: nothing to zero
      const at::Tensor& now = slots[s].param.grad();
      if (now.defined() && now.is_same(h.param_grad) && now._version() == h.param_grad_version) continue;
      at::Tensor& piece = slots[s].piece;
      if (!piece.defined() || !piece.grad().defined()) continue;
      if (now.defined())
        piece.mutable_grad().zero_();
      else
        piece.mutable_grad().reset();
    }
  }
}

void GradientReducer::update_sharded_grad_bytes() {
  int64_t bytes = 0;
  for (const auto& fp : flat_params_) bytes += fp->grad().sharded_bytes();
  memory_.set_sharded_grad_bytes(bytes);
}

}  // namespace fsdp
