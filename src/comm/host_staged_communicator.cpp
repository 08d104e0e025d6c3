#include "comm/host_staged_communicator.h"

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "comm/communicator_work.h"
#include "fsdp/check.h"

namespace fsdp {
namespace {

at::Tensor pinned_like(const at::Tensor& t) {
  return at::empty({t.numel()}, at::TensorOptions().dtype(t.scalar_type()).pinned_memory(true));
}

// A 1-D tensor over t's memory with a version counter of its own: the copy back writes the
// parameters' storage without moving the counters autograd checks (as NCCL writing raw memory).
at::Tensor flat_alias(const at::Tensor& t) {
  return at::empty({0}, t.options()).set_(t.storage(), t.storage_offset(), {t.numel()}, {1});
}

bool debug_enabled() {
  static const bool on = std::getenv("FSDP_DEBUG_COMM") != nullptr;
  return on;
}

// Polls `event` (recorded or never recorded) until it has fired; false after `timeout`.
bool wait_for_event(const at::cuda::CUDAEvent& event, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!event.query()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return true;
}

// One collective: its device tensors, their host copies, and whether its result is back.
class StagedWork : public Work {
 public:
  StagedWork(c10::Device device, std::string what, std::chrono::milliseconds timeout)
      : device_(device), what_(std::move(what)), timeout_(timeout) {}
  ~StagedWork() override {
    // Dropped without wait(): the device tensors die with this handle, so the CPU waits for the
    // copy back rather than let the allocator hand its memory to other work.
    if (!waited_ && done_.isCreated()) done_.synchronize();
  }

  void wait() override {
    wait_copied_back();
    c10::cuda::CUDAGuard guard(device_);
    done_.block(c10::cuda::getCurrentCUDAStream(device_.index()));
    waited_ = true;
  }
  bool completed() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return finished_ && (!error_.empty() || done_.query());
  }
  WorkTiming timing() const override { return host_work_ ? host_work_->timing() : WorkTiming{}; }

  // Blocks until the copy back is queued and done_ recorded; rethrows the collective's error.
  void wait_copied_back() {
    std::unique_lock<std::mutex> lock(mu_);
    FSDP_CHECK(cv_.wait_for(lock, timeout_ + std::chrono::seconds(5), [&] { return finished_; }), what_,
               " did not complete within ", timeout_.count() / 1000.0,
               " s; a peer rank died, hangs or issued different collectives. Set FSDP_TIMEOUT_S to wait longer");
    FSDP_CHECK(error_.empty(), error_);
  }
  void finish(std::string error) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      error_ = std::move(error);
      finished_ = true;
    }
    cv_.notify_all();
  }

  c10::Device device_;
  std::string what_;
  std::chrono::milliseconds timeout_;
  std::vector<at::Tensor> keep_;   // every device tensor of the collective, alive until wait()
  at::Tensor dev_in_, host_in_;    // copied to the host before the CPU collective
  at::Tensor dev_out_, host_out_;  // copied back after it
  at::cuda::CUDAEvent ready_;      // the caller's stream at issue
  at::cuda::CUDAEvent done_;       // the copy back, on the copy-back stream
  WorkPtr after_;                  // the caller's CollectiveOptions::after
  WorkPtr host_work_;              // the CPU collective

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool finished_ = false;
  bool waited_ = false;
  std::string error_;
};

