#include "comm/shm_communicator.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstring>
#include <new>
#include <sstream>
#include <vector>

#include "comm/collective_queue.h"
#include "comm/shm_segment.h"
#include "fsdp/check.h"

namespace fsdp {
namespace {

// Every member's worker thread runs the rounds of shm_segment.h's protocol.
constexpr int kSpins = 256;
constexpr auto kSleepSlice = std::chrono::milliseconds(20);
constexpr auto kLivenessPeriod = std::chrono::milliseconds(100);

// memcpy for the pieces of a collective: a collective of nothing still runs one empty round,
// where the tensor's data_ptr() is null, and memcpy's pointers must not be null even for 0 bytes.
void copy_bytes(void* dst, const void* src, int64_t n) {
  if (n > 0) std::memcpy(dst, src, n);
}

class ShmCommunicator : public Communicator {
 public:
  ShmCommunicator(std::unique_ptr<ShmSegment> segment, int index, int size, std::string name,
                  std::chrono::milliseconds timeout)
      : segment_(std::move(segment)),
        rank_(index),
        size_(size),
        slot_(segment_->header()->slot_bytes),
        name_(std::move(name)),
        timeout_(timeout) {
    auto* me = segment_->control(rank_);
    queue_ = std::make_unique<CollectiveQueue>(
        name_, rank_, size_, timeout_,
        [me] {
          me->pid = static_cast<int32_t>(getpid());
          me->pid_namespace = pid_namespace();
          pthread_mutex_lock(&me->alive);
        },
        [me] { pthread_mutex_unlock(&me->alive); },
        [me] {  // peers waiting on this member learn at once that it failed
          uint32_t running = kRunning;
          me->state.compare_exchange_strong(running, kFailed);
        });
    queue_->enqueue("start", [] {})->wait();  // the liveness lock is held from here on
  }
  ~ShmCommunicator() override {
    shutdown_on_destruction(*this, *queue_);
    queue_.reset();  // joins the worker (which releases the lock) before unmapping
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_; }
  std::string transport() const override { return "shared memory"; }
  int64_t shared_memory_bytes() const override { return segment_->bytes(); }

  WorkPtr all_gather_into(at::Tensor out, at::Tensor in, CollectiveOptions opts) override {
    check_all_gather_args(out, in, size_, "shared-memory");
    return queue_->enqueue(
        "all_gather_into",
        [this, out, in, label = std::move(opts.label)] {
          const int64_t n = in.nbytes();
          auto* dst = static_cast<uint8_t*>(out.data_ptr());
          const auto* src = static_cast<const uint8_t*>(in.data_ptr());
          if (n > 0 && dst + rank_ * n != src) std::memmove(dst + rank_ * n, src, n);
          Descriptor d = describe(CollectiveKind::kAllGather, n, in, label);
          for_each_piece(n, slot_, d, [&](int64_t off, int64_t len) {
            copy_bytes(segment_->buffer(rank_, round_), src + off, len);
            exchange(d);
            for (int p = 0; p < size_; ++p)
              if (p != rank_) copy_bytes(dst + p * n + off, segment_->buffer(p, round_), len);
          });
        },
        opts.after);
  }

  WorkPtr reduce_scatter(at::Tensor out, at::Tensor in, CollectiveOptions opts) override {
    check_reduce_scatter_args(out, in, size_, "shared-memory");
    return queue_->enqueue(
        "reduce_scatter",
        [this, out, in, label = std::move(opts.label)] {
          const int64_t n = out.numel(), elem = in.element_size();
          // Per round, a member stages one piece for each destination member.
          const int64_t piece = std::max<int64_t>(1, slot_ / (size_ * elem));
          auto* src = static_cast<const uint8_t*>(in.data_ptr());
          const at::Tensor flat_in = in.view({-1}), flat_out = out.view({-1});
          Descriptor d = describe(CollectiveKind::kReduceScatter, in.nbytes(), in, label);
          for_each_piece(n, piece, d, [&](int64_t off, int64_t len) {
            uint8_t* mine = segment_->buffer(rank_, round_);
            for (int q = 0; q < size_; ++q)
              if (q != rank_) copy_bytes(mine + q * piece * elem, src + (q * n + off) * elem, len * elem);
            exchange(d);
            at::Tensor sum = flat_out.narrow(0, off, len);
            sum.copy_(flat_in.narrow(0, rank_ * n + off, len));
            for (int p = 0; p < size_; ++p)
              if (p != rank_) sum.add_(staged(p, rank_ * piece * elem, len, out));
          });
        },
        opts.after);
  }

