// The planner's schedule replay (schedule_sim.h). Each function mirrors the runtime function of the
// same name in src/runtime/scheduler.cpp, unit.cpp and gradient_reducer.cpp, on byte counts and
// modeled times instead of tensors and collectives.
#include "planner/schedule_sim.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <utility>
#include <vector>

#include "planner/sim_memory.h"
#include "planner/sim_orders.h"

namespace fsdp::planner {
namespace {

enum class State { kIdle, kForwardPrefetched, kForward, kBackwardPrefetched, kBackward, kBackwardDone };

class Replay {
 public:
  explicit Replay(const SimInput& in)
      : in_(in), n_(static_cast<int>(in.units.size())), state_(n_, State::kIdle), gather_end_(n_, 0.0) {
    for (auto* v : {&unsharded_, &pending_, &ran_, &partials_, &parts_, &gathering_parts_, &exact_held_})
      v->assign(n_, 0);
    grads_allocated_.assign(n_, {});
  }

  SimResult run() {
    plan_orders();
    if (in_.micro.grads_held)
      for (int u = 0; u < n_; ++u)
        if (first_segment_[u] >= 0) allocate_grads(u);
    if (in_.micro.partials_held)
      for (int u = 0; u < n_; ++u)
        if (first_segment_[u] >= 0) hold_partials(u);
    if (in_.micro.params_held)
      for (int u = 0; u < n_; ++u)
        if (first_segment_[u] >= 0) hold_unsharded(u);
    for (size_t i = 0; i < in_.segments.size(); ++i) {
      const SimSegment& s = in_.segments[i];
      if (enters_[i] && s.unit == last_used_) {
        if (needs_unshard(s.unit)) unshard(s.unit);
        wait_unshard(s.unit);
      } else if (enters_[i]) {
        pre_forward(s.unit);
      }
      compute(s.forward_s);
      mem_.add_acts(kept(s));
    }
    r_.forward_s = now_;
    for (int i = static_cast<int>(in_.segments.size()) - 1; i >= 0; --i) {
      const SimSegment& s = in_.segments[i];
      const int u = s.unit;
      for (const int from : recomputes_[i])  // a checkpointed forward around inner units, run again first
        for (int j = from; j <= i; ++j)
          if (enters_[j]) use_in_backward(in_.segments[j].unit);
      if (enters_[i] && s.backward_reads) use_in_backward(u);
      if (i == grads_alloc_segment_[u]) allocate_grads(u);
      for (size_t k = 0; k < flat_alloc_segment_[u].size(); ++k)
        if (i == flat_alloc_segment_[u][k]) allocate_flat(u, k);
      const int64_t recomputed = in_.units[u].checkpointed ? share(s, in_.units[u].full_activation_bytes) : 0;
      mem_.add_acts(recomputed);
      compute(s.backward_s);
      mem_.add_acts(-recomputed - kept(s));
      if (i == grads_in_segment_[u]) post_backward(u);
    }
    finish_reductions(0);
    if (!in_.micro.reduce)  // GradientReducer::end_backward without sync: every gradient folded
      for (int u = 0; u < n_; ++u)
        if (!grads_allocated_[u].empty()) {
          hold_exact(u);
          for (const SimFlat& f : in_.units[u].flats)
            if (f.exact_bytes > 0) compute(f.reduce_pack_s);
        }
    held_back_ = -1;
    lingering_.clear();
    if (in_.micro.reshard_after_backward)
      for (int u = 0; u < n_; ++u) reshard(u);
    for (int u = 0; u < n_; ++u) drop_parts(u);  // a unit without gradients never gathered them
    compute(in_.step_s);
    const SimMemory::Peaks peaks = mem_.peaks();
    r_.param_transient_peak = peaks.param;
    r_.grad_transient_peak = peaks.grad;
    r_.activation_peak = peaks.activation;
    r_.total_transient_peak = peaks.total;
    r_.pool_bytes = peaks.pool;
    r_.step_s = now_;
    r_.exposed_s = exposed_;
    r_.compute_s = compute_;
    return r_;
  }

