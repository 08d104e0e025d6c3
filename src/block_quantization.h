#pragma once
// Block quantization of flat tensors for communication: each block of at most `block` consecutive
// values travels as 8-bit codes (int8, or float8 e4m3 where LibTorch has it) and one float32
// scale, in one packed byte buffer: [scales: float32 x blocks][codes: 1 byte x values]. Blocks
// never span a cut (where a flat parameter's next original parameter starts), so each parameter's
// values get scales of their own. Round to nearest: the error of a value is at most half a code
// step of its block (error_bound()). See Note [Quantized communication] in docs/design.md.
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "fsdp/options.h"

namespace fsdp {

struct BlockFormat {
  QuantizedDtype dtype = QuantizedDtype::kInt8;
  int64_t block = 256;  // >= 1; any size up to INT64_MAX (a block longer than a segment is the segment)
  // Offsets in the flat buffer, ascending, at which a block must end; none: blocks of `block`
  // from each part's start.
  std::shared_ptr<const std::vector<int64_t>> cuts;

  // Calls visit(start, length) for each segment of the part [origin, origin + numel) of the flat
  // buffer (its stretches between cuts), in order, `start` relative to origin.
  template <typename Visit>
  void for_each_segment(int64_t origin, int64_t numel, Visit&& visit) const {
    int64_t start = 0;
    if (cuts)
      for (auto it = std::upper_bound(cuts->begin(), cuts->end(), origin); it != cuts->end() && *it < origin + numel;
           ++it) {
        if (*it - origin > start) visit(start, *it - origin - start);
        start = *it - origin;
      }
    if (numel > start) visit(start, numel - start);
  }
  // Calls visit(start, length) for each block of that part: each segment's values in blocks of
  // `block` from its start, the last one shorter.
  template <typename Visit>
  void for_each_block(int64_t origin, int64_t numel, Visit&& visit) const {
    for_each_segment(origin, numel, [&](int64_t start, int64_t length) {
      for (int64_t i = 0; i < length; i += std::min(block, length - i)) visit(start + i, std::min(block, length - i));
    });
  }
  // Blocks of the part [origin, origin + numel).
  int64_t blocks(int64_t numel, int64_t origin = 0) const {
    int64_t count = 0;
    for_each_segment(origin, numel, [&](int64_t, int64_t length) { count += 1 + (length - 1) / block; });
    return count;
  }
  // Bytes of the packed form of the part [origin, origin + numel).
  int64_t packed_bytes(int64_t numel, int64_t origin = 0) const { return 4 * blocks(numel, origin) + numel; }
};

// The cuts of a flat buffer of `numel` values whose original parameters start at `starts` (any
// order; 0 and numel are no cuts): where blocks must end.
std::shared_ptr<const std::vector<int64_t>> parameter_cuts(std::vector<int64_t> starts, int64_t numel);

// Packs the 1-D `values` (any floating dtype; numel n), the part of the flat buffer from `origin`,
// into `packed` (uint8, packed_bytes(n, origin)).
void quantize_into(const at::Tensor& packed, const at::Tensor& values, const BlockFormat& format, int64_t origin = 0);
// Unpacks one packed part of `out.numel()` values from `origin` into the 1-D `out`, cast to out's dtype.
void dequantize_into(const at::Tensor& out, const at::Tensor& packed, const BlockFormat& format, int64_t origin = 0);
// out (float32, contiguous) = the sum, in order, of `count` packed forms of the same part (out's
// numel values from `origin`), form r starting at byte r * stride of `packed`.
void sum_dequantized_into(const at::Tensor& out, const at::Tensor& packed, int64_t count, int64_t stride,
                          const BlockFormat& format, int64_t origin = 0);
// quantize_into() with error feedback: with `residual` defined (float32, values' numel), packs
// values + residual and leaves in `residual` what the codes drop of that (values + residual minus
// their dequantized codes).
void quantize_with_feedback(const at::Tensor& packed, const at::Tensor& values, const at::Tensor& residual,
                            const BlockFormat& format, int64_t origin = 0);
// quantize_with_feedback() into the first packed_bytes(n, origin) bytes of `slot`, the rest of
// which (the room a larger part of the same collective needs) is zeroed.
void quantize_into_slot(const at::Tensor& slot, const at::Tensor& values, const at::Tensor& residual,
                        const BlockFormat& format, int64_t origin);
// The largest |dequantized - value| quantize_into allows for a value of a block whose largest
// magnitude is `block_max`.
double error_bound(double block_max, const BlockFormat& format);

}  // namespace fsdp
