#include "optimizer.h"

namespace gpt {

std::unique_ptr<torch::optim::AdamW> make_adamw(const std::vector<std::pair<std::string, torch::Tensor>>& named,
                                                const std::map<std::string, int64_t>& dims, double lr,
                                                double weight_decay) {
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
  return std::make_unique<torch::optim::AdamW>(std::move(groups), *options(weight_decay));
}

}  // namespace gpt
