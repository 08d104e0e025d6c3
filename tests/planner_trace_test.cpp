// The planner's operator trace (PlanRequest::trace_forward): one forward on the meta device counts
// what the rules cannot see (convolutions, attention, normalization, pooling), operators without a
// meta kernel in this LibTorch included, and equals the rules where they apply.
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/version.h>

#include <algorithm>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "counting_allocator.h"

#include "fsdp/cluster.h"
#include "fsdp/fsdp.h"
#include "fsdp/planner.h"
#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

namespace nn = torch::nn;

fsdp::PlanRequest world_one() {
  return fsdp::PlanRequest()
      .global_batch(1)
      .strategies({fsdp::ShardingStrategy::kFullShard})
      .precisions({at::kFloat})
      .cpu_offload({false})
      .grads_kept_between_steps(true);
}

// The forward FLOPs per token a plan entry was built from: TFLOP/s counts three forwards per step.
double forward_flops_per_token(const fsdp::PlanEntry& e, int64_t tokens) {
  return e.time.tflops_per_device * 1e12 * e.time.step_s / (3.0 * static_cast<double>(tokens));
}

// Blocks of two Linear layers: by rule and by trace, each keeps its input (d values per token) and
// its hidden layer (4d).
struct LinearStackImpl : nn::Module {
  LinearStackImpl(int d, int depth) {
    for (int i = 0; i < depth; ++i) blocks->push_back(nn::Sequential(nn::Linear(d, 4 * d), nn::Linear(4 * d, d)));
    register_module("blocks", blocks);
  }
  at::Tensor forward(at::Tensor x) {
    for (const auto& block : *blocks) x = block->as<nn::Sequential>()->forward(x);
    return x;
  }
  nn::ModuleList blocks;
};
TORCH_MODULE(LinearStack);

TEST(PlannerTrace, EqualsTheRulesOnLinearLayers) {
  fsdp::DeferredInit deferred;
  LinearStack model(64, 3);
  const int64_t seq = 128, d = 64;
  auto request = world_one().seq_len(seq).wrap_policies({{"block", fsdp::wrap::by_type<nn::SequentialImpl>()}});
  const fsdp::Plan by_rules = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request);
  request.trace_forward([&] { model->forward(torch::zeros({1, seq, d})); });
  const fsdp::Plan traced = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request);
  ASSERT_EQ(by_rules.entries.size(), 4U);  // none, the first block, the first two, all three checkpointed
  ASSERT_EQ(traced.entries.size(), 4U);
  for (size_t i = 0; i < 4; ++i) {
    const auto& r = by_rules.entries[i];
    const auto& t = traced.entries[i];
    EXPECT_EQ(t.candidate.describe(), r.candidate.describe());
    EXPECT_EQ(t.memory.activations, r.memory.activations) << t.candidate.describe();
    const int64_t k = !t.candidate.activation_checkpointing ? 0
                      : t.candidate.checkpointed_units > 0  ? t.candidate.checkpointed_units
                                                            : 3;
    // Each checkpointed block keeps its input; the first recomputed stands beside the others' inputs.
    EXPECT_EQ(t.memory.activations, std::max((3 - k) * 5 * d + k * d, k > 0 ? k * d + 5 * d : 0) * seq * 4)
        << t.candidate.describe();
    EXPECT_NEAR(forward_flops_per_token(t, seq), 3 * 2 * (2.0 * d * 4 * d), 1e-6 * 3 * 2 * (2.0 * d * 4 * d));
    EXPECT_NEAR(t.time.step_s, r.time.step_s, 1e-12);
  }
}

// A small convolutional network: the rules cannot see its spatial sizes, the trace can.
struct ConvNetImpl : nn::Module {
  ConvNetImpl() {
    features = register_module(
        "features", nn::Sequential(nn::Conv2d(nn::Conv2dOptions(3, 8, 3).padding(1)), nn::BatchNorm2d(8), nn::ReLU(),
                                   nn::MaxPool2d(2), nn::Conv2d(nn::Conv2dOptions(8, 16, 3).padding(1).groups(2)),
                                   nn::ReLU(), nn::AdaptiveAvgPool2d(1), nn::Flatten()));
    head = register_module("head", nn::Linear(16, 10));
  }
  at::Tensor forward(const at::Tensor& x) { return head->forward(features->forward(x)); }
  nn::Sequential features{nullptr};
  nn::Linear head{nullptr};
};
TORCH_MODULE(ConvNet);

TEST(PlannerTrace, CountsConvolutionsPoolingAndNormalizationFromShapes) {
  fsdp::DeferredInit deferred;
  ConvNet model;
  const int64_t images = 2;
  auto request =
      world_one().global_batch(static_cast<int>(images)).micro_batches({2}).activation_checkpointing({false});
  request.trace_sequences(images).trace_forward([&] {
    auto y = model->forward(torch::zeros({images, 3, 16, 16}));
    nn::functional::cross_entropy(y, torch::zeros({images}, torch::kLong));
  });
  const fsdp::Plan plan = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request);
  ASSERT_EQ(plan.entries.size(), 1U);
  const fsdp::PlanEntry& e = plan.entries[0];
  // Per image: 8 x 16 x 16 outputs of 3 x 3 x 3 weights, 16 x 8 x 8 of 4 x 3 x 3 (two groups), 16 x 10.
  const double flops = 2.0 * (8 * 16 * 16) * 27 + 2.0 * (16 * 8 * 8) * 36 + 2.0 * 16 * 10;
  EXPECT_NEAR(forward_flops_per_token(e, images), flops, 1e-6 * flops);
  // Kept per image, in values: the image (768); the batch norm's input (2048) and its two statistics
  // (8 + 8 per batch); the ReLU's output (2048); the pool's int64 indices (512, two values' bytes each);
  // the second convolution's input (512) and its ReLU's output (1024); the average pool's input (the
  // same); the head's input (16); the log-softmax's output (10); the loss's targets (int64, 2 values)
  // and its total weight (one value per batch).
  const double kept = images * (768 + 2048 + 2048 + 2 * 512 + 512 + 1024 + 16 + 10 + 2) + 16 + 1;
  EXPECT_EQ(e.memory.activations, static_cast<int64_t>(kept * 4)) << plan.table();
}

// A small transformer: embedding, layer norms, attention written out (products, scaling, a causal
// mask, softmax), a GELU MLP and a language-model head.
struct AttentionLmImpl : nn::Module {
  AttentionLmImpl(int64_t vocab, int64_t d, int64_t heads, bool fused = false) : heads(heads), fused(fused) {
    embed = register_module("embed", nn::Embedding(vocab, d));
    ln1 = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({d})));
    qkv = register_module("qkv", nn::Linear(d, 3 * d));
    proj = register_module("proj", nn::Linear(d, d));
    ln2 = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({d})));
    fc = register_module("fc", nn::Linear(d, 4 * d));
    out = register_module("out", nn::Linear(4 * d, d));
    head = register_module("head", nn::Linear(d, vocab));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    const int64_t b = tokens.size(0), t = tokens.size(1);
    at::Tensor x = embed->forward(tokens);
    const int64_t d = x.size(-1), hd = d / heads;
    auto parts = qkv->forward(ln1->forward(x)).chunk(3, -1);
    auto split = [&](const at::Tensor& p) {
      return p.view({b, t, heads, hd}).transpose(1, 2);
    };
    at::Tensor q = split(parts[0]), k = split(parts[1]), v = split(parts[2]);
    at::Tensor mixed;
#if TORCH_VERSION_MAJOR >= 2
    if (fused)
      mixed = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
#endif
    if (!mixed.defined()) {
      at::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
      at::Tensor future = torch::ones({t, t}, torch::TensorOptions().dtype(torch::kBool)).triu(1);
      at::Tensor weights = torch::softmax(scores.masked_fill(future, -std::numeric_limits<float>::infinity()), -1);
      mixed = torch::matmul(weights, v);
    }
    x = x + proj->forward(mixed.transpose(1, 2).reshape({b, t, d}));
    x = x + out->forward(torch::gelu(fc->forward(ln2->forward(x))));
    return head->forward(x);
  }
  int64_t heads;
  bool fused;  // LibTorch 2.x's fused attention (on the CPU, flash attention)
  nn::Embedding embed{nullptr};
  nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, out{nullptr}, head{nullptr};
};
TORCH_MODULE(AttentionLm);

// An MLP with SiLU, dropout and a regression loss.
struct DropoutMlpImpl : nn::Module {
  DropoutMlpImpl() {
    net = register_module(
        "net", nn::Sequential(nn::Linear(32, 96), nn::SiLU(), nn::Dropout(0.25), nn::Linear(96, 8), nn::Tanh()));
  }
  at::Tensor forward(const at::Tensor& x) { return net->forward(x); }
  nn::Sequential net{nullptr};
};
TORCH_MODULE(DropoutMlp);

// A recurrent language model: embedding, a two-layer LSTM, a GRU and a head.
struct RecurrentLmImpl : nn::Module {
  RecurrentLmImpl() {
    embed = register_module("embed", nn::Embedding(40, 16));
    lstm = register_module("lstm", nn::LSTM(nn::LSTMOptions(16, 24).num_layers(2).batch_first(true)));
    gru = register_module("gru", nn::GRU(nn::GRUOptions(24, 20).batch_first(true)));
    head = register_module("head", nn::Linear(20, 40));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor x = std::get<0>(lstm->forward(embed->forward(tokens)));
    return head->forward(std::get<0>(gru->forward(x)));
  }
  nn::Embedding embed{nullptr};
  nn::LSTM lstm{nullptr};
  nn::GRU gru{nullptr};
  nn::Linear head{nullptr};
};
TORCH_MODULE(RecurrentLm);

