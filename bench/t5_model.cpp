#include "t5_model.h"

#include <cmath>

namespace t5 {

namespace nn = torch::nn;

AttentionImpl::AttentionImpl(const T5Config& c, bool causal_) : heads(c.heads), d_kv(c.d_kv), causal(causal_) {
  const int64_t inner = c.heads * c.d_kv;
  q = register_module("q", nn::Linear(nn::LinearOptions(c.d_model, inner).bias(false)));
  k = register_module("k", nn::Linear(nn::LinearOptions(c.d_model, inner).bias(false)));
  v = register_module("v", nn::Linear(nn::LinearOptions(c.d_model, inner).bias(false)));
  o = register_module("o", nn::Linear(nn::LinearOptions(inner, c.d_model).bias(false)));
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& memory) {
  const int64_t b = x.size(0), t = x.size(1), s = memory.size(1);
  auto split = [&](const torch::Tensor& y, int64_t len) {
    return y.view({b, len, heads, d_kv}).transpose(1, 2);
  };
  auto qh = split(q(x), t), kh = split(k(memory), s), vh = split(v(memory), s);
  auto scores = torch::matmul(qh, kh.transpose(-2, -1)) / std::sqrt(static_cast<double>(d_kv));
  if (causal) scores = scores.masked_fill(torch::ones({t, s}, torch::kBool).triu(1), -INFINITY);
  auto mixed = torch::matmul(torch::softmax(scores, -1), vh);
  return o(mixed.transpose(1, 2).reshape({b, t, heads * d_kv}));
}

FeedForwardImpl::FeedForwardImpl(const T5Config& c) {
  wi = register_module("wi", nn::Linear(nn::LinearOptions(c.d_model, c.d_ff).bias(false)));
  wo = register_module("wo", nn::Linear(nn::LinearOptions(c.d_ff, c.d_model).bias(false)));
}

torch::Tensor FeedForwardImpl::forward(const torch::Tensor& x) { return wo(torch::relu(wi(x))); }

EncoderBlockImpl::EncoderBlockImpl(const T5Config& c) {
  norm1 = register_module("norm1", nn::LayerNorm(nn::LayerNormOptions({c.d_model})));
  attn = register_module("attn", Attention(c, false));
  norm2 = register_module("norm2", nn::LayerNorm(nn::LayerNormOptions({c.d_model})));
  ff = register_module("ff", FeedForward(c));
}

torch::Tensor EncoderBlockImpl::forward(const torch::Tensor& x) {
  auto n = norm1(x);
  auto y = x + attn(n, n);
  return y + ff(norm2(y));
}

DecoderBlockImpl::DecoderBlockImpl(const T5Config& c) {
  norm1 = register_module("norm1", nn::LayerNorm(nn::LayerNormOptions({c.d_model})));
  self_attn = register_module("self_attn", Attention(c, true));
  norm2 = register_module("norm2", nn::LayerNorm(nn::LayerNormOptions({c.d_model})));
  cross_attn = register_module("cross_attn", Attention(c, false));
  norm3 = register_module("norm3", nn::LayerNorm(nn::LayerNormOptions({c.d_model})));
  ff = register_module("ff", FeedForward(c));
}

torch::Tensor DecoderBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& encoded) {
  auto n = norm1(x);
  auto y = x + self_attn(n, n);
  y = y + cross_attn(norm2(y), encoded);
  return y + ff(norm3(y));
}

T5Impl::T5Impl(const T5Config& c) : config(c) {
  embed = register_module("embed", nn::Embedding(c.vocab, c.d_model));
  for (int64_t i = 0; i < c.layers; ++i) encoder->push_back(EncoderBlock(c));
  register_module("encoder", encoder);
  encoder_norm = register_module("encoder_norm", nn::LayerNorm(nn::LayerNormOptions({c.d_model})));
  for (int64_t i = 0; i < c.layers; ++i) decoder->push_back(DecoderBlock(c));
  register_module("decoder", decoder);
  decoder_norm = register_module("decoder_norm", nn::LayerNorm(nn::LayerNormOptions({c.d_model})));
}

torch::Tensor T5Impl::forward(const torch::Tensor& inputs, const torch::Tensor& targets) {
  auto x = embed(inputs);
  for (const auto& block : *encoder) x = block->as<EncoderBlock>()->forward(x);
  const auto encoded = encoder_norm(x);
  // Teacher forcing: the decoder reads the targets shifted right by one (token 0 first).
  auto shifted = torch::cat({torch::zeros_like(targets.narrow(1, 0, 1)), targets.narrow(1, 0, targets.size(1) - 1)}, 1);
  auto y = embed(shifted);
  for (const auto& block : *decoder) y = block->as<DecoderBlock>()->forward(y, encoded);
  auto logits = torch::matmul(decoder_norm(y), embed->weight.t());
  return torch::nn::functional::cross_entropy(logits.reshape({-1, config.vocab}).to(torch::kFloat),
                                              targets.reshape({-1}));
}

int64_t count_parameters(const torch::nn::Module& model) {
  int64_t n = 0;
  for (const auto& p : model.parameters()) n += p.numel();
  return n;
}

fsdp::ModuleCost module_cost(const std::string&, const torch::nn::Module& module, int64_t seq_len) {
  fsdp::ModuleCost cost;
  const auto len = static_cast<double>(seq_len);
  if (const auto* attn = dynamic_cast<const AttentionImpl*>(&module)) {
    const auto inner = static_cast<double>(attn->heads * attn->d_kv);
    cost.forward_flops = 4.0 * len * inner;                                         // scores and mixing
    cost.activation_values = 3.0 * inner + static_cast<double>(attn->heads) * len;  // q, k, v; softmax
  } else if (const auto* model = dynamic_cast<const T5Impl*>(&module)) {
    cost.forward_flops = 2.0 * static_cast<double>(model->config.vocab * model->config.d_model);  // tied logits
    cost.activation_values = static_cast<double>(model->config.vocab);  // log-softmax of the logits
  }
  return cost;
}

}  // namespace t5