 private:
  struct Pending {
    int64_t buffer_bytes, output_bytes;
    double end;
    bool output_kept = false;     // the output becomes the unit's partial sums
    std::vector<int64_t> packed;  // quantized: the collective's packed buffers
    double land_s = 0;            // quantized: the work on the compute thread once it lands
    double step_s = 0;            // step in backward, on the compute thread once it lands
  };

  static int64_t share(const SimSegment& s, int64_t bytes) {
    return std::llround(static_cast<double>(bytes) * s.activation_share);
  }
  int64_t kept(const SimSegment& s) const { return share(s, in_.units[s.unit].kept_activation_bytes); }

  // The units' first-use and last-use orders in forward: prefetch and backward follow them.
  void plan_orders() {
    SimOrders o = sim_orders(in_);
    enters_ = std::move(o.enters);
    recomputes_ = std::move(o.recomputes);
    first_segment_ = std::move(o.first_segment);
    grads_in_segment_ = std::move(o.grads_in_segment);
    grads_alloc_segment_ = std::move(o.grads_alloc_segment);
    flat_alloc_segment_ = std::move(o.flat_alloc_segment);
    previous_forward_order_ = std::move(o.forward_order);
    backward_order_ = std::move(o.backward_order);
    first_in_backward_ = o.first_in_backward;
    unread_in_backward_ = std::move(o.unread_in_backward);
  }

