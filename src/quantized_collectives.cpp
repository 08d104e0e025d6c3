#include "quantized_collectives.h"

#include <algorithm>
#include <string>

#include "fsdp/check.h"
#include "internal_op_guard.h"

namespace fsdp {

void DequantizingWork::wait() {
  inner_->wait();
  std::lock_guard<std::mutex> lock(mu_);
  if (then_) {
    InternalOpGuard internal;
    at::NoGradGuard no_grad;
    auto then = std::move(then_);
    then_ = nullptr;
    then();
  }
}

namespace {

// out (any floating dtype) = the sum of `count` packed forms of the part from `origin`, `stride`
// bytes apart, in float32.
void sum_into(const at::Tensor& out, const at::Tensor& packed, int64_t count, int64_t stride, const BlockFormat& format,
              int64_t origin) {
  if (out.scalar_type() == at::kFloat && out.is_contiguous())
    return sum_dequantized_into(out, packed, count, stride, format, origin);
  at::Tensor sum = at::empty({out.numel()}, out.options().dtype(at::kFloat));
  sum_dequantized_into(sum, packed, count, stride, format, origin);
  out.copy_(sum);
}

// The residual of `values` (float32 zeros at first use), or undefined without error feedback.
at::Tensor residual_for(at::Tensor* residual, const at::Tensor& values) {
  if (!residual) return at::Tensor();
  if (!residual->defined()) *residual = at::zeros({values.numel()}, values.options().dtype(at::kFloat));
  return *residual;
}

}  // namespace

int64_t packed_slot_bytes(const BlockFormat& format, int64_t parts, int64_t numel, int64_t origin) {
  int64_t most = 0;
  for (int64_t q = 0; q < parts; ++q) most = std::max(most, format.packed_bytes(numel, origin + q * numel));
  return most;
}

WorkPtr quantized_reduce_scatter(Communicator& comm, const at::Tensor& out, const at::Tensor& in,
                                 const QuantizedBuffers& buffers, at::Tensor* residual, CollectiveOptions opts) {
  const int W = comm.size();
  const BlockFormat format = buffers.format;
  const int64_t n = out.numel(), origin = buffers.origin, per = packed_slot_bytes(format, W, n, origin);
  FSDP_CHECK(in.numel() == W * n, "quantized_reduce_scatter: the input is not size() times the output");
  auto bytes = in.options().dtype(at::kByte);
  at::Tensor packed = buffers.pool->empty(W * per, bytes), received = buffers.pool->empty(W * per, bytes);
  MemoryTracker* memory = buffers.memory;
  memory->add_grad(2 * W * per);
  const at::Tensor res = residual_for(residual, in);
  for (int q = 0; q < W; ++q)
    quantize_into_slot(packed.narrow(0, q * per, per), in.narrow(0, q * n, n),
                       res.defined() ? res.narrow(0, q * n, n) : at::Tensor(), format, origin + q * n);
  WorkPtr work = comm.all_to_all_into(received, packed, std::move(opts));
  const int64_t mine = origin + comm.rank() * n;
  auto unpack = [packed, received, out, W, per, format, memory, mine]() mutable {
    sum_into(out, received, W, per, format, mine);
    memory->add_grad(-2 * W * per);
    packed = at::Tensor();
    received = at::Tensor();
  };
  return std::make_shared<DequantizingWork>(std::move(work), std::move(unpack));
}

WorkPtr quantized_all_reduce(Communicator& comm, const at::Tensor& t, const QuantizedBuffers& buffers,
                             QuantizationResiduals* residuals, CollectiveOptions opts) {
  FSDP_CHECK(t.dim() == 1 && t.is_contiguous(), "quantized_all_reduce: t must be 1-D and contiguous");
  const int W = comm.size(), me = comm.rank();
  const BlockFormat format = buffers.format;
  // Member q owns part q: p values from q * p (the last parts shorter, or empty).
  const int64_t N = t.numel(), p = (N + W - 1) / W, origin = buffers.origin;
  auto length = [N, p](int q) {
    return std::max<int64_t>(0, std::min(p, N - q * p));
  };
  // Part q's packed form starts a slot of `per` bytes (the largest part's; the last parts are shorter).
  int64_t per = 0;
  for (int q = 0; q < W; ++q) per = std::max(per, format.packed_bytes(length(q), origin + q * p));
  auto bytes = t.options().dtype(at::kByte);
  BufferPool& pool = *buffers.pool;
  at::Tensor packed = pool.empty(W * per, bytes), received = pool.empty(W * per, bytes), own = pool.empty(per, bytes),
             gathered = pool.empty(W * per, bytes);
  MemoryTracker* memory = buffers.memory;
  const int64_t counted = (3 * W + 1) * per;
  memory->add_grad(counted);
  const bool feedback = residuals && residuals->enabled;
  const at::Tensor sent = feedback ? residual_for(&residuals->sent, t) : at::Tensor();
  if (feedback && !residuals->summed.defined())
    residuals->summed = at::zeros({length(me)}, t.options().dtype(at::kFloat));
  const at::Tensor summed = feedback ? residuals->summed : at::Tensor();

  // Stage 1: each member's parts, quantized once, to their owners.
  auto quantize = [packed, t, sent, format, W, N, p, per, length, origin]() {
    for (int q = 0; q < W; ++q) {
      const int64_t len = length(q), from = std::min(N, q * p);  // an empty part at the end
      quantize_into_slot(packed.narrow(0, q * per, per), t.narrow(0, from, len),
                         sent.defined() ? sent.narrow(0, from, len) : at::Tensor(), format, origin + q * p);
    }
  };
  const std::string label = opts.label;
  if (opts.after)
    opts.after = std::make_shared<DequantizingWork>(std::move(opts.after), std::move(quantize));
  else
    quantize();
  WorkPtr scatter = comm.all_to_all_into(received, packed, std::move(opts));

  // Stage 2: the owner sums its part in float32 in member order and quantizes the sum once.
  auto sum_and_quantize = [received, own, summed, format, W, per, len = length(me), from = origin + me * p]() {
    at::Tensor sum = at::empty({len}, received.options().dtype(at::kFloat));
    sum_dequantized_into(sum, received, W, per, format, from);
    quantize_into_slot(own, sum, summed, format, from);
  };
  CollectiveOptions gather_opts = CollectiveOptions::labeled(label + ", quantized sums all-gather");
  gather_opts.tag = 0;
  gather_opts.after = std::make_shared<DequantizingWork>(std::move(scatter), std::move(sum_and_quantize));
  WorkPtr gather = comm.all_gather_into(gathered, own, std::move(gather_opts));

  // Every member, the owner too, takes the dequantized sums: all hold the same values.
  auto unpack = [gathered, t, format, W, p, per, length, memory, counted, origin]() mutable {
    for (int q = 0; q < W; ++q) {
      const int64_t len = length(q), from = origin + q * p;
      if (len > 0)
        dequantize_into(t.narrow(0, q * p, len), gathered.narrow(0, q * per, format.packed_bytes(len, from)), format,
                        from);
    }
    memory->add_grad(-counted);
    gathered = at::Tensor();
  };
  return std::make_shared<DequantizingWork>(std::move(gather), std::move(unpack));
}

}  // namespace fsdp