// Handed to the CPU communicator as its collective's `after`: its wait(), on that communicator's
// thread just before the collective runs, copies the input to the host.
class StageIn : public Work {
 public:
  StageIn(std::shared_ptr<StagedWork> work, c10::cuda::CUDAStream stream) : work_(std::move(work)), stream_(stream) {}
  void wait() override {
    StagedWork& w = *work_;
    c10::cuda::CUDAGuard guard(w.device_);
    if (w.after_) {
      if (auto* prior = dynamic_cast<StagedWork*>(w.after_.get())) {
        prior->wait_copied_back();
        prior->done_.block(stream_);
      } else {
        w.after_->wait();
      }
    }
    // The caller's stream at issue must have produced the input: polled on the CPU (bounded), so
    // a device that never gets there fails the collective instead of hanging this thread.
    FSDP_CHECK(wait_for_event(w.ready_, w.timeout_), w.what_, ": the device did not produce its input within ",
               w.timeout_.count() / 1000.0, " s of its issue");
    {
      c10::cuda::CUDAStreamGuard on(stream_);
      w.host_in_.copy_(w.dev_in_, /*non_blocking=*/true);
    }
    stream_.synchronize();
    if (debug_enabled()) std::fprintf(stderr, "[staged] %s: input on the host\n", w.what_.c_str());
    done_ = true;
    work_ = nullptr;
  }
  bool completed() const override { return done_; }

 private:
  std::shared_ptr<StagedWork> work_;
  c10::cuda::CUDAStream stream_;
  bool done_ = false;
};

