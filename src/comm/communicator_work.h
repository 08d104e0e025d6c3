#pragma once
// CommunicatorWork: marks the tensor operations a communicator runs for its own collectives
// (staging copies, partial sums) on this thread, so that callers can tell them from a model's own
// operations (Note [Internal operations] in docs/design.md).
namespace fsdp {

// True while a CommunicatorWork is alive on this thread.
bool in_communicator_work();

class CommunicatorWork {
 public:
  CommunicatorWork();
  ~CommunicatorWork();
  CommunicatorWork(const CommunicatorWork&) = delete;
  CommunicatorWork& operator=(const CommunicatorWork&) = delete;

 private:
  bool previous_;
};

}  // namespace fsdp