// One-dimensional convolutions with group and instance norms, PReLU, a transposed convolution,
// average pooling and a log-softmax with its negative log-likelihood.
struct SignalNetImpl : nn::Module {
  SignalNetImpl() {
    net = register_module(
        "net", nn::Sequential(nn::Conv1d(nn::Conv1dOptions(4, 12, 5).padding(2)), nn::GroupNorm(3, 12), nn::PReLU(),
                              nn::ConvTranspose1d(nn::ConvTranspose1dOptions(12, 8, 4).stride(2)),
                              nn::InstanceNorm1d(nn::InstanceNorm1dOptions(8).affine(true)), nn::LeakyReLU(),
                              nn::AvgPool1d(2), nn::ELU(), nn::Flatten(), nn::Linear(8 * 33, 6), nn::LogSoftmax(1)));
  }
  at::Tensor forward(const at::Tensor& x) { return net->forward(x); }
  nn::Sequential net{nullptr};
};
TORCH_MODULE(SignalNet);

// LibTorch's MultiheadAttention with dropout, Mish, Hardtanh and Softplus, and a binary loss.
struct MhaNetImpl : nn::Module {
  MhaNetImpl() {
    attn = register_module("attn", nn::MultiheadAttention(nn::MultiheadAttentionOptions(16, 4).dropout(0.1)));
    mlp = register_module("mlp", nn::Sequential(nn::Linear(16, 32), nn::Mish(), nn::Linear(32, 32), nn::Hardtanh(),
                                                nn::Linear(32, 1), nn::Softplus()));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = std::get<0>(attn->forward(x, x, x));
    return mlp->forward(y);
  }
  nn::MultiheadAttention attn{nullptr};
  nn::Sequential mlp{nullptr};
};
TORCH_MODULE(MhaNet);

