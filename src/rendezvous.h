#pragma once
// The rendezvous: every rank of a job meets at the store rank 0 hosts (MASTER_ADDR, MASTER_PORT),
// publishes its process identity (member_watch.h) and waits until all ranks have arrived; a rank
// that never comes is named, and a port that answers as something else fails after the timeout.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

#include "fsdp/rank_env.h"

namespace fsdp {

// Returns the job's store once every rank has arrived (rank 0 hosts it). Throws fsdp::Error
// naming what to check.
c10::intrusive_ptr<c10d::Store> rendezvous(const RankEnv& env, std::chrono::milliseconds timeout);

// Note [SIGPIPE]: a write to a socket whose peer died raises SIGPIPE, whose default action ends
// the process silently (exit 141) before Gloo or the store can report the dead peer. Ignored, the
// write fails with EPIPE and the rank fails with a message. A handler the program set is kept.
void ignore_sigpipe();

}  // namespace fsdp
