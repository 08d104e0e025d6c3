#include "optimizer.h"

#include <fsdp/adafactor.h>
#include <fsdp/lamb.h>
#include <fsdp/muon.h>
#include <fsdp/optim.h>

namespace gpt {

std::unique_ptr<torch::optim::AdamW> make_adamw(const std::vector<std::pair<std::string, torch::Tensor>>& named,
                                                const std::map<std::string, int64_t>& dims, double lr,
                                                double weight_decay, bool fused) {
  std::vector<torch::Tensor> decayed, not_decayed;
  for (const auto& [name, p] : named) (dims.at(name) >= 2 ? decayed : not_decayed).push_back(p);
  // beta2 0.99 instead of 0.999 (nanoGPT's choice for small character-level runs): the
  // second-moment estimate then adapts within ~100 steps, a fraction of a run this short.
  auto options = [&](double wd) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(lr).betas({0.9, 0.99}).weight_decay(wd));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decayed, options(weight_decay));
  groups.emplace_back(not_decayed, options(0.0));
  if (fused) return std::make_unique<fsdp::FusedAdamW>(std::move(groups), *options(weight_decay));
  return std::make_unique<torch::optim::AdamW>(std::move(groups), *options(weight_decay));
}

bool muon_steps(const std::string& name) { return name.rfind("blocks.", 0) == 0; }

std::unique_ptr<torch::optim::Optimizer> make_whole_param_optimizer(const std::string& kind,
                                                                    fsdp::FullyShardedModule& sharded,
                                                                    const std::map<std::string, int64_t>& dims,
                                                                    double lr, double weight_decay) {
  // Groups alike on every rank (a rank may hold no piece of one): matrices and embeddings, the
  // rest; for Muon, the blocks' parameters first.
  std::vector<torch::Tensor> blocks, decayed, not_decayed;
  for (const auto& p : sharded.shard_pieces()) {
    if (!p.piece.requires_grad()) continue;
    if (kind == "muon" && muon_steps(p.name))
      blocks.push_back(p.piece);
    else
      (dims.at(p.name) >= 2 ? decayed : not_decayed).push_back(p.piece);
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (kind == "lamb") {
    auto o = [&](double wd) {
      return std::make_unique<fsdp::LambOptions>(fsdp::LambOptions(lr).betas({0.9, 0.99}).weight_decay(wd));
    };
    groups.emplace_back(decayed, o(weight_decay));
    groups.emplace_back(not_decayed, o(0));
    return std::make_unique<fsdp::Lamb>(sharded, std::move(groups), *o(weight_decay));
  }
  if (kind == "adafactor") {
    auto o = [&](double wd) {
      return std::make_unique<fsdp::AdafactorOptions>(
          fsdp::AdafactorOptions(lr).relative_step(false).scale_parameter(false).weight_decay(wd));
    };
    groups.emplace_back(decayed, o(weight_decay));
    groups.emplace_back(not_decayed, o(0));
    return std::make_unique<fsdp::Adafactor>(sharded, std::move(groups), *o(weight_decay));
  }
  TORCH_CHECK(kind == "muon", "unknown optimizer '", kind, "'");
  auto adamw = [&](double wd) {
    return fsdp::MuonAdamW(lr).betas({0.9, 0.99}).weight_decay(wd);
  };
  auto o = [&](bool muon, double wd) {
    return std::make_unique<fsdp::MuonOptions>(fsdp::MuonOptions(kMuonLrScale * lr).use_muon(muon).adamw(adamw(wd)));
  };
  groups.emplace_back(blocks, o(true, 0));
  groups.emplace_back(decayed, o(false, weight_decay));
  groups.emplace_back(not_decayed, o(false, 0));
  return std::make_unique<fsdp::Muon>(sharded, std::move(groups), *o(true, 0));
}

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) {
    if (auto* muon = dynamic_cast<fsdp::MuonOptions*>(&group.options())) {
      muon->lr(kMuonLrScale * lr);
      muon->adamw().lr(lr);
    } else {
      group.options().set_lr(lr);
    }
  }
}

}  // namespace gpt
