#pragma once
// A Communicator over NCCL for CUDA tensors (built only when libfsdp is built against a CUDA
// LibTorch with NCCL: FSDP_WITH_NCCL).
//
// Streams. Each communicator has two lanes, each an NCCL communicator with its own CUDA stream:
// the gather lane (all_gather_into, broadcast) and the reduce lane (reduce_scatter, all_reduce,
// all_to_all_into as grouped sends and receives),
// so a reduce-scatter of one unit runs while the next unit's all-gather does (NCCL kernels of one
// NCCL communicator must not run concurrently on two streams; two communicators may).
// A collective is ordered with events, never with recordStream:
//   - the lane's stream first waits for an event recorded on the caller's current stream, so the
//     input (and the output's memory, allocated on that stream) is ready;
//   - Work::wait() makes the caller's current stream wait for the collective's completion event:
//     it does not block the CPU; the output may be read and the buffers freed on that stream after
//     it, in stream order;
//   - the Work keeps every tensor of the collective alive until then (the runtime frees buffers only
//     after wait(), on the stream that allocated them), so the caching allocator cannot hand their
//     memory to another stream while NCCL still writes it.
// A watchdog aborts the NCCL communicators of a collective that has not completed within the
// timeout (a dead or diverging peer) and every later call then fails naming it.
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <string>

#include "fsdp/comm.h"

namespace c10d {
class Store;
}

namespace fsdp {

// Every member calls it with the same store (private to the group); rank 0 publishes the NCCL
// unique ids through it. `device` is this rank's CUDA device.
CommunicatorPtr make_nccl_communicator(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                       std::string name, std::chrono::milliseconds timeout, c10::Device device);

}  // namespace fsdp