  bool has_all_to_all() const override { return true; }
  WorkPtr all_to_all_into(at::Tensor out, at::Tensor in, CollectiveOptions opts) override {
    check_all_to_all_args(out, in, size_, "shared-memory");
    return queue_->enqueue(
        "all_to_all_into",
        [this, out, in, label = std::move(opts.label)] {
          const int64_t n = in.nbytes() / size_;  // bytes per part
          // Per round, a member stages one piece for each destination member.
          const int64_t piece = std::max<int64_t>(1, slot_ / size_);
          const auto* src = static_cast<const uint8_t*>(in.data_ptr());
          auto* dst = static_cast<uint8_t*>(out.data_ptr());
          Descriptor d = describe(CollectiveKind::kAllToAll, in.nbytes(), in, label);
          for_each_piece(n, piece, d, [&](int64_t off, int64_t len) {
            uint8_t* mine = segment_->buffer(rank_, round_);
            for (int q = 0; q < size_; ++q)
              if (q != rank_) copy_bytes(mine + q * piece, src + q * n + off, len);
            exchange(d);
            if (dst != src) std::memmove(dst + rank_ * n + off, src + rank_ * n + off, len);
            for (int p = 0; p < size_; ++p)
              if (p != rank_) copy_bytes(dst + p * n + off, segment_->buffer(p, round_) + rank_ * piece, len);
          });
        },
        opts.after);
  }

  WorkPtr all_reduce(at::Tensor t, CollectiveOptions opts) override {
    check_dense_cpu(t, "all_reduce", "tensor", "shared-memory");
    return queue_->enqueue(
        "all_reduce",
        [this, t, label = std::move(opts.label)] {
          // Per chunk: a reduce-scatter round (member m sums part m of the chunk), then an all-gather
          // round of the sums; each part is summed once, so every member ends with the same bits.
          const int64_t elem = t.element_size();
          auto* data = static_cast<uint8_t*>(t.data_ptr());
          const at::Tensor flat = t.view({-1});
          Descriptor d = describe(CollectiveKind::kAllReduce, t.nbytes(), t, label);
          for_each_piece(t.numel(), slot_ / elem, d, [&](int64_t off, int64_t len) {
            auto part = [&](int m) {
              return std::make_pair(len * m / size_, len * (m + 1) / size_);
            };
            const auto [lo, hi] = part(rank_);
            copy_bytes(segment_->buffer(rank_, round_), data + off * elem, len * elem);
            exchange(d);
            at::Tensor sum = flat.narrow(0, off + lo, hi - lo);
            for (int p = 0; p < size_; ++p)
              if (p != rank_) sum.add_(staged(p, lo * elem, hi - lo, t));
            end_round(d);
            copy_bytes(segment_->buffer(rank_, round_) + lo * elem, data + (off + lo) * elem, (hi - lo) * elem);
            exchange(d);
            for (int p = 0; p < size_; ++p) {
              if (p == rank_) continue;
              const auto [plo, phi] = part(p);
              copy_bytes(data + (off + plo) * elem, segment_->buffer(p, round_) + plo * elem, (phi - plo) * elem);
            }
          });
        },
        opts.after);
  }

  WorkPtr broadcast(at::Tensor t, int root, CollectiveOptions opts) override {
    check_dense_cpu(t, "broadcast", "tensor", "shared-memory");
    FSDP_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is outside [0, ", size_, ")");
    return queue_->enqueue(
        "broadcast",
        [this, t, root, label = std::move(opts.label)] {
          auto* data = static_cast<uint8_t*>(t.data_ptr());
          Descriptor d = describe(CollectiveKind::kBroadcast, t.nbytes(), t, label, root);
          for_each_piece(t.nbytes(), slot_, d, [&](int64_t off, int64_t len) {
            if (rank_ == root) copy_bytes(segment_->buffer(rank_, round_), data + off, len);
            exchange(d);
            if (rank_ != root) copy_bytes(data + off, segment_->buffer(root, round_), len);
          });
        },
        opts.after);
  }

  void barrier() override {
    queue_
        ->enqueue("barrier",
                  [this] {
                    Descriptor d = describe(CollectiveKind::kBarrier, 0, at::Tensor(), "");
                    for_each_piece(0, 1, d, [&](int64_t, int64_t) { exchange(d); });
                  })
        ->wait();
  }

  WorkPtr shutdown() override {
    return queue_->enqueue_shutdown([this] {
      Descriptor d = describe(CollectiveKind::kShutdown, 0, at::Tensor(), "");
      for_each_piece(0, 1, d, [&](int64_t, int64_t) { exchange(d); });
    });
  }

 private:
  Descriptor describe(CollectiveKind kind, int64_t bytes, const at::Tensor& t, const std::string& label,
                      int root = -1) {
    return Fingerprint::of(kind, collectives_++, t, bytes, root, label);
  }

