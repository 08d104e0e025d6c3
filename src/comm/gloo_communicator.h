#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "fsdp/comm.h"

namespace gloo {
class Context;
}

namespace fsdp {
// A Communicator over a connected gloo context. Collectives run in issue order on one worker
// thread owned by the communicator, so the compute thread only blocks where it calls wait().
// `check`: compare collective fingerprints before each collective (the shutdown always is).
// `exited`: if given, says which member is known to have died (or nothing); a collective Gloo
// leaves waiting on a dead member then ends the process within seconds, saying why
// (CollectiveQueue::watch_members).
CommunicatorPtr make_gloo_communicator(std::shared_ptr<gloo::Context> context, std::string name,
                                       std::chrono::milliseconds timeout, bool check = true,
                                       std::function<std::string()> exited = {});
}  // namespace fsdp
