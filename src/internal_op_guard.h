#pragma once
// InternalOpGuard: marks FSDP's own tensor operations on this thread, so the operator hook
// ignores them (see Note [Internal operations] in docs/design.md).
namespace fsdp {

// True while an InternalOpGuard is alive on this thread.
bool& internal_op_flag();

class InternalOpGuard {
 public:
  InternalOpGuard() : previous_(internal_op_flag()) { internal_op_flag() = true; }
  ~InternalOpGuard() { internal_op_flag() = previous_; }
  InternalOpGuard(const InternalOpGuard&) = delete;
  InternalOpGuard& operator=(const InternalOpGuard&) = delete;

 private:
  bool previous_;
};

}  // namespace fsdp