// A bag of embeddings (their mean) under a linear classifier.
struct BagNetImpl : nn::Module {
  BagNetImpl() {
    bag = register_module("bag", nn::EmbeddingBag(nn::EmbeddingBagOptions(30, 12).mode(torch::kMean)));
    head = register_module("head", nn::Linear(12, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return head->forward(bag->forward(x)); }
  nn::EmbeddingBag bag{nullptr};
  nn::Linear head{nullptr};
};
TORCH_MODULE(BagNet);

// Elementwise and reducing operators with their own backward: where, clamp, abs, log1p, maximum,
// GLU, hardsigmoid, expm1, logsumexp, reciprocal, atan.
struct ElementwiseNetImpl : nn::Module {
  ElementwiseNetImpl() {
    a = register_module("a", nn::Linear(8, 24));
    b = register_module("b", nn::Linear(8, 24));
    c = register_module("c", nn::Linear(24, 32));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = a->forward(x);
    at::Tensor z = torch::clamp(torch::where(y > 0, y, y * 0.1), -2.0, 2.0);
    at::Tensor w = torch::maximum(z.abs() + torch::log1p(z.abs()), b->forward(x));
    at::Tensor g = nn::functional::glu(c->forward(w), -1);
    at::Tensor h = torch::hardsigmoid(g) * torch::expm1(g) + torch::atan(g);
    return h - torch::logsumexp(h, -1, /*keepdim=*/true) + torch::reciprocal(h.abs() + 1.0);
  }
  nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(ElementwiseNet);

// A LLaMA-style block written out: RMS normalization and a SwiGLU feed-forward layer.
struct RmsNormImpl : nn::Module {
  explicit RmsNormImpl(int64_t d) : weight(register_parameter("weight", torch::ones({d}))) {}
  at::Tensor forward(const at::Tensor& x) {
    return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + 1e-6) * weight;
  }
  at::Tensor weight;
};
TORCH_MODULE(RmsNorm);

struct SwiGluLmImpl : nn::Module {
  SwiGluLmImpl() {
    embed = register_module("embed", nn::Embedding(30, 16));
    norm = register_module("norm", RmsNorm(16));
    gate = register_module("gate", nn::Linear(nn::LinearOptions(16, 40).bias(false)));
    up = register_module("up", nn::Linear(nn::LinearOptions(16, 40).bias(false)));
    down = register_module("down", nn::Linear(nn::LinearOptions(40, 16).bias(false)));
    final_norm = register_module("final_norm", RmsNorm(16));
    head = register_module("head", nn::Linear(16, 30));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor x = embed->forward(tokens);
    at::Tensor h = norm->forward(x);
    x = x + down->forward(nn::functional::silu(gate->forward(h)) * up->forward(h));
    return head->forward(final_norm->forward(x));
  }
  nn::Embedding embed{nullptr};
  RmsNorm norm{nullptr}, final_norm{nullptr};
  nn::Linear gate{nullptr}, up{nullptr}, down{nullptr}, head{nullptr};
};
TORCH_MODULE(SwiGluLm);

// Reductions, orderings and index updates: std, var, norm, sort, topk, cumprod, scatter_add,
// index_add, CELU, logit and the soft margin loss.
struct ReductionNetImpl : nn::Module {
  ReductionNetImpl() {
    a = register_module("a", nn::Linear(6, 12));
    b = register_module("b", nn::Linear(12, 12));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = a->forward(x);
    at::Tensor z = (y - y.mean(-1, /*keepdim=*/true)) / (y.std({-1}, /*unbiased=*/true, /*keepdim=*/true) + 1e-5);
    z = z + y.var({-1}, /*unbiased=*/true, /*keepdim=*/true) + y.norm(2, {-1}, /*keepdim=*/true);
    at::Tensor s = std::get<0>(torch::sort(z, -1)) + std::get<0>(torch::topk(z, 3)).sum(-1, /*keepdim=*/true);
    at::Tensor c = torch::cumprod(torch::sigmoid(z) + 0.5, -1);
    const int64_t rows = x.size(0);
    at::Tensor i = torch::zeros({rows, 12}).scatter_add(1, torch::zeros({rows, 12}, torch::kLong), c);
    at::Tensor j = torch::zeros({rows, 12}).index_add(1, torch::arange(12), s);
    return b->forward(nn::functional::celu(i + j) + torch::logit(torch::sigmoid(z) * 0.5 + 0.25));
  }
  nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(ReductionNet);

// Operators the keep table has no entry for, whose backward keeps indices, inputs or results:
// advanced indexing, max over a dimension, min, lerp, hypot, erfinv, acos in place, a Cholesky
// factorization, which refuses the stand-ins' first values (and flip, cumsum, tril and lerp in place
// by a number, which keep nothing). The trace learns what each keeps by running it once on stand-ins.
struct UnlistedNetImpl : nn::Module {
  UnlistedNetImpl() {
    a = register_module("a", nn::Linear(6, 10));
    b = register_module("b", nn::Linear(6, 10));
    c = register_module("c", nn::Linear(10, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = torch::tanh(a->forward(x)) * 0.5;
    at::Tensor z = b->forward(x);
    const int64_t rows = x.size(0);
    at::Tensor picked = z.index({torch::arange(rows), torch::zeros({rows}, torch::kLong)}).unsqueeze(-1);
    at::Tensor m = std::get<0>(z.max(-1, /*keepdim=*/true)) + z.min();
    at::Tensor l = torch::lerp(y, z, torch::sigmoid(z)) + torch::hypot(y, z);
    at::Tensor e = torch::erfinv(y) + (y * 2.0).acos_() + torch::flip(z, {-1}).cumsum(-1).tril();
    e = e + (z * 2.0).lerp_(y, 0.25);
    // Positive definite in a real forward: y^T y + I.
    e = e + torch::cholesky(torch::matmul(y.transpose(0, 1), y) + torch::eye(10)).sum(0);
    return c->forward(l * e + picked + m);
  }
  nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(UnlistedNet);

// A small U-Net: strided and transposed convolutions, batch norm, channel dropout, a skip joined by
// cat, bilinear upsampling, reflection padding and pixel shuffle.
struct UNetImpl : nn::Module {
  UNetImpl() {
    down = register_module("down", nn::Conv2d(nn::Conv2dOptions(3, 8, 3).stride(2).padding(1)));
    norm = register_module("norm", nn::BatchNorm2d(8));
    drop = register_module("drop", nn::Dropout2d(0.25));
    up = register_module("up", nn::ConvTranspose2d(nn::ConvTranspose2dOptions(8, 8, 2).stride(2)));
    mix = register_module("mix", nn::Conv2d(nn::Conv2dOptions(11, 12, 3)));
    shuffle = register_module("shuffle", nn::PixelShuffle(2));
    head = register_module("head", nn::Conv2d(nn::Conv2dOptions(3, 2, 1)));
  }
  at::Tensor forward(const at::Tensor& x) {
    namespace F = nn::functional;
    at::Tensor d = drop->forward(torch::leaky_relu(norm->forward(down->forward(x)), 0.2));
    at::Tensor u = up->forward(d) + F::interpolate(d, F::InterpolateFuncOptions()
                                                          .scale_factor(std::vector<double>{2.0, 2.0})
                                                          .mode(torch::kBilinear)
                                                          .align_corners(false));
    at::Tensor m = mix->forward(F::pad(torch::cat({u, x}, 1), F::PadFuncOptions({1, 1, 1, 1}).mode(torch::kReflect)));
    return head->forward(shuffle->forward(torch::silu(m)));
  }
  nn::Conv2d down{nullptr}, mix{nullptr}, head{nullptr};
  nn::BatchNorm2d norm{nullptr};
  nn::Dropout2d drop{nullptr};
  nn::ConvTranspose2d up{nullptr};
  nn::PixelShuffle shuffle{nullptr};
};
TORCH_MODULE(UNet);

// LibTorch's TransformerEncoderLayer, a bidirectional LSTM, einsum, a bilinear layer and cosine
// similarity, with a KL-divergence loss.
struct EncoderMixImpl : nn::Module {
  EncoderMixImpl() {
    encoder = register_module(
        "encoder",
        nn::TransformerEncoderLayer(nn::TransformerEncoderLayerOptions(16, 4).dim_feedforward(32).dropout(0.1)));
    lstm = register_module("lstm", nn::LSTM(nn::LSTMOptions(16, 8).bidirectional(true)));
    bilinear = register_module("bilinear", nn::Bilinear(16, 16, 6));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = encoder->forward(x);
    at::Tensor r = std::get<0>(lstm->forward(h));
    at::Tensor scores = torch::einsum("sbd,tbd->bst", {h, r}).softmax(-1);
    at::Tensor mixed = torch::einsum("bst,tbd->sbd", {scores, r});
    at::Tensor b = bilinear->forward(mixed, h);
    at::Tensor c = nn::functional::cosine_similarity(mixed, h, nn::functional::CosineSimilarityFuncOptions().dim(-1));
    return torch::log_softmax(b + c.unsqueeze(-1), -1);
  }
  nn::TransformerEncoderLayer encoder{nullptr};
  nn::LSTM lstm{nullptr};
  nn::Bilinear bilinear{nullptr};
};
TORCH_MODULE(EncoderMix);

// One model for the comparison: made on the device `build` runs under, its inputs (made before
// the counting starts), and its forward and loss.
struct KeptCase {
  std::string name;
  std::function<std::shared_ptr<nn::Module>()> build;
  std::function<std::vector<at::Tensor>()> inputs;
  std::function<at::Tensor(nn::Module&, const std::vector<at::Tensor>&)> loss;
  int64_t sequences, seq_len;
  bool listed = true;  // every operator it records is in the trace's keep table
};

// Two sequences of 12 tokens through an AttentionLm over 50 tokens, with its next-token loss.
KeptCase language_model_case(const std::string& name, bool fused) {
  const int64_t tokens = 12, vocab = 50;
  return {name,
          [=] { return AttentionLm(vocab, 32, 4, fused).ptr(); },
          [=] {
            return std::vector<at::Tensor>{torch::zeros({2, tokens}, torch::kLong),
                                           torch::zeros({2 * tokens}, torch::kLong)};
          },
          [=](nn::Module& m, const std::vector<at::Tensor>& in) {
            at::Tensor logits = dynamic_cast<AttentionLmImpl&>(m).forward(in[0]);
            return nn::functional::cross_entropy(logits.reshape({-1, vocab}), in[1]);
          },
          2,
          tokens};
}

// A case whose model `Model` is built by its default constructor and whose loss compares its
// output on the first input with the second.
template <class Model, class Loss>
KeptCase model_case(std::string name, std::function<std::vector<at::Tensor>()> inputs, Loss loss, int64_t sequences,
                    int64_t seq_len) {
  return {std::move(name),
          [] { return Model().ptr(); },
          std::move(inputs),
          [loss](nn::Module& m, const std::vector<at::Tensor>& in) {
            return loss(dynamic_cast<typename Model::ContainedType&>(m).forward(in[0]), in[1]);
          },
          sequences,
          seq_len};
}

// Two tensors of the given shapes: an input and a target (int64 class indices where `classes`).
std::function<std::vector<at::Tensor>()> input_and_target(std::vector<int64_t> input, bool tokens,
                                                          std::vector<int64_t> target, bool classes) {
  return [=] {
    return std::vector<at::Tensor>{tokens ? torch::zeros(input, torch::kLong) : torch::zeros(input),
                                   classes ? torch::zeros(target, torch::kLong) : torch::zeros(target)};
  };
}

std::vector<KeptCase> kept_cases() {
  namespace F = nn::functional;
  const int64_t images = 3, rows = 5;
  auto cross_entropy = [](const at::Tensor& y, const at::Tensor& t) {
    return F::cross_entropy(y, t);
  };
  auto token_cross_entropy = [](const at::Tensor& y, const at::Tensor& t) {
    return F::cross_entropy(y.reshape({-1, y.size(-1)}), t);
  };
  auto mse = [](const at::Tensor& y, const at::Tensor& t) {
    return F::mse_loss(y, t);
  };
  std::vector<KeptCase> cases;
  cases.push_back(model_case<ConvNet>("convnet", input_and_target({images, 3, 16, 16}, false, {images}, true),
                                      cross_entropy, images, 1));
  // The same network with its convolutional features frozen: only the head's work is kept.
  KeptCase frozen = cases.back();
  frozen.name = "convnet, features frozen";
  frozen.build = [] {
    ConvNet net;
    for (at::Tensor& p : net->features->parameters()) p.requires_grad_(false);
    return net.ptr();
  };
  cases.push_back(frozen);
  cases.push_back(language_model_case("transformer", /*fused=*/false));
#if TORCH_VERSION_MAJOR >= 2
  cases.push_back(language_model_case("transformer, fused attention", /*fused=*/true));
#endif
  cases.push_back(model_case<DropoutMlp>("mlp", input_and_target({rows, 32}, false, {rows, 8}, false), mse, rows, 1));
  cases.push_back(
      model_case<RecurrentLm>("recurrent", input_and_target({3, 7}, true, {21}, true), token_cross_entropy, 3, 7));
  cases.push_back(model_case<SignalNet>(
      "signal", input_and_target({3, 4, 32}, false, {3}, true),
      [](const at::Tensor& y, const at::Tensor& t) { return F::nll_loss(y, t); }, 3, 1));
  cases.push_back(model_case<MhaNet>(
      "mha", input_and_target({6, 2, 16}, false, {6, 2, 1}, false),
      [](const at::Tensor& y, const at::Tensor& t) { return F::binary_cross_entropy_with_logits(y, t); }, 2, 6));
  cases.push_back(model_case<BagNet>("bag", input_and_target({4, 5}, true, {4}, true), cross_entropy, 4, 1));
  cases.push_back(
      model_case<ElementwiseNet>("elementwise", input_and_target({rows, 8}, false, {rows, 16}, false), mse, rows, 1));
  cases.push_back(
      model_case<SwiGluLm>("swiglu", input_and_target({2, 9}, true, {18}, true), token_cross_entropy, 2, 9));
  cases.push_back(model_case<ReductionNet>(
      "reductions",
      [] {
        return std::vector<at::Tensor>{torch::zeros({rows, 6}), torch::ones({rows, 12})};
      },
      [](const at::Tensor& y, const at::Tensor& t) { return F::soft_margin_loss(y, t); }, rows, 1));
  cases.push_back(model_case<UnlistedNet>("unlisted operators", input_and_target({rows, 6}, false, {rows, 4}, false),
                                          mse, rows, 1));
  cases.back().listed = false;
  cases.push_back(model_case<UNet>("unet", input_and_target({2, 3, 8, 8}, false, {2, 2, 16, 16}, false), mse, 2, 1));
  cases.push_back(model_case<EncoderMix>(
      "encoder mix", input_and_target({5, 2, 16}, false, {5, 2, 6}, false),
      [](const at::Tensor& y, const at::Tensor& t) {
        return F::kl_div(y, t.softmax(-1), F::KLDivFuncOptions().reduction(torch::kBatchMean));
      },
      2, 5));
  return cases;
}

// Per case: the bytes the trace counts, and the bytes a real forward and loss keep alive on the
// CPU (counted by the allocator), their inputs included where autograd keeps them.
// The bytes the trace counts for case `c`, its operators probed on stand-ins up to `probe_bytes`
// (0: by the keep table only).
int64_t traced_bytes(const KeptCase& c, int64_t probe_bytes) {
  fsdp::DeferredInit deferred;
  std::shared_ptr<nn::Module> model = c.build();
  auto request = world_one()
                     .global_batch(static_cast<int>(c.sequences))
                     .micro_batches({static_cast<int>(c.sequences)})
                     .activation_checkpointing({false})
                     .seq_len(c.seq_len)
                     .trace_sequences(c.sequences)
                     .trace_probe_bytes(probe_bytes)
                     .trace_forward([&] { c.loss(*model, c.inputs()); });
  const fsdp::Plan plan = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request);
  if (plan.entries.size() != 1U) throw std::runtime_error(c.name + ": not one candidate");
  return plan.entries[0].memory.activations;
}

// Per case: the bytes the trace counts, probing operators and by its keep table alone, and the
// bytes a real forward and loss keep alive on the CPU (counted by the allocator), their inputs
// included where autograd keeps them.
FSDP_WORKER(trace_kept_bytes_worker) {
  auto* counter = new fsdp_bench::CountingAllocator(c10::GetCPUAllocator());
  c10::SetCPUAllocator(counter, /*priority=*/100);
  // The trace follows LibTorch's own kernels, which the meta device runs; where oneDNN is on, the
  // CPU runs some operators through it instead (LibTorch 2's LSTM), which keep other tensors
  // (docs/planner.md, What it does not model).
  at::globalContext().setUserEnabledMkldnn(false);
  for (const KeptCase& c : kept_cases()) {
    const int64_t probed = traced_bytes(c, fsdp::PlanRequest().trace_probe_bytes());
    const int64_t by_table = traced_bytes(c, 0);
    const int64_t mixed = traced_bytes(c, 4096);  // small operators probed, large ones by the table
    torch::manual_seed(0);
    std::shared_ptr<nn::Module> model = c.build();
    model->train();
    const int64_t before = counter->live();
    at::Tensor loss;
    {
      const std::vector<at::Tensor> inputs = c.inputs();  // alive after this scope only where autograd keeps them
      loss = c.loss(*model, inputs);
    }
    // The loss itself is not kept for backward (its storage may be larger than its one value).
    const int64_t measured = counter->live() - before - static_cast<int64_t>(loss.storage().nbytes());
    std::cout << c.name << ": traced " << probed << " bytes (keep table alone " << by_table
              << "), kept by a real forward " << measured << std::endl;
    WORKER_CHECK(probed == measured, c.name, ": the trace counts ", probed, " bytes, a real forward keeps ", measured);
    WORKER_CHECK(mixed == measured, c.name, ": probing up to 4096 bytes, the trace counts ", mixed, " bytes");
    if (c.listed)
      WORKER_CHECK(by_table == measured, c.name, ": the keep table counts ", by_table, " bytes, a real forward keeps ",
                   measured);
    else
      WORKER_CHECK(by_table < measured, c.name, ": the keep table alone counts ", by_table, " of ", measured, " bytes");
    loss.backward();
  }
  std::cout << "kept bytes ok" << std::endl;
}

TEST(PlannerTrace, CountsWhatARealForwardKeepsAlive) {
  auto r = launch("trace_kept_bytes_worker", 1);
  ASSERT_TRUE(r.all_ok()) << r.report();
  std::cout << r.ranks[0].output;
  EXPECT_TRUE(contains(r.ranks[0].output, "kept bytes ok")) << r.report();
}

// A convolution, max pooling (which keeps int64 indices) and a classifier.
struct PoolNetImpl : nn::Module {
  PoolNetImpl() {
    conv = register_module("conv", nn::Conv2d(nn::Conv2dOptions(3, 4, 3).padding(1)));
    fc = register_module("fc", nn::Linear(4 * 4 * 4, 5));
  }
  at::Tensor forward(const at::Tensor& x) { return fc(torch::max_pool2d(torch::relu(conv(x)), 2).flatten(1)); }
  nn::Conv2d conv{nullptr};
  nn::Linear fc{nullptr};
};
TORCH_MODULE(PoolNet);

// Under mixed precision the floating tensors forward keeps narrow to the compute dtype; integer
// ones (pooling's indices, the loss's class targets) keep their width.
TEST(PlannerTrace, KeepsTheWidthOfIntegerTensorsUnderMixedPrecision) {
  fsdp::DeferredInit deferred;
  PoolNet model;
  const int64_t images = 2;
  auto request = world_one()
                     .global_batch(static_cast<int>(images))
                     .micro_batches({static_cast<int>(images)})
                     .activation_checkpointing({false})
                     .precisions({at::kFloat, at::kBFloat16})
                     .trace_sequences(images)
                     .trace_forward([&] {
                       nn::functional::cross_entropy(model->forward(torch::zeros({images, 3, 8, 8})),
                                                     torch::zeros({images}, torch::kLong));
                     });
  const fsdp::Plan plan = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request);
  ASSERT_EQ(plan.entries.size(), 2U) << plan.table();
  int64_t fp32 = 0, bf16 = 0;
  for (const fsdp::PlanEntry& e : plan.entries)
    (e.candidate.precision == at::kFloat ? fp32 : bf16) = e.memory.activations;
  // fp32 = 4 F + I and bf16 = 2 F + I, F the floating values kept and I the integer bytes: the
  // pooling's indices (2 x 4 x 4 x 4 int64) and the targets (2 int64).
  const int64_t integer_bytes = (images * 4 * 4 * 4 + images) * 8;
  EXPECT_EQ(2 * bf16 - fp32, integer_bytes) << plan.table();
}

// Token embeddings, a residual block and logits, whose loss casts them to float32; with `norm`, the
// block's input is normalized in float32 and cast back, as LLaMA's RMS normalization does (its
// float32 copy is the trace's tensor itself, which the residual also adds).
struct WideNetImpl : nn::Module {
  static constexpr int64_t kVocab = 40;
  explicit WideNetImpl(bool norm) : norm(norm) {
    embed = register_module("embed", nn::Embedding(kVocab, 16));
    hidden = register_module("hidden", nn::Linear(16, 16));
    head = register_module("head", nn::Linear(16, kVocab));
    scale = register_parameter("scale", torch::ones({16}));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor x = embed(tokens), n = x;
    if (norm) {
      const at::Tensor x32 = x.to(torch::kFloat);
      n = (x32 * torch::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + 1e-6)).type_as(x) * scale;
    }
    return head(x + torch::tanh(hidden(n)));
  }
  bool norm;
  nn::Embedding embed{nullptr};
  nn::Linear hidden{nullptr}, head{nullptr};
  at::Tensor scale;
};
TORCH_MODULE(WideNet);

at::Tensor wide_loss(WideNet& model, const at::Tensor& tokens, const at::Tensor& targets) {
  return nn::functional::cross_entropy(model->forward(tokens).to(torch::kFloat).reshape({-1, WideNetImpl::kVocab}),
                                       targets.reshape({-1}));
}

// Tensors the program casts to float32 keep that width under mixed precision: the trace counts,
// per precision, what a real forward and loss of the model in that precision keep alive.
FSDP_WORKER(trace_wide_loss_worker) {
  auto* counter = new fsdp_bench::CountingAllocator(c10::GetCPUAllocator());
  c10::SetCPUAllocator(counter, /*priority=*/100);
  at::globalContext().setUserEnabledMkldnn(false);  // as in trace_kept_bytes_worker
  const int64_t sequences = 3, tokens = 5;
  for (const bool norm : {false, true}) {
    std::map<at::ScalarType, int64_t> predicted;
    {
      fsdp::DeferredInit deferred;
      WideNet model(norm);
      auto request = world_one()
                         .global_batch(static_cast<int>(sequences))
                         .micro_batches({static_cast<int>(sequences)})
                         .activation_checkpointing({false})
                         .precisions({at::kFloat, at::kBFloat16})
                         .seq_len(tokens)
                         .trace_sequences(sequences)
                         .trace_forward([&] {
                           wide_loss(model, torch::zeros({sequences, tokens}, torch::kLong),
                                     torch::zeros({sequences, tokens}, torch::kLong));
                         });
      const fsdp::Plan plan = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request);
      WORKER_CHECK(plan.entries.size() == 2U, plan.table());
      for (const fsdp::PlanEntry& e : plan.entries) predicted[e.candidate.precision] = e.memory.activations;
    }
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      WideNet model(norm);
      model->to(dtype);
      const int64_t before = counter->live();
      at::Tensor loss = wide_loss(model, torch::zeros({sequences, tokens}, torch::kLong),
                                  torch::zeros({sequences, tokens}, torch::kLong));
      const int64_t measured = counter->live() - before - static_cast<int64_t>(loss.storage().nbytes());
      std::cout << (norm ? "with" : "without") << " the norm, " << dtype << ": traced " << predicted[dtype]
                << " bytes, kept by a real forward " << measured << std::endl;
      WORKER_CHECK(predicted[dtype] == measured, dtype, ": the trace counts ", predicted[dtype],
                   " bytes, a real forward keeps ", measured);
      loss.backward();
    }
  }
  std::cout << "wide loss ok" << std::endl;
}

TEST(PlannerTrace, KeepsTheWidthOfALossCastToFloatUnderMixedPrecision) {
  auto r = launch("trace_wide_loss_worker", 1);
  ASSERT_TRUE(r.all_ok()) << r.report();
  std::cout << r.ranks[0].output;
  EXPECT_TRUE(contains(r.ranks[0].output, "wide loss ok")) << r.report();
}

// The trace runs some operators on the CPU (randomized leaky ReLU draws its slopes there): it leaves
// the CPU generator where it found it.
TEST(PlannerTrace, LeavesTheRandomNumbersAsItFoundThem) {
  torch::manual_seed(7);
  const at::Tensor expected = torch::rand({4});
  torch::manual_seed(7);
  {
    fsdp::DeferredInit deferred;
    nn::Sequential model(nn::Linear(8, 16), nn::RReLU(), nn::Linear(16, 4));
    model->train();
    auto request = world_one().activation_checkpointing({false}).trace_sequences(3).trace_forward([&] {
      model->forward(torch::zeros({3, 8}));
    });
    EXPECT_EQ(fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request).entries.size(), 1U);
  }
  EXPECT_TRUE(torch::equal(torch::rand({4}), expected));
}

