#pragma once
// The optimizers whose state a checkpoint carries (torch::optim::AdamW, fsdp::FusedAdamW as AdamW,
// Adam, SGD, Adagrad, RMSprop, fsdp::Lamb, fsdp::Muon, fsdp::Adafactor, fsdp::LBFGS): their kind,
// and one parameter's state as named tensors plus a step count. LibTorch keys an optimizer's state
// by the parameter's TensorImpl.
#include <torch/torch.h>

#include <map>
#include <string>

#include <nlohmann/json.hpp>

namespace fsdp::checkpoint::detail {

enum class OptimizerKind { kNone, kAdamW, kAdam, kSgd, kAdagrad, kRmsprop, kLamb, kMuon, kAdafactor, kLbfgs };
// Null: kNone. Throws for an optimizer of another kind, naming the supported ones.
OptimizerKind optimizer_kind(const torch::optim::Optimizer* optimizer);
std::string to_string(OptimizerKind kind);

// What an optimizer keeps besides its options and its pieces' state (fsdp::LBFGS's history's
// scalars), into its first group's saved options, and back (before the pieces' state is set).
void add_optimizer_scalars(OptimizerKind kind, const torch::optim::Optimizer& optimizer, nlohmann::json& group);
void restore_optimizer_scalars(OptimizerKind kind, const nlohmann::json& group, torch::optim::Optimizer& optimizer,
                               const std::string& where);

// The optimizer's parameter group of each tensor it holds (by TensorImpl); empty for null.
std::map<const c10::TensorImpl*, int> groups_by_tensor(const torch::optim::Optimizer* optimizer);

struct PieceState {
  bool present = false;                       // false: the optimizer has no state for it (never stepped)
  int64_t step = 0;                           // all but SGD
  std::map<std::string, at::Tensor> tensors;  // exp_avg, exp_avg_sq, momentum_buffer, sum, square_avg, ...
};
PieceState get_piece_state(OptimizerKind kind, torch::optim::Optimizer& optimizer, const at::Tensor& param);
// Replaces the parameter's state (removes it if !state.present).
void set_piece_state(OptimizerKind kind, torch::optim::Optimizer& optimizer, const at::Tensor& param,
                     const PieceState& state);

}  // namespace fsdp::checkpoint::detail
