#include "runtime/backward_stepper.h"

#include <unordered_set>
#include <utility>

#include "fsdp/check.h"
#include "internal_op_guard.h"

namespace fsdp {

BackwardStepper::~BackwardStepper() {
  if (!worker_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  worker_.join();
}

void BackwardStepper::set(torch::optim::Optimizer* optimizer, StepThread thread,
                          const std::vector<std::unique_ptr<FlatParam>>& flat_params) {
  bool only_pieces = true, offloaded = false;  // held by the optimizer; CPU offload
  if (optimizer) {
    FSDP_CHECK(dynamic_cast<torch::optim::LBFGS*>(optimizer) == nullptr,
               "set_step_in_backward: LBFGS steps with a closure over the whole model and cannot step one unit "
               "at a time; call its step() after backward instead");
    std::unordered_set<const c10::TensorImpl*> held, pieces;
    for (const auto& group : optimizer->param_groups())
      for (const auto& p : group.params()) held.insert(p.unsafeGetTensorImpl());
    for (const auto& fp : flat_params) {
      offloaded = offloaded || fp->offloaded();
      for (const auto& s : fp->slots()) {
        if (!s.piece.defined()) continue;
        pieces.insert(s.piece.unsafeGetTensorImpl());
        FSDP_CHECK(thread != StepThread::kOwn || s.piece.is_cpu(),
                   "set_step_in_backward(..., StepThread::kOwn): the shard piece of parameter '", s.name, "' is on ",
                   s.piece.device(),
                   ", where the step is kernels queued in stream order from backward's thread; "
                   "the step's own thread is for shards in host memory (CPU training, or Options::offload). Use "
                   "StepThread::kAuto or kBackward");
        FSDP_CHECK(!s.piece.requires_grad() || held.count(s.piece.unsafeGetTensorImpl()),
                   "set_step_in_backward: the optimizer does not hold the shard piece of parameter '", s.name,
                   "', so it would never be stepped. Build the optimizer over FullyShardedModule::parameters()");
      }
    }
    for (const auto* impl : held) only_pieces = only_pieces && pieces.count(impl);
    FSDP_CHECK(thread != StepThread::kOwn || only_pieces,
               "set_step_in_backward(..., StepThread::kOwn): the optimizer holds a tensor that is not a shard piece "
               "of this module, whose gradient autograd may write while the step thread reads it. Give that "
               "tensor an optimizer of its own, or step on backward's thread (StepThread::kBackward)");
  }
  if (worker_.joinable()) {  // between backward passes the queue is empty; wait for a step that failed late
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [&] { return jobs_.empty() && !busy_; });
    error_ = nullptr;
    spans_.clear();
  }
  optimizer_ = optimizer;
  // Automatic: its own thread under CPU offload, where the step runs on the host while the device
  // computes; on backward's thread otherwise, where both would share the same cores.
  own_thread_ = optimizer && (thread == StepThread::kOwn || (thread == StepThread::kAuto && offloaded && only_pieces));
  claimed_.assign(flat_params.size(), 0);
  stepped_.assign(flat_params.size(), 0);
}

void BackwardStepper::step(FlatParam& fp, const std::string& unit_name) {
  if (!optimizer_ || claimed_.at(fp.id())) return;
  if (!own_thread_) {
    if (run_step(fp, unit_name)) claimed_[fp.id()] = stepped_[fp.id()] = 1;
    return;
  }
  claimed_[fp.id()] = 1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back({&fp, unit_name});
    if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
  }
  wake_.notify_one();
}

void BackwardStepper::wait_all(Tracer& tracer) {
  if (!worker_.joinable()) return;
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [&] { return jobs_.empty() && !busy_; });
    for (const Span& s : spans_) tracer.step(s.unit, s.start, s.end, "optimizer thread");
    spans_.clear();
    std::swap(error, error_);
  }
  if (error) std::rethrow_exception(error);
}

bool BackwardStepper::stepped_any() const {
  for (char s : stepped_)
    if (s) return true;
  return false;
}

void BackwardStepper::end_backward() {
  std::fill(claimed_.begin(), claimed_.end(), 0);
  std::fill(stepped_.begin(), stepped_.end(), 0);
}

bool BackwardStepper::run_step(FlatParam& fp, const std::string& unit_name) {
  std::unordered_set<const c10::TensorImpl*> mine;
  for (const auto& s : fp.slots())
    if (s.piece.defined() && s.piece.grad().defined()) mine.insert(s.piece.unsafeGetTensorImpl());
  if (mine.empty()) return false;  // no gradient reached this rank's pieces: nothing to step, as in local training
  // The optimizer steps only parameters that have a gradient: every other one's is set aside for
  // the call (usually none: stepped pieces have theirs dropped, unreduced ones have none yet).
  std::vector<std::pair<at::Tensor, at::Tensor>> aside;
  for (auto& group : optimizer_->param_groups())
    for (auto& p : group.params())
      if (p.grad().defined() && !mine.count(p.unsafeGetTensorImpl())) {
        aside.emplace_back(p, p.grad());
        p.mutable_grad().reset();
      }
  auto restore = [&] {
    for (auto& [p, g] : aside) p.mutable_grad() = g;
  };
  try {
    InternalOpGuard internal;
    optimizer_->step();
  } catch (const std::exception& e) {
    restore();
    FSDP_CHECK(false, "the optimizer step in backward of unit '", unit_name.empty() ? "<root>" : unit_name,
               "' failed: ", e.what());
  }
  restore();
  for (auto& s : fp.slots())
    if (s.piece.defined()) s.piece.mutable_grad().reset();
  return true;
}

void BackwardStepper::worker_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
    if (stop_) return;  // the module is going away: what is left of a failed backward is not stepped
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    busy_ = true;
    const bool skip = error_ != nullptr;  // a step failed: the rest of this backward is not stepped
    lock.unlock();
    std::exception_ptr error;
    bool stepped = false;
    Span span{job.fp->unit(), {}, {}};
    if (!skip) {
      try {
        // The reduction into the pieces' gradients (under CPU offload once its copy to the host
        // is in); backward's thread writes no piece gradient while this thread runs.
        job.fp->grad().land();
        span.start = Tracer::Clock::now();
        stepped = run_step(*job.fp, job.unit_name);
        span.end = Tracer::Clock::now();
      } catch (...) {
        error = std::current_exception();
      }
    }
    lock.lock();
    if (error && !error_) error_ = error;
    if (stepped) {
      stepped_[job.fp->id()] = 1;
      spans_.push_back(span);
    }
    busy_ = false;
    if (jobs_.empty()) idle_.notify_all();
  }
}

}  // namespace fsdp