// LibTorch's MultiheadAttention asks torch::equal whether query, key and value are one tensor: the
// trace answers from identity, so self- and cross-attention both trace.
TEST(PlannerTrace, AnswersEqualFromIdentity) {
  fsdp::DeferredInit deferred;
  nn::MultiheadAttention attention(nn::MultiheadAttentionOptions(16, 4));
  std::vector<bool> answers;
  auto request = world_one().seq_len(6).trace_forward([&] {
    at::Tensor x = torch::zeros({6, 1, 16}), y = torch::zeros({6, 1, 16});
    answers = {torch::equal(x, x), torch::equal(x, x.view({6, 1, 16})), torch::equal(x, y),
               torch::equal(x, torch::zeros({6, 16}))};
    attention->forward(x, x, x);
    attention->forward(x, y, y);
  });
  const fsdp::Plan plan = fsdp::plan(*attention, fsdp::Cluster::parse("cpu:1x1"), request);
  EXPECT_FALSE(plan.entries.empty());
  EXPECT_EQ(answers, std::vector<bool>({true, true, false, false}));
}

TEST(PlannerTrace, RefusesAMaterializedModelValueReadsAndBothWaysOfCounting) {
  LinearStack real(8, 1);
  auto request = world_one().seq_len(4).trace_forward([&] { real->forward(torch::zeros({1, 4, 8})); });
  try {
    fsdp::plan(*real, fsdp::Cluster::parse("cpu:1x1"), request);
    FAIL() << "a model on the CPU was traced";
  } catch (const fsdp::Error& e) {
    EXPECT_TRUE(contains(e.what(), "build the model inside fsdp::DeferredInit")) << e.what();
  }
  fsdp::DeferredInit deferred;
  LinearStack model(8, 1);
  request.trace_forward([&] { model->forward(torch::zeros({1, 4, 8})).sum().item<float>(); });
  try {
    fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request);
    FAIL() << "a forward that reads a value was traced";
  } catch (const fsdp::Error& e) {
    EXPECT_TRUE(contains(e.what(), "trace_forward failed on the meta device")) << e.what();
    EXPECT_TRUE(contains(e.what(), "reads a tensor's value")) << e.what();
  }
  request.trace_forward([&] { model->forward(torch::zeros({1, 4, 8})).nonzero(); });
  try {
    fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request);
    FAIL() << "an operator whose result's shape depends on values was traced";
  } catch (const fsdp::Error& e) {
    EXPECT_TRUE(contains(e.what(), "trace_forward failed on the meta device")) << e.what();
    EXPECT_TRUE(contains(e.what(), "nonzero")) << e.what();
  }
  request.trace_forward([&] {
           model->forward(torch::zeros({1, 4, 8}));
         })
      .module_cost([](const std::string&, const nn::Module&, int64_t) { return fsdp::ModuleCost{}; });
  EXPECT_THROW(fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request), fsdp::Error);
}

