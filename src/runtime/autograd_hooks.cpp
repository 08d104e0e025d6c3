// Backward: AccumulateGrad pre-hooks make sure the flat gradient buffer exists; AccumulateGrad
// hands the parameter autograd's own gradient tensor; post-hooks move it into the buffer (one
// copy, no zero-fill), count a unit's gradients and, once all arrived, reshard the unit and issue
// its reduction; a callback queued on the autograd engine finishes everything at the end of backward.
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>

#include "fsdp/check.h"
#include "runtime/internal_guard.h"
#include "runtime/runtime.h"

namespace fsdp {

namespace {

struct GradPreHook : torch::autograd::FunctionPreHook {
  GradPreHook(Runtime* r, int f, int s) : runtime(r), flat_param(f), slot(s) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    runtime->on_grad_pre(flat_param, slot);
    return grads;
  }
  Runtime* runtime;
  int flat_param, slot;
};

struct GradPostHook : torch::autograd::FunctionPostHook {
  GradPostHook(Runtime* r, int f, int s) : runtime(r), flat_param(f), slot(s) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    runtime->on_grad_post(flat_param, slot);
    return outputs;
  }
  Runtime* runtime;
  int flat_param, slot;
};

}  // namespace

void Runtime::register_hooks() {
  // Autograd holds AccumulateGrad nodes weakly, so the slots keep them alive; ~Runtime removes
  // these hooks again, since a graph may keep a node alive longer than the runtime.
  for (size_t f = 0; f < flat_params_.size(); ++f) {
    auto& slots = flat_params_[f]->slots();
    for (size_t s = 0; s < slots.size(); ++s) {
      if (!slots[s].param.requires_grad()) continue;
      auto acc = torch::autograd::impl::grad_accumulator(slots[s].param);
      FSDP_CHECK(acc, "internal: parameter '", slots[s].name, "' has no gradient accumulator");
      acc->add_pre_hook(std::make_unique<GradPreHook>(this, int(f), int(s)));
      acc->add_post_hook(std::make_unique<GradPostHook>(this, int(f), int(s)));
      slots[s].grad_accumulator = std::move(acc);
    }
  }
}

void Runtime::remove_hooks() {
  for (auto& fp : flat_params_)
    for (auto& slot : fp->slots()) {
      if (!slot.grad_accumulator) continue;
      auto& pre = slot.grad_accumulator->pre_hooks();
      pre.erase(std::remove_if(pre.begin(), pre.end(),
                               [](const auto& h) { return dynamic_cast<GradPreHook*>(h.get()) != nullptr; }),
                pre.end());
      auto& post = slot.grad_accumulator->post_hooks();
      post.erase(std::remove_if(post.begin(), post.end(),
                                [](const auto& h) { return dynamic_cast<GradPostHook*>(h.get()) != nullptr; }),
                 post.end());
      slot.grad_accumulator.reset();
    }
}

void Runtime::on_grad_pre(int f, int s) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  InternalOpGuard internal;
  rethrow_pending_error();
  if (!final_callback_queued_) {
    torch::autograd::Engine::get_default_engine().queue_callback([this] { on_backward_end(); });
    final_callback_queued_ = true;
    if (!backward_started_) begin_backward();
    update_sharded_grad_bytes();  // the user may have dropped them (zero_grad(set_to_none))
  }
  FlatParam& fp = *flat_params_[f];
  // A gradient arriving after this FlatParameter was already reduced in this backward (a
  // parameter used again later): finish that reduction, then start a fresh buffer.
  if (fp.reduce_pending()) {
    finish_reduction(f);
    reduce_order_.erase(std::remove(reduce_order_.begin(), reduce_order_.end(), f), reduce_order_.end());
  }
  if (fp.ensure_grad_buffer()) update_sharded_grad_bytes();
  // AccumulateGrad then steals autograd's gradient tensor; the post-hook moves it into the buffer.
  fp.slots()[s].param.mutable_grad().reset();
}

void Runtime::on_grad_post(int f, int s) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  InternalOpGuard internal;
  FlatParam& fp = *flat_params_[f];
  fp.take_grad(s);
  ParamSlot& slot = fp.slots()[s];
  Unit& unit = units_[fp.unit()];
  if (!unit.counted) {
    unit.expected_grads = 0;
    for (int g : unit.flat_params)
      for (const auto& sl : flat_params_[g]->slots())
        unit.expected_grads += ((sl.used || !intercepting_) && sl.param.requires_grad());
    unit.counted = true;
  }
  if (!slot.used) {  // reached without our seeing a forward read: count it now
    slot.used = true;
    if (intercepting_) ++unit.expected_grads;  // otherwise it was counted already
  }
  slot.got_grad = true;
  if (++unit.ready_grads >= unit.expected_grads) post_backward(fp.unit());
}