  // Runs body(offset, length) over [0, total) in pieces of at most `piece`, one round each; a
  // collective of nothing still takes one (empty) round, so every collective is matched.
  template <typename Body>
  void for_each_piece(int64_t total, int64_t piece, Descriptor& d, Body&& body) {
    int64_t off = 0;
    do {
      const int64_t len = std::min(piece, total - off);
      body(off, len);
      end_round(d);
      off += len;
    } while (off < total);
  }

  void end_round(Descriptor& d) {
    ++round_;
    ++d.round;
  }

  // A member's staged elements as a tensor of `like`'s dtype (no copy).
  at::Tensor staged(int member, int64_t byte_offset, int64_t numel, const at::Tensor& like) {
    return at::from_blob(segment_->buffer(member, round_) + byte_offset, {numel}, like.options());
  }

  // Posts this member's round and waits until every member has posted it; then checks that all
  // are running the same collective.
  void exchange(const Descriptor& d) {
    MemberControl* me = segment_->control(rank_);
    me->descriptor[round_ % 2] = d;
    const uint32_t target = round_ + 1;
    me->posted.store(target, std::memory_order_seq_cst);
    if (me->waiters.load(std::memory_order_seq_cst) != 0) futex_wake_all(&me->posted);
    for (int p = 0; p < size_; ++p)
      if (p != rank_) wait_for(p, target);
    for (int p = 0; p < size_; ++p) {
      const Descriptor& other = segment_->control(p)->descriptor[round_ % 2];
      if (!(other == d)) fail_out_of_step(name_, rank_, d, p, other);
    }
  }

  static bool reached(const MemberControl* c, uint32_t target) {
    return static_cast<int32_t>(c->posted.load(std::memory_order_acquire) - target) >= 0;
  }

  void wait_for(int member, uint32_t target) {
    MemberControl* c = segment_->control(member);
    for (int i = 0; i < kSpins; ++i) {
      if (reached(c, target)) return;
      cpu_relax();
    }
    const auto start = std::chrono::steady_clock::now();
    auto next_check = start + kLivenessPeriod;
    for (;;) {
      c->waiters.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t seen = c->posted.load(std::memory_order_seq_cst);
      if (static_cast<int32_t>(seen - target) < 0) futex_wait(&c->posted, seen, kSleepSlice);
      c->waiters.fetch_sub(1, std::memory_order_seq_cst);
      if (reached(c, target)) return;
      const auto now = std::chrono::steady_clock::now();
      if (now >= next_check) {
        check_alive(member);
        next_check = now + kLivenessPeriod;
      }
      FSDP_CHECK(now - start < timeout_, "member ", member, " of ", name_, " (pid ", c->pid, ") did not arrive within ",
                 timeout_.count() / 1000.0, " s");
    }
  }

  // Fails if `member` died, left or failed. Its state word is checked first and written by whoever
  // finds out, so every member sees the same answer however many ask (Note [Dead members]).
  void check_alive(int member) {
    MemberControl* c = segment_->control(member);
    uint32_t state = c->state.load(std::memory_order_acquire);
    if (state == kRunning) {
      const int rc = pthread_mutex_trylock(&c->alive);
      uint32_t found = kRunning;
      if (rc == 0) {
        pthread_mutex_unlock(&c->alive);
        found = kLeft;
      } else if (rc == EOWNERDEAD || rc == ENOTRECOVERABLE ||
                 (c->pid > 0 && c->pid_namespace != 0 && c->pid_namespace == pid_namespace() && kill(c->pid, 0) != 0 &&
                  errno == ESRCH)) {
        // The lock is left owned (or unrecoverable): the state word is the record. Or the process
        // is gone although its lock reads as held.
        found = kDied;
      }
      if (found != kRunning) {
        uint32_t expected = kRunning;
        c->state.compare_exchange_strong(expected, found, std::memory_order_acq_rel);
        state = c->state.load(std::memory_order_acquire);
      }
    }
    switch (state) {
      case kRunning: return;
      case kLeft:
        FSDP_FAIL("member ", member, " of ", name_, " (pid ", c->pid,
                  ") left the group: its communicator was destroyed before this collective completed");
      case kFailed:
        FSDP_FAIL("member ", member, " of ", name_, " (pid ", c->pid,
                  ") failed a collective (its own error says why: see that rank's output)");
      default: FSDP_FAIL("member ", member, " of ", name_, " (pid ", c->pid, ") died");
    }
  }

