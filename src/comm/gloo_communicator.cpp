#include "comm/gloo_communicator.h"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/context.h>
#include <gloo/math.h>
#include <gloo/types.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <cstdio>
#include <cstdlib>

#include "fsdp/check.h"

namespace fsdp {
namespace {

// Slot prefix for our ring reduce-scatter; gloo's own collectives use 0x01..0x08.
constexpr uint8_t kReduceScatterSlotPrefix = 0x10;
// Tags chosen by the communicator itself have the top bit set so they never collide with
// explicit tags, which must stay below 2^31.
constexpr uint32_t kAutoTagBit = 0x80000000u;
constexpr uint32_t kTagStride = 64;

class GlooWork : public Work {
 public:
  void wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    if (!error_.empty()) throw Error(error_);
  }
  bool completed() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  WorkTiming timing() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return timing_;
  }
  void started() {
    std::lock_guard<std::mutex> lock(mu_);
    timing_.start = std::chrono::steady_clock::now();
  }
  void finish(std::string error) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      timing_.end = std::chrono::steady_clock::now();
      if (timing_.start.time_since_epoch().count() == 0) timing_.start = timing_.end;
      done_ = true;
      error_ = std::move(error);
    }
    cv_.notify_all();
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
  WorkTiming timing_;
};

void bf16_sum(void* c, const void* a, const void* b, size_t n) {
  auto* out = static_cast<c10::BFloat16*>(c);
  auto* x = static_cast<const c10::BFloat16*>(a);
  auto* y = static_cast<const c10::BFloat16*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = c10::BFloat16(float(x[i]) + float(y[i]));
}

gloo::AllreduceOptions::Func sum_function(at::ScalarType type) {
  using F = void (*)(void*, const void*, const void*, size_t);
  switch (type) {
    case at::kFloat: return static_cast<F>(&gloo::sum<float>);
    case at::kDouble: return static_cast<F>(&gloo::sum<double>);
    case at::kHalf: return static_cast<F>(&gloo::sum<gloo::float16>);
    case at::kBFloat16: return &bf16_sum;
    case at::kInt: return static_cast<F>(&gloo::sum<int32_t>);
    case at::kLong: return static_cast<F>(&gloo::sum<int64_t>);
    case at::kByte: return static_cast<F>(&gloo::sum<uint8_t>);
    default: FSDP_FAIL("all_reduce: dtype ", type, " is not supported by the Gloo communicator");
  }
}

void check_dense_cpu(const at::Tensor& t, const char* op, const char* what) {
  FSDP_CHECK(t.defined(), op, ": ", what, " is undefined");
  FSDP_CHECK(t.device().is_cpu(), op, ": ", what, " is on ", t.device(),
             "; the Gloo communicator works on CPU tensors");
  FSDP_CHECK(t.is_contiguous(), op, ": ", what, " must be contiguous");
}

class GlooCommunicator : public Communicator, public std::enable_shared_from_this<GlooCommunicator> {
 public:
  GlooCommunicator(std::shared_ptr<gloo::Context> ctx, std::string name, std::chrono::milliseconds timeout)
      : ctx_(std::move(ctx)), name_(std::move(name)), timeout_(timeout) {
    worker_ = std::thread([this] { run(); });
  }
  ~GlooCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  int rank() const override { return ctx_->rank; }
  int64_t scratch_bytes() const override { return scratch_bytes_; }
  int size() const override { return ctx_->size; }
  std::string name() const override { return name_; }

  WorkPtr all_gather_into(at::Tensor out, at::Tensor in, CollectiveOptions opts) override {
    check_dense_cpu(out, "all_gather_into", "output");
    check_dense_cpu(in, "all_gather_into", "input");
    FSDP_CHECK(out.scalar_type() == in.scalar_type(), "all_gather_into: output dtype ", out.scalar_type(),
               " differs from input dtype ", in.scalar_type());
    FSDP_CHECK(out.numel() == in.numel() * size(), "all_gather_into: output has ", out.numel(),
               " elements, expected world size ", size(), " x input ", in.numel());
    const uint32_t tag = resolve_tag(opts);
    return enqueue("all_gather_into", [this, out, in, tag] {
      if (size() == 1) {
        out.copy_(in);
        return;
      }
      gloo::AllgatherOptions o(ctx_);
      o.setInput(static_cast<uint8_t*>(in.data_ptr()), in.nbytes());
      o.setOutput(static_cast<uint8_t*>(out.data_ptr()), out.nbytes());
      o.setTag(tag);
      o.setTimeout(timeout_);
      gloo::allgather(o);
    });
  }

  WorkPtr reduce_scatter(at::Tensor out, at::Tensor in, CollectiveOptions opts) override {
    check_dense_cpu(out, "reduce_scatter", "output");
    check_dense_cpu(in, "reduce_scatter", "input");
    FSDP_CHECK(out.scalar_type() == in.scalar_type(), "reduce_scatter: output dtype ", out.scalar_type(),
               " differs from input dtype ", in.scalar_type());
    FSDP_CHECK(in.numel() == out.numel() * size(), "reduce_scatter: input has ", in.numel(),
               " elements, expected world size ", size(), " x output ", out.numel());
    const uint32_t tag = resolve_tag(opts);
    return enqueue("reduce_scatter", [this, out, in, tag] { ring_reduce_scatter(out, in, tag); });
  }

