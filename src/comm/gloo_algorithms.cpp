#include "comm/gloo_algorithms.h"

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <cstring>

#include "fsdp/check.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace fsdp {
namespace {

// out = a + b, elementwise. For float32 on x86-64 the sums bypass the cache (non-temporal stores):
// the result is not read again soon, and the cache lines need not be read first
// (Note [Gloo reduce-scatter]). Bitwise the same as at::add_out.
void add_to_output(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
#if defined(__x86_64__)
  if (out.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat &&
      out.is_contiguous() && a.is_contiguous() && b.is_contiguous()) {
    float* o = out.data_ptr<float>();
    const float* x = a.data_ptr<float>();
    const float* y = b.data_ptr<float>();
    const int64_t n = out.numel();
    int64_t i = 0;
    for (; i < n && (reinterpret_cast<uintptr_t>(o + i) & 15) != 0; ++i) o[i] = x[i] + y[i];
    for (; i + 16 <= n; i += 16) {
      const __m128 s0 = _mm_add_ps(_mm_loadu_ps(x + i), _mm_loadu_ps(y + i));
      const __m128 s1 = _mm_add_ps(_mm_loadu_ps(x + i + 4), _mm_loadu_ps(y + i + 4));
      const __m128 s2 = _mm_add_ps(_mm_loadu_ps(x + i + 8), _mm_loadu_ps(y + i + 8));
      const __m128 s3 = _mm_add_ps(_mm_loadu_ps(x + i + 12), _mm_loadu_ps(y + i + 12));
      _mm_stream_ps(o + i, s0);
      _mm_stream_ps(o + i + 4, s1);
      _mm_stream_ps(o + i + 8, s2);
      _mm_stream_ps(o + i + 12, s3);
    }
    for (; i < n; ++i) o[i] = x[i] + y[i];
    _mm_sfence();  // the stores are visible before the collective is reported complete
    return;
  }
#endif
  at::add_out(out, a, b);
}

// The reduce-scatter's pipeline (Note [Gloo reduce-scatter]): segments of kSegmentBytes, a
// receive ring of kDepth segments.
constexpr int kDepth = 4;
constexpr size_t kSegmentBytes = size_t(1) << 20;

}  // namespace

std::function<void()> gloo_aborter(gloo::transport::UnboundBuffer* send, gloo::transport::UnboundBuffer* recv) {
  return [send, recv] {
    send->abortWaitSend();
    recv->abortWaitRecv();
  };
}

namespace {

// A wait that is aborted, or fails once the members are known to be out of step, throws the
// divergence.
void wait_one(gloo::transport::UnboundBuffer& buf, const GlooWaiting& waiting, const char* what, bool recv) {
  bool done = false;
  try {
    done = recv ? buf.waitRecv(nullptr, waiting.timeout) : buf.waitSend(nullptr, waiting.timeout);
  } catch (const std::exception&) {
    if (waiting.diagnosis) waiting.diagnosis->throw_if_diverged();
    throw;
  }
  if (done) return;
  if (waiting.diagnosis) waiting.diagnosis->throw_if_diverged();
  FSDP_FAIL(what, " was aborted");
}

}  // namespace

void gloo_wait_recv(gloo::transport::UnboundBuffer& buf, const GlooWaiting& waiting, const char* what) {
  wait_one(buf, waiting, what, true);
}

void gloo_wait_send(gloo::transport::UnboundBuffer& buf, const GlooWaiting& waiting, const char* what) {
  wait_one(buf, waiting, what, false);
}

// All-gather in one round: every member posts its receives from all others, sends its input to
// all others, and copies its own part while they travel (Note [Gloo all-gather]).
void gloo_all_gather(gloo::Context& ctx, const at::Tensor& out, const at::Tensor& in, uint64_t slot,
                     const GlooWaiting& waiting) {
  const int W = ctx.size, r = ctx.rank;
  const size_t bytes = in.nbytes();
  auto* base = static_cast<uint8_t*>(out.data_ptr());
  auto send_buf = ctx.createUnboundBuffer(in.data_ptr(), bytes);
  auto recv_buf = ctx.createUnboundBuffer(base, out.nbytes());
  for (int i = 1; i < W; ++i) {
    const int from = (r + W - i) % W;
    recv_buf->recv(from, slot, static_cast<size_t>(from) * bytes, bytes);
  }
  for (int i = 1; i < W; ++i) send_buf->send((r + i) % W, slot, 0, bytes);
  uint8_t* own = base + static_cast<size_t>(r) * bytes;
  if (own != in.data_ptr()) std::memcpy(own, in.data_ptr(), bytes);  // in place: already there
  StallDiagnosis::Wait registered(waiting.diagnosis, waiting.fingerprint, gloo_aborter(send_buf.get(), recv_buf.get()));
  for (int i = 1; i < W; ++i) gloo_wait_recv(*recv_buf, waiting, "all_gather receive");
  for (int i = 1; i < W; ++i) gloo_wait_send(*send_buf, waiting, "all_gather send");
}

