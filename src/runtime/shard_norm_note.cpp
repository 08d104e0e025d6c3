#include "runtime/shard_norm_note.h"

#include <cstring>
#include <mutex>

#include "fsdp/check.h"

namespace fsdp {

bool is_norm_op(const char* op) {
  if (std::strncmp(op, "aten::", 6) != 0) return false;
  const char* bare = op + 6;
  for (const char* n : {"norm", "linalg_vector_norm", "linalg_norm", "frobenius_norm", "_foreach_norm"})
    if (std::strcmp(bare, n) == 0) return true;
  return false;
}

std::string shard_norm_note(FsdpState& state, const at::RecordFunction& fn, const at::Tensor& t) {
  const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  std::lock_guard<std::recursive_mutex> lock(state.mutex());
  for (const auto& fp : state.flat_params()) {
    if (!fp->sharded_over_peers()) continue;  // its pieces are whole parameters
    for (const ParamSlot& s : fp->slots())
      if (s.piece.defined() && s.piece.grad().defined() && s.piece.grad().has_storage() &&
          s.piece.grad().storage().unsafeGetStorageImpl() == storage)
        return detail::compose(
            "libfsdp: operator ", fn.name(), " took a norm of the gradient of shard piece '", s.name,
            "': a piece is this rank's part of a sharded parameter, so the norm is this rank's part only, and "
            "torch::nn::utils::clip_grad_norm_ over FullyShardedModule::parameters() would clip each rank by a "
            "different norm. Clip with FullyShardedModule::clip_grad_norm_(max_norm), which combines the parts over "
            "the ranks; grad_norms() gives each parameter's whole norm. (A norm you combine over the ranks yourself "
            "is right. This note is printed once.)");
  }
  return "";
}

}  // namespace fsdp