TEST(PlannerTrace, RefusesWithoutTheTraceModulesItsRulesMiscount) {
  ConvNet model;
  auto request = world_one().global_batch(2).micro_batches({2}).activation_checkpointing({false});
  try {
    fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request);
    FAIL() << "a convolutional model was planned by rules that cannot count it";
  } catch (const fsdp::Error& e) {
    EXPECT_TRUE(contains(e.what(), "Conv2d")) << e.what();
    EXPECT_TRUE(contains(e.what(), "trace_forward")) << e.what();
  }
  // A module_cost that gives nothing: the plan says what its predictions leave out.
  request.module_cost([](const std::string&, const nn::Module&, int64_t) { return fsdp::ModuleCost{}; });
  const fsdp::Plan silent = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request);
  bool noted = false;
  for (const auto& note : silent.notes) noted = noted || contains(note, "missing from every prediction");
  EXPECT_TRUE(noted);
  // A module_cost that counts the convolutions replaces the rules' figures for them.
  request.module_cost([](const std::string&, const nn::Module& m, int64_t) {
    fsdp::ModuleCost c;
    if (dynamic_cast<const nn::Conv2dImpl*>(&m) != nullptr) c.forward_flops = 1e9;
    return c;
  });
  const fsdp::Plan counted = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request);
  ASSERT_EQ(counted.entries.size(), 1U);
  ASSERT_EQ(silent.entries.size(), 1U);
  EXPECT_GT(counted.entries[0].time.step_s, silent.entries[0].time.step_s);
}

TEST(PlannerTrace, NotesTheRepeatedBlockWhenEveryWrapPolicyPlansTheRootOnly) {
  LinearStack model(8, 3);
  auto request = world_one().seq_len(4);
  auto notes = [&] {
    std::string all;
    for (const auto& note : fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request).notes) all += note;
    return all;
  };
  const std::string root_only = notes();
  EXPECT_TRUE(contains(root_only, "torch::nn::SequentialImpl repeats 3 times and holds 100% of the parameters: "
                                  "PlanRequest::wrap_policies({{\"block\", "
                                  "fsdp::wrap::by_type<torch::nn::SequentialImpl>()}})"))
      << root_only;
  request.wrap_policies({{"block", fsdp::wrap::by_type<nn::SequentialImpl>()}});
  EXPECT_FALSE(contains(notes(), "repeats")) << notes();
}

// The share counts a tied parameter once: the blocks hold 216 of 344 elements (63%), not 216 of 472.
struct TiedStackImpl : nn::Module {
  TiedStackImpl() {
    emb = register_module("emb", nn::Embedding(16, 8));
    for (int i = 0; i < 3; ++i) blocks->push_back(nn::Sequential(nn::Linear(8, 8)));
    register_module("blocks", blocks);
    head = register_module("head", TiedHead(emb->weight));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor x = emb(tokens);
    for (const auto& block : *blocks) x = block->as<nn::Sequential>()->forward(x);
    return head(x);
  }
  nn::Embedding emb{nullptr};
  nn::ModuleList blocks;
  TiedHead head{nullptr};
};
TORCH_MODULE(TiedStack);

TEST(PlannerTrace, CountsATiedParameterOnceInTheRepeatedBlockNote) {
  TiedStack model;
  std::string all;
  for (const auto& note : fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), world_one().seq_len(4)).notes)
    all += note;
  EXPECT_TRUE(contains(all, "repeats 3 times and holds 63% of the parameters")) << all;
}

// A CNN whose root holds only the classifier, read last in forward: the trace's first stretch reads
// no parameter, so the runtime gathers the root at the classifier and reduces its gradient as
// backward begins; under mixed precision its batch norms keep FlatParameters of their own.
// `root_norm`: the root also normalizes the images first, in a FlatParameter beside the
// classifier's whose first gradient comes at the end of backward.
struct ConvClassifierImpl : nn::Module {
  explicit ConvClassifierImpl(bool root_norm = false) {
    if (root_norm) norm = register_module("norm", nn::BatchNorm2d(3));
    for (int i = 0; i < 2; ++i)
      blocks->push_back(nn::Sequential(nn::Conv2d(nn::Conv2dOptions(i == 0 ? 3 : 8, 8, 3).padding(1).bias(false)),
                                       nn::BatchNorm2d(8), nn::ReLU()));
    register_module("blocks", blocks);
    fc = register_module("fc", nn::Linear(8 * 4 * 4, 10));
  }
  at::Tensor forward(at::Tensor x) {
    if (norm) x = norm(x);
    for (const auto& block : *blocks) x = torch::max_pool2d(block->as<nn::Sequential>()->forward(x), 2);
    return fc(x.flatten(1));
  }
  nn::BatchNorm2d norm{nullptr};
  nn::ModuleList blocks;
  nn::Linear fc{nullptr};
};
TORCH_MODULE(ConvClassifier);

// A language model whose root's only trainable parameter is its embedding, tied to the head: its
// gradient arrives once, at the end of backward, though the root runs first in backward.
struct TiedLMImpl : nn::Module {
  TiedLMImpl() {
    emb = register_module("emb", nn::Embedding(50, 16));
    for (int i = 0; i < 2; ++i) blocks->push_back(nn::Sequential(nn::Linear(16, 32), nn::Linear(32, 16)));
    register_module("blocks", blocks);
    frozen = register_module("frozen", nn::Linear(16, 16));
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
    head = register_module("head", TiedHead(emb->weight));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor x = emb(tokens);
    for (const auto& block : *blocks) x = block->as<nn::Sequential>()->forward(x);
    return head(frozen(x));
  }
  nn::Embedding emb{nullptr};
  nn::ModuleList blocks;
  nn::Linear frozen{nullptr};
  TiedHead head{nullptr};
};
TORCH_MODULE(TiedLM);

// Every candidate's predicted parameter and gradient peaks against memory_stats() after real steps.
FSDP_WORKER(root_read_last_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const int per_rank = 2;
  auto request = fsdp::PlanRequest()
                     .global_batch(per_rank * pg->size())
                     .micro_batches({per_rank})
                     .strategies({fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp})
                     .precisions({at::kFloat, at::kBFloat16})
                     .wrap_policies({{"block", fsdp::wrap::by_type<nn::SequentialImpl>()}})
                     .activation_checkpointing({false})
                     .cpu_offload({false});
  const auto cluster = fsdp::Cluster::parse("cpu:1x" + std::to_string(pg->size()));
  int checked = 0;
  auto check = [&](const fsdp::Plan& plan, const std::function<std::shared_ptr<nn::Module>()>& build,
                   const std::function<at::Tensor(nn::Module&, fsdp::FullyShardedModule&)>& loss) {
    WORKER_CHECK(plan.entries.size() == 4, "expected 4 candidates, got ", plan.entries.size());
    for (const fsdp::PlanEntry& e : plan.entries) {
      torch::manual_seed(0);
      std::shared_ptr<nn::Module> model = build();
      auto sharded = fsdp::fully_shard(model, pg, e.candidate.options());
      torch::optim::SGD opt(sharded->parameters(), 0.01);
      for (int step = 0; step < 3; ++step) {  // the first step's peaks stay below the steady ones
        opt.zero_grad();
        sharded->reset_peak_memory_stats();
        loss(*model, *sharded).backward();
        opt.step();
      }
      const auto m = sharded->memory_stats();
      WORKER_CHECK(m.param_peak_bytes == e.memory.params && m.grad_peak_bytes == e.memory.grads, e.candidate.describe(),
                   ": peaks measured ", m.param_peak_bytes, " and ", m.grad_peak_bytes, ", predicted ", e.memory.params,
                   " and ", e.memory.grads);
      ++checked;
    }
  };
  TiedLM lm{nullptr};
  {
    fsdp::DeferredInit deferred;
    lm = TiedLM();
  }
  for (const bool root_norm : {false, true}) {
    ConvClassifier convnet{nullptr};
    {
      fsdp::DeferredInit deferred;
      convnet = ConvClassifier(root_norm);
    }
    auto traced = request;
    traced.trace_sequences(per_rank).trace_forward([&] { convnet->forward(torch::zeros({per_rank, 3, 16, 16})); });
    check(
        fsdp::plan(*convnet, cluster, traced), [root_norm] { return ConvClassifier(root_norm).ptr(); },
        [&](nn::Module& model, fsdp::FullyShardedModule& sharded) {
          const at::Tensor x = sharded.cast_forward_input(torch::randn({per_rank, 3, 16, 16}));
          const at::Tensor out = dynamic_cast<ConvClassifierImpl&>(model).forward(x).to(at::kFloat);
          return torch::nn::functional::cross_entropy(out, torch::randint(10, {per_rank}));
        });
  }
  auto rules = request;  // the rules: the head's matrix is a product, the embedding a lookup
  check(
      fsdp::plan(*lm, cluster, rules.seq_len(8)), [] { return TiedLM().ptr(); },
      [&](nn::Module& model, fsdp::FullyShardedModule&) {
        const at::Tensor tokens = torch::randint(50, {per_rank, 8});
        const at::Tensor logits = dynamic_cast<TiedLMImpl&>(model).forward(tokens).to(at::kFloat);
        return torch::nn::functional::cross_entropy(logits.reshape({-1, 50}), tokens.reshape({-1}));
      });
  std::cout << "root read last: " << checked << " configurations exact" << std::endl;
}

