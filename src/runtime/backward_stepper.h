#pragma once
// BackwardStepper: the optimizer step in backward (FullyShardedModule::set_step_in_backward). Each
// FlatParameter's shard pieces are stepped as soon as their reduced gradients are in, while later
// reductions still run, and their gradients are then dropped so a later optimizer.step() skips
// them; either on backward's own thread or on a host thread of the stepper's own. See Notes
// [Step in backward] and [Step on its own thread] in docs/design.md.
#include <torch/torch.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "flat_param.h"
#include "fsdp/options.h"
#include "runtime/tracer.h"

namespace fsdp {

class BackwardStepper {
 public:
  BackwardStepper() = default;
  ~BackwardStepper();
  BackwardStepper(const BackwardStepper&) = delete;
  BackwardStepper& operator=(const BackwardStepper&) = delete;

  // `optimizer` (null: off) must hold every trainable piece, and (own thread) nothing else; checked here.
  void set(torch::optim::Optimizer* optimizer, StepThread thread,
           const std::vector<std::unique_ptr<FlatParam>>& flat_params);
  bool on() const { return optimizer_ != nullptr; }
  bool own_thread() const { return own_thread_; }
  // Steps `fp`'s pieces that have a gradient, once per backward, then drops those gradients. On the
  // own thread: queued, and that thread first lands fp's pending reduction (FlatParam::land_grads).
  void step(FlatParam& fp, const std::string& unit_name);
  // Waits until every queued step ran; rethrows the first that failed. The steps' trace spans go to `tracer`.
  void wait_all(Tracer& tracer);
  // Whether fp was stepped, or queued for a step, in this backward.
  bool stepped(const FlatParam& fp) const { return optimizer_ && claimed_.at(fp.id()); }
  // Whether some FlatParameter was stepped in this backward (after wait_all).
  bool stepped_any() const;
  // The backward is over: the next one steps every FlatParameter again.
  void end_backward();

 private:
  // The step itself, on whichever thread runs it; false if no piece of fp had a gradient.
  bool run_step(FlatParam& fp, const std::string& unit_name);
  void worker_loop();

  torch::optim::Optimizer* optimizer_ = nullptr;
  bool own_thread_ = false;
  // Per FlatParameter id, in this backward: stepped or queued (backward's thread), stepped (the
  // thread that stepped it; read after wait_all).
  std::vector<char> claimed_, stepped_;

  // Own thread: the queue of FlatParameters to step, guarded by mutex_.
  struct Job {
    FlatParam* fp;
    std::string unit_name;
  };
  struct Span {
    int unit;
    Tracer::Clock::time_point start, end;
  };
  std::mutex mutex_;  // the members below
  std::condition_variable wake_, idle_;
  std::deque<Job> jobs_;
  bool busy_ = false, stop_ = false;
  std::exception_ptr error_;
  std::vector<Span> spans_;
  std::thread worker_;
};

}  // namespace fsdp
