#pragma once
// Our own collectives over a Gloo context's unbound buffers, for GlooCommunicator: one-round
// all-gather and all-to-all (Note [Gloo all-gather]) and a pipelined ring reduce-scatter (Note
// [Gloo reduce-scatter]). Each sends on the slot it is given, which carries the collective's
// fingerprint (Note [Collective fingerprints]), and waits as `GlooWaiting` says.
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>

#include "comm/collective_queue.h"
#include "comm/stall_diagnosis.h"

namespace gloo {
class Context;
namespace transport {
class UnboundBuffer;
}
}  // namespace gloo

namespace fsdp {

// How a collective waits on its peers: up to `timeout` per message; with a `diagnosis`, each wait
// is registered there under `fingerprint`, and an aborted or failed wait throws the divergence the
// diagnosis found.
struct GlooWaiting {
  std::chrono::milliseconds timeout{0};
  StallDiagnosis* diagnosis = nullptr;
  Fingerprint fingerprint;
};

// What wakes a wait on these buffers when the stall diagnosis finds the members out of step.
std::function<void()> gloo_aborter(gloo::transport::UnboundBuffer* send, gloo::transport::UnboundBuffer* recv);
// Waits for one receive / send on `buf`; `what` names it in errors.
void gloo_wait_recv(gloo::transport::UnboundBuffer& buf, const GlooWaiting& waiting, const char* what);
void gloo_wait_send(gloo::transport::UnboundBuffer& buf, const GlooWaiting& waiting, const char* what);

// out (W parts) = every member's `in`, part p from member p; `in` may be this member's part of out.
void gloo_all_gather(gloo::Context& ctx, const at::Tensor& out, const at::Tensor& in, uint64_t slot,
                     const GlooWaiting& waiting);
// Part p of `out` = part `rank` of member p's `in`; out and in do not overlap.
void gloo_all_to_all(gloo::Context& ctx, const at::Tensor& out, const at::Tensor& in, uint64_t slot,
                     const GlooWaiting& waiting);
// out = the sum over members of their `in`'s part `rank`; `in` is overwritten with partial sums.
// `scratch` is the receive ring, grown as needed and kept by the caller between calls.
void gloo_reduce_scatter(gloo::Context& ctx, const at::Tensor& out, const at::Tensor& in, uint64_t slot,
                         at::Tensor& scratch, const GlooWaiting& waiting);

}  // namespace fsdp
