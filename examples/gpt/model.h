#pragma once
// A small decoder-only transformer (GPT) in plain LibTorch. Nothing here knows about FSDP: the
// trainer shards this model as it is.
#include <fsdp/activation_checkpoint.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace gpt {

struct GPTConfig {
  int64_t vocab_size = 256;  // byte-level tokens
  int64_t context = 64;      // longest sequence the position embedding covers
  int64_t width = 128;       // embedding / residual stream size
  int64_t layers = 4;
  int64_t heads = 4;
  // Blocks wrapped in fsdp::Checkpointed: only their inputs are kept, backward recomputes them.
  bool activation_checkpointing = false;
  int64_t checkpointed_blocks = 0;  // with activation_checkpointing: only the first this many; 0: every one
  // Dropout on each block's attention and MLP outputs while training with gradients on.
  double dropout = 0.0;
};

// Multi-head self-attention where position t only sees positions <= t.
struct CausalSelfAttentionImpl : torch::nn::Module {
  explicit CausalSelfAttentionImpl(const GPTConfig& config);
  torch::Tensor forward(const torch::Tensor& x);  // [batch, time, width] -> same

  int64_t heads;
  torch::nn::Linear qkv{nullptr};   // width -> 3 * width: queries, keys and values in one matmul
  torch::nn::Linear proj{nullptr};  // width -> width: mixes the heads back into the residual stream
};
TORCH_MODULE(CausalSelfAttention);

struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(const GPTConfig& config);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Linear fc{nullptr};    // width -> 4 * width
  torch::nn::Linear proj{nullptr};  // 4 * width -> width
};
TORCH_MODULE(MLP);

// One pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)).
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const GPTConfig& config);
  torch::Tensor forward(torch::Tensor x);

  double dropout;

  torch::nn::LayerNorm ln_attn{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::LayerNorm ln_mlp{nullptr};
  MLP mlp{nullptr};
};
TORCH_MODULE(Block);

// The output projection to vocabulary logits. It has no weight of its own: it registers the token
// embedding's weight (weight tying), so the one tensor is a parameter of both modules.
struct TiedLMHeadImpl : torch::nn::Module {
  explicit TiedLMHeadImpl(torch::Tensor embedding_weight);
  torch::Tensor forward(const torch::Tensor& x);  // [..., width] -> [..., vocab]

  torch::Tensor weight;
};
TORCH_MODULE(TiedLMHead);

struct GPTImpl : torch::nn::Module {
  explicit GPTImpl(const GPTConfig& config);
  // tokens: [batch, time] int64 with time <= context; returns logits [batch, time, vocab].
  torch::Tensor forward(const torch::Tensor& tokens);

  GPTConfig config;
  torch::nn::Embedding token_embedding{nullptr};
  torch::nn::Embedding position_embedding{nullptr};
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm ln_final{nullptr};
  TiedLMHead lm_head{nullptr};
};
TORCH_MODULE(GPT);

// Initializes the tensors `module` registers itself (not its children's), `name` being its
// qualified name in a GPT: the constructor applies it to every module in pre-order, and a model
// built under fsdp::DeferredInit gets the same values when FSDP applies it (Options::param_init_fn).
void initialize(const GPTConfig& config, const std::string& name, torch::nn::Module& module);

// Parameter elements, counting a tensor registered in several modules (the tied weight) once.
int64_t count_parameters(torch::nn::Module& module);

}  // namespace gpt
