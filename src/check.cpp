#include "fsdp/check.h"

namespace fsdp::detail {
void throw_error(const char* /*file*/, int /*line*/, const std::string& msg) {
  // The location is not part of the message: messages are written for users, not for us.
  throw Error("libfsdp: " + msg);
}
}  // namespace fsdp::detail
