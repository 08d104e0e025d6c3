#include "internal_op_guard.h"

namespace fsdp {

bool& internal_op_flag() {
  thread_local bool flag = false;
  return flag;
}

}  // namespace fsdp
