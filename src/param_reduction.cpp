#include "fsdp/param_reduction.h"

#include <algorithm>

#include "fsdp/check.h"
#include "state_access.h"

namespace fsdp {

ParamReduction::ParamReduction(FullyShardedModule& module) : state_(&detail::StateAccess::of(module)) {
  FsdpState& state = *state_;
  for (size_t f = 0; f < state.flat_params().size(); ++f) {
    const auto& fp = state.flat_params()[f];
    const int64_t lo = fp->keep_unsharded() ? 0 : int64_t(fp->shard_rank()) * fp->shard_numel();
    for (const auto& s : fp->slots()) {
      WholeParam p;
      p.name = s.name;
      p.shape = s.shape;
      p.numel = s.numel;
      p.trainable = fp->requires_grad();
      p.dtype = fp->dtype();
      if (s.piece.defined()) {
        p.piece = s.piece;
        p.begin = lo + s.piece_offset - s.offset;
      }
      params_.push_back(std::move(p));
      flat_of_.push_back(f);
    }
  }
  const CommunicatorPtr& shard = state.groups().shard_comm;
  if (!state.groups().keep_unsharded && shard && shard->size() > 1) comm_ = shard;
}

bool ParamReduction::update_trainable() {
  bool changed = false;
  for (size_t i = 0; i < params_.size(); ++i) {
    const bool now = state_->flat_params()[flat_of_[i]]->requires_grad();
    changed = changed || now != params_[i].trainable;
    params_[i].trainable = now;
  }
  return changed;
}

int ParamReduction::add(const at::Tensor& part, Combine how) {
  FSDP_CHECK(part.is_floating_point(), "ParamReduction::add: the part must be floating point, got ",
             part.scalar_type());
  parts_.push_back(part.detach().reshape({-1}));
  how_.push_back(how);
  return static_cast<int>(parts_.size()) - 1;
}

void ParamReduction::run() {
  RuntimeCall call(*state_);  // rethrows an error of the runtime's (a failed reduction) first
  results_.clear();
  if (parts_.empty()) return;
  std::vector<int64_t> offsets{0};
  for (const auto& p : parts_) offsets.push_back(offsets.back() + p.numel());
  const int64_t n = offsets.back();
  // One float64 buffer carries every part (Note [Whole-parameter reductions]), built where the
  // collective runs and copied to the host once.
  const c10::Device device = comm_ ? comm_->device() : c10::Device(at::kCPU);
  std::vector<at::Tensor> on_device;
  on_device.reserve(parts_.size());
  for (const auto& p : parts_) on_device.push_back(p.to(device, at::kDouble));
  const at::Tensor local = at::cat(on_device);
  at::Tensor combined;
  if (!comm_) {
    combined = local.cpu();
  } else {
    const int members = comm_->size();
    at::Tensor gathered = at::empty({members * n}, local.options());
    comm_->all_gather_into(gathered, local, CollectiveOptions::labeled("whole-parameter reductions: all-gather"))
        ->wait();
    ++collectives_;
    bytes_sent_ += n * int64_t(sizeof(double));
    const at::Tensor all = gathered.cpu().view({members, n});
    // Combined in rank order, so that every rank computes the same values: sums of every element,
    // then the maxima of the parts that ask for them.
    combined = all[0].clone();
    for (int r = 1; r < members; ++r) combined.add_(all[r]);
    for (size_t i = 0; i < parts_.size(); ++i)
      if (how_[i] == Combine::kMax)
        combined.narrow(0, offsets[i], parts_[i].numel()).copy_(all.narrow(1, offsets[i], parts_[i].numel()).amax(0));
  }
  for (size_t i = 0; i < parts_.size(); ++i) results_.push_back(combined.narrow(0, offsets[i], parts_[i].numel()));
  parts_.clear();
  how_.clear();
}

const at::Tensor& ParamReduction::result(int id) const {
  FSDP_CHECK(id >= 0 && id < static_cast<int>(results_.size()), "ParamReduction::result: no reduction ", id,
             " in the last run() (", results_.size(), " ran)");
  return results_[static_cast<size_t>(id)];
}

PieceRows piece_rows(const WholeParam& p, const at::Tensor& values) {
  FSDP_CHECK(p.shape.size() == 2, "piece_rows: '", p.name, "' is not a matrix");
  const int64_t cols = std::max<int64_t>(1, p.shape[1]);
  const int64_t n = values.numel();
  PieceRows out;
  out.first_row = p.begin / cols;
  const int64_t end_row = (p.begin + n + cols - 1) / cols;
  out.matrix = at::zeros({end_row - out.first_row, cols}, values.options());
  out.matrix.view({-1}).narrow(0, p.begin - out.first_row * cols, n).copy_(values.reshape({-1}));
  return out;
}

at::Tensor piece_of_rows(const WholeParam& p, const at::Tensor& matrix) {
  const int64_t cols = std::max<int64_t>(1, p.shape[1]);
  const int64_t first_row = p.begin / cols;
  return matrix.reshape({-1}).narrow(0, p.begin - first_row * cols, p.piece.numel());
}

}  // namespace fsdp
