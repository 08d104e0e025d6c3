#pragma once
// Tensors over existing storage built without a dispatcher call: these run per parameter per
// iteration (Note [Per-unit overhead] in docs/design.md). Neither is an autograd view.
#include <torch/torch.h>

namespace fsdp {

// A contiguous tensor of `shape` over `storage` from element `offset`, with like's dtype and
// dispatch keys: what narrow/view or set_ give.
inline at::Tensor alias(const c10::Storage& storage, int64_t offset, at::IntArrayRef shape, const at::Tensor& like) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(storage), like.key_set(), like.dtype());
  impl->set_storage_offset(offset);
  impl->set_sizes_contiguous(shape);
  return at::Tensor(std::move(impl));
}

// The elements [offset, offset + numel) of the 1-D contiguous `flat`, shaped `shape`.
inline at::Tensor region(const at::Tensor& flat, int64_t offset, at::IntArrayRef shape) {
  return alias(flat.storage(), flat.storage_offset() + offset, shape, flat);
}

}  // namespace fsdp
