// The shards as the original parameters see them: each rank's pieces with their parameters' shapes
// (FullyShardedModule::shard_pieces) and each parameter's gradient norm (grad_norms).
#include "fsdp/fully_shard.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "fsdp/check.h"
#include "internal_op_guard.h"
#include "runtime/fsdp_state.h"

namespace fsdp {

std::vector<ShardPiece> FullyShardedModule::shard_pieces() const {
  std::vector<ShardPiece> out;
  for (const auto& fp : state_->flat_params()) {
    const int64_t lo = fp->keep_unsharded() ? 0 : int64_t(fp->shard_rank()) * fp->shard_numel();
    for (const auto& s : fp->slots())
      if (s.piece.defined()) out.push_back({s.name, s.piece, s.shape, lo + s.piece_offset - s.offset});
  }
  return out;
}

std::vector<std::pair<std::string, double>> FullyShardedModule::grad_norms(double norm_type) {
  FSDP_CHECK(norm_type > 0 && !std::isnan(norm_type), "grad_norms: norm_type must be positive or infinity, got ",
             norm_type);
  FsdpState& state = *state_;
  RuntimeCall call(state);
  FSDP_CHECK(!state.reducer().holds_unreduced(), GradientReducer::unreduced_error("grad_norms"));
  InternalOpGuard internal;  // its norms of the pieces are its own (Note [Norms of shard pieces])
  const bool inf = std::isinf(norm_type);
  // Per original parameter, in the same order on every rank: this rank's part (max |g|, or sum
  // |g|^p) and whether it holds a gradient of it.
  std::vector<const ParamSlot*> slots;
  for (const auto& fp : state.flat_params())
    for (const auto& s : fp->slots()) slots.push_back(&s);
  const int64_t n = static_cast<int64_t>(slots.size());
  at::Tensor local = at::zeros({2 * n}, at::kDouble);
  auto* v = local.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    const ParamSlot& s = *slots[i];
    if (!s.piece.defined() || !s.piece.grad().defined()) continue;
    at::Tensor g = s.piece.grad().to(at::kDouble);
    if (g.is_sparse()) g = g.coalesce().values();
    v[2 * i + 1] = 1;
    if (g.numel() == 0) continue;
    v[2 * i] = inf ? g.abs().max().item<double>() : g.norm(norm_type).pow(norm_type).item<double>();
  }
  // Pieces are disjoint within a shard group and equal across replicas (Note [Clipping across
  // shards]): gather the shard group's parts and combine them in rank order.
  at::Tensor parts = local;
  const CommunicatorPtr& shard = state.groups().shard_comm;
  if (!state.groups().keep_unsharded && shard && shard->size() > 1) {
    const at::Tensor mine = local.to(shard->device());
    at::Tensor gathered = at::empty({shard->size() * 2 * n}, mine.options());
    shard->all_gather_into(gathered, mine, CollectiveOptions::labeled("grad_norms: all-gather"))->wait();
    parts = gathered.cpu();
  }
  const auto* p = parts.data_ptr<double>();
  const int64_t members = parts.numel() / std::max<int64_t>(1, 2 * n);
  std::vector<std::pair<std::string, double>> out;
  for (int64_t i = 0; i < n; ++i) {
    double total = 0;
    bool has = false;
    for (int64_t r = 0; r < members; ++r) {
      const double part = p[r * 2 * n + 2 * i];
      has = has || p[r * 2 * n + 2 * i + 1] > 0;
      total = inf ? std::max(total, part) : total + part;
    }
    if (has) out.emplace_back(slots[i]->name, inf ? total : std::pow(total, 1.0 / norm_type));
  }
  return out;
}

}  // namespace fsdp
