#pragma once
// StallDiagnosis: finds members out of step while a collective waits on its peers, through the
// job's store, so that collectives whose data cannot pair with a different collective need no
// fingerprint messages of their own (Note [Collective fingerprints] in docs/design.md).
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

#include "comm/collective_queue.h"

namespace fsdp {

class StallDiagnosis {
 public:
  // `store`: a store private to the communicator (its keys are this class's alone); `group` and
  // `member`: for messages; `after`: how long a wait lasts before the member publishes it.
  StallDiagnosis(c10::intrusive_ptr<c10d::Store> store, std::string group, int member, int size,
                 std::chrono::milliseconds after);

  // One wait on peers, from construction to destruction: `abort` wakes the waiting thread (it is
  // called under this class's lock, so whatever it touches must outlive the Wait).
  class Wait {
   public:
    Wait(StallDiagnosis* diagnosis, const Fingerprint& mine, std::function<void()> abort);
    ~Wait();
    Wait(const Wait&) = delete;
    Wait& operator=(const Wait&) = delete;

   private:
    StallDiagnosis* diagnosis_;
  };

  // On the queue's watch thread, while a job runs: publishes the waiting collective once it has
  // waited `after`, compares it with what the first member to publish at the same position did,
  // and reads the verdict; a divergence aborts the wait. Store errors end the diagnosis quietly
  // (the member that hosts the store is gone; its peers find that out otherwise).
  void poll();
  // Throws the divergence found, if one was; the waiting thread calls it when a wait returns
  // aborted or fails (a peer that failed first closes its connections).
  void throw_if_diverged() const;

 private:
  bool publish(const Fingerprint& mine, std::string* divergence);
  std::string read_verdict();
  void settle(const std::string& divergence, bool found_here);
  void abort_wait();  // the current wait, once a divergence is known

  c10::intrusive_ptr<c10d::Store> store_;
  std::string group_;
  int member_, size_;
  std::chrono::milliseconds after_;
  mutable std::mutex mu_;
  uint64_t waits_ = 0;    // waits begun; the current one's number while `waiting_`
  bool waiting_ = false;  // under mu_, with the four below
  Fingerprint mine_;
  std::function<void()> abort_;
  std::chrono::steady_clock::time_point since_;
  uint64_t published_ = 0;   // the wait last published (only the watch thread touches it)
  std::string divergence_;   // under mu_: set once, then every wait aborts
  bool store_lost_ = false;  // only the watch thread touches it
};

}  // namespace fsdp
