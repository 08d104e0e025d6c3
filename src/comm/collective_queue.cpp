#include "comm/collective_queue.h"

#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>

#include "fsdp/check.h"
#include "internal_op_guard.h"

namespace fsdp {

void check_dense_cpu(const at::Tensor& t, const char* op, const char* what, const char* kind) {
  FSDP_CHECK(t.defined(), op, ": ", what, " is undefined");
  FSDP_CHECK(t.device().is_cpu(), op, ": ", what, " is on ", t.device(), "; the ", kind,
             " communicator works on CPU tensors");
  FSDP_CHECK(t.is_contiguous(), op, ": ", what, " must be contiguous");
}

void check_all_gather_args(const at::Tensor& out, const at::Tensor& in, int size, const char* kind) {
  check_dense_cpu(out, "all_gather_into", "output", kind);
  check_dense_cpu(in, "all_gather_into", "input", kind);
  FSDP_CHECK(out.scalar_type() == in.scalar_type(), "all_gather_into: output dtype ", out.scalar_type(),
             " differs from input dtype ", in.scalar_type());
  FSDP_CHECK(out.numel() == in.numel() * size, "all_gather_into: output has ", out.numel(),
             " elements, expected world size ", size, " x input ", in.numel());
}

void check_reduce_scatter_args(const at::Tensor& out, const at::Tensor& in, int size, const char* kind) {
  check_dense_cpu(out, "reduce_scatter", "output", kind);
  check_dense_cpu(in, "reduce_scatter", "input", kind);
  FSDP_CHECK(out.scalar_type() == in.scalar_type(), "reduce_scatter: output dtype ", out.scalar_type(),
             " differs from input dtype ", in.scalar_type());
  FSDP_CHECK(in.numel() == out.numel() * size, "reduce_scatter: input has ", in.numel(),
             " elements, expected world size ", size, " x output ", out.numel());
}

void QueuedWork::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_; });
  if (!error_.empty()) throw Error(error_);
}

bool QueuedWork::completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

WorkTiming QueuedWork::timing() const {
  std::lock_guard<std::mutex> lock(mu_);
  return timing_;
}

void QueuedWork::started() {
  std::lock_guard<std::mutex> lock(mu_);
  timing_.start = std::chrono::steady_clock::now();
}

void QueuedWork::finish(std::string error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    timing_.end = std::chrono::steady_clock::now();
    if (timing_.start.time_since_epoch().count() == 0) timing_.start = timing_.end;
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

CollectiveQueue::CollectiveQueue(std::string name, int rank, int size, std::chrono::milliseconds timeout,
                                 std::function<void()> on_start, std::function<void()> on_stop)
    : name_(std::move(name)),
      rank_(rank),
      size_(size),
      timeout_(timeout),
      on_start_(std::move(on_start)),
      on_stop_(std::move(on_stop)) {
  worker_ = std::thread([this] { run(); });
}

CollectiveQueue::~CollectiveQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

WorkPtr CollectiveQueue::enqueue(const char* op, std::function<void()> body, WorkPtr after) {
  auto work = std::make_shared<QueuedWork>();
  static const bool debug = std::getenv("FSDP_DEBUG_COMM") != nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  if (debug) std::fprintf(stderr, "[comm] %s #%u %s\n", name_.c_str(), debug_count_++, op);
  queue_.push_back([this, op, body = std::move(body), after = std::move(after), work]() mutable {
    if (!failure_.empty()) {
      body = nullptr;
      after = nullptr;
      work->finish(detail::compose(op, " on ", name_, " was not run: an earlier collective failed: ", failure_));
      return;
    }
    try {
      at::NoGradGuard no_grad;
      InternalOpGuard internal;  // the op interception must not take our copies for parameter reads
      if (after) {
        try {
          after->wait();
        } catch (const std::exception& e) {
          FSDP_FAIL("the collective it depends on failed: ", e.what());
        }
        after = nullptr;
      }
      work->started();
      body();
      body = nullptr;
      work->finish("");
    } catch (const std::exception& e) {
      body = nullptr;
      after = nullptr;
      failure_ = e.what();
      work->finish(
          detail::compose("collective ", op, " on ", name_, " failed on rank ", rank_, " of ", size_, ": ", e.what(),
                          ". A peer rank has probably died, issued a different collective (ranks diverged), or did "
                          "not arrive within the timeout (",
                          timeout_.count() / 1000.0, " s; set ProcessGroupOptions::timeout or FSDP_TIMEOUT_S)."));
    }
  });
  cv_.notify_one();
  return work;
}

void CollectiveQueue::run() {
  if (on_start_) on_start_();
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) break;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job();
  }
  if (on_stop_) on_stop_();
}

}  // namespace fsdp
