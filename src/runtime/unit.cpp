#include "runtime/unit.h"

#include "flat_param_collectives.h"

namespace fsdp {

const char* to_string(TrainingState s) {
  switch (s) {
    case TrainingState::kIdle: return "idle";
    case TrainingState::kForwardPrefetched: return "forward prefetched";
    case TrainingState::kForward: return "forward";
    case TrainingState::kBackwardPrefetched: return "backward prefetched";
    case TrainingState::kBackward: return "backward";
    case TrainingState::kBackwardDone: return "backward done";
  }
  return "?";
}

Unit::Unit(int index, std::string name, int parent, std::vector<int> ancestors, std::vector<FlatParam*> flat_params,
           bool reshard_after_forward, Tracer* tracer)
    : index_(index),
      name_(std::move(name)),
      parent_(parent),
      ancestors_(std::move(ancestors)),
      flat_params_(std::move(flat_params)),
      reshard_after_forward_(reshard_after_forward && parent >= 0),
      tracer_(tracer) {}

bool Unit::prefetched() const {
  return state_ == TrainingState::kForwardPrefetched || state_ == TrainingState::kBackwardPrefetched;
}

bool Unit::forward_seen() const {
  return state_ != TrainingState::kIdle && state_ != TrainingState::kForwardPrefetched;
}

void Unit::mark_used(bool in_backward, bool grad_enabled) {
  if (!in_backward && grad_enabled && !forward_seen()) {
    state_ = TrainingState::kForward;
  } else if (state_ == TrainingState::kForwardPrefetched) {
    state_ = TrainingState::kIdle;  // used outside a forward with grad (e.g. evaluation)
  } else if (state_ == TrainingState::kForward || state_ == TrainingState::kBackwardPrefetched) {
    // Used by its backward, or (prefetched for backward) again by a forward.
    state_ = in_backward ? TrainingState::kBackward : TrainingState::kForward;
  }
}

void Unit::mark_prefetched() {
  if (state_ == TrainingState::kIdle)
    state_ = TrainingState::kForwardPrefetched;
  else if (state_ == TrainingState::kForward || state_ == TrainingState::kBackward)
    state_ = TrainingState::kBackwardPrefetched;
}

bool Unit::has_frozen_params() const {
  for (const FlatParam* fp : flat_params_)
    if (!fp->keep_unsharded() && !fp->requires_grad()) return true;
  return false;
}

bool Unit::all_frozen() const {
  bool any = false;
  for (const FlatParam* fp : flat_params_) {
    if (fp->keep_unsharded()) continue;
    if (fp->requires_grad()) return false;
    any = true;
  }
  return any;
}

bool Unit::is_unsharded() const {
  for (const FlatParam* fp : flat_params_)
    if (!fp->keep_unsharded() && fp->is_unsharded()) return true;
  return false;
}

bool Unit::needs_unshard() const {
  for (const FlatParam* fp : flat_params_)
    if (!fp->keep_unsharded() && (!fp->is_unsharded() || fp->unsharded_is_stale())) return true;
  return false;
}

bool Unit::unshard(bool cast_on_host) {
  bool issued = false;
  for (FlatParam* fp : flat_params_) {
    if (fp->keep_unsharded() || (fp->is_unsharded() && !fp->unsharded_is_stale())) continue;
    WorkPtr work = start_all_gather(*fp, cast_on_host);
    tracer_->collective(TraceEvent::Kind::kUnshard, index_, "all-gather", fp->gather_track(), work);
    issued = true;
  }
  return issued;
}

void Unit::wait_for_unshard(const char* what) {
  for (FlatParam* fp : flat_params_) {
    if (!fp->unshard_pending()) continue;
    const bool done = fp->gather_work()->completed();
    const auto start = Tracer::Clock::now();
    fp->wait_unshard();
    if (!done) tracer_->wait(index_, what, start, Tracer::Clock::now());
  }
}

bool Unit::reshard(bool to_post_forward_shards) {
  bool freed = false;
  for (FlatParam* fp : flat_params_) {
    if (fp->keep_unsharded() || !fp->is_unsharded()) continue;
    if (fp->unshard_pending() && !fp->gather_work()->completed()) {  // a prefetch nobody used
      const auto start = Tracer::Clock::now();
      fp->wait_unshard();
      tracer_->wait(index_, "all-gather (unused prefetch)", start, Tracer::Clock::now());
    }
    if (to_post_forward_shards)
      fp->reshard_to_post_forward_shard();
    else
      fp->reshard();
    freed = true;
  }
  // Clear "prefetched": a prefetch freed unused leaves the unit as it was before.
  if (state_ == TrainingState::kForwardPrefetched)
    state_ = TrainingState::kIdle;
  else if (state_ == TrainingState::kBackwardPrefetched)
    state_ = TrainingState::kForward;
  return freed;
}

void Unit::drop_post_forward_shards() {
  for (FlatParam* fp : flat_params_) fp->drop_post_forward_shard();
}

bool Unit::note_grad(bool every_param_expected, bool newly_used) {
  if (expected_grads_ < 0) {
    expected_grads_ = 0;
    for (const FlatParam* fp : flat_params_)
      for (const auto& sl : fp->slots())
        expected_grads_ += ((sl.used || every_param_expected) && sl.param.requires_grad());
  }
  if (newly_used && !every_param_expected) ++expected_grads_;  // reached without a forward read seen
  return ++ready_grads_ >= expected_grads_;
}

}  // namespace fsdp
