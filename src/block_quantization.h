#pragma once
// Block quantization of flat tensors for communication: each block of `block` consecutive values
// travels as 8-bit codes (int8, or float8 e4m3 where LibTorch has it) and one float32 scale, in one
// packed byte buffer: [scales: float32 x blocks][codes: 1 byte x blocks * block]. Round to
// nearest: the error of a value is at most half a code step of its block (error_bound()). See
// Note [Quantized communication] in docs/design.md.
#include <torch/torch.h>

#include <cstdint>

#include "fsdp/options.h"

namespace fsdp {

struct BlockFormat {
  QuantizedDtype dtype = QuantizedDtype::kInt8;
  int64_t block = 256;
  int64_t blocks(int64_t numel) const { return (numel + block - 1) / block; }
  // Bytes of the packed form of `numel` values.
  int64_t packed_bytes(int64_t numel) const { return blocks(numel) * (4 + block); }
};

// Whether this LibTorch has the 8-bit float type kFloat8E4M3 needs.
bool has_float8();

// Packs the 1-D `values` (any floating dtype; numel n) into `packed` (uint8, packed_bytes(n)).
void quantize_into(const at::Tensor& packed, const at::Tensor& values, const BlockFormat& format);
// Unpacks `count` consecutive packed buffers of `numel` values each (as all_gather_into lays them
// out) into the 1-D `out` (numel count * numel), cast to out's dtype.
void dequantize_into(const at::Tensor& out, const at::Tensor& packed, int64_t count, int64_t numel,
                     const BlockFormat& format);
// out (float32, contiguous, numel `numel`) = the sum, in order, of `count` packed buffers of
// `numel` values each, buffer r starting at byte r * stride of `packed`.
void sum_dequantized_into(const at::Tensor& out, const at::Tensor& packed, int64_t count, int64_t numel, int64_t stride,
                          const BlockFormat& format);
// quantize_into() with error feedback: with `residual` defined (float32, values' numel), packs
// values + residual and leaves in `residual` what the codes drop of that (values + residual minus
// their dequantized codes).
void quantize_with_feedback(const at::Tensor& packed, const at::Tensor& values, const at::Tensor& residual,
                            const BlockFormat& format);
// The largest |dequantized - value| quantize_into allows for a value of a block whose largest
// magnitude is `block_max`.
double error_bound(double block_max, const BlockFormat& format);

}  // namespace fsdp