void Runtime::post_backward(int u) {
  // All of u's gradients are in: its parameters are no longer needed in this backward.
  tracer_.leave_compute();
  units_[u].backward_done = true;
  if (options_.sharding_strategy() != ShardingStrategy::kNoShard) reshard(u);
  if (last_touched_ == u) last_touched_ = -1;
  if (options_.backward_prefetch() == BackwardPrefetch::kBackwardPost && backward_started_)
    prefetch(next_pending_in_backward(u), "prefetch backward post");
  // Bound the unsharded gradient buffers in flight. Waiting before issuing (not after) frees the
  // oldest buffer before this reduction's output is allocated; the communicator would run this
  // reduction only after the older ones anyway.
  const size_t in_flight = static_cast<size_t>(options_.reductions_in_flight());
  for (int f : units_[u].flat_params) {
    FlatParam& fp = *flat_params_[f];
    if (!fp.has_grad_buffer() || fp.reduce_pending()) continue;
    finish_reductions(in_flight > 0 ? in_flight - 1 : 0);
    fp.start_reduce();
    const char* op = fp.keep_unsharded() ? "all-reduce" : "reduce-scatter";
    tracer_.collective(TraceEvent::Kind::kReduce, u, op, fp.reduce_track(), fp.reduce_work());
    tracer_.instant(TraceEvent::Kind::kReduceIssued, u, op);
    reduce_order_.push_back(f);
  }
  finish_reductions(in_flight);
}

void Runtime::finish_reduction(int f) {
  FlatParam& fp = *flat_params_[f];
  const bool done = !fp.reduce_pending() || fp.reduce_work()->completed();
  const auto start = Tracer::Clock::now();
  fp.finish_reduce();
  if (!done) tracer_.wait(fp.unit(), fp.keep_unsharded() ? "all-reduce" : "reduce-scatter", start, Tracer::Clock::now());
}

void Runtime::finish_reductions(size_t keep_in_flight) {
  // By count only, not as soon as one completes: gradient memory must not depend on timing.
  while (reduce_order_.size() > keep_in_flight) {
    const int f = reduce_order_.front();
    reduce_order_.erase(reduce_order_.begin());
    finish_reduction(f);
  }
}

void Runtime::on_backward_end() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  InternalOpGuard internal;
  final_callback_queued_ = false;
  rethrow_pending_error();
  // Units that did not receive every expected gradient (unused parameters, or parameters read
  // without taking part in the loss) are reduced now, in unit order on every rank.
  for (size_t u = 0; u < units_.size(); ++u) {
    bool needs = false;
    for (int f : units_[u].flat_params)
      needs |= flat_params_[f]->has_grad_buffer() && !flat_params_[f]->reduce_pending();
    if (needs) post_backward(static_cast<int>(u));
  }
  finish_reductions(0);
  update_sharded_grad_bytes();
  reshard_all();
  if (options_.broadcast_buffers()) broadcast_buffers();
  for (auto& unit : units_) {
    unit.counted = false;
    unit.expected_grads = unit.ready_grads = 0;
    unit.forward_seen = unit.prefetched = unit.backward_done = false;
  }
  for (auto& fp : flat_params_)
    for (auto& s : fp->slots()) s.used = s.got_grad = false;
  last_touched_ = -1;
  // The next iteration prefetches along this one's forward order.
  if (!forward_first_order_.empty()) previous_forward_order_ = std::move(forward_first_order_);
  forward_first_order_.clear();
  forward_post_order_.clear();
  backward_started_ = false;
  if (tracer_.enabled()) {
    std::vector<std::string> names;
    for (const auto& info : unit_infos_) names.push_back(info.name);
    last_trace_ = tracer_.finish_iteration(pg_->rank(), names);
  }
}

void Runtime::enable_trace(bool on) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  tracer_.enable(on);
}

IterationTrace Runtime::last_trace() const {
  std::lock_guard<std::recursive_mutex> lock(const_cast<Runtime*>(this)->mu_);
  return last_trace_;
}

void Runtime::update_sharded_grad_bytes() {
  int64_t bytes = 0;
  for (const auto& fp : flat_params_) bytes += fp->sharded_grad_bytes();
  memory_.set_sharded_grad_bytes(bytes);
}

void Runtime::reshard_all() {
  deferred_prefetch_ = -1;
  for (size_t u = 0; u < units_.size(); ++u) reshard(static_cast<int>(u));
}

void Runtime::broadcast_buffers() {
  if (pg_->size() == 1) return;
  for (auto& kv : buffers_) {
    at::Tensor b = kv.second;
    if (!b.defined() || b.numel() == 0) continue;
    const auto start = Tracer::Clock::now();
    if (b.is_contiguous()) {
      auto work = pg_->world()->broadcast(b, 0);
      tracer_.collective(TraceEvent::Kind::kReduce, -1, "broadcast " + kv.first, pg_->world()->name(), work);
      work->wait();
    } else {
      at::Tensor tmp = b.contiguous();
      auto work = pg_->world()->broadcast(tmp, 0);
      tracer_.collective(TraceEvent::Kind::kReduce, -1, "broadcast " + kv.first, pg_->world()->name(), work);
      work->wait();
      b.copy_(tmp);
    }
    tracer_.wait(-1, "broadcast buffers", start, Tracer::Clock::now());
  }
}

}  // namespace fsdp
