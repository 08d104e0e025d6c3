#include "comm/gloo_communicator.h"

#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/context.h>
#include <gloo/math.h>
#include <gloo/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "comm/collective_queue.h"
#include "comm/gloo_algorithms.h"
#include "comm/stall_diagnosis.h"
#include "fsdp/check.h"

#if defined(__SANITIZE_THREAD__)
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
#endif

namespace fsdp {
namespace {

// A copy of an error's message that Gloo may have made on its event-loop thread (Note [Gloo
// errors under TSan]).
std::string message_of(const std::exception& e) {
#if defined(__SANITIZE_THREAD__)
  AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
#endif
  std::string message = e.what();
#if defined(__SANITIZE_THREAD__)
  AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
#endif
  return message;
}

// Runs a job of Gloo calls on the queue's thread; an error Gloo made is rethrown as an fsdp::Error
// made here.
void run_gloo_job(const std::function<void()>& body) {
  try {
    body();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(message_of(e));
  }
}

// The member watch (Note [Dead members]): a collective running this long is checked for dead
// members, and one still running this long after a member was found dead ends the process.
constexpr std::chrono::milliseconds kWatchEvery{200};
constexpr std::chrono::milliseconds kWatchGrace{2000};
// How long a collective waits on its peers before its member publishes it for the stall diagnosis.
constexpr std::chrono::milliseconds kStallAfter{1000};

// Slot prefixes for our own collectives and the fingerprint exchange; gloo's own collectives use 0x01..0x08.
constexpr uint8_t kReduceScatterSlotPrefix = 0x10;
constexpr uint8_t kFingerprintSlotPrefix = 0x11;
constexpr uint8_t kAllGatherSlotPrefix = 0x12;
constexpr uint8_t kAllToAllSlotPrefix = 0x13;
constexpr uint8_t kAllReduceScatterSlotPrefix = 0x14;  // our all-reduce's two phases
constexpr uint8_t kAllReduceGatherSlotPrefix = 0x15;
// Tags chosen by the communicator itself have the top bit set so they never collide with
// explicit tags, which must stay below 2^31.
constexpr uint32_t kAutoTagBit = 0x80000000u;
constexpr uint32_t kTagStride = 64;

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

class GlooCommunicator : public Communicator, public std::enable_shared_from_this<GlooCommunicator> {
 public:
  GlooCommunicator(std::shared_ptr<gloo::Context> ctx, std::string name, std::chrono::milliseconds timeout, bool check,
                   std::function<std::string()> exited, c10::intrusive_ptr<c10d::Store> store)
      : ctx_(std::move(ctx)),
        name_(std::move(name)),
        timeout_(timeout),
        check_(check),
        diagnosis_(check && store && ctx_->size > 1
                       ? std::make_unique<StallDiagnosis>(std::move(store), name_, ctx_->rank, ctx_->size, kStallAfter)
                       : nullptr),
        queue_(std::make_unique<CollectiveQueue>(name_, ctx_->rank, ctx_->size, timeout_)) {
    std::function<void()> stalled;
    if (diagnosis_)
      stalled = [d = diagnosis_.get()] {
        d->poll();
      };
    if (exited || stalled) queue_->watch(std::move(exited), std::move(stalled), kWatchEvery, kWatchGrace);
  }
  // The queue is declared last, so its worker finishes the queued jobs before the scratch and the
  // context go.
  ~GlooCommunicator() override { shutdown_on_destruction(*this, *queue_); }

  int rank() const override { return ctx_->rank; }
  int64_t scratch_bytes() const override { return scratch_bytes_; }
  int size() const override { return ctx_->size; }
  std::string name() const override { return name_; }
  std::string transport() const override { return "Gloo over TCP"; }

