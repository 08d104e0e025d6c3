#pragma once
// What every CPU communicator shares: collectives run in issue order on one worker thread that the
// communicator owns, each returning a Work that completes (or fails) when its job has run. After a
// failure the queue is poisoned: later jobs report that an earlier collective failed instead of
// running against peers that are in an unknown state.
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <torch/torch.h>

#include "fsdp/comm.h"

namespace fsdp {

// Argument checks shared by the CPU communicators; `kind` names the communicator in the message.
void check_dense_cpu(const at::Tensor& t, const char* op, const char* what, const char* kind);
void check_all_gather_args(const at::Tensor& out, const at::Tensor& in, int size, const char* kind);
void check_reduce_scatter_args(const at::Tensor& out, const at::Tensor& in, int size, const char* kind);

class QueuedWork : public Work {
 public:
  void wait() override;
  bool completed() const override;
  WorkTiming timing() const override;
  void started();
  void finish(std::string error);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
  WorkTiming timing_;
};

class CollectiveQueue {
 public:
  // `name` names the communicator in errors (with this rank's place in it); on_start / on_stop run
  // on the worker thread before its first and after its last job (e.g. to hold a liveness lock
  // for as long as the thread lives).
  CollectiveQueue(std::string name, int rank, int size, std::chrono::milliseconds timeout,
                  std::function<void()> on_start = {}, std::function<void()> on_stop = {});
  ~CollectiveQueue();  // runs the jobs already queued, then joins the worker
  CollectiveQueue(const CollectiveQueue&) = delete;
  CollectiveQueue& operator=(const CollectiveQueue&) = delete;

  // The job runs under NoGradGuard and drops its captures before the Work completes, so once
  // wait() returns the caller holds the only references to the tensors it passed.
  // With `after`, the job first waits for that work (see CollectiveOptions::after).
  WorkPtr enqueue(const char* op, std::function<void()> body, WorkPtr after = nullptr);

 private:
  void run();
  std::string name_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::function<void()> on_start_, on_stop_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::string failure_;  // only touched by the worker thread
  uint32_t debug_count_ = 0;
  std::thread worker_;
};

}  // namespace fsdp