TEST(PlannerTrace, PredictsPeaksExactlyWhereTheRootIsReadLastOrTiedOnly) {
  auto r = launch("root_read_last_worker", 2);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "root read last: 12 configurations exact")) << r.report();
}

// A block holding a unit of its own (its MLP), both checkpointed: the block's recompute in backward
// enters the MLP's unit before backward reaches the MLP's own stretch.
struct InnerMlpImpl : nn::Module {
  InnerMlpImpl() {
    fc1 = register_module("fc1", nn::Linear(32, 96));
    fc2 = register_module("fc2", nn::Linear(96, 32));
  }
  at::Tensor forward(at::Tensor x) { return fc2(torch::gelu(fc1(x))); }
  nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(InnerMlp);

struct NestedBlockImpl : nn::Module {
  NestedBlockImpl() {
    ln = register_module("ln", nn::LayerNorm(nn::LayerNormOptions({32})));
    proj = register_module("proj", nn::Linear(32, 32));
    mlp = register_module("mlp", fsdp::Checkpointed<InnerMlp>(InnerMlp()));
  }
  at::Tensor forward(at::Tensor x) {
    x = x + torch::relu(proj(ln(x)));
    return x + mlp(x);
  }
  nn::LayerNorm ln{nullptr};
  nn::Linear proj{nullptr};
  fsdp::Checkpointed<InnerMlp> mlp{nullptr};
};
TORCH_MODULE(NestedBlock);

struct NestedLmImpl : nn::Module {
  NestedLmImpl() {
    emb = register_module("emb", nn::Embedding(64, 32));
    for (int i = 0; i < 2; ++i)
      blocks.push_back(register_module("b" + std::to_string(i), fsdp::Checkpointed<NestedBlock>(NestedBlock())));
    lnf = register_module("lnf", nn::LayerNorm(nn::LayerNormOptions({32})));
    head = register_module("head", nn::Linear(32, 64));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor x = emb(tokens);
    for (auto& block : blocks) x = block(x);
    return head(lnf(x));
  }
  nn::Embedding emb{nullptr};
  std::vector<fsdp::Checkpointed<NestedBlock>> blocks;
  nn::LayerNorm lnf{nullptr};
  nn::Linear head{nullptr};
};
TORCH_MODULE(NestedLm);

// Every candidate's predicted peaks against memory_stats() after real steps, each applied as planned.
FSDP_WORKER(nested_checkpointed_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const int per_rank = 2;
  NestedLm meta{nullptr};
  {
    fsdp::DeferredInit deferred;
    meta = NestedLm();
  }
  const fsdp::Plan plan =
      fsdp::plan(*meta, fsdp::Cluster::parse("cpu:1x" + std::to_string(pg->size())),
                 fsdp::PlanRequest()
                     .global_batch(per_rank * pg->size())
                     .seq_len(8)
                     .micro_batches({1, 2})
                     .no_sync({false, true})
                     .keep_unsharded({false, true})
                     .strategies({fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp})
                     .precisions({at::kFloat, at::kBFloat16})
                     .wrap_policies({{"nested", fsdp::wrap::by_type<NestedBlockImpl, InnerMlpImpl>()}})
                     .activation_checkpointing({true})
                     .cpu_offload({false})
                     .grads_kept_between_steps(true));  // zeroed in place below, on every LibTorch
  WORKER_CHECK(plan.entries.size() == 16, "expected 16 candidates, got ", plan.entries.size());
  int checked = 0;
  for (const fsdp::PlanEntry& e : plan.entries) {
    const fsdp::Candidate& c = e.candidate;
    torch::manual_seed(0);
    NestedLm model;
    WORKER_CHECK(c.activation_checkpointing && fsdp::apply_activation_checkpointing(*model, c.wrap.policy) == 4,
                 c.describe(), ": every block and MLP checkpointed");
    auto sharded = fsdp::fully_shard(model.ptr(), pg, c.options());
    torch::optim::SGD opt(sharded->parameters(), 0.01);
    // The first step's backward keeps no unit from forward: the outer recompute's prefetch of the
    // next unit is not held back, and the inner unit is then gathered on demand beside it.
    int64_t one_more = 0;
    for (const auto& unit : sharded->units())
      if (unit.parent >= 0)
        one_more =
            std::max(one_more, unit.padded_bytes + (c.precision == at::kFloat ? 0 : unit.padded_bytes / pg->size()));
    for (int step = 0; step < 3; ++step) {
      sharded->reset_peak_memory_stats();
      zero_grad_in_place(opt);
      for (int m = 0; m < c.accumulation; ++m) {
        std::optional<fsdp::FullyShardedModule::NoSyncGuard> no_sync;
        if (c.no_sync && m + 1 < c.accumulation) no_sync.emplace(sharded->no_sync());
        if (c.keep_unsharded) sharded->set_reshard_after_backward(m + 1 == c.accumulation);
        const at::Tensor tokens = torch::randint(64, {c.micro_batch, 8});
        lm_loss(model->forward(tokens).to(at::kFloat), tokens).backward();
      }
      opt.step();
      const auto mem = sharded->memory_stats();
      if (step == 0) {
        WORKER_CHECK(mem.param_peak_bytes <= e.memory.params + one_more && mem.grad_peak_bytes <= e.memory.grads,
                     c.describe(), ": the first step's peaks ", mem.param_peak_bytes, " and ", mem.grad_peak_bytes,
                     " exceed the predicted ", e.memory.params, " (and one unit more) and ", e.memory.grads);
        continue;
      }
      WORKER_CHECK(mem.param_peak_bytes == e.memory.params && mem.grad_peak_bytes == e.memory.grads, c.describe(),
                   ": peaks measured ", mem.param_peak_bytes, " and ", mem.grad_peak_bytes, ", predicted ",
                   e.memory.params, " and ", e.memory.grads);
    }
    ++checked;
  }
  std::cout << "nested checkpointed: " << checked << " configurations exact" << std::endl;
}

TEST(PlannerTrace, PredictsPeaksExactlyWhereACheckpointedUnitHoldsAnother) {
  auto r = launch("nested_checkpointed_worker", 2);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "nested checkpointed: 16 configurations exact")) << r.report();
}

// Checkpointed blocks whose gradients reach a unit in several recomputations' backwards, or not:
// "twice" applies its first block twice in forward, "shared" registers one Linear in both blocks
// (its parameters then belong to the root), "distinct" does neither.
struct PassesImpl : nn::Module {
  explicit PassesImpl(const std::string& kind) : twice(kind == "twice") {
    nn::Linear shared(16, 16);
    for (int i = 0; i < 2; ++i) {
      nn::Sequential block(kind == "shared" ? shared : nn::Linear(16, 16), nn::Tanh(), nn::Linear(16, 16));
      blocks.push_back(register_module("b" + std::to_string(i), fsdp::Checkpointed<nn::Sequential>(block)));
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& block : blocks) x = block(x);
    return twice ? blocks[0](x) : x;
  }
  bool twice;
  std::vector<fsdp::Checkpointed<nn::Sequential>> blocks;
};
TORCH_MODULE(Passes);

// The plan leaves out checkpointed candidates that step in backward exactly where the runtime
// refuses them: the trace sees a block run twice, the module tree a parameter in two blocks.
FSDP_WORKER(several_passes_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string kind = ctx.args.at(0);
  Passes meta{nullptr};
  {
    fsdp::DeferredInit deferred;
    meta = Passes(kind);
  }
  fsdp::PlanRequest request = world_one()
                                  .world(pg->size())
                                  .global_batch(pg->size())
                                  .seq_len(4)
                                  .wrap_policies({{"block", fsdp::wrap::by_type<nn::SequentialImpl>()}})
                                  .activation_checkpointing({false, true})
                                  .step_in_backward({false, true})
                                  .trace_forward([&] {
                                    meta->forward(torch::zeros({1, 4, 16}, at::kMeta));
                                  });
  const fsdp::Plan plan = fsdp::plan(*meta, fsdp::Cluster::parse("cpu:1x" + std::to_string(pg->size())), request);
  std::string notes;
  for (const auto& note : plan.notes) notes += note;
  int stepping = 0, checkpointed_stepping = 0;
  for (const fsdp::PlanEntry& e : plan.entries) {
    stepping += e.candidate.step_in_backward;
    checkpointed_stepping += e.candidate.step_in_backward && e.candidate.activation_checkpointing;
  }
  const bool several = kind != "distinct";
  WORKER_CHECK(stepping > 0 && (checkpointed_stepping == 0) == several, kind, ": ", checkpointed_stepping,
               " checkpointed candidates that step in backward of ", stepping, " that step in it\n", plan.table());
  const std::string why = kind == "twice" ? "the checkpointed module 'b0' runs 2 times in one forward"
                                          : "the checkpointed modules 'b0' and 'b1' share the parameter";
  WORKER_CHECK(contains(notes, "left out") == several && (!several || contains(notes, why)), kind, ": notes: ", notes);
  // The runtime: checkpointed, stepping in backward, refused where several passes bring gradients.
  torch::manual_seed(0);
  Passes model(kind);
  fsdp::apply_activation_checkpointing(*model, fsdp::wrap::by_type<nn::SequentialImpl>());
  auto sharded =
      fsdp::fully_shard(model.ptr(), pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<nn::SequentialImpl>()));
  torch::optim::SGD opt(sharded->parameters(), 0.01);
  sharded->set_step_in_backward(&opt);
  std::string refused;
  try {
    model->forward(torch::randn({1, 4, 16})).pow(2).mean().backward();
  } catch (const std::exception& e) {
    refused = e.what();
  }
  WORKER_CHECK(contains(refused, "arrived after that unit's gradients were reduced") == several, kind,
               ": the runtime's answer: ", refused.empty() ? "none" : refused);
  std::cout << kind << " ok" << std::endl;
}

