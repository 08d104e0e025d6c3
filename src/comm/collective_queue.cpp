#include "comm/collective_queue.h"

#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <sstream>

#include "comm/communicator_work.h"
#include "fsdp/check.h"

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

void check_all_to_all_args(const at::Tensor& out, const at::Tensor& in, int size, const char* kind) {
  check_dense_cpu(out, "all_to_all_into", "output", kind);
  check_dense_cpu(in, "all_to_all_into", "input", kind);
  FSDP_CHECK(out.scalar_type() == in.scalar_type() && out.numel() == in.numel() && in.numel() % size == 0,
             "all_to_all_into: output and input must have the same dtype and numel, a multiple of the world size ",
             size, "; got ", out.numel(), " ", out.scalar_type(), " and ", in.numel(), " ", in.scalar_type());
}

namespace {

const char* kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather: return "all_gather_into";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kBarrier: return "barrier";
    case CollectiveKind::kShutdown: return "shutdown";
    case CollectiveKind::kAllToAll: return "all_to_all_into";
  }
  return "an unknown collective";
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

class AlreadyDoneWork : public Work {
 public:
  void wait() override {}
  bool completed() const override { return true; }
};

}  // namespace

Fingerprint Fingerprint::of(CollectiveKind kind, uint64_t sequence, const at::Tensor& t, int64_t bytes, int root,
                            const std::string& label) {
  Fingerprint f;
  f.kind = kind;
  f.dtype = t.defined() ? static_cast<int32_t>(t.scalar_type()) : -1;
  f.bytes = bytes;
  f.root = root;
  f.sequence = sequence;
  f.label_hash = label.empty() ? 0 : fnv1a(label);
  std::strncpy(f.label, label.c_str(), sizeof(f.label) - 1);
  return f;
}

bool Fingerprint::operator==(const Fingerprint& o) const {
  return kind == o.kind && dtype == o.dtype && bytes == o.bytes && root == o.root && round == o.round &&
         sequence == o.sequence && label_hash == o.label_hash;
}

uint64_t Fingerprint::digest() const {
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i, v >>= 8) h = (h ^ (v & 0xff)) * 0x100000001b3ull;
  };
  mix(static_cast<uint64_t>(kind));
  mix(static_cast<uint64_t>(static_cast<int64_t>(dtype)));
  mix(static_cast<uint64_t>(bytes));
  mix(static_cast<uint64_t>(static_cast<int64_t>(root)));
  mix(round);
  mix(sequence);
  mix(label_hash);
  return h;
}

std::string Fingerprint::describe() const {
  std::ostringstream s;
  s << kind_name(kind) << " #" << sequence;
  if (kind == CollectiveKind::kShutdown) {
    s << " (the end of its use of the communicator: it issued no further collective)";
    return s.str();
  }
  s << " of " << bytes << " bytes";
  if (dtype >= 0) s << " (" << static_cast<at::ScalarType>(dtype) << ")";
  if (kind == CollectiveKind::kBroadcast) s << " from root " << root;
  if (label[0] != 0) s << " for '" << std::string(label, strnlen(label, sizeof(label))) << "'";
  return s.str();
}

std::string out_of_step_message(const std::string& group, int me, const Fingerprint& mine, int other,
                                const Fingerprint& theirs) {
  return detail::compose(
      "ranks diverged: member ", me, " of ", group, " issued ", mine.describe(), " while member ", other, " issued ",
      theirs.describe(),
      ". Every rank must issue the same collectives in the same order (same model, same FSDP options, "
      "same control flow through the units, same number of steps and micro-batches; reading a sharded "
      "parameter outside forward and backward, e.g. to log it, gathers it: do it on every rank; a forward on "
      "some ranks only, e.g. evaluation on rank 0, gathers too: run it on every rank, or inside "
      "summon_full_params() entered on every rank; state dicts, checkpoints and clip_grad_norm_ are collective: "
      "call them on every rank)");
}

void fail_out_of_step(const std::string& group, int me, const Fingerprint& mine, int other, const Fingerprint& theirs) {
  FSDP_FAIL(out_of_step_message(group, me, mine, other, theirs));
}

WorkPtr completed_work() { return std::make_shared<AlreadyDoneWork>(); }

WorkPtr Communicator::shutdown() { return completed_work(); }

// NOLINTNEXTLINE(performance-unnecessary-value-param): the virtual takes its options by value, as every collective
WorkPtr Communicator::all_to_all_into(at::Tensor, at::Tensor, CollectiveOptions) {
  FSDP_FAIL(name(), ": ", transport(),
            " has no all_to_all_into (quantized gradient reductions need it); use the "
            "shared-memory or Gloo transport, or turn reduce quantization off");
}