// All-to-all in one round, like the all-gather: part q of `in` goes to member q, and part p of
// `out` comes from member p.
void gloo_all_to_all(gloo::Context& ctx, const at::Tensor& out, const at::Tensor& in, uint64_t slot,
                     const GlooWaiting& waiting) {
  const int W = ctx.size, r = ctx.rank;
  const size_t part = in.nbytes() / static_cast<size_t>(W);
  auto* src = static_cast<uint8_t*>(in.data_ptr());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  auto send_buf = ctx.createUnboundBuffer(src, in.nbytes());
  auto recv_buf = ctx.createUnboundBuffer(dst, out.nbytes());
  for (int i = 1; i < W; ++i) {
    const int from = (r + W - i) % W;
    recv_buf->recv(from, slot, static_cast<size_t>(from) * part, part);
  }
  for (int i = 1; i < W; ++i) {
    const int to = (r + i) % W;
    send_buf->send(to, slot, static_cast<size_t>(to) * part, part);
  }
  std::memcpy(dst + static_cast<size_t>(r) * part, src + static_cast<size_t>(r) * part, part);
  StallDiagnosis::Wait registered(waiting.diagnosis, waiting.fingerprint, gloo_aborter(send_buf.get(), recv_buf.get()));
  for (int i = 1; i < W; ++i) gloo_wait_recv(*recv_buf, waiting, "all_to_all receive");
  for (int i = 1; i < W; ++i) gloo_wait_send(*send_buf, waiting, "all_to_all send");
}

// Ring reduce-scatter, using `in` as its working buffer: in step s, rank r sends its partial sum
// of chunk (r - 1 - s) mod W to r + 1 and adds the partial sum of chunk (r - 2 - s) mod W received
// from r - 1. After W - 1 steps chunk r is complete on rank r; the last step's additions write it
// straight into `out`. Traffic per rank: (W-1)/W of the input, like a ring all-gather. Pipelined
// by segments into the receive ring `scratch`.
void gloo_reduce_scatter(gloo::Context& ctx, const at::Tensor& out, const at::Tensor& in, uint64_t slot,
                         at::Tensor& scratch, const GlooWaiting& waiting) {
  const int W = ctx.size, r = ctx.rank;
  const int64_t n = out.numel();
  if (W == 1) {
    out.copy_(in);
    return;
  }
  if (n == 0) return;
  const int64_t elem = in.element_size();
  const int64_t seg = std::max<int64_t>(1, std::min<int64_t>(n, static_cast<int64_t>(kSegmentBytes) / elem));
  const int64_t segments = (n + seg - 1) / seg;
  const int64_t receives = segments * (W - 1);
  const int64_t depth = std::min<int64_t>(kDepth, receives);
  if (scratch.numel() < depth * seg || scratch.scalar_type() != in.scalar_type()) {
    scratch = at::Tensor();
    scratch = at::empty({depth * seg}, in.options());
  }
  at::Tensor flat = in.view({W * n});
  auto send_buf = ctx.createUnboundBuffer(in.data_ptr(), in.nbytes());
  auto recv_buf = ctx.createUnboundBuffer(scratch.data_ptr(), scratch.nbytes());
  const int next = (r + 1) % W, prev = (r + W - 1) % W;
  auto chunk_at = [&](int64_t step, int shift) {
    return ((r - shift - step) % W + W) % W;
  };
  auto seg_len = [&](int64_t k) {
    return std::min(seg, n - k * seg);
  };
  // Receive j is segment j % segments of step j / segments, into scratch slot j % depth.
  auto post_recv = [&](int64_t j) {
    recv_buf->recv(prev, slot, static_cast<size_t>((j % depth) * seg * elem),
                   static_cast<size_t>(seg_len(j % segments) * elem));
  };
  int64_t sends = 0;
  auto send_segment = [&](int chunk, int64_t k) {
    send_buf->send(next, slot, static_cast<size_t>((chunk * n + k * seg) * elem),
                   static_cast<size_t>(seg_len(k) * elem));
    ++sends;
  };
  for (int64_t j = 0; j < depth; ++j) post_recv(j);
  for (int64_t k = 0; k < segments; ++k) send_segment(chunk_at(0, 1), k);
  StallDiagnosis::Wait registered(waiting.diagnosis, waiting.fingerprint, gloo_aborter(send_buf.get(), recv_buf.get()));
  for (int64_t j = 0; j < receives; ++j) {
    gloo_wait_recv(*recv_buf, waiting, "reduce_scatter receive");
    const int64_t step = j / segments, k = j % segments, len = seg_len(k);
    const int chunk = chunk_at(step, 2);
    at::Tensor partial = flat.narrow(0, chunk * n + k * seg, len);
    at::Tensor received = scratch.narrow(0, (j % depth) * seg, len);
    if (step + 1 < W - 1) {
      partial.add_(received);
    } else {
      at::Tensor o = out.narrow(0, k * seg, len);  // chunk == r: the result goes out directly
      add_to_output(o, partial, received);
    }
    if (j + depth < receives) post_recv(j + depth);
    if (step + 1 < W - 1) send_segment(chunk, k);  // this partial sum is the next step's send
  }
  for (int64_t i = 0; i < sends; ++i) gloo_wait_send(*send_buf, waiting, "reduce_scatter send");
}

}  // namespace fsdp
