#pragma once
// Small models written as a LibTorch user would, with no knowledge of FSDP but for the explicit
// form of units (fsdp::Sharded) where asked.
#include <fsdp/sharded.h>
#include <torch/torch.h>

#include <functional>
#include <stdexcept>
#include <string>

namespace fsdp_test {

struct MLPImpl : torch::nn::Module {
  MLPImpl(int in, int hidden, int out, int depth) {
    int d = in;
    for (int i = 0; i < depth; ++i) {
      layers->push_back(torch::nn::Linear(d, hidden));
      layers->push_back(torch::nn::Tanh());
      d = hidden;
    }
    layers->push_back(torch::nn::Linear(d, out));
    register_module("layers", layers);
  }
  torch::Tensor forward(const torch::Tensor& x) { return layers->forward(x); }
  torch::nn::Sequential layers;
};
TORCH_MODULE(MLP);

// `depth` blocks of two linear layers, d -> 4d -> d, each a torch::nn::Sequential: 8 d^2 + 5 d
// parameters a block, no others.
struct LinearBlocksImpl : torch::nn::Module {
  LinearBlocksImpl(int d, int depth) {
    for (int i = 0; i < depth; ++i)
      blocks->push_back(torch::nn::Sequential(torch::nn::Linear(d, 4 * d), torch::nn::Linear(4 * d, d)));
    register_module("blocks", blocks);
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : *blocks) x = b->as<torch::nn::Sequential>()->forward(x);
    return x;
  }
  torch::nn::ModuleList blocks;
};
TORCH_MODULE(LinearBlocks);

// A transformer block; with `dropout` > 0, dropout on the attention weights and on the MLP's
// hidden layer (a submodule "drop").
struct BlockImpl : torch::nn::Module {
  BlockImpl(int d, int heads, double dropout = 0.0) : heads(heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    // No qkv bias: its key part has an exactly-zero true gradient (softmax ignores a per-row
    // shift), and Adam would turn rounding noise there into full-size steps in any comparison.
    qkv = register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(d, 3 * d).bias(false)));
    proj = register_module("proj", torch::nn::Linear(d, d));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc1 = register_module("fc1", torch::nn::Linear(d, 4 * d));
    fc2 = register_module("fc2", torch::nn::Linear(4 * d, d));
    if (dropout > 0) drop = register_module("drop", torch::nn::Dropout(dropout));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto dropped = [&](const torch::Tensor& t) {
      return drop.is_empty() ? t : drop(t);
    };
    const auto B = x.size(0), T = x.size(1), D = x.size(2), hd = D / heads;
    auto q_k_v = qkv(ln1(x)).chunk(3, -1);
    auto split = [&](const torch::Tensor& t) {
      return t.view({B, T, heads, hd}).transpose(1, 2);
    };
    auto q = split(q_k_v[0]), k = split(q_k_v[1]), v = split(q_k_v[2]);
    auto att = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(hd));
    auto mask = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(x.device())).triu(1);
    att = dropped(torch::softmax(att.masked_fill(mask, -1e9), -1));
    auto y = torch::matmul(att, v).transpose(1, 2).reshape({B, T, D});
    x = x + proj(y);
    return x + fc2(dropped(torch::gelu(fc1(ln2(x)))));
  }
  int heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Block);

