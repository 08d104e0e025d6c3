#pragma once
// ShmSegment: the shared-memory segment of one shm communicator (shm_communicator.h): a header,
// one control block per member and two staging buffers per member, mapped by every member, with
// the futex operations that members wait and wake on.
//
// Every member owns two staging buffers of slot_bytes(size) in the segment and a control block. A
// collective is a sequence of rounds; all members run the same rounds in the same order. In round
// g a member writes its data into its buffer g % 2, publishes a descriptor of the collective, sets
// its `posted` counter to g + 1 and then waits until every member has posted g + 1; then it reads
// what it needs from the other members' buffers g % 2. A member can only write buffer g % 2 again
// in round g + 2, after every member posted g + 1, which each does only after finishing its reads
// of round g: two buffers make one counter per member enough, without acknowledgements.
//
// Waiting spins briefly, then sleeps on the peer's counter (a futex shared between processes).
// While asleep it checks, every kLivenessPeriod, that the peer is alive: each member's worker
// thread holds a robust process-shared mutex for as long as it runs, so a member that died (or
// destroyed its communicator) is seen at once, not at the timeout.
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "comm/collective_queue.h"
#include "job_token.h"

namespace fsdp {

using Descriptor = Fingerprint;  // what a member is doing in a round; every member must be doing the same

// A member's state as the others see it; written once, by the member or by the first to find it gone.
enum MemberState : uint32_t { kRunning = 0, kDied, kLeft, kFailed };

struct alignas(64) MemberControl {
  std::atomic<uint32_t> posted;   // rounds this member has posted (a futex word)
  std::atomic<uint32_t> waiters;  // members asleep on `posted`
  std::atomic<uint32_t> state;    // MemberState
  int32_t pid;
  uint64_t pid_namespace;    // inode of its /proc/self/ns/pid (0: unknown)
  Descriptor descriptor[2];  // per buffer, like the data
  pthread_mutex_t alive;     // held by the member's worker thread while it runs (robust)
};

struct alignas(64) ShmHeader {
  std::atomic<uint64_t> magic;  // written last by the creator
  uint64_t nonce;
  int32_t size;
  int64_t slot_bytes;
  uint8_t tag[32];  // segment_tag(): proves the creator holds the job token
};

// The tag a segment of the job carries: HMAC-SHA-256, keyed by the job token, of its name and nonce.
Digest segment_tag(const std::string& token, const std::string& name, uint64_t nonce);
// Bytes of each staging buffer in a segment for `size` members.
int64_t slot_bytes(int size);
// The inode of this process's pid namespace (0: unknown).
uint64_t pid_namespace();
// A pause in a spin loop.
void cpu_relax();
// Shared (not process-private) futex operations: the word lives in a segment mapped by several processes.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::milliseconds slice);
void futex_wake_all(std::atomic<uint32_t>* word);

// One mapping of the segment; the creator also owns the name until every member has mapped it.
class ShmSegment {
 public:
  ShmSegment() = default;
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  // Creates and initializes a fresh segment for `size` members, readable by this user only; on
  // failure returns the reason.
  std::string create(const std::string& name, uint64_t nonce, int size, const Digest& tag);
  // Maps an existing segment after checking that this user owns it, that no one else may open it,
  // and that it carries `tag` (Note [Shared-memory segment checks] in docs/design.md).
  std::string open(const std::string& name, uint64_t nonce, int size, const Digest& tag);
  ShmHeader* header() const { return static_cast<ShmHeader*>(base_); }
  MemberControl* control(int m) const;
  uint8_t* buffer(int m, uint32_t round) const;
  int64_t bytes() const { return bytes_; }

 private:
  std::string map(int fd, int64_t bytes, const std::string& name);
  void* base_ = nullptr;
  int64_t bytes_ = 0;
};

}  // namespace fsdp
