#include "model.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_set>

namespace gpt {

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GPTConfig& config) : heads(config.heads) {
  TORCH_CHECK(config.width % config.heads == 0, "width ", config.width, " is not divisible by heads ", config.heads);
  qkv = register_module("qkv", torch::nn::Linear(config.width, 3 * config.width));
  proj = register_module("proj", torch::nn::Linear(config.width, config.width));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t batch = x.size(0), time = x.size(1), width = x.size(2), head_dim = width / heads;
  auto q_k_v = qkv(x).chunk(3, /*dim=*/-1);
  // [batch, time, width] -> [batch, heads, time, head_dim]
  auto split_heads = [&](const torch::Tensor& t) {
    return t.view({batch, time, heads, head_dim}).transpose(1, 2);
  };
  auto q = split_heads(q_k_v[0]), k = split_heads(q_k_v[1]), v = split_heads(q_k_v[2]);

#if TORCH_VERSION_MAJOR >= 2
  // LibTorch 2.x: the fused attention kernel (flash attention on a GPU), same math.
  auto mixed = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true)
                   .transpose(1, 2)
                   .reshape({batch, time, width});
#else
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
  // Entries above the diagonal are future positions: mask them out before the softmax.
  auto future = torch::ones({time, time}, torch::TensorOptions().dtype(torch::kBool).device(x.device())).triu(1);
  auto weights = torch::softmax(scores.masked_fill(future, -std::numeric_limits<float>::infinity()), /*dim=*/-1);
  auto mixed = torch::matmul(weights, v).transpose(1, 2).reshape({batch, time, width});
#endif
  return proj(mixed);
}

MLPImpl::MLPImpl(const GPTConfig& config) {
  fc = register_module("fc", torch::nn::Linear(config.width, 4 * config.width));
  proj = register_module("proj", torch::nn::Linear(4 * config.width, config.width));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) { return proj(torch::gelu(fc(x))); }

BlockImpl::BlockImpl(const GPTConfig& config) : dropout(config.dropout) {
  ln_attn = register_module("ln_attn", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.width})));
  attn = register_module("attn", CausalSelfAttention(config));
  ln_mlp = register_module("ln_mlp", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.width})));
  mlp = register_module("mlp", MLP(config));
}

torch::Tensor BlockImpl::forward(torch::Tensor x) {
  // In training mode only (evaluation and generation switch it off), also inside a checkpointed
  // block's forward, which runs without gradients and whose recomputation must draw the same masks.
  const bool drop = dropout > 0 && is_training();
  const auto maybe_drop = [&](const torch::Tensor& t) {
    return drop ? torch::dropout(t, dropout, true) : t;
  };
  x = x + maybe_drop(attn(ln_attn(x)));
  return x + maybe_drop(mlp(ln_mlp(x)));
}

TiedLMHeadImpl::TiedLMHeadImpl(torch::Tensor embedding_weight) {
  weight = register_parameter("weight", std::move(embedding_weight));
}

torch::Tensor TiedLMHeadImpl::forward(const torch::Tensor& x) { return torch::linear(x, weight); }

GPTImpl::GPTImpl(const GPTConfig& cfg) : config(cfg) {
  // The module constructors below draw LibTorch's default initializations from the global
  // generator. Rewind it afterwards, so the weights depend on the seed and `initialize` alone: the
  // same whether the model is built eagerly or deferred (meta tensors draw nothing, and FSDP calls
  // `initialize` module by module in this same pre-order).
  auto generator = at::detail::getDefaultCPUGenerator();
  at::Tensor seed_state;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    seed_state = generator.get_state();
  }
  token_embedding = register_module("token_embedding", torch::nn::Embedding(config.vocab_size, config.width));
  position_embedding = register_module("position_embedding", torch::nn::Embedding(config.context, config.width));
  for (int64_t i = 0; i < config.layers; ++i) {
    if (config.activation_checkpointing && (config.checkpointed_blocks == 0 || i < config.checkpointed_blocks))
      blocks->push_back(fsdp::Checkpointed<Block>(Block(config)));
    else
      blocks->push_back(Block(config));
  }
  register_module("blocks", blocks);
  ln_final = register_module("ln_final", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.width})));
  lm_head = register_module("lm_head", TiedLMHead(token_embedding->weight));
  if (token_embedding->weight.is_meta()) return;  // deferred: initialized when materialized

  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(seed_state);
  }
  torch::NoGradGuard no_grad;
  for (const auto& item : named_modules(/*name_prefix=*/"", /*include_self=*/false))
    initialize(config, item.key(), *item.value());
}

void initialize(const GPTConfig& config, const std::string& name, torch::nn::Module& module) {
  // GPT-2's initialization: small normal weights, zero biases, and the projections that write into
  // the residual stream scaled down by sqrt(2 * layers) so the stream's variance does not grow
  // with depth. LibTorch's default N(0, 1) embedding would give the tied head huge initial logits.
  auto ends_with = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (auto* linear = module.as<torch::nn::Linear>()) {
    const bool residual = ends_with("attn.proj") || ends_with("mlp.proj");
    linear->weight.normal_(0.0, residual ? 0.02 / std::sqrt(2.0 * static_cast<double>(config.layers)) : 0.02);
    if (linear->bias.defined()) linear->bias.zero_();
  } else if (auto* embedding = module.as<torch::nn::Embedding>()) {
    embedding->weight.normal_(0.0, 0.02);
  } else if (auto* norm = module.as<torch::nn::LayerNorm>()) {
    norm->reset_parameters();  // gain 1, bias 0
  }
  // The other modules register no tensors of their own (the head's weight is the embedding's).
}

torch::Tensor GPTImpl::forward(const torch::Tensor& tokens) {
  const int64_t time = tokens.size(1);
  TORCH_CHECK(time <= config.context, "sequence of ", time, " tokens is longer than the context ", config.context);
  auto positions = torch::arange(time, torch::TensorOptions().dtype(torch::kLong).device(tokens.device()));
  auto x = token_embedding(tokens) + position_embedding(positions);
  for (const auto& block : *blocks) {
    if (auto* checkpointed = block->as<fsdp::CheckpointedImpl<Block>>())
      x = checkpointed->forward(x);
    else
      x = block->as<BlockImpl>()->forward(x);
  }
  return lm_head(ln_final(x));
}

int64_t count_parameters(torch::nn::Module& module) {
  std::unordered_set<const c10::TensorImpl*> seen;
  int64_t total = 0;
  for (const auto& p : module.parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) total += p.numel();
  return total;
}

}  // namespace gpt