void shutdown_on_destruction(Communicator& comm, const CollectiveQueue& queue) {
  if (queue.shut_down() || queue.failed() || std::uncaught_exceptions() > 0 || comm.size() == 1) return;
  try {
    comm.shutdown()->wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "[fsdp] rank %d of %s: %s\n[fsdp] exiting with status 1: this rank must not finish out of step with "
                 "its peers\n",
                 comm.rank(), comm.name().c_str(), e.what());
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(1);
  }
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
                                 std::function<void()> on_start, std::function<void()> on_stop,
                                 std::function<void()> on_failure)
    : name_(std::move(name)),
      rank_(rank),
      size_(size),
      timeout_(timeout),
      on_start_(std::move(on_start)),
      on_stop_(std::move(on_stop)),
      on_failure_(std::move(on_failure)) {
  worker_ = std::thread([this] { run(); });
}

CollectiveQueue::~CollectiveQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    stop_watch_ = true;
  }
  cv_.notify_all();
  watch_cv_.notify_all();
  if (watcher_.joinable()) watcher_.join();
  worker_.join();
}

void CollectiveQueue::watch(std::function<std::string()> exited, std::function<void()> stalled,
                            std::chrono::milliseconds every, std::chrono::milliseconds grace) {
  FSDP_CHECK((exited || stalled) && !watcher_.joinable(), "internal: watch needs a check and is set once");
  exited_ = std::move(exited);
  stalled_ = std::move(stalled);
  every_ = every;
  grace_ = grace;
  watcher_ = std::thread([this] { watch_jobs(); });
}

void CollectiveQueue::watch_jobs() {
  // It polls: the worker never wakes it, so collectives pay nothing for the watch.
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_watch_) {
    watch_cv_.wait_for(lock, every_);
    if (stop_watch_ || running_job_ == 0 || std::chrono::steady_clock::now() < running_since_ + every_) continue;
    const uint64_t job = running_job_;
    lock.unlock();
    if (stalled_) stalled_();
    const std::string why = exited_ ? exited_() : std::string();
    lock.lock();
    if (why.empty() || running_job_ != job) continue;
    // A member is gone. A collective it had done its part of may still be completing here (its
    // last bytes in flight), so the job gets `grace` to end on its own.
    const auto deadline = std::chrono::steady_clock::now() + grace_;
    while (!stop_watch_ && running_job_ == job && std::chrono::steady_clock::now() < deadline)
      watch_cv_.wait_until(lock, deadline);
    if (stop_watch_ || running_job_ != job) continue;
    std::fprintf(stderr,
                 "[fsdp] rank %d of %s: collective %s cannot complete: %s while it waited on it (found by "
                 "libfsdp's member watch; the transport had not reported it)\n[fsdp] exiting with status 1: the "
                 "transport still owns this collective's buffers\n",
                 rank_, name_.c_str(), running_op_, why.c_str());
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(1);
  }
}

bool CollectiveQueue::shut_down() const {
  std::lock_guard<std::mutex> lock(mu_);
  return shutdown_ != nullptr;
}

WorkPtr CollectiveQueue::enqueue_shutdown(std::function<void()> body) {
  std::lock_guard<std::mutex> serial(shutdown_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_) return shutdown_;
  }
  WorkPtr work = enqueue("shutdown", std::move(body), nullptr, /*is_shutdown=*/true);
  std::lock_guard<std::mutex> lock(mu_);
  if (!shutdown_) shutdown_ = work;
  return shutdown_;
}

WorkPtr CollectiveQueue::enqueue(const char* op, std::function<void()> body, WorkPtr after) {
  return enqueue(op, std::move(body), std::move(after), false);
}

WorkPtr CollectiveQueue::enqueue(const char* op, std::function<void()> body, WorkPtr after, bool is_shutdown) {
  auto work = std::make_shared<QueuedWork>();
  static const bool debug = std::getenv("FSDP_DEBUG_COMM") != nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  if (shutdown_) {
    work->finish(detail::compose(op, " on ", name_,
                                 " was issued after the communicator was shut down (ProcessGroup::shutdown() or "
                                 "Communicator::shutdown() ran): shut a process group down only after the last "
                                 "forward, backward and state-dict call of every model sharded over it"));
    return work;
  }
  if (debug) std::fprintf(stderr, "[comm] %s #%u %s\n", name_.c_str(), debug_count_++, op);
  queue_.emplace_back(op, [this, op, body = std::move(body), after = std::move(after), work, is_shutdown]() mutable {
    if (!failure_.empty()) {
      body = nullptr;
      after = nullptr;
      if (is_shutdown) return work->finish("");  // the failure was reported; there is nothing left to agree on
      work->finish(detail::compose(op, " on ", name_, " was not run: an earlier collective failed: ", failure_));
      return;
    }
    try {
      at::NoGradGuard no_grad;
      CommunicatorWork own_work;  // its copies and sums are not the model's operations
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
      failed_.store(true);
      if (on_failure_) on_failure_();
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
      running_op_ = queue_.front().first;
      job = std::move(queue_.front().second);
      queue_.pop_front();
      running_job_ = ++jobs_started_;
      running_since_ = std::chrono::steady_clock::now();
    }
    job();
    job = nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    running_job_ = 0;
  }
  if (on_stop_) on_stop_();
}

}  // namespace fsdp
