#pragma once
// A T5-style encoder-decoder (the FSDP paper's T5 experiments) for the planner benchmark: a shared
// token embedding, encoder blocks (self-attention, feed-forward), decoder blocks (causal
// self-attention, cross-attention over the encoder's output, feed-forward), pre-norm residuals,
// bias-free projections, and the loss's logits through the tied embedding. No relative position
// bias (its parameters are negligible at these sizes). `module_cost` is its planner cost function.
#include <fsdp/plan_request.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace t5 {

struct T5Config {
  int64_t vocab = 32128;
  int64_t d_model = 1024;
  int64_t d_ff = 4096;
  int64_t heads = 16;
  int64_t d_kv = 64;    // per head
  int64_t layers = 24;  // encoder blocks; as many decoder blocks
};

struct AttentionImpl : torch::nn::Module {
  AttentionImpl(const T5Config& c, bool causal);
  // x: [batch, time, d_model] queries; memory: keys and values ([batch, source, d_model]).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& memory);
  int64_t heads, d_kv;
  bool causal;
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
};
TORCH_MODULE(Attention);

struct FeedForwardImpl : torch::nn::Module {
  explicit FeedForwardImpl(const T5Config& c);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Linear wi{nullptr}, wo{nullptr};
};
TORCH_MODULE(FeedForward);

struct EncoderBlockImpl : torch::nn::Module {
  explicit EncoderBlockImpl(const T5Config& c);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  Attention attn{nullptr};
  FeedForward ff{nullptr};
};
TORCH_MODULE(EncoderBlock);

struct DecoderBlockImpl : torch::nn::Module {
  explicit DecoderBlockImpl(const T5Config& c);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& encoded);
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr}, norm3{nullptr};
  Attention self_attn{nullptr}, cross_attn{nullptr};
  FeedForward ff{nullptr};
};
TORCH_MODULE(DecoderBlock);

struct T5Impl : torch::nn::Module {
  explicit T5Impl(const T5Config& c);
  // The next-token loss of `targets` given `inputs` (both [batch, time] int64).
  torch::Tensor forward(const torch::Tensor& inputs, const torch::Tensor& targets);
  T5Config config;
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList encoder, decoder;
  torch::nn::LayerNorm encoder_norm{nullptr}, decoder_norm{nullptr};
};
TORCH_MODULE(T5);

int64_t count_parameters(const torch::nn::Module& model);

// Per-token costs the planner's rules leave out: attention's products and softmax, the tied
// logits, the loss (the feed-forward's ReLU keeps its output, the second Linear's input, which the
// rules count). Encoder and decoder sequences are both `seq_len` long.
fsdp::ModuleCost module_cost(const std::string& name, const torch::nn::Module& module, int64_t seq_len);

}  // namespace t5