TEST(PlannerTrace, LeavesOutTheStepInBackwardWhereCheckpointedGradientsArriveInSeveralPasses) {
  for (const char* kind : {"twice", "shared", "distinct"}) {
    auto r = launch("several_passes_worker", 2, {kind});
    ASSERT_TRUE(r.all_ok()) << kind << "\n" << r.report();
    EXPECT_TRUE(contains(r.ranks[0].output, std::string(kind) + " ok")) << r.report();
  }
}

// A language model whose forward skips one of its blocks (layer drop at a fixed place): the runtime
// never gathers that unit, and its parameters get no gradient and no optimizer state.
struct SkippingLmImpl : nn::Module {
  SkippingLmImpl() {
    emb = register_module("emb", nn::Embedding(64, 32));
    for (int i = 0; i < 3; ++i) blocks->push_back(nn::Sequential(nn::Linear(32, 64), nn::GELU(), nn::Linear(64, 32)));
    register_module("blocks", blocks);
    head = register_module("head", nn::Linear(32, 64));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor x = emb(tokens);
    for (size_t i = 0; i < blocks->size(); ++i)
      if (i != 1) x = x + blocks[i]->as<nn::Sequential>()->forward(x);
    return head(x);
  }
  nn::Embedding emb{nullptr};
  nn::ModuleList blocks;
  nn::Linear head{nullptr};
};
TORCH_MODULE(SkippingLm);

// Bytes of every tensor in an AdamW's state.
int64_t adamw_state_bytes(torch::optim::AdamW& opt) {
  int64_t bytes = 0;
  for (const auto& entry : opt.state()) {
    const auto& s = dynamic_cast<const torch::optim::AdamWParamState&>(*entry.second);
    for (const at::Tensor& t : {s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()})
      if (t.defined()) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  }
  return bytes;
}

// The run's parameter and gradient peaks and its AdamW state equal the entry's prediction.
void check_peaks_and_state(const fsdp::PlanEntry& e, const fsdp::FullyShardedModule& sharded,
                           torch::optim::AdamW& opt) {
  const auto m = sharded.memory_stats();
  const int64_t state = adamw_state_bytes(opt);
  WORKER_CHECK(
      m.param_peak_bytes == e.memory.params && m.grad_peak_bytes == e.memory.grads && state == e.memory.optimizer,
      e.candidate.describe(), ": parameter, gradient and optimizer state measured ", m.param_peak_bytes, ", ",
      m.grad_peak_bytes, " and ", state, " bytes, predicted ", e.memory.params, ", ", e.memory.grads, " and ",
      e.memory.optimizer);
}

// A language model with one block frozen, accumulating under no_sync with the parameters kept
// unsharded between micro-batches (keep_unsharded) or not: a frozen unit stays gathered from one
// micro-batch to the next like the others, and every peak is predicted exactly. args: frozen block
struct FrozenBlockLmImpl : nn::Module {
  explicit FrozenBlockLmImpl(int frozen) {
    emb = register_module("emb", nn::Embedding(64, 32));
    for (int i = 0; i < 3; ++i) blocks->push_back(nn::Sequential(nn::Linear(32, 48), nn::GELU(), nn::Linear(48, 32)));
    register_module("blocks", blocks);
    head = register_module("head", nn::Linear(32, 64));
    for (auto& p : blocks[frozen]->parameters()) p.requires_grad_(false);
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor x = emb(tokens);
    for (const auto& block : *blocks) x = x + block->as<nn::Sequential>()->forward(x);
    return head(x);
  }
  nn::Embedding emb{nullptr};
  nn::ModuleList blocks;
  nn::Linear head{nullptr};
};
TORCH_MODULE(FrozenBlockLm);

FSDP_WORKER(frozen_kept_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const int frozen = std::stoi(ctx.args.at(0));
  FrozenBlockLm meta{nullptr};
  {
    fsdp::DeferredInit deferred;
    meta = FrozenBlockLm(frozen);
  }
  const fsdp::Plan plan = fsdp::plan(*meta, fsdp::Cluster::parse("cpu:1x" + std::to_string(pg->size())),
                                     fsdp::PlanRequest()
                                         .global_batch(2 * pg->size())
                                         .seq_len(8)
                                         .micro_batches({1})
                                         .no_sync({true})
                                         .keep_unsharded({false, true})
                                         .strategies({fsdp::ShardingStrategy::kFullShard})
                                         .precisions({at::kFloat, at::kBFloat16})
                                         .wrap_policies({{"block", fsdp::wrap::by_type<nn::SequentialImpl>()}})
                                         .activation_checkpointing({false})
                                         .cpu_offload({false})
                                         .grads_kept_between_steps(true));
  WORKER_CHECK(plan.entries.size() == 4, "expected 4 candidates, got ", plan.entries.size());
  for (const fsdp::PlanEntry& e : plan.entries) {
    const fsdp::Candidate& c = e.candidate;
    torch::manual_seed(0);
    FrozenBlockLm model(frozen);
    auto sharded = fsdp::fully_shard(model.ptr(), pg, c.options());
    torch::optim::AdamW opt(sharded->parameters(), torch::optim::AdamWOptions(0.01));
    for (int step = 0; step < 3; ++step) {
      sharded->reset_peak_memory_stats();
      zero_grad_in_place(opt);
      for (int m = 0; m < c.accumulation; ++m) {
        std::optional<fsdp::FullyShardedModule::NoSyncGuard> no_sync;
        if (m + 1 < c.accumulation) no_sync.emplace(sharded->no_sync());
        if (c.keep_unsharded) sharded->set_reshard_after_backward(m + 1 == c.accumulation);
        const at::Tensor tokens = torch::randint(64, {c.micro_batch, 8});
        lm_loss(model->forward(tokens).to(at::kFloat), tokens).backward();
      }
      opt.step();
    }
    check_peaks_and_state(e, *sharded, opt);
  }
  std::cout << "frozen block " << frozen << ": 4 configurations exact" << std::endl;
}

TEST(PlannerTrace, PredictsPeaksExactlyForFrozenUnitsKeptUnshardedBetweenMicroBatches) {
  for (const std::string frozen : {"0", "2"}) {
    auto r = launch("frozen_kept_worker", 2, {frozen});
    ASSERT_TRUE(r.all_ok()) << r.report();
    EXPECT_TRUE(contains(r.ranks[0].output, "frozen block " + frozen + ": 4 configurations exact")) << r.report();
  }
}

// Every candidate's predicted parameter, gradient and optimizer state peaks against real steps.
FSDP_WORKER(skipped_unit_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const int per_rank = 2;
  SkippingLm meta{nullptr};
  {
    fsdp::DeferredInit deferred;
    meta = SkippingLm();
  }
  const fsdp::Plan plan =
      fsdp::plan(*meta, fsdp::Cluster::parse("cpu:1x" + std::to_string(pg->size())),
                 fsdp::PlanRequest()
                     .global_batch(per_rank * pg->size())
                     .micro_batches({per_rank})
                     .strategies({fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp,
                                  fsdp::ShardingStrategy::kNoShard})
                     .precisions({at::kFloat, at::kBFloat16})
                     .wrap_policies({{"block", fsdp::wrap::by_type<nn::SequentialImpl>()}})
                     .activation_checkpointing({false})
                     .cpu_offload({false})
                     .grads_kept_between_steps(true)  // zeroed in place below, on every LibTorch
                     .trace_sequences(per_rank)
                     .trace_forward([&] {
                       meta->forward(torch::zeros({per_rank, 8}, at::kLong));
                     }));
  WORKER_CHECK(plan.entries.size() == 6, "expected 6 candidates, got ", plan.entries.size());
  int checked = 0;
  for (const fsdp::PlanEntry& e : plan.entries) {
    torch::manual_seed(0);
    SkippingLm model;
    auto sharded = fsdp::fully_shard(model.ptr(), pg, e.candidate.options());
    torch::optim::AdamW opt(sharded->parameters(), torch::optim::AdamWOptions(0.01));
    for (int step = 0; step < 3; ++step) {
      zero_grad_in_place(opt);
      sharded->reset_peak_memory_stats();
      const at::Tensor tokens = torch::randint(64, {per_rank, 8});
      lm_loss(model->forward(tokens).to(at::kFloat), tokens).backward();
      opt.step();
    }
    check_peaks_and_state(e, *sharded, opt);
    ++checked;
  }
  std::cout << "skipped unit: " << checked << " configurations exact" << std::endl;
}

TEST(PlannerTrace, PredictsPeaksExactlyWhereForwardSkipsAUnit) {
  auto r = launch("skipped_unit_worker", 2);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "skipped unit: 6 configurations exact")) << r.report();
}