  WorkPtr all_reduce(at::Tensor t, CollectiveOptions opts) override {
    check_dense_cpu(t, "all_reduce", "tensor");
    auto fn = sum_function(t.scalar_type());
    const uint32_t tag = resolve_tag(opts);
    return enqueue("all_reduce", [this, t, tag, fn] {
      if (size() == 1 || t.numel() == 0) return;
      // Gloo splits the buffer into segments by element size, so hand it a pointer type of the
      // element's width; the reduce function interprets the elements as the real dtype.
      switch (t.element_size()) {
        case 1: run_allreduce(static_cast<uint8_t*>(t.data_ptr()), t.numel(), fn, tag); break;
        case 2: run_allreduce(static_cast<uint16_t*>(t.data_ptr()), t.numel(), fn, tag); break;
        case 4: run_allreduce(static_cast<uint32_t*>(t.data_ptr()), t.numel(), fn, tag); break;
        case 8: run_allreduce(static_cast<uint64_t*>(t.data_ptr()), t.numel(), fn, tag); break;
        default: FSDP_FAIL("all_reduce: unsupported element size ", t.element_size());
      }
    });
  }

  template <typename T>
  void run_allreduce(T* ptr, int64_t n, const gloo::AllreduceOptions::Func& fn, uint32_t tag) {
    gloo::AllreduceOptions o(ctx_);
    o.setOutput(ptr, n);  // in place: output only (an input aliasing it would be a second buffer)
    o.setReduceFunction(fn);
    o.setTag(tag);
    o.setTimeout(timeout_);
    gloo::allreduce(o);
  }

  WorkPtr broadcast(at::Tensor t, int root, CollectiveOptions opts) override {
    check_dense_cpu(t, "broadcast", "tensor");
    FSDP_CHECK(root >= 0 && root < size(), "broadcast: root ", root, " is outside [0, ", size(), ")");
    const uint32_t tag = resolve_tag(opts);
    return enqueue("broadcast", [this, t, root, tag] {
      if (size() == 1 || t.numel() == 0) return;
      gloo::BroadcastOptions o(ctx_);
      o.setRoot(root);
      if (rank() == root) o.setInput(static_cast<uint8_t*>(t.data_ptr()), t.nbytes());
      o.setOutput(static_cast<uint8_t*>(t.data_ptr()), t.nbytes());
      o.setTag(tag);
      o.setTimeout(timeout_);
      gloo::broadcast(o);
    });
  }

  void barrier() override {
    const uint32_t tag = resolve_tag({});
    enqueue("barrier", [this, tag] {
      if (size() == 1) return;
      gloo::BarrierOptions o(ctx_);
      o.setTag(tag);
      o.setTimeout(timeout_);
      gloo::barrier(o);
    })->wait();
  }

 private:
  uint32_t resolve_tag(const CollectiveOptions& opts) {
    if (opts.tag != 0) {
      FSDP_CHECK((opts.tag & kAutoTagBit) == 0, "collective tag ", opts.tag, " must be below 2^31");
      return opts.tag;
    }
    // Spaced apart as a precaution against slot offsets derived from a tag; not known to be needed.
    return kAutoTagBit | ((next_tag_.fetch_add(1) * kTagStride) & ~kAutoTagBit);
  }

  // Ring reduce-scatter in place over `in`: in step s, rank r sends its partial sum of chunk
  // (r - 1 - s) mod W to r + 1 and adds the partial sum of chunk (r - 2 - s) mod W received from
  // r - 1. After W - 1 steps chunk r is complete on rank r. Traffic per rank: (W-1)/W of the
  // input, like a ring all-gather.
  //
  // Its receive ring (at most kDepth x kSegmentBytes, 2 MiB) is kept between calls (scratch_bytes()),
  // so reduce-scatters do not map fresh pages every time.
  //
  // Pipelined by segments: a segment is forwarded as soon as it is summed, and up to kDepth
  // receives are posted ahead into a small scratch ring, so the additions overlap the transfers
  // instead of alternating with them. Each chunk is summed into exactly once per rank (at one
  // step), and chunk r - 1 is only ever sent, so a segment in flight is never written to.
  // Messages between two ranks on one slot match receives in posting order, which is the order
  // the previous rank sends them (step by step, segment by segment).
  static constexpr int kDepth = 4;
  static constexpr size_t kSegmentBytes = size_t(512) << 10;

