#include "model_cost.h"

#include <torch/version.h>

#include "model.h"

namespace gpt {

fsdp::ModuleCost module_cost(const std::string&, const torch::nn::Module& module, int64_t seq_len) {
  fsdp::ModuleCost cost;
  const auto context = static_cast<double>(seq_len);
  if (const auto* attn = dynamic_cast<const CausalSelfAttentionImpl*>(&module)) {
    const auto width = static_cast<double>(attn->proj->options.in_features());
    cost.forward_flops = 4.0 * context * width;  // scores and mixing
#if TORCH_VERSION_MAJOR >= 2
    // q, k, v; the fused kernel's log-sum-exp (its output is the projection's input, counted there)
    cost.activation_values = 3.0 * width + static_cast<double>(attn->heads);
#else
    cost.activation_values = 3.0 * width + static_cast<double>(attn->heads) * context;  // q, k, v; softmax
#endif
  } else if (const auto* mlp = dynamic_cast<const MLPImpl*>(&module)) {
    cost.activation_values = static_cast<double>(mlp->fc->options.out_features());  // GELU's input
  } else if (const auto* model = dynamic_cast<const GPTImpl*>(&module)) {
    // The loss's log-softmax, of the logits cast to float32 (next_token_loss) in every precision.
    cost.activation_bytes = 4.0 * static_cast<double>(model->config.vocab_size);
  }
  return cost;
}

}  // namespace gpt