  // Deterministic training's exact sums of u's FlatParameters, allocated by a fold.
  void hold_exact(int u) {
    if (exact_held_[u]) return;
    exact_held_[u] = 1;
    for (const SimFlat& f : in_.units[u].flats) mem_.grad_buffer(f.exact_bytes, 1);
  }
  // u's gradient buffers: those held from earlier micro-batches (with its exact sums) or of unknown
  // arrival with its first gradient, the others with their own (allocate_flat).
  void allocate_grads(int u) {
    if (in_.micro.grads_held) hold_exact(u);
    if (!grads_allocated_[u].empty()) return;
    grads_allocated_[u].assign(in_.units[u].flats.size(), 0);
    for (size_t k = 0; k < grads_allocated_[u].size(); ++k)
      if (in_.micro.grads_held || flat_alloc_segment_[u][k] < 0) allocate_flat(u, k);
  }
  void allocate_flat(int u, size_t k) {
    if (!std::exchange(grads_allocated_[u][k], 1)) mem_.grad_buffer(in_.units[u].flats[k].grad_buffer_bytes, 1);
  }
  // A unit the previous micro-batch's backward left unsharded (its gathers landed long ago).
  void hold_unsharded(int u) {
    if (!gathers(u)) return;
    for (const SimFlat& f : in_.units[u].flats)
      if (f.separate_shard) mem_.param_buffer(f.unsharded_bytes, 1);
    unsharded_[u] = 1;
  }
  // FlatGrad's partial sums of replica-deferred micro-batches before this one: one output per reduction.
  void hold_partials(int u) {
    partials_[u] = 1;
    for (const SimFlat& f : in_.units[u].flats)
      if (f.requires_grad) mem_.grad_buffer(f.reduce_output_bytes, 1);
  }
  // The inputs of f's gather from its shard: the shard cast, or the packed shard and the gathered slots.
  void gather_inputs(const SimFlat& f, int n) {
    for (const int64_t b : {f.gather_input_bytes, f.packed_shard_bytes, f.packed_gathered_bytes})
      mem_.param_buffer(b, n);
  }
  double issue(double duration, double share, bool reduction, double weight) {
    ++r_.collectives;
    // The transport's copies take the compute thread's time (all exposed); the rest is on the links.
    // Waits on peers: the weight's share blocked; where ranks share cores, the rest parked.
    const double copying = std::min(1.0, share) * duration, wait = in_.wait_per_collective_s;
    const double blocked_weight = in_.waits_preempt ? std::min(1.0, weight) : weight, blocked = blocked_weight * wait;
    r_.wait_weight += blocked_weight;
    wait_until(now_ + std::max(0.0, copying + blocked));  // negative waits: at most the copy
    if (in_.waits_preempt && wait > blocked) now_ += wait - blocked;
    const double peers = now_ + in_.beside_wait_per_collective_s;  // the peers' arrival, beside the link
    if (copying >= duration) return peers;
    const int lane = in_.separate_lanes && reduction ? 1 : 0;
    return lane_free_[lane] = std::max(std::max(now_, lane_free_[lane]) + duration - copying, peers);
  }
  void wait_until(double t) {
    exposed_ += std::max(0.0, t - now_);
    now_ = std::max(now_, t);
  }
  void compute(double s) {
    now_ += s;
    compute_ += s;
  }
  bool gathers(int u) const {
    for (const SimFlat& f : in_.units[u].flats)
      if (f.separate_shard) return true;
    return false;
  }
  bool needs_unshard(int u) const { return gathers(u) && !unsharded_[u]; }
  bool prefetched(int u) const {
    return state_[u] == State::kForwardPrefetched || state_[u] == State::kBackwardPrefetched;
  }
  bool forward_seen(int u) const { return state_[u] != State::kIdle && state_[u] != State::kForwardPrefetched; }
  bool awaits_backward(int u) const { return state_[u] == State::kForward || state_[u] == State::kBackwardPrefetched; }
  bool is_ancestor(int v, int of) const {
    const auto& a = in_.units[of].ancestors;
    return std::find(a.begin(), a.end(), v) != a.end();
  }
  void mark_used(int u, bool in_backward) {
    State& s = state_[u];
    if (!in_backward && !forward_seen(u))
      s = State::kForward;
    else if (s == State::kForwardPrefetched)
      s = State::kIdle;
    else if (s == State::kForward || s == State::kBackwardPrefetched)
      s = in_backward ? State::kBackward : State::kForward;
  }
  void mark_prefetched(int u) {
    State& s = state_[u];
    if (s == State::kIdle)
      s = State::kForwardPrefetched;
    else if (s == State::kForward || s == State::kBackward)
      s = State::kBackwardPrefetched;
  }
  void unshard(int u) {
    if (!needs_unshard(u)) return;
    double end = now_;
    const bool from_parts = parts_[u] != 0;  // hpZ: gathered within the group, the parts as input
    for (const SimFlat& f : in_.units[u].flats) {
      if (!f.separate_shard) continue;
      const bool part = from_parts && f.post_forward_bytes > 0;
      mem_.param_buffer(f.unsharded_bytes, 1);
      if (!part) gather_inputs(f, 1);
      compute(f.issue_work_s + (part ? 0.0 : f.gather_pack_s));
      end = std::max(end, part ? issue(f.post_forward_gather_s, in_.hpz_cpu_share, false, in_.hpz_wait_weight)
                               : issue(f.gather_s, in_.shard_cpu_share, false, in_.shard_wait_weight));
    }
    parts_[u] = 0;
    gathering_parts_[u] = from_parts ? 1 : 0;
    unsharded_[u] = 1;
    pending_[u] = 1;
    gather_end_[u] = end;
    r_.max_unsharded_units = std::max(r_.max_unsharded_units, unsharded_count());
  }
  void wait_unshard(int u) {
    if (!pending_[u]) return;
    wait_until(gather_end_[u]);
    for (const SimFlat& f : in_.units[u].flats) {
      if (!f.separate_shard) continue;
      if (gathering_parts_[u] && f.post_forward_bytes > 0) {
        mem_.param_buffer(f.post_forward_bytes, -1);
      } else {
        compute(f.gather_unpack_s);
        gather_inputs(f, -1);
      }
    }
    pending_[u] = 0;
    gathering_parts_[u] = 0;
  }
  void drop_parts(int u) {
    if (!parts_[u]) return;
    for (const SimFlat& f : in_.units[u].flats)
      if (f.separate_shard) mem_.param_buffer(f.post_forward_bytes, -1);
    parts_[u] = 0;
  }
  // Unit::reshard (keeping hpZ parts for a backward still to come), then Scheduler::reshard's issue
  // of a held-back prefetch.
  void reshard(int u) {
    if (kept_for_backward_ == u) kept_for_backward_ = -1;
    if (!unsharded_[u]) return;
    const bool keep_parts = awaits_backward(u);
    wait_unshard(u);
    for (const SimFlat& f : in_.units[u].flats)
      if (f.separate_shard) {
        if (keep_parts && f.post_forward_bytes > 0) {
          mem_.param_buffer(f.post_forward_bytes, 1);
          parts_[u] = 1;
        }
        mem_.param_buffer(f.unsharded_bytes, -1);
      }
    unsharded_[u] = 0;
    if (state_[u] == State::kForwardPrefetched)
      state_[u] = State::kIdle;
    else if (state_[u] == State::kBackwardPrefetched)
      state_[u] = State::kForward;
    if (held_back_ >= 0) {
      const int v = held_back_;
      held_back_ = -1;
      prefetch(v);
    }
  }
  int unsharded_count() const {
    int count = 0;
    for (int v = 1; v < n_; ++v)
      count += unsharded_[v] && (in_.units[v].reshard_after_forward || !forward_seen(v) || prefetched(v)) ? 1 : 0;
    return count;
  }
  int depth() const { return in_.limit_all_gathers ? in_.all_gather_limit : 1; }