  WorkPtr all_gather_into(at::Tensor out, at::Tensor in, CollectiveOptions opts) override {
    check_all_gather_args(out, in, size(), "Gloo");
    return issue("all_gather_into", CollectiveKind::kAllGather, in, -1, opts, /*carries=*/true,
                 [this, out, in](const Issued& is) {
                   if (size() == 1) {
                     out.copy_(in);
                     return;
                   }
                   if (in.numel() == 0) return;
                   gloo_all_gather(*ctx_, out, in, is.slot(kAllGatherSlotPrefix), waiting(is));
                 });
  }

  WorkPtr reduce_scatter(at::Tensor out, at::Tensor in, CollectiveOptions opts) override {
    check_reduce_scatter_args(out, in, size(), "Gloo");
    return issue("reduce_scatter", CollectiveKind::kReduceScatter, in, -1, opts, /*carries=*/true,
                 [this, out, in](const Issued& is) {
                   gloo_reduce_scatter(*ctx_, out, in, is.slot(kReduceScatterSlotPrefix), scratch_, waiting(is));
                   if (scratch_.defined()) scratch_bytes_ = scratch_.nbytes();
                 });
  }

  bool has_all_to_all() const override { return true; }
  WorkPtr all_to_all_into(at::Tensor out, at::Tensor in, CollectiveOptions opts) override {
    check_all_to_all_args(out, in, size(), "Gloo");
    const auto* o = static_cast<const uint8_t*>(out.data_ptr());
    const auto* i = static_cast<const uint8_t*>(in.data_ptr());
    FSDP_CHECK(size() == 1 || in.numel() == 0 || o + out.nbytes() <= i || i + in.nbytes() <= o,
               "all_to_all_into: over Gloo the output must not overlap the input; pass a separate output tensor");
    return issue("all_to_all_into", CollectiveKind::kAllToAll, in, -1, opts, /*carries=*/true,
                 [this, out, in](const Issued& is) {
                   if (size() == 1 || in.numel() == 0) {
                     if (!out.is_same(in)) out.copy_(in);
                     return;
                   }
                   gloo_all_to_all(*ctx_, out, in, is.slot(kAllToAllSlotPrefix), waiting(is));
                 });
  }

