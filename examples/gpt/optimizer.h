#pragma once
// The GPT's optimizer as the example trainer and the peer benchmark build it.
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
// number of dimensions.
std::unique_ptr<torch::optim::AdamW> make_adamw(const std::vector<std::pair<std::string, torch::Tensor>>& named,
                                                const std::map<std::string, int64_t>& dims, double lr,
                                                double weight_decay);

}  // namespace gpt