  bool prefetch(int v) {
    if (v < 0) return false;
    if (!needs_unshard(v)) return true;
    if (backward_started_ && state_[v] == State::kBackwardDone) return false;
    if (in_.limit_all_gathers && unsharded_count() >= in_.all_gather_limit) {
      held_back_ = v;
      return false;
    }
    if (held_back_ == v) held_back_ = -1;
    unshard(v);
    mark_prefetched(v);
    return true;
  }
  void leave_forward(int u) {
    if (u == first_in_backward_ && awaits_backward(u)) {
      mark_prefetched(u);
      kept_for_backward_ = u;
      return;
    }
    reshard(u);
  }
  void reshard_units_left(int u, bool forward) {
    for (int v = 1; v < n_; ++v) {
      if (v == u || !in_.units[v].reshard_after_forward || prefetched(v) || !unsharded_[v]) continue;
      if (is_ancestor(v, u)) continue;
      if (forward && !ran_[v]) continue;  // left unsharded for this forward to use
      if (!forward && !in_.micro.reshard_after_backward && state_[v] == State::kBackwardDone) continue;
      leave_forward(v);
    }
  }

  int next_in_forward(int u) const {
    auto it = std::find(previous_forward_order_.begin(), previous_forward_order_.end(), u);
    if (it == previous_forward_order_.end() || ++it == previous_forward_order_.end()) return -1;
    return *it;
  }
  int next_pending_in_backward(int u) const {
    auto it = std::find(backward_order_.begin(), backward_order_.end(), u);
    if (it == backward_order_.end()) return -1;
    for (++it; it != backward_order_.end(); ++it)
      if (state_[*it] != State::kBackwardDone && !unread_in_backward_[*it]) return *it;
    return -1;
  }

  void pre_forward(int u) {
    if (kept_for_backward_ >= 0 && u != kept_for_backward_ && u != 0) reshard(kept_for_backward_);
    reshard_units_left(u, true);
    mark_used(u, false);
    ran_[u] = 1;
    last_used_ = u;
    if (held_back_ == u) held_back_ = -1;
    if (needs_unshard(u)) unshard(u);
    if (in_.forward_prefetch) {
      int next = u;
      for (int d = 0; d < depth(); ++d) {
        next = next_in_forward(next);
        if (next < 0 || forward_seen(next) || ran_[next]) break;
        if (!prefetch(next)) break;
      }
    }
    wait_unshard(u);
  }