  WorkPtr all_reduce(at::Tensor t, CollectiveOptions opts) override {
    check_dense_cpu(t, "all_reduce", "tensor", "Gloo");
    auto fn = sum_function(t.scalar_type());
    // A tensor that splits evenly over the members goes through our ring reduce-scatter and
    // all-gather, in place, which carry the fingerprint in their slots; any other through Gloo's
    // all-reduce (Note [Collective fingerprints]).
    const bool ours = size() > 1 && t.is_contiguous() && t.numel() > 0 && t.numel() % size() == 0;
    return issue(
        "all_reduce", CollectiveKind::kAllReduce, t, -1, opts, /*carries=*/ours, [this, t, fn, ours](const Issued& is) {
          if (size() == 1 || t.numel() == 0) return;
          if (ours) {
            const at::Tensor flat = t.view({t.numel()});
            const at::Tensor mine = flat.view({size(), -1})[rank()];
            gloo_reduce_scatter(*ctx_, mine, flat, is.slot(kAllReduceScatterSlotPrefix), scratch_, waiting(is));
            if (scratch_.defined()) scratch_bytes_ = scratch_.nbytes();
            gloo_all_gather(*ctx_, flat, mine, is.slot(kAllReduceGatherSlotPrefix), waiting(is));
            return;
          }
          const uint32_t tag = is.tag;
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
    check_dense_cpu(t, "broadcast", "tensor", "Gloo");
    FSDP_CHECK(root >= 0 && root < size(), "broadcast: root ", root, " is outside [0, ", size(), ")");
    return issue("broadcast", CollectiveKind::kBroadcast, t, root, opts, /*carries=*/false,
                 [this, t, root](const Issued& is) {
                   if (size() == 1 || t.numel() == 0) return;
                   gloo::BroadcastOptions o(ctx_);
                   o.setRoot(root);
                   if (rank() == root) o.setInput(static_cast<uint8_t*>(t.data_ptr()), t.nbytes());
                   o.setOutput(static_cast<uint8_t*>(t.data_ptr()), t.nbytes());
                   o.setTag(is.tag);
                   o.setTimeout(timeout_);
                   gloo::broadcast(o);
                 });
  }

  void barrier() override {
    issue("barrier", CollectiveKind::kBarrier, at::Tensor(), -1, {}, /*carries=*/false, [this](const Issued& is) {
      if (size() == 1) return;
      gloo::BarrierOptions o(ctx_);
      o.setTag(is.tag);
      o.setTimeout(timeout_);
      gloo::barrier(o);
    })->wait();
  }

  WorkPtr shutdown() override {
    std::lock_guard<std::mutex> issuing(issue_mu_);
    if (queue_->shut_down()) return queue_->enqueue_shutdown(nullptr);  // returns the first shutdown's work
    const uint32_t tag = resolve_tag({});
    auto x = post_fingerprint(CollectiveKind::kShutdown, at::Tensor(), 0, -1, "", tag, /*exchange=*/true);
    return queue_->enqueue_shutdown([this, x] { run_gloo_job([&] { check_fingerprint(*x); }); });
  }

 private:
  // What a collective's job gets: its tag, and the bits its data's slots carry of its fingerprint
  // (0 where the fingerprints are exchanged instead, or not checked).
  struct Issued {
    uint32_t tag = 0;
    uint64_t fingerprint_bits = 0;
    Fingerprint fingerprint;
    uint64_t slot(uint8_t prefix) const { return (uint64_t(prefix) << 56) | fingerprint_bits | tag; }
  };

  // Before Gloo's own algorithms, every member sends its fingerprint of the collective to every
  // other and compares what it receives with its own before any data moves: members out of step
  // fail at once, each naming both collectives, where the data exchange would wait for messages
  // that never come. The exchange is posted when the collective is issued, so it travels while
  // earlier collectives run; the worker only checks it. Our own algorithms exchange nothing: their
  // slots carry the fingerprint, so different collectives never pair, and the stall diagnosis
  // names them (Note [Collective fingerprints]).
  struct FingerprintExchange {
    Fingerprint mine;
    std::vector<Fingerprint> got;
    std::unique_ptr<gloo::transport::UnboundBuffer> send_buf, recv_buf;  // null: nothing to exchange
    std::string error;                                                   // posting failed
  };
  using ExchangePtr = std::shared_ptr<FingerprintExchange>;

  // Posts this collective's exchange (with `exchange`); called under issue_mu_, in issue order.
  ExchangePtr post_fingerprint(CollectiveKind kind, const at::Tensor& t, int64_t bytes, int root,
                               const std::string& label, uint32_t tag, bool exchange) {
    auto x = std::make_shared<FingerprintExchange>();
    x->mine = Fingerprint::of(kind, collectives_++, t, bytes, root, label);
    const int W = size(), r = rank();
    // Nothing alone, nothing when checks are off (except at shutdown), nothing after shutdown
    // (the queue refuses the collective itself).
    if (!exchange || W == 1 || (!check_ && kind != CollectiveKind::kShutdown) || queue_->shut_down()) return x;
    x->got.resize(W);
    try {
      x->send_buf = ctx_->createUnboundBuffer(&x->mine, sizeof(Fingerprint));
      x->recv_buf = ctx_->createUnboundBuffer(x->got.data(), sizeof(Fingerprint) * W);
      const uint64_t slot = gloo::Slot::build(kFingerprintSlotPrefix, tag);
      for (int p = 0; p < W; ++p) {
        if (p == r) continue;
        x->recv_buf->recv(p, slot, sizeof(Fingerprint) * p, sizeof(Fingerprint));
        x->send_buf->send(p, slot, 0, sizeof(Fingerprint));
      }
    } catch (const std::exception& e) {
      x->error = message_of(e);
    }
    return x;
  }

  // Waits for the exchange and compares; on the worker thread, before the collective's data.
  void check_fingerprint(FingerprintExchange& x) {
    FSDP_CHECK(x.error.empty(), "sending its fingerprint failed: ", x.error);
    if (!x.send_buf) return;
    const int W = size(), r = rank();
    {
      const GlooWaiting how{timeout_, diagnosis_.get(), x.mine};
      StallDiagnosis::Wait registered(how.diagnosis, x.mine, gloo_aborter(x.send_buf.get(), x.recv_buf.get()));
      for (int i = 0; i < W - 1; ++i) gloo_wait_recv(*x.recv_buf, how, "fingerprint receive");
      for (int i = 0; i < W - 1; ++i) gloo_wait_send(*x.send_buf, how, "fingerprint send");
    }
    for (int p = 0; p < W; ++p)
      if (p != r && !(x.got[p] == x.mine)) fail_out_of_step(name_, r, x.mine, p, x.got[p]);
  }

  GlooWaiting waiting(const Issued& is) const { return {timeout_, diagnosis_.get(), is.fingerprint}; }

  uint32_t resolve_tag(const CollectiveOptions& opts) {
    if (opts.tag != 0) {
      FSDP_CHECK((opts.tag & kAutoTagBit) == 0, "collective tag ", opts.tag, " must be below 2^31");
      return opts.tag;
    }
    // Spaced apart as a precaution against slot offsets derived from a tag; not known to be needed.
    return kAutoTagBit | ((next_tag_.fetch_add(1) * kTagStride) & ~kAutoTagBit);
  }

  // Issues one collective: its tag, fingerprint (exchange) and queue position are taken under
  // issue_mu_, so all three follow the issue order; its job checks the fingerprint, then runs
  // body on the worker (through run_gloo_job). `carries`: the body's data slots can carry the
  // fingerprint instead (our own algorithms), when the stall diagnosis runs and data moves.
  WorkPtr issue(const char* op, CollectiveKind kind, const at::Tensor& t, int root, const CollectiveOptions& opts,
                bool carries, std::function<void(const Issued&)> body) {
    std::lock_guard<std::mutex> issuing(issue_mu_);
    const int64_t bytes = t.defined() ? t.nbytes() : 0;
    carries = carries && diagnosis_ && bytes > 0;
    Issued is;
    is.tag = resolve_tag(opts);
    auto x = post_fingerprint(kind, t, bytes, root, opts.label, is.tag, /*exchange=*/!carries);
    is.fingerprint = x->mine;
    if (carries) is.fingerprint_bits = (is.fingerprint.digest() & 0xffffffull) << 32;
    return queue_->enqueue(
        op,
        [this, x, is, body = std::move(body)] {
          run_gloo_job([&] {
            check_fingerprint(*x);
            body(is);
          });
        },
        opts.after);
  }

  std::shared_ptr<gloo::Context> ctx_;
  std::string name_;
  std::chrono::milliseconds timeout_;
  bool check_;
  std::atomic<uint32_t> next_tag_{1};
  std::mutex issue_mu_;                        // issuing: tag, fingerprint and queue position in one order
  uint64_t collectives_ = 0;                   // collectives issued, under issue_mu_
  std::unique_ptr<StallDiagnosis> diagnosis_;  // with checks on and a store; outlives the queue's threads
  at::Tensor scratch_;                         // reduce-scatter receive ring, only touched by the worker thread
  std::atomic<int64_t> scratch_bytes_{0};      // its size, for memory_stats() on other threads
  std::unique_ptr<CollectiveQueue> queue_;
};

}  // namespace

CommunicatorPtr make_gloo_communicator(std::shared_ptr<gloo::Context> context, std::string name,
                                       std::chrono::milliseconds timeout, bool check,
                                       std::function<std::string()> exited, c10::intrusive_ptr<c10d::Store> store) {
  return std::make_shared<GlooCommunicator>(std::move(context), std::move(name), timeout, check, std::move(exited),
                                            std::move(store));
}

}  // namespace fsdp
