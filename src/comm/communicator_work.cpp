#include "comm/communicator_work.h"

namespace fsdp {

namespace {
thread_local bool t_communicator_work = false;
}  // namespace

bool in_communicator_work() { return t_communicator_work; }

CommunicatorWork::CommunicatorWork() : previous_(t_communicator_work) { t_communicator_work = true; }

CommunicatorWork::~CommunicatorWork() { t_communicator_work = previous_; }

}  // namespace fsdp