// An output projection that uses a weight owned elsewhere (weight tying).
struct TiedHeadImpl : torch::nn::Module {
  explicit TiedHeadImpl(torch::Tensor w) { weight = register_parameter("weight", w); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::linear(x, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(TiedHead);

// Token embedding tied to the LM head, a frozen positional table, and an unused parameter.
// `explicit_units`: each block is marked as a unit in the model's code (fsdp::Sharded<Block>).
struct TinyTransformerImpl : torch::nn::Module {
  TinyTransformerImpl(int vocab, int d, int heads, int layers, int context, bool explicit_units = false)
      : explicit_units(explicit_units) {
    tok = register_module("tok", torch::nn::Embedding(vocab, d));
    pos = register_parameter("pos", torch::randn({context, d}) * 0.02, /*requires_grad=*/false);
    for (int i = 0; i < layers; ++i) {
      if (explicit_units)
        blocks->push_back(fsdp::Sharded<Block>(Block(d, heads)));
      else
        blocks->push_back(Block(d, heads));
    }
    register_module("blocks", blocks);
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    head = register_module("head", TiedHead(tok->weight));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    auto x = tok(idx) + pos.narrow(0, 0, idx.size(1));
    for (auto& b : *blocks)
      x = explicit_units ? b->as<fsdp::ShardedImpl<Block>>()->forward(x) : b->as<BlockImpl>()->forward(x);
    return head(ln_f(x));
  }
  bool explicit_units;
  torch::nn::Embedding tok{nullptr};
  torch::Tensor pos;
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  TiedHead head{nullptr};
};
TORCH_MODULE(TinyTransformer);

// The fault tests' model: one unit per layer; its forward can skip the middle unit and call back
// inside forward and backward.
struct SkippyImpl : torch::nn::Module {
  SkippyImpl() {
    l0 = register_module("l0", torch::nn::Linear(8, 16));
    l1 = register_module("l1", torch::nn::Linear(16, 16));
    l2 = register_module("l2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(const torch::Tensor& x, bool skip_middle = false) {
    auto h = torch::tanh(l0(x));
    if (in_forward) in_forward();  // between units: l0's gathered, l1's not yet
    if (!skip_middle) h = torch::tanh(l1(h));
    // Runs in backward once l2's gradients exist (its reduction issued), before l1's backward.
    if (in_backward && h.requires_grad()) h.register_hook([this](const torch::Tensor&) { in_backward(); });
    return l2(h);
  }
  torch::nn::Linear l0{nullptr}, l1{nullptr}, l2{nullptr};
  std::function<void()> in_forward, in_backward;
};
TORCH_MODULE(Skippy);

// Cross entropy of logits [..., vocab] against the token ids y of the same leading shape.
inline at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& y) {
  return torch::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

// The next-token loss of m on the token rows x (each row's target: x rolled by one).
inline at::Tensor loss_of(TinyTransformer& m, const at::Tensor& x) { return lm_loss(m->forward(x), x.roll(1, 1)); }

// Two TinyTransformer(vocab 32, width 16, 2 heads, 3 blocks, context 8) in f64 with the same
// initial weights: a local reference and a model to shard.
inline std::pair<TinyTransformer, TinyTransformer> twin_tiny_transformers() {
  torch::manual_seed(3);
  TinyTransformer ref(32, 16, 2, 3, 8);
  torch::manual_seed(3);
  TinyTransformer model(32, 16, 2, 3, 8);
  ref->to(torch::kFloat64);
  model->to(torch::kFloat64);
  return {ref, model};
}

// A residual block whose training forward changes buffers: BatchNorm's running statistics and
// num_batches_tracked, `calls` counted up in place, and `input_mean` (a running mean of its inputs)
// replaced with set_data.
struct NormBlockImpl : torch::nn::Module {
  explicit NormBlockImpl(int d) {
    fc = register_module("fc", torch::nn::Linear(d, d));
    bn = register_module("bn", torch::nn::BatchNorm1d(d));
    calls = register_buffer("calls", torch::zeros({}, torch::kLong));
    input_mean = register_buffer("input_mean", torch::zeros({d}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    if (bn->is_training()) {  // the block's own flag: a wrapper's train() does not reach it
      torch::NoGradGuard no_grad;
      calls.add_(1);
      input_mean.set_data(0.9 * input_mean + 0.1 * x.mean(0));
    }
    return x + torch::tanh(bn(fc(x)));
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  torch::Tensor calls, input_mean;
};
TORCH_MODULE(NormBlock);

// Two Linear layers the tests use in unusual ways, one never used, and a BatchNorm (buffers); no
// forward: each test composes its own from the submodules.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl() {
    a = register_module("a", torch::nn::Linear(5, 5));
    b = register_module("b", torch::nn::Linear(5, 5));
    unused = register_module("unused", torch::nn::Linear(5, 5));
    bn = register_module("bn", torch::nn::BatchNorm1d(5));
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, unused{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Branchy);

// A lookup with max_norm (a stock Embedding, EmbeddingBag, or the functional form on a parameter of
// its own), a Linear, and a head tied to the table: the head reads every row after the lookup
// renormalized some, so each rank's output depends on the rows the other ranks' batches name.
struct LookupImpl : torch::nn::Module {
  explicit LookupImpl(const std::string& kind) : kind(kind) {
    if (kind == "embedding")
      emb = register_module("emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(kRows, 6).max_norm(1.0)));
    else if (kind == "bag")
      bag = register_module(
          "bag", torch::nn::EmbeddingBag(
                     torch::nn::EmbeddingBagOptions(kRows, 6).max_norm(0.9).norm_type(3.0).mode(torch::kMean)));
    else
      table = register_parameter("table", torch::randn({kRows, 6}));
    lin = register_module("lin", torch::nn::Linear(6, 6));
  }
  at::Tensor weight() const { return emb ? emb->weight : bag ? bag->weight : table; }
  at::Tensor forward(const at::Tensor& idx) {
    at::Tensor e;
    if (emb)
      e = emb(idx).mean(1);
    else if (bag)
      e = bag(idx);
    else
      e = torch::nn::functional::embedding(idx, table, torch::nn::functional::EmbeddingFuncOptions().max_norm(0.8))
              .mean(1);
    return torch::tanh(lin(e)).matmul(weight().t());
  }
  static constexpr int64_t kRows = 40;
  std::string kind;
  torch::nn::Embedding emb{nullptr};
  torch::nn::EmbeddingBag bag{nullptr};
  at::Tensor table;
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(Lookup);

// Passes values through in forward; its backward throws "a failure inside backward".
struct ThrowingBackward : torch::autograd::Function<ThrowingBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext*, torch::autograd::tensor_list) {
    throw std::runtime_error("a failure inside backward");
  }
};

// Four Linear layers with Tanh between them, float64 on `device`, the same weights every call.
inline torch::nn::Sequential four_linears(const torch::Device& device = torch::kCPU) {
  torch::manual_seed(6);
  torch::nn::Sequential m(torch::nn::Linear(5, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8), torch::nn::Tanh(),
                          torch::nn::Linear(8, 8), torch::nn::Tanh(), torch::nn::Linear(8, 3));
  m->to(device, at::kDouble);
  return m;
}

// four_linears' forward with ThrowingBackward after its first Linear: backward reduces the later
// units (or has their reductions in flight) and then fails before the first one.
inline at::Tensor forward_failing_in_backward(torch::nn::Sequential& m, const at::Tensor& x) {
  at::Tensor h = ThrowingBackward::apply(torch::tanh(m[0]->as<torch::nn::Linear>()->forward(x)));
  for (auto it = m->begin() + 2; it != m->end(); ++it) h = it->forward(h);
  return h;
}

}  // namespace fsdp_test
