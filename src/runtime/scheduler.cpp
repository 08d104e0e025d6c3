#include "runtime/scheduler.h"

#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>

#include "internal_op_guard.h"
#include "runtime/checkpointed_forward.h"

namespace fsdp {

Scheduler::Scheduler(std::vector<Unit>& units, const Options& options, int rank, Tracer& tracer,
                     GradientReducer& reducer)
    : units_(units), options_(options), rank_(rank), tracer_(tracer), reducer_(reducer) {}

bool Scheduler::in_backward() { return torch::autograd::get_current_graph_task_exec_info() != nullptr; }

void Scheduler::use(int u) {
  InternalOpGuard internal;
  const bool backward = in_backward();
  if (backward) {
    read_in_backward_.resize(units_.size(), 0);
    read_in_backward_[u] = 1;
  }
  // Another operator of the current unit. The first operator of backward takes the full path
  // even in the unit forward ended in, so that backward prefetching starts there.
  if (u == last_used_ && (backward_started_ || !backward)) {
    if (units_[u].needs_unshard()) unshard(u, backward ? "on demand backward" : "on demand");
    units_[u].wait_for_unshard();
    return;
  }
  if (backward) {
    pre_backward(u);
  } else {
    pre_forward(u);
  }
}

void Scheduler::pre_forward(int u) {
  tracer_.leave_compute();
  // Another forward reached a non-root unit after the kept one: it was not the last after all.
  if (kept_for_backward_ >= 0 && u != kept_for_backward_ && !units_[u].is_root()) reshard(kept_for_backward_);
  reshard_units_left(u, /*forward=*/true);
  Unit& unit = units_[u];
  // A Checkpointed forward runs without grad but has a backward (Note [Activation checkpointing]).
  const bool with_grad = detail::forward_with_grad();
  if (with_grad) {
    if (!unit.forward_seen()) forward_first_order_.push_back(u);
    forward_last_order_.erase(std::remove(forward_last_order_.begin(), forward_last_order_.end(), u),
                              forward_last_order_.end());
    forward_last_order_.push_back(u);
  }
  unit.mark_used(/*in_backward=*/false, with_grad);
  note_forward_entry(u);
  last_used_ = u;
  if (held_back_prefetch_ == u) held_back_prefetch_ = -1;
  if (unit.needs_unshard()) unshard(u, "on demand");
  // Issue the next units' gathers before waiting for this one, so they overlap this unit's compute.
  // Only units this forward has not run yet: one used again later (e.g. the root's output layer)
  // must not re-gather what already ran.
  if (options_.forward_prefetch()) {
    int next = u;
    for (int d = 0; d < prefetch_depth(); ++d) {
      next = next_in(previous_forward_order_, next);
      if (next < 0 || units_[next].forward_seen() || ran_in_forward_[next]) break;
      if (!prefetch(next, "prefetch forward")) break;
    }
  }
  unit.wait_for_unshard();
  tracer_.enter_compute(u);
}

void Scheduler::pre_backward(int u) {
  begin_backward();
  tracer_.leave_compute();
  reshard_units_left(u, /*forward=*/false);
  reshard_lingering_left(u);
  Unit& unit = units_[u];
  unit.mark_used(/*in_backward=*/true, at::GradMode::is_enabled());
  last_used_ = u;
  if (kept_for_backward_ == u) kept_for_backward_ = -1;
  if (held_back_prefetch_ == u) held_back_prefetch_ = -1;
  if (unit.needs_unshard()) unshard(u, "on demand backward");
  if (options_.backward_prefetch() == BackwardPrefetch::kBackwardPre) {
    int next = u;
    for (int d = 0; d < prefetch_depth(); ++d) {
      next = next_pending_in_backward(next);
      if (next >= 0 && next == kept_for_backward_) next = next_pending_in_backward(next);  // that one is gathered
      if (next < 0 || !prefetch(next, "prefetch backward pre")) break;
    }
  }
  unit.wait_for_unshard();
  tracer_.enter_compute(u);
}

void Scheduler::note_forward_entry(int u) {
  ran_in_forward_.resize(units_.size(), 0);
  // The pass begins at the first non-root unit of the previous forward (the root is entered again
  // between its children); a forward without grad has no backward to end it.
  int start = -1;
  for (int v : previous_forward_order_)
    if (!units_[v].is_root()) {
      start = v;
      break;
    }
  if (u == start && ran_in_forward_[u]) std::fill(ran_in_forward_.begin(), ran_in_forward_.end(), 0);
  ran_in_forward_[u] = 1;
}

void Scheduler::reshard_units_left(int u, bool forward) {
  // Units other than u's ancestors (whose forward may still be running), the root (kept until
  // backward, paper 3.3.1), units gathered ahead of use, in forward units this pass has not
  // entered yet (left unsharded by a backward with set_reshard_after_backward(false), or by an
  // explicit unshard, for this forward to use), and in such a backward the units it has finished
  // and those whose parameters are all frozen (no gradient ever finishes them).
  const auto& anc = units_[u].ancestors();
  for (int v = 1; v < static_cast<int>(units_.size()); ++v) {
    if (v == u || !units_[v].reshard_after_forward() || units_[v].prefetched() || !units_[v].is_unsharded()) continue;
    if (std::find(anc.begin(), anc.end(), v) != anc.end()) continue;
    if (forward && !(v < static_cast<int>(ran_in_forward_.size()) && ran_in_forward_[v])) continue;
    if (!forward && !reshard_after_backward_ && (units_[v].backward_done() || units_[v].all_frozen())) continue;
    leave_forward(v);
  }
}

void Scheduler::leave_forward(int u) {
  if (u == first_in_backward_ && units_[u].awaits_backward()) {
    units_[u].mark_prefetched();  // gathered for its backward: counted by the rate limiter
    kept_for_backward_ = u;
    return;
  }
  reshard(u);
}

void Scheduler::post_forward(int u) {
  if (!units_[u].reshard_after_forward() || in_backward()) return;
  InternalOpGuard internal;
  tracer_.leave_compute();
  leave_forward(u);
  if (last_used_ == u) last_used_ = -1;
}

void Scheduler::begin_backward() {
  if (backward_started_) return;
  backward_started_ = true;
  backward_order_.assign(forward_last_order_.rbegin(), forward_last_order_.rend());
  // The next forward keeps the first non-root unit of this order, unless a ReshardPolicy decides.
  first_in_backward_ = -1;
  if (!options_.reshard_after_forward_policy())
    for (int v : backward_order_)
      if (!units_[v].is_root()) {
        if (units_[v].reshard_after_forward()) first_in_backward_ = v;
        break;
      }
}

void Scheduler::reshard_lingering_left(int u) {
  const auto& anc = units_[u].ancestors();
  std::vector<int> keep;
  for (int v : lingering_) {
    if (v == u || std::find(anc.begin(), anc.end(), v) != anc.end())
      keep.push_back(v);  // still in its computation, or around it
    else
      reshard(v);
  }
  lingering_ = std::move(keep);
}

void Scheduler::post_backward(int u) {
  tracer_.leave_compute();
  units_[u].mark_backward_done();
  if (options_.sharding_strategy() != ShardingStrategy::kNoShard && reshard_after_backward_) {
    // Frozen parameters get no gradient, so "all gradients in" is not the end of their last use.
    if (units_[u].has_frozen_params() && in_backward())
      lingering_.push_back(u);
    else
      reshard(u);
  }
  if (last_used_ == u) last_used_ = -1;
  if (options_.backward_prefetch() == BackwardPrefetch::kBackwardPost && backward_started_)
    prefetch(next_pending_in_backward(u), "prefetch backward post");
  reducer_.reduce(u);
}

void Scheduler::finalize_backward(const std::vector<std::pair<std::string, at::Tensor>>& buffers) {
  // Units whose expected gradients did not all arrive (unused parameters, or parameters read
  // without taking part in the loss) are reduced now, in unit order on every rank.
  for (size_t u = 0; u < units_.size(); ++u)
    if (reducer_.has_unreduced(static_cast<int>(u))) post_backward(static_cast<int>(u));
  reducer_.finish_all();
  reducer_.update_sharded_grad_bytes();
  if (reshard_after_backward_) reshard_all();
  if (options_.broadcast_buffers() && reducer_.sync()) reducer_.broadcast_buffers(buffers);
  reducer_.end_backward();
  // Units this backward reached without reading them are not gathered for the next one.
  unread_in_backward_.assign(units_.size(), 0);
  read_in_backward_.resize(units_.size(), 0);
  for (int v : backward_order_) unread_in_backward_[v] = !read_in_backward_[v];
  std::fill(read_in_backward_.begin(), read_in_backward_.end(), 0);
  if (first_in_backward_ >= 0 && unread_in_backward_[first_in_backward_]) first_in_backward_ = -1;
  start_next_iteration();
}

void Scheduler::abandon_backward() {
  std::fill(read_in_backward_.begin(), read_in_backward_.end(), 0);
  reducer_.abandon_backward();
  reshard_all();
  start_next_iteration();
}

void Scheduler::end_backward_without_gradients() {
  std::fill(read_in_backward_.begin(), read_in_backward_.end(), 0);
  if (reshard_after_backward_) reshard_all();
  kept_for_backward_ = -1;
  lingering_.clear();
  last_used_ = -1;
  backward_started_ = false;
}

void Scheduler::start_next_iteration() {
  for (auto& unit : units_) {
    unit.drop_post_forward_shards();
    unit.reset();
    for (FlatParam* fp : unit.flat_params()) fp->note_backward_finished();
  }
  last_used_ = -1;
  kept_for_backward_ = -1;
  lingering_.clear();
  std::fill(ran_in_forward_.begin(), ran_in_forward_.end(), 0);
  // The next iteration prefetches along this one's forward order.
  if (!forward_first_order_.empty()) previous_forward_order_ = std::move(forward_first_order_);
  forward_first_order_.clear();
  forward_last_order_.clear();
  backward_started_ = false;
  if (tracer_.enabled()) {
    std::vector<std::string> names;
    for (const auto& unit : units_) names.push_back(unit.name());
    last_trace_ = tracer_.finish_iteration(rank_, names);
  }
}

void Scheduler::unshard_now(int u) {
  unshard(u, "on demand");
  units_[u].wait_for_unshard();
}

void Scheduler::unshard(int u, const char* why) {
  // The host casts offloaded shards unless it is stepping on a thread of its own (Note [Cast on the host]).
  const bool host_steps = in_backward() && reducer_.stepper().on() && reducer_.stepper().own_thread();
  if (units_[u].unshard(/*cast_on_host=*/options_.offload().cast_on_host() && !host_steps) && tracer_.enabled()) {
    tracer_.instant(TraceEvent::Kind::kUnshardIssued, u, why);
    tracer_.note_unsharded_units(unsharded_unit_count());
  }
}

int Scheduler::unsharded_unit_count() const {
  // Under SHARD_GRAD_OP units stay unsharded from their forward until backward by design; only
  // those gathered ahead of use count against the limit.
  int n = 0;
  for (int v = 1; v < static_cast<int>(units_.size()); ++v) {
    if (!units_[v].is_unsharded()) continue;
    if (!units_[v].reshard_after_forward() && units_[v].forward_seen() && !units_[v].prefetched()) continue;
    ++n;
  }
  return n;
}

int Scheduler::next_pending_in_backward(int u) const {
  auto it = std::find(backward_order_.begin(), backward_order_.end(), u);
  if (it == backward_order_.end()) return -1;
  for (++it; it != backward_order_.end(); ++it)
    if (!units_[*it].backward_done() &&
        !(*it < static_cast<int>(unread_in_backward_.size()) && unread_in_backward_[*it]))
      return *it;
  return -1;
}

int Scheduler::next_in(const std::vector<int>& order, int u) {
  auto it = std::find(order.begin(), order.end(), u);
  if (it == order.end() || ++it == order.end()) return -1;
  return *it;
}

int Scheduler::prefetch_depth() const { return options_.limit_all_gathers() ? options_.all_gather_limit() : 1; }

bool Scheduler::prefetch(int v, const char* why) {
  if (v < 0) return false;
  if (!units_[v].needs_unshard()) return true;
  if (backward_started_ && units_[v].backward_done()) return false;  // e.g. a held-back prefetch overtaken by events
  if (options_.limit_all_gathers() && unsharded_unit_count() >= options_.all_gather_limit()) {
    held_back_prefetch_ = v;  // issued by the next reshard that makes room
    held_back_why_ = why;
    return false;
  }
  if (held_back_prefetch_ == v) held_back_prefetch_ = -1;
  unshard(v, why);
  units_[v].mark_prefetched();
  return true;
}

void Scheduler::reshard(int u) {
  // A unit whose backward is still to come keeps its post-forward shards for that backward's gathers.
  if (kept_for_backward_ == u) kept_for_backward_ = -1;
  if (!units_[u].reshard(/*to_post_forward_shards=*/units_[u].awaits_backward())) return;
  tracer_.instant(TraceEvent::Kind::kReshard, u, "");
  if (held_back_prefetch_ >= 0) {
    const int v = held_back_prefetch_;
    held_back_prefetch_ = -1;
    prefetch(v, held_back_why_);
  }
}

void Scheduler::reshard_all() {
  held_back_prefetch_ = -1;
  for (size_t u = 0; u < units_.size(); ++u) reshard(static_cast<int>(u));
}

}  // namespace fsdp
