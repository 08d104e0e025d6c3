#pragma once
// A Communicator for ranks that share one host: collectives go through a shared-memory segment
// instead of loopback TCP (one copy in and one copy out per byte, no kernel socket copies, futex
// wake-ups instead of socket round trips), as NCCL and MPI do within a node.
#include <chrono>
#include <memory>
#include <string>

#include <c10/util/intrusive_ptr.h>

#include "fsdp/comm.h"

namespace c10d {
class Store;
}

namespace fsdp {

// Sets up a segment shared by the `size` members of a group (this process is member `index`),
// rendezvousing through `store` (a store private to the group). Every member must call it.
// Returns nullptr on every member alike when some member cannot map the segment (another host,
// another /dev/shm namespace), unless `required`, where that is an error naming the member.
CommunicatorPtr make_shm_communicator(const c10::intrusive_ptr<c10d::Store>& store, int index, int size,
                                      const std::string& name, std::chrono::milliseconds timeout, bool required);

}  // namespace fsdp