  void ring_reduce_scatter(const at::Tensor& out, const at::Tensor& in, uint32_t tag) {
    const int W = size(), r = rank();
    const int64_t n = out.numel();
    if (W == 1) {
      out.copy_(in);
      return;
    }
    if (n == 0) return;
    const int64_t elem = in.element_size();
    const int64_t seg = std::max<int64_t>(1, std::min<int64_t>(n, static_cast<int64_t>(kSegmentBytes) / elem));
    const int64_t segments = (n + seg - 1) / seg;
    const int64_t receives = segments * (W - 1);
    const int64_t depth = std::min<int64_t>(kDepth, receives);
    // Kept between calls: this thread runs one collective at a time.
    if (scratch_.numel() < depth * seg || scratch_.scalar_type() != in.scalar_type()) {
      scratch_ = at::Tensor();
      scratch_ = at::empty({depth * seg}, in.options());
      scratch_bytes_ = scratch_.nbytes();
    }
    at::Tensor flat = in.view({W * n});
    auto send_buf = ctx_->createUnboundBuffer(in.data_ptr(), in.nbytes());
    auto recv_buf = ctx_->createUnboundBuffer(scratch_.data_ptr(), scratch_.nbytes());
    const uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);
    const int next = (r + 1) % W, prev = (r + W - 1) % W;
    auto chunk_at = [&](int64_t step, int shift) { return ((r - shift - step) % W + W) % W; };
    auto seg_len = [&](int64_t k) { return std::min(seg, n - k * seg); };
    // Receive j is segment j % segments of step j / segments, into scratch slot j % depth.
    auto post_recv = [&](int64_t j) {
      recv_buf->recv(prev, slot, static_cast<size_t>((j % depth) * seg * elem), static_cast<size_t>(seg_len(j % segments) * elem));
    };
    int64_t sends = 0;
    auto send_segment = [&](int chunk, int64_t k) {
      send_buf->send(next, slot, static_cast<size_t>((chunk * n + k * seg) * elem), static_cast<size_t>(seg_len(k) * elem));
      ++sends;
    };
    for (int64_t j = 0; j < depth; ++j) post_recv(j);
    for (int64_t k = 0; k < segments; ++k) send_segment(chunk_at(0, 1), k);
    for (int64_t j = 0; j < receives; ++j) {
      FSDP_CHECK(recv_buf->waitRecv(nullptr, timeout_), "reduce_scatter receive was aborted");
      const int64_t step = j / segments, k = j % segments, len = seg_len(k);
      const int chunk = chunk_at(step, 2);
      flat.narrow(0, chunk * n + k * seg, len).add_(scratch_.narrow(0, (j % depth) * seg, len));
      if (j + depth < receives) post_recv(j + depth);
      if (step + 1 < W - 1) send_segment(chunk, k);  // this partial sum is the next step's send
    }
    for (int64_t i = 0; i < sends; ++i)
      FSDP_CHECK(send_buf->waitSend(nullptr, timeout_), "reduce_scatter send was aborted");
    out.copy_(flat.narrow(0, r * n, n));
  }

  WorkPtr enqueue(const char* op, std::function<void()> body) {
    auto work = std::make_shared<GlooWork>();
    static const bool debug = std::getenv("FSDP_DEBUG_COMM") != nullptr;
    if (debug) std::fprintf(stderr, "[comm] %s #%u %s\n", name_.c_str(), debug_count_++, op);
    {
      std::lock_guard<std::mutex> lock(mu_);
      // The job drops its tensors before it reports completion: once wait() returns, the caller
      // holds the only references (a buffer freed after the wait is free, not still in use here).
      queue_.push_back([this, op, body = std::move(body), work]() mutable {
        if (!failure_.empty()) {
          body = nullptr;
          work->finish(compose(op, " on ", name_, " was not run: an earlier collective failed: ", failure_));
          return;
        }
        try {
          at::NoGradGuard no_grad;
          work->started();
          body();
          body = nullptr;
          work->finish("");
        } catch (const std::exception& e) {
          body = nullptr;
          failure_ = e.what();
          work->finish(compose(
              "collective ", op, " on ", name_, " failed on rank ", rank(), " of ", size(), ": ", e.what(),
              ". A peer rank has probably died, issued a different collective (ranks diverged), or did "
              "not arrive within the timeout (", timeout_.count() / 1000.0,
              " s; set ProcessGroupOptions::timeout or FSDP_TIMEOUT_S)."));
        }
      });
    }
    cv_.notify_one();
    return work;
  }

  template <typename... P>
  static std::string compose(const P&... p) { return detail::compose(p...); }

  void run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job();
    }
  }

  std::shared_ptr<gloo::Context> ctx_;
  std::string name_;
  std::chrono::milliseconds timeout_;
  std::atomic<uint32_t> next_tag_{1};
  uint32_t debug_count_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::string failure_;  // only touched by the worker thread
  at::Tensor scratch_;   // reduce-scatter receive ring, only touched by the worker thread
  std::atomic<int64_t> scratch_bytes_{0};  // its size, for memory_stats() on other threads
  std::thread worker_;
};

}  // namespace

CommunicatorPtr make_gloo_communicator(std::shared_ptr<gloo::Context> context, std::string name,
                                       std::chrono::milliseconds timeout) {
  return std::make_shared<GlooCommunicator>(std::move(context), std::move(name), timeout);
}

}  // namespace fsdp