// A block holding, beside its Linear, a float64 and a bfloat16 parameter: each gets a FlatParameter
// of its own dtype, which fp32 candidates (no mixed precision) keep and bf16 ones cast.
struct MixedDtypeBlockImpl : nn::Module {
  MixedDtypeBlockImpl() {
    lin = register_module("lin", nn::Linear(8, 8));
    wide = register_parameter("wide", torch::full({5}, 0.1, at::kDouble));
    narrow = register_parameter("narrow", torch::full({3}, 0.2, at::kBFloat16));
  }
  at::Tensor forward(const at::Tensor& x) {
    return lin(x) * (1 + wide.mean().to(x.scalar_type())) + narrow.mean().to(x.scalar_type());
  }
  nn::Linear lin{nullptr};
  at::Tensor wide, narrow;
};
TORCH_MODULE(MixedDtypeBlock);

struct MixedDtypeNetImpl : nn::Module {
  MixedDtypeNetImpl() {
    for (int i = 0; i < 2; ++i) blocks.push_back(register_module("b" + std::to_string(i), MixedDtypeBlock()));
    head = register_module("head", nn::Linear(8, 4));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : blocks) x = b(x);
    return head(x);
  }
  std::vector<MixedDtypeBlock> blocks;
  nn::Linear head{nullptr};
};
TORCH_MODULE(MixedDtypeNet);

// Every candidate, with the gradients kept between steps (zeroed) and dropped (set to none): the
// predicted peaks against memory_stats() after real steps.
FSDP_WORKER(dtypes_and_dropped_grads_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const int per_rank = 2;
  MixedDtypeNet meta{nullptr};
  {
    fsdp::DeferredInit deferred;
    meta = MixedDtypeNet();
  }
  int checked = 0;
  for (const bool kept : {true, false}) {
    std::vector<fsdp::ShardingStrategy> strategies{fsdp::ShardingStrategy::kFullShard};
    if (pg->size() > 1)
      strategies.insert(strategies.end(), {fsdp::ShardingStrategy::kNoShard, fsdp::ShardingStrategy::kShardGradOp});
    const fsdp::Plan plan =
        fsdp::plan(*meta, fsdp::Cluster::parse("cpu:1x" + std::to_string(pg->size())),
                   fsdp::PlanRequest()
                       .global_batch(per_rank * pg->size())
                       .seq_len(1)
                       .micro_batches({per_rank})
                       .strategies(strategies)
                       .precisions({at::kFloat, at::kBFloat16})
                       .wrap_policies({{"none", nullptr}, {"block", fsdp::wrap::by_type<MixedDtypeBlockImpl>()}})
                       .activation_checkpointing({false})
                       .cpu_offload({false})
                       .grads_kept_between_steps(kept)
                       .trace_sequences(per_rank)
                       .trace_forward([&] {
                         meta->forward(torch::zeros({per_rank, 8}));
                       }));
    for (const fsdp::PlanEntry& e : plan.entries) {
      torch::manual_seed(0);
      MixedDtypeNet model;
      auto sharded = fsdp::fully_shard(model.ptr(), pg, e.candidate.options());
      torch::optim::SGD opt(sharded->parameters(), 0.01);
      for (int step = 0; step < 3; ++step) {
        if (kept) {
          zero_grad_in_place(opt);
        } else {
          for (auto& p : sharded->parameters()) p.mutable_grad().reset();
        }
        sharded->reset_peak_memory_stats();
        const at::Tensor x = sharded->cast_forward_input(torch::randn({per_rank, 8}));
        model->forward(x).to(at::kFloat).pow(2).mean().backward();
        opt.step();
      }
      const auto m = sharded->memory_stats();
      const bool exact = m.param_peak_bytes == e.memory.params && m.grad_peak_bytes == e.memory.grads;
      const bool below = m.param_peak_bytes <= e.memory.params && m.grad_peak_bytes <= e.memory.grads;
      WORKER_CHECK(pg->rank() == 0 ? exact : below, e.candidate.describe(), kept ? "" : ", gradients dropped",
                   ": peaks measured ", m.param_peak_bytes, " and ", m.grad_peak_bytes, ", predicted ", e.memory.params,
                   " and ", e.memory.grads);
      ++checked;
    }
  }
  std::cout << "dtypes and dropped gradients: " << checked << " configurations exact" << std::endl;
}

TEST(PlannerTrace, PredictsPeaksExactlyForParametersOfOtherDtypesAndDroppedGradients) {
  for (const auto& [world, candidates] : std::vector<std::pair<int, int>>{{1, 8}, {2, 24}}) {
    auto r = launch("dtypes_and_dropped_grads_worker", world);
    ASSERT_TRUE(r.all_ok()) << r.report();
    EXPECT_TRUE(contains(r.ranks[0].output,
                         "dtypes and dropped gradients: " + std::to_string(candidates) + " configurations exact"))
        << r.report();
  }
}

// A model with a side tower the run leaves alone (Options::ignored_modules or ignored_parameters),
// planned with the meta model's tower as PlanRequest's: FSDP's peaks and the optimizer state over its
// pieces exclude what is ignored, counted whole with its gradients and its own optimizer's state instead.
struct SideTowerNetImpl : nn::Module {
  SideTowerNetImpl() {
    for (int i = 0; i < 2; ++i) blocks->push_back(nn::Sequential(nn::Linear(8, 16), nn::Linear(16, 8)));
    register_module("blocks", blocks);
    side = register_module("side", nn::Linear(8, 8));
  }
  at::Tensor forward(at::Tensor x) {
    for (const auto& block : *blocks) x = block->as<nn::Sequential>()->forward(x);
    return x + side(x.to(at::kFloat)).to(x.scalar_type());  // the ignored tower stays float32
  }
  nn::ModuleList blocks;
  nn::Linear side{nullptr};
};
TORCH_MODULE(SideTowerNet);

FSDP_WORKER(ignored_modules_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const int per_rank = 2;
  SideTowerNet meta{nullptr};
  {
    fsdp::DeferredInit deferred;
    meta = SideTowerNet();
  }
  // The whole tower ignored and stepped by an AdamW of its own (PlanRequest::step_ignored), or its
  // weight alone ignored and left unstepped, planned by the rules and by the trace: its bias stays
  // FSDP's, the root's only parameter, which backward does not read (no backward prefetch there).
  int checked = 0;
  for (const auto& [whole, traced] : std::vector<std::pair<bool, bool>>{{true, false}, {false, false}, {false, true}}) {
    fsdp::PlanRequest request =
        fsdp::PlanRequest()
            .global_batch(per_rank * pg->size())
            .seq_len(1)
            .micro_batches({per_rank})
            .strategies({fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp,
                         fsdp::ShardingStrategy::kNoShard})
            .precisions(whole ? std::vector<at::ScalarType>{at::kFloat, at::kBFloat16}
                              : std::vector<at::ScalarType>{at::kFloat})
            .wrap_policies({{"none", nullptr}, {"block", fsdp::wrap::by_type<nn::SequentialImpl>()}})
            .activation_checkpointing({false})
            .cpu_offload({false})
            .grads_kept_between_steps(true);
    if (whole)
      request.ignored_modules({meta->side.ptr()});
    else
      request.ignored_parameters({meta->side->weight}).step_ignored(false);
    if (traced) request.trace_sequences(per_rank).trace_forward([&] { meta->forward(torch::zeros({per_rank, 8})); });
    const fsdp::Plan plan = fsdp::plan(*meta, fsdp::Cluster::parse("cpu:1x" + std::to_string(pg->size())), request);
    for (const fsdp::PlanEntry& e : plan.entries) {
      torch::manual_seed(0);
      SideTowerNet model;
      fsdp::Options options = e.candidate.options();
      if (whole)
        options.ignored_modules({model->side.ptr()});
      else
        options.ignored_parameters({model->side->weight});
      auto sharded = fsdp::fully_shard(model.ptr(), pg, options);
      torch::optim::AdamW opt(sharded->parameters(), torch::optim::AdamWOptions(0.01));
      std::vector<at::Tensor> side;
      for (const auto& [name, p] : sharded->ignored_parameters()) side.push_back(p);
      torch::optim::AdamW side_opt(side, torch::optim::AdamWOptions(0.01));
      for (int step = 0; step < 3; ++step) {
        zero_grad_in_place(opt);
        zero_grad_in_place(side_opt);
        sharded->reset_peak_memory_stats();
        const at::Tensor x = sharded->cast_forward_input(torch::randn({per_rank, 8}));
        model->forward(x).to(at::kFloat).pow(2).mean().backward();
        opt.step();
        if (whole) side_opt.step();
      }
      int64_t side_bytes = adamw_state_bytes(side_opt);  // float32 parameters and their gradients besides
      for (const at::Tensor& p : side) side_bytes += 2 * p.numel() * 4;
      WORKER_CHECK(side_bytes == (whole ? 4 * (8 * 8 + 8) * 4 : 2 * 8 * 8 * 4), "measured ", side_bytes);
      WORKER_CHECK(e.memory.ignored == side_bytes, e.candidate.describe(), ": ignored ", e.memory.ignored,
                   " predicted, ", side_bytes, " measured");
      check_peaks_and_state(e, *sharded, opt);
      ++checked;
    }
  }
  std::cout << "ignored modules and parameters: " << checked << " configurations exact" << std::endl;
}

TEST(PlannerTrace, PredictsPeaksExactlyWithIgnoredModulesAndParameters) {
  auto r = launch("ignored_modules_worker", 2);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "ignored modules and parameters: 24 configurations exact")) << r.report();
}

}  // namespace
}  // namespace fsdp_test
