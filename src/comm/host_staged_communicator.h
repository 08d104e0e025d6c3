#pragma once
// A Communicator for CUDA tensors over a CPU communicator (shared memory or Gloo): each collective
// copies its input into page-locked host memory, runs the CPU collective there, and copies the
// result back to the device. It serves ranks that share one GPU, which NCCL refuses, so the
// multi-rank CUDA path runs (and is tested) on one device; it is not a fast path. Built only with
// CUDA (FSDP_WITH_CUDA). See Note [Host-staged collectives] in docs/design.md.
//
// Ordering is the NCCL communicator's contract (Work::wait() orders the caller's current stream,
// buffers are freed on the stream that allocated them, after wait()):
//   - the copy to the host waits for an event recorded on the caller's current stream at issue;
//   - the CPU collective is issued to the host communicator at once, in the caller's order (ranks
//     match collectives by order), and runs once the copy to the host has landed;
//   - a worker thread copies each result back when its CPU collective completes and records the
//     completion event; Work::wait() blocks until that event is recorded (not until it fires),
//     then makes the caller's current stream wait for it.
#include <chrono>

#include "fsdp/comm.h"

namespace fsdp {

// `host` moves CPU tensors between the same members; `device` is this rank's CUDA device; a
// collective whose input the device has not produced, or whose result has not come back, within
// `timeout` fails naming it.
CommunicatorPtr make_host_staged_communicator(CommunicatorPtr host, c10::Device device,
                                              std::chrono::milliseconds timeout);

}  // namespace fsdp
