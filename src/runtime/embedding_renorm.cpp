#include "runtime/embedding_renorm.h"

#include <cmath>
#include <cstring>
#include <string>

#include "fsdp/check.h"
#include "internal_op_guard.h"

namespace fsdp {

bool is_embedding_renorm(const char* op) { return std::strcmp(op, "aten::embedding_renorm_") == 0; }

bool has_max_norm_embedding(const torch::nn::Module& module) {
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (const auto* e = dynamic_cast<const torch::nn::EmbeddingImpl*>(m.get()); e && e->options.max_norm()) return true;
    if (const auto* b = dynamic_cast<const torch::nn::EmbeddingBagImpl*>(m.get()); b && b->options.max_norm())
      return true;
  }
  return false;
}

namespace {

// A row's norm as the operator's kernel on the row's device takes it: the CPU kernel's row.norm(p);
// CUDA's sums x^p without the absolute value for p other than 1 and 2, in its accumulation type.
double kernel_row_norm(const at::Tensor& row, double p) {
  if (row.is_cpu() || p == 1 || p == 2) return row.norm(p).item<double>();
  const bool in_double = row.scalar_type() == at::kDouble;
  const double sum = row.to(in_double ? at::kDouble : at::kFloat).pow(p).sum().item<double>();
  return in_double ? std::pow(sum, 1.0 / p) : double(std::pow(float(sum), float(1.0 / p)));
}

}  // namespace

void renorm_rows_of_every_rank(const at::RecordFunction& fn, FlatParam& fp, const ParamSlot& slot) {
  const auto inputs = fn.inputs();
  if (inputs.size() < 4 || !inputs[0].isTensor() || !inputs[1].isTensor()) return;  // the kernel says why
  const at::Tensor weight = inputs[0].toTensor();
  const at::Tensor indices = inputs[1].toTensor();
  const double max_norm = inputs[2].toDouble(), norm_type = inputs[3].toDouble();
  if (weight.dim() != 2 || weight.numel() == 0) return;
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  const int64_t rows = weight.size(0), cols = weight.size(1);

  // Which rows this rank's indices name, and how many ranks name each.
  at::Tensor mine = at::zeros({rows}, weight.options().dtype(at::kFloat));
  mine.index_fill_(0, indices.reshape({-1}).to(at::kLong), 1);
  at::Tensor named = mine;
  const CommunicatorPtr& world = fp.groups().world_comm;
  if (world && world->size() > 1) {
    named = mine.to(world->device(), at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    world->all_reduce(named, CollectiveOptions::labeled("embedding max_norm rows of '" + slot.name + "'"))->wait();
  }
  const at::Tensor any = named.cpu().nonzero().reshape({-1});
  const at::Tensor own = mine.cpu();
  const int64_t* row_ids = any.data_ptr<int64_t>();
  const float* own_rows = own.data_ptr<float>();
  const bool separate_shard = weight.storage().unsafeGetStorageImpl() != fp.shard().storage().unsafeGetStorageImpl();

  // Row by row as the operator's kernel does, so that the scale of a row it renormalizes here is
  // the one it computes for it.
  for (int64_t i = 0; i < any.numel(); ++i) {
    const int64_t r = row_ids[i];
    at::Tensor row = weight.select(0, r);
    const double norm = kernel_row_norm(row, norm_type);
    if (!(norm > max_norm)) continue;
    const double scale = max_norm / (norm + 1e-7);
    if (own_rows[r] == 0) row.mul_(scale);
    if (separate_shard) fp.scale_shard_range(slot.offset + r * cols, slot.offset + (r + 1) * cols, scale);
  }
}

}  // namespace fsdp