class HostStagedCommunicator : public Communicator {
 public:
  HostStagedCommunicator(CommunicatorPtr host, c10::Device device, std::chrono::milliseconds timeout)
      : host_(std::move(host)),
        device_(device),
        timeout_(timeout),
        to_host_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index())),
        to_device_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index())) {
    worker_ = std::thread([this] { copy_back_loop(); });
  }
  ~HostStagedCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::string name() const override { return host_->name(); }
  c10::Device device() const override { return device_; }
  std::string transport() const override { return "host-staged " + host_->transport(); }
  int64_t scratch_bytes() const override { return host_->scratch_bytes(); }
  int64_t shared_memory_bytes() const override { return host_->shared_memory_bytes(); }

  WorkPtr all_gather_into(at::Tensor out, at::Tensor in, CollectiveOptions opts) override {
    check_args(out, "all_gather_into output");
    check_args(in, "all_gather_into input");
    return issue("all-gather", in, out, std::move(opts), [this](at::Tensor hin, at::Tensor hout, CollectiveOptions o) {
      return host_->all_gather_into(hout, hin, std::move(o));
    });
  }
  WorkPtr reduce_scatter(at::Tensor out, at::Tensor in, CollectiveOptions opts) override {
    check_args(out, "reduce_scatter output");
    check_args(in, "reduce_scatter input");
    return issue("reduce-scatter", in, out, std::move(opts),
                 [this](at::Tensor hin, at::Tensor hout, CollectiveOptions o) {
                   return host_->reduce_scatter(hout, hin, std::move(o));
                 });
  }
  WorkPtr all_reduce(at::Tensor t, CollectiveOptions opts) override {
    check_args(t, "all_reduce tensor");
    return issue("all-reduce", t, t, std::move(opts),
                 [this](at::Tensor h, at::Tensor, CollectiveOptions o) { return host_->all_reduce(h, std::move(o)); });
  }
  bool has_all_to_all() const override { return host_->has_all_to_all(); }
  WorkPtr all_to_all_into(at::Tensor out, at::Tensor in, CollectiveOptions opts) override {
    check_args(out, "all_to_all_into output");
    check_args(in, "all_to_all_into input");
    return issue("all-to-all", in, out, std::move(opts), [this](at::Tensor hin, at::Tensor hout, CollectiveOptions o) {
      return host_->all_to_all_into(hout, hin, std::move(o));
    });
  }
  WorkPtr broadcast(at::Tensor t, int root, CollectiveOptions opts) override {
    check_args(t, "broadcast tensor");
    return issue("broadcast", t, t, std::move(opts), [this, root](at::Tensor h, at::Tensor, CollectiveOptions o) {
      return host_->broadcast(h, root, std::move(o));
    });
  }
  void barrier() override { host_->barrier(); }
  WorkPtr shutdown() override { return host_->shutdown(); }

 private:
  void check_args(const at::Tensor& t, const char* what) const {
    FSDP_CHECK(t.defined() && t.device() == device_ && t.is_contiguous(), name(), ": the ", what,
               " must be a contiguous tensor on ", device_, " (got ",
               t.defined() ? t.device().str() : std::string("an undefined tensor"), ")");
  }

  using Run = std::function<WorkPtr(at::Tensor host_in, at::Tensor host_out, CollectiveOptions)>;
  WorkPtr issue(const char* what, at::Tensor in, at::Tensor out, CollectiveOptions opts, const Run& run) {
    c10::cuda::CUDAGuard guard(device_);
    // Work of another kind may queue kernels on the caller's stream once it is done (a quantized
    // reduction's next stage): waited for here, on the caller's thread (blocking it), so the input
    // copy below follows those kernels and later waits on that work see them in stream order.
    if (opts.after && !dynamic_cast<StagedWork*>(opts.after.get())) {
      opts.after->wait();
      opts.after = nullptr;
    }
    CommunicatorWork own_work;
    // Under one lock: the CPU collectives are issued, and copied back, in the caller's order.
    std::lock_guard<std::mutex> lock(mu_);
    auto w = std::make_shared<StagedWork>(
        device_, std::string(what) + " #" + std::to_string(issued_++) + " on " + name(), timeout_);
    if (debug_enabled()) std::fprintf(stderr, "[staged] %s: issued\n", w->what_.c_str());
    w->keep_ = {in, out};
    w->dev_in_ = in.view({-1});
    w->dev_out_ = flat_alias(out);
    w->host_in_ = pinned_like(in);
    w->host_out_ = in.is_same(out) ? w->host_in_ : pinned_like(out);
    w->ready_.record(c10::cuda::getCurrentCUDAStream(device_.index()));
    w->after_ = std::move(opts.after);
    opts.after = std::make_shared<StageIn>(w, to_host_);
    w->host_work_ = run(w->host_in_, w->host_out_, std::move(opts));
    pending_.push_back(w);
    cv_.notify_all();
    return w;
  }

  // The worker: as each CPU collective completes (in issue order), queues its result's copy to
  // the device and records the completion event.
  void copy_back_loop() {
    // Every tensor operation of this thread is the communicator's own (a caller may wait for this
    // copy while holding locks that the model's operations take).
    CommunicatorWork own_work;
    at::NoGradGuard no_grad;
    for (;;) {
      std::shared_ptr<StagedWork> w;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
        if (pending_.empty()) return;
        w = std::move(pending_.front());
        pending_.pop_front();
      }
      try {
        w->host_work_->wait();
        c10::cuda::CUDAGuard guard(device_);
        c10::cuda::CUDAStreamGuard on(to_device_);
        w->dev_out_.copy_(w->host_out_, /*non_blocking=*/true);
        w->done_.record(to_device_);
        if (debug_enabled()) std::fprintf(stderr, "[staged] %s: copy back queued\n", w->what_.c_str());
        w->finish("");
      } catch (const std::exception& e) {
        w->finish(e.what());
      }
    }
  }

  CommunicatorPtr host_;
  c10::Device device_;
  std::chrono::milliseconds timeout_;
  int64_t issued_ = 0;  // collectives issued, under mu_ (names them)
  c10::cuda::CUDAStream to_host_, to_device_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<StagedWork>> pending_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace

CommunicatorPtr make_host_staged_communicator(CommunicatorPtr host, c10::Device device,
                                              std::chrono::milliseconds timeout) {
  FSDP_CHECK(host != nullptr && host->device().is_cpu(), "internal: a host-staged communicator needs a CPU one");
  FSDP_CHECK(device.is_cuda() && device.has_index(), host->name(),
             ": a host-staged communicator needs a CUDA device with an index (got ", device, ")");
  return std::make_shared<HostStagedCommunicator>(std::move(host), device, timeout);
}

}  // namespace fsdp
