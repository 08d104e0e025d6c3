#pragma once
// What every CPU communicator shares: collectives run in issue order on one worker thread that the
// communicator owns, each returning a Work that completes (or fails) when its job has run. After a
// failure the queue is poisoned: later jobs report that an earlier collective failed instead of
// running against peers that are in an unknown state.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include <torch/torch.h>

#include "fsdp/comm.h"

namespace fsdp {

// Argument checks shared by the CPU communicators; `kind` names the communicator in the message.
void check_dense_cpu(const at::Tensor& t, const char* op, const char* what, const char* kind);
void check_all_gather_args(const at::Tensor& out, const at::Tensor& in, int size, const char* kind);
void check_reduce_scatter_args(const at::Tensor& out, const at::Tensor& in, int size, const char* kind);
void check_all_to_all_args(const at::Tensor& out, const at::Tensor& in, int size, const char* kind);

// What a member says it is running; every member of a collective must say the same (Note
// [Collective fingerprints]). Plain bytes, so transports can stage or exchange it as is.
enum class CollectiveKind : uint32_t {
  kAllGather = 1,
  kReduceScatter,
  kAllReduce,
  kBroadcast,
  kBarrier,
  kShutdown,
  kAllToAll
};
struct Fingerprint {
  CollectiveKind kind{};
  int32_t dtype = -1;       // at::ScalarType; -1 without a tensor
  int64_t bytes = 0;        // the payload per member
  int32_t root = -1;        // broadcast only
  uint32_t round = 0;       // a transport's step within the collective (shared memory's rounds)
  uint64_t sequence = 0;    // collectives this member issued on the communicator before this one
  uint64_t label_hash = 0;  // of the whole CollectiveOptions::label
  char label[104] = {};     // the label's beginning, for messages

  static Fingerprint of(CollectiveKind kind, uint64_t sequence, const at::Tensor& t, int64_t bytes, int root,
                        const std::string& label);
  bool operator==(const Fingerprint& o) const;
  uint64_t digest() const;       // of every field operator== compares: equal fingerprints, equal digests
  std::string describe() const;  // e.g. "all_reduce #4 of 40 bytes (Float) for 'unit 2 gradient all-reduce #0'"
};
// The error of member `me`, whose collective is `mine`, finding member `other` at `theirs`.
std::string out_of_step_message(const std::string& group, int me, const Fingerprint& mine, int other,
                                const Fingerprint& theirs);
// Throws it.
[[noreturn]] void fail_out_of_step(const std::string& group, int me, const Fingerprint& mine, int other,
                                   const Fingerprint& theirs);

// A Work that is already complete (a collective with nothing to do).
WorkPtr completed_work();

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
  // for as long as the thread lives); on_failure runs there when a job fails.
  CollectiveQueue(std::string name, int rank, int size, std::chrono::milliseconds timeout,
                  std::function<void()> on_start = {}, std::function<void()> on_stop = {},
                  std::function<void()> on_failure = {});
  ~CollectiveQueue();  // runs the jobs already queued, then joins the worker
  CollectiveQueue(const CollectiveQueue&) = delete;
  CollectiveQueue& operator=(const CollectiveQueue&) = delete;

  // The job runs under NoGradGuard and drops its captures before the Work completes, so once
  // wait() returns the caller holds the only references to the tensors it passed.
  // With `after`, the job first waits for that work (see CollectiveOptions::after).
  WorkPtr enqueue(const char* op, std::function<void()> body, WorkPtr after = nullptr);
  // Queues the communicator's last job (its shutdown); jobs queued after it fail without running.
  // A second call returns the first one's Work. After a failed job it completes without running.
  WorkPtr enqueue_shutdown(std::function<void()> body);
  // Whether a job has failed (the queue is poisoned) / the shutdown was queued.
  bool failed() const { return failed_.load(); }
  bool shut_down() const;

  // Watch of long-running jobs, on a thread of its own; call once, before the first enqueue. Once
  // a job has run for `every`, it calls `stalled()` (if given) each `every`, for the transport's
  // own diagnosis, and asks `exited()` (if given) whether a member is known to have died (a
  // description, or empty): for transports that may not notice a dead peer (Note [Dead
  // members]). If one has and the same job is still running `grace` later, prints why and ends
  // the process with status 1: the transport still owns the job's buffers, so failing its Work
  // and going on would let it write into memory handed back.
  void watch(std::function<std::string()> exited, std::function<void()> stalled, std::chrono::milliseconds every,
             std::chrono::milliseconds grace);

 private:
  WorkPtr enqueue(const char* op, std::function<void()> body, WorkPtr after, bool is_shutdown);
  void run();
  void watch_jobs();
  std::string name_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::function<void()> on_start_, on_stop_, on_failure_;
  mutable std::mutex mu_;
  std::mutex shutdown_mu_;  // serializes enqueue_shutdown
  std::condition_variable cv_;
  std::deque<std::pair<const char*, std::function<void()>>> queue_;  // each job's op and body
  bool stop_ = false;
  std::string failure_;  // only touched by the worker thread
  std::atomic<bool> failed_{false};
  WorkPtr shutdown_;  // under mu_
  uint32_t debug_count_ = 0;
  // The watch. The running job (under mu_): its number (0: the worker is idle), op, start.
  std::function<std::string()> exited_;
  std::function<void()> stalled_;
  std::chrono::milliseconds every_{0}, grace_{0};
  uint64_t jobs_started_ = 0, running_job_ = 0;
  const char* running_op_ = nullptr;
  std::chrono::steady_clock::time_point running_since_;
  bool stop_watch_ = false;
  std::condition_variable watch_cv_;  // only to stop the watch
  std::thread watcher_;
  std::thread worker_;
};

// What a CPU communicator's destructor does when its shutdown never ran: runs it, unless a collective
// failed or an exception is unwinding; if it fails, prints why and ends the process with status 1,
// so no rank finishes "successfully" out of step with its peers (Note [End-of-job agreement]).
void shutdown_on_destruction(Communicator& comm, const CollectiveQueue& queue);

}  // namespace fsdp
