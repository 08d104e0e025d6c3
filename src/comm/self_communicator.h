#pragma once
// The communicator of a group of one process: every collective is a local copy (or nothing), done
// before the call returns. Used for groups of one where no Gloo is built in (the CUDA build on
// PyTorch's own LibTorch, which ships no Gloo headers).
#include <string>

#include "fsdp/comm.h"

namespace fsdp {
CommunicatorPtr make_self_communicator(std::string name);
}  // namespace fsdp
