#pragma once
// Marks FSDP's own tensor operations on this thread, so the op interception ignores them.
namespace fsdp {
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