  // Scheduler::use in backward: another operator of the unit backward is in, else pre_backward.
  void use_in_backward(int u) {
    if (u != last_used_ || !backward_started_) return pre_backward(u);
    if (needs_unshard(u)) unshard(u);
    wait_unshard(u);
  }
  void pre_backward(int u) {
    backward_started_ = true;
    reshard_units_left(u, false);
    reshard_lingering_left(u);
    mark_used(u, true);
    last_used_ = u;
    if (kept_for_backward_ == u) kept_for_backward_ = -1;
    if (held_back_ == u) held_back_ = -1;
    if (needs_unshard(u)) unshard(u);
    if (in_.backward_prefetch == BackwardPrefetch::kBackwardPre) {
      int next = u;
      for (int d = 0; d < depth(); ++d) {
        next = next_pending_in_backward(next);
        if (next >= 0 && next == kept_for_backward_) next = next_pending_in_backward(next);
        if (next < 0 || !prefetch(next)) break;
      }
    }
    wait_unshard(u);
  }

  // Frozen parameters get no gradient: a unit with any stays gathered until backward moves to a
  // unit that is neither it nor one of its ancestors (Note [Frozen parameters in backward]).
  bool has_frozen(int u) const {
    for (const SimFlat& f : in_.units[u].flats)
      if (f.separate_shard && !f.requires_grad) return true;
    return false;
  }
  void reshard_lingering_left(int u) {
    std::vector<int> keep;
    for (const int v : lingering_) {
      if (v == u || is_ancestor(v, u))
        keep.push_back(v);
      else
        reshard(v);
    }
    lingering_ = std::move(keep);
  }

  void post_backward(int u) {
    state_[u] = State::kBackwardDone;
    if (!in_.no_shard && in_.micro.reshard_after_backward) {
      if (has_frozen(u))
        lingering_.push_back(u);
      else
        reshard(u);
    }
    if (last_used_ == u) last_used_ = -1;
    if (in_.backward_prefetch == BackwardPrefetch::kBackwardPost) prefetch(next_pending_in_backward(u));
    if (in_.micro.reduce) reduce(u);
  }

