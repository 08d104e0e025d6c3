#pragma once
// The GPT's optimizer as the example trainer and the peer benchmark build it.
#include <fsdp/fully_shard.h>
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace gpt {

// AdamW with betas (0.9, 0.99), weight decay on the parameters of matrices and embeddings only:
// `named` are the parameters (or shard pieces, which are 1-D) by name, `dims` each name's original
// number of dimensions; `fused`: an fsdp::FusedAdamW.
std::unique_ptr<torch::optim::AdamW> make_adamw(const std::vector<std::pair<std::string, torch::Tensor>>& named,
                                                const std::map<std::string, int64_t>& dims, double lr,
                                                double weight_decay, bool fused = false);

// Muon's learning rate for the blocks' matrices, as a multiple of the AdamW learning rate.
constexpr double kMuonLrScale = 20;

// Whether muon's groups give the parameter `name` to Muon (where it is a matrix): the blocks'.
bool muon_steps(const std::string& name);

// `kind` (lamb, adafactor, muon) over the pieces of `sharded`, grouped by `dims` as make_adamw does:
// lamb with AdamW's betas; adafactor with a fixed (scheduled) lr and no parameter scaling; muon for
// the blocks' matrices at kMuonLrScale x lr, AdamW for the embeddings and vectors.
std::unique_ptr<torch::optim::Optimizer> make_whole_param_optimizer(const std::string& kind,
                                                                    fsdp::FullyShardedModule& sharded,
                                                                    const std::map<std::string, int64_t>& dims,
                                                                    double lr, double weight_decay);

// Sets the learning rate of every group to `lr` (Muon's matrices: kMuonLrScale x lr).
void set_learning_rate(torch::optim::Optimizer& optimizer, double lr);

}  // namespace gpt