  std::unique_ptr<ShmSegment> segment_;
  int rank_, size_;
  int64_t slot_;  // bytes of each staging buffer
  std::string name_;
  std::chrono::milliseconds timeout_;
  uint32_t round_ = 0;        // worker thread only
  uint64_t collectives_ = 0;  // worker thread only
  std::unique_ptr<CollectiveQueue> queue_;
};

std::string bytes_to_string(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> string_to_bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

}  // namespace

namespace {

// Waits until every member has set `prefix + m`; on timeout names the members that did not.
void wait_for_members(c10d::Store& store, const std::string& prefix, int size, const std::string& name,
                      std::chrono::milliseconds timeout, const char* what) {
  std::vector<std::string> keys;
  for (int m = 0; m < size; ++m) keys.push_back(prefix + std::to_string(m));
  try {
    store.wait(keys, timeout);
    return;
  } catch (const std::exception&) {
  }
  std::string missing;
  for (int m = 0; m < size; ++m) {
    bool present = false;
    try {
      present = store.check({keys[m]});
    } catch (const std::exception&) {
    }
    if (!present) missing += (missing.empty() ? "" : ", ") + std::to_string(m);
  }
  FSDP_FAIL("setting up the shared-memory transport for ", name, ": member(s) ", missing.empty() ? "?" : missing,
            " did not ", what, " within ", timeout.count() / 1000.0,
            " s (they never started, died, or failed earlier: see their output)");
}

}  // namespace

CommunicatorPtr make_shm_communicator(const c10::intrusive_ptr<c10d::Store>& store, int index, int size,
                                      const std::string& name, std::chrono::milliseconds timeout, bool required) {
  FSDP_CHECK(size >= 1 && index >= 0 && index < size, "make_shm_communicator: member ", index, " of ", size);
  auto segment = std::make_unique<ShmSegment>();
  // The first member creates the segment and announces "<name> <nonce>" (or "!<why>").
  std::string shm_name;
  uint64_t nonce = 0;
  // The creator unlinks the name once every member has mapped it, or on any failure before that:
  // the segment never outlives the job however the processes end (Note [Dead members]).
  struct Unlink {
    std::string name;
    ~Unlink() {
      if (!name.empty()) shm_unlink(name.c_str());
    }
  } unlink;
  const std::string token = job_token();
  if (index == 0) {
    // An unguessable name (128 random bits) and nonce: no one can create the segment first.
    const std::string random = random_bytes(16 + sizeof(nonce));
    std::memcpy(&nonce, random.data() + 16, sizeof(nonce));
    shm_name = "/fsdp-" + std::to_string(getpid()) + "-" + to_hex(random.substr(0, 16));
    const std::string error = segment->create(shm_name, nonce, size, segment_tag(token, shm_name, nonce));
    if (error.empty()) unlink.name = shm_name;
    store->set("shm/segment0", string_to_bytes(error.empty() ? shm_name + " " + std::to_string(nonce) : "!" + error));
  }
  wait_for_members(*store, "shm/segment", 1, name, timeout, "announce the segment");
  const std::string announced = bytes_to_string(store->get("shm/segment0"));
  std::string my_status;
  if (announced.rfind('!', 0) == 0) {
    my_status = announced.substr(1);
  } else if (index != 0) {
    std::istringstream in(announced);
    if (!(in >> shm_name >> nonce))
      my_status = "the announced segment '" + announced + "' is not '<name> <nonce>'";
    else
      my_status = segment->open(shm_name, nonce, size, segment_tag(token, shm_name, nonce));
  }
  store->set("shm/status/" + std::to_string(index), string_to_bytes(my_status.empty() ? "ok" : my_status));
  wait_for_members(*store, "shm/status/", size, name, timeout, "report whether it could map the segment");
  std::string failure;
  for (int m = 0; m < size && failure.empty(); ++m) {
    const std::string s = bytes_to_string(store->get("shm/status/" + std::to_string(m)));
    if (s != "ok") failure = "member " + std::to_string(m) + ": " + s;
  }
  if (!unlink.name.empty()) {  // everyone has mapped it (or given up): the name is no longer needed
    shm_unlink(unlink.name.c_str());
    unlink.name.clear();
  }
  if (!failure.empty()) {
    FSDP_CHECK(!required,
               "the shared-memory transport was requested (FSDP_TRANSPORT=shm or "
               "ProcessGroupOptions::transport) for ",
               name, " but its members cannot share a segment (", failure,
               "). Use FSDP_TRANSPORT=auto (or tcp) when the group spans hosts or /dev/shm namespaces");
    if (index == 0)
      std::fprintf(stderr, "[fsdp] %s: shared memory is unavailable (%s); using Gloo over TCP instead\n", name.c_str(),
                   failure.c_str());
    return nullptr;
  }
  auto comm = std::make_shared<ShmCommunicator>(std::move(segment), index, size, name, timeout);
  // Every member's liveness lock is held before any member starts a collective.
  store->set("shm/ready/" + std::to_string(index), string_to_bytes("1"));
  wait_for_members(*store, "shm/ready/", size, name, timeout, "start its communicator");
  return comm;
}

}  // namespace fsdp
