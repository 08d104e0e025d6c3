#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

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
// `check`: check that the members issue the same collectives (the shutdown always is checked):
// with `store` (one private to this communicator), the data of our own algorithms carries the
// fingerprint and a stalled collective is diagnosed through the store; without it, and for
// Gloo's own algorithms, fingerprints are exchanged before each collective (Note [Collective
// fingerprints]). `exited`: if given, says which member is known to have died (or nothing); a
// collective Gloo leaves waiting on a dead member then ends the process within seconds, saying
// why (CollectiveQueue::watch).
CommunicatorPtr make_gloo_communicator(std::shared_ptr<gloo::Context> context, std::string name,
                                       std::chrono::milliseconds timeout, bool check = true,
                                       std::function<std::string()> exited = {},
                                       c10::intrusive_ptr<c10d::Store> store = {});
}  // namespace fsdp