  // GradientReducer::reduce: wait for the oldest reductions until fewer than k remain, then issue.
  void reduce(int u) {
    if (grads_allocated_[u].empty()) return;
    const size_t k = static_cast<size_t>(in_.reductions_in_flight);
    for (const SimFlat& f : in_.units[u].flats) {
      if (!f.requires_grad) continue;
      finish_reductions(k > 0 ? k - 1 : 0);
      mem_.grad_buffer(f.reduce_output_bytes, 1);
      compute(f.issue_work_s + f.reduce_pack_s);
      take_packed(f.reduce_packed, 1);
      std::vector<int64_t> held = f.reduce_packed;  // freed as the reduction lands
      if (f.exact_bytes > 0) {                      // the exact sums the reduction sends, folded now unless held
        if (!exact_held_[u]) mem_.grad_buffer(f.exact_bytes, 1);
        held.push_back(f.exact_bytes);
      }
      const double step_s = f.step_elements * in_.step_s_per_element;
      const bool replicas = f.replica_reduce_s > 0 || f.replica_land_s > 0;
      if (in_.micro.defer_replicas) {  // the shard group's sums only: the first become the partial sums
        const double end = issue(f.reduce_s - f.replica_reduce_s, in_.shard_cpu_share, true, in_.shard_wait_weight);
        reductions_.push_back(
            {f.grad_buffer_bytes, f.reduce_output_bytes, end, !partials_[u], held, f.reduce_land_s, 0});
      } else if (partials_[u]) {  // the reduce-scatter waited for, the partial sums added, then the all-reduce
        wait_until(issue(f.reduce_s - f.replica_reduce_s, in_.shard_cpu_share, true, in_.shard_wait_weight));
        compute(f.reduce_land_s + f.replica_pack_s);
        take_packed(held, -1);
        mem_.grad_buffer(f.reduce_output_bytes, -1);
        take_packed(f.replica_packed, 1);
        reductions_.push_back({f.grad_buffer_bytes, f.reduce_output_bytes,
                               issue(f.replica_reduce_s, in_.comm_cpu_share, true, in_.replica_wait_weight), false,
                               f.replica_packed, f.replica_land_s, step_s});
      } else {  // a chained replica all-reduce frees the reduce-scatter's packed buffers by the time it lands
        take_packed(f.replica_packed, 1);
        std::vector<int64_t> packed = held;
        packed.insert(packed.end(), f.replica_packed.begin(), f.replica_packed.end());
        // Chained: the reduce-scatter lands and the replicas' values are packed on the replica thread.
        const double lane_work = replicas ? f.reduce_land_s + f.replica_pack_s : 0.0;
        const double shard_part = f.reduce_s - f.replica_reduce_s, total = f.reduce_s + lane_work;
        const double copying = in_.shard_cpu_share * shard_part + in_.comm_cpu_share * (total - shard_part);
        const double weight = in_.shard_wait_weight + (replicas ? in_.replica_wait_weight : 0.0);
        reductions_.push_back({f.grad_buffer_bytes, f.reduce_output_bytes, issue(total, copying / total, true, weight),
                               false, std::move(packed), replicas ? f.replica_land_s : f.reduce_land_s, step_s});
      }
    }
    if (in_.micro.defer_replicas) partials_[u] = 1;
    exact_held_[u] = 0;
    finish_reductions(k);
  }
  // A quantized reduction's packed buffers, taken from (n = 1) or given back to (n = -1) the pool.
  void take_packed(const std::vector<int64_t>& buffers, int n) {
    for (const int64_t b : buffers) mem_.grad_buffer(b, n);
  }
  void finish_reductions(size_t keep) {
    while (reductions_.size() > keep) {
      const Pending& p = reductions_.front();
      wait_until(p.end);
      take_packed(p.packed, -1);
      mem_.grad_buffer(p.buffer_bytes, -1);
      if (!p.output_kept) mem_.grad_buffer(p.output_bytes, -1);
      const double after_s = p.land_s + p.step_s;
      reductions_.pop_front();
      compute(after_s);
    }
  }

  const SimInput& in_;
  int n_;
  std::vector<State> state_;
  std::vector<char> unsharded_, pending_, ran_;
  std::vector<std::vector<char>> grads_allocated_;  // per unit, per FlatParameter; none yet: empty
  std::vector<double> gather_end_;
  std::vector<char> partials_;                 // replica-deferred: the unit's partial sums held
  std::vector<char> parts_, gathering_parts_;  // hpZ: parts held; the pending gather reads them
  std::vector<int> lingering_;                 // done with backward, gathered for their frozen parameters
  std::vector<char> exact_held_;               // deterministic: the unit's exact sums held from a fold
  std::vector<int> first_segment_, grads_in_segment_, grads_alloc_segment_, previous_forward_order_, backward_order_;
  std::vector<std::vector<int>> flat_alloc_segment_;
  std::vector<char> unread_in_backward_;
  std::vector<char> enters_;                  // per stretch: it enters its unit
  std::vector<std::vector<int>> recomputes_;  // per stretch: where the forwards its backward recomputes begin
  int first_in_backward_ = -1, kept_for_backward_ = -1, held_back_ = -1, last_used_ = -1;
  bool backward_started_ = false;
  std::deque<Pending> reductions_;
  SimMemory mem_;
  double now_ = 0, compute_ = 0, exposed_ = 0;
  double lane_free_[2] = {0, 0};
  SimResult r_;
};

}  // namespace

SimResult simulate(const SimInput& input) { return Replay(input).run(); }

}  // namespace fsdp::planner
