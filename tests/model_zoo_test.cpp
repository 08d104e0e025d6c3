// Model zoo: standard LibTorch modules beyond Linear/LayerNorm/Embedding train as locally.
// Convolutions with group norm, a sparse Embedding feeding LSTM and GRU (whose forward reads a
// cached list of weight tensors), the built-in TransformerEncoderLayer (MultiheadAttention's fused
// in-projection), EmbeddingBag, and a frozen submodule. Each is trained with FSDP at world 3 (every
// unit padded) and compared with single-process training on the same global batch.
#include <gtest/gtest.h>

#include <functional>

#include "harness.h"

namespace fsdp_test {
namespace {

namespace nn = torch::nn;

struct ConvNetImpl : nn::Module {
  ConvNetImpl() {
    features = register_module(
        "features", nn::Sequential(nn::Conv2d(nn::Conv2dOptions(3, 6, 3).padding(1)), nn::GroupNorm(2, 6), nn::ReLU(),
                                   nn::MaxPool2d(2), nn::Conv2d(nn::Conv2dOptions(6, 5, 3).stride(2)),
                                   nn::GroupNorm(1, 5), nn::ReLU()));
    up = register_module("up", nn::ConvTranspose2d(nn::ConvTranspose2dOptions(5, 4, 2).stride(2)));
    head = register_module("head", nn::Linear(4 * 2 * 2, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(up(features->forward(x)).flatten(1)); }
  nn::Sequential features{nullptr};
  nn::ConvTranspose2d up{nullptr};
  nn::Linear head{nullptr};
};
TORCH_MODULE(ConvNet);

struct RecurrentImpl : nn::Module {
  RecurrentImpl() {
    // Sparse gradients: FSDP turns them into its dense flat gradient.
    embed = register_module("embed", nn::Embedding(nn::EmbeddingOptions(11, 6).sparse(true)));
    lstm = register_module("lstm", nn::LSTM(nn::LSTMOptions(6, 7).num_layers(2).batch_first(true)));
    gru = register_module("gru", nn::GRU(nn::GRUOptions(7, 5).bidirectional(true).batch_first(true)));
    head = register_module("head", nn::Linear(10, 3));
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    auto h = std::get<0>(lstm(embed(tokens)));
    h = std::get<0>(gru(h));
    return head(h.select(1, -1));
  }
  nn::Embedding embed{nullptr};
  nn::LSTM lstm{nullptr};
  nn::GRU gru{nullptr};
  nn::Linear head{nullptr};
};
TORCH_MODULE(Recurrent);

struct EncoderImpl : nn::Module {
  EncoderImpl() {
    bag = register_module("bag", nn::EmbeddingBag(nn::EmbeddingBagOptions(13, 8).mode(torch::kMean)));
    embed = register_module("embed", nn::Embedding(13, 8));
    for (int i = 0; i < 2; ++i)
      layers->push_back(
          nn::TransformerEncoderLayer(nn::TransformerEncoderLayerOptions(8, 2).dim_feedforward(12).dropout(0.0)));
    register_module("layers", layers);
    // Frozen: no gradient, never changed by the optimizer, still sharded and gathered.
    frozen = register_module("frozen", nn::Linear(8, 8));
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
    head = register_module("head", nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    auto x = embed(tokens).transpose(0, 1);  // (seq, batch, d)
    for (auto& layer : *layers) x = layer->as<nn::TransformerEncoderLayerImpl>()->forward(x);
    auto pooled = x.mean(0) + bag(tokens);
    return head(torch::tanh(frozen(pooled)));
  }
  nn::EmbeddingBag bag{nullptr};
  nn::Embedding embed{nullptr};
  nn::ModuleList layers;
  nn::Linear frozen{nullptr};
  nn::Linear head{nullptr};
};
TORCH_MODULE(Encoder);

struct Zoo {
  std::function<std::shared_ptr<nn::Module>()> make;
  std::function<at::Tensor(nn::Module&, const at::Tensor&)> forward;
  std::function<at::Tensor(int64_t rows, at::Generator&)> input;
  fsdp::WrapPolicy policy;
};

Zoo zoo(const std::string& name) {
  if (name == "conv")
    return {[] { return ConvNet().ptr(); },
            [](nn::Module& m, const at::Tensor& x) { return m.as<ConvNetImpl>()->forward(x); },
            [](int64_t rows, at::Generator& g) {
              return at::randn({rows, 3, 8, 8}, g);
            },
            fsdp::wrap::by_type<nn::Conv2dImpl, nn::ConvTranspose2dImpl>()};
  if (name == "recurrent")
    return {[] { return Recurrent().ptr(); },
            [](nn::Module& m, const at::Tensor& x) { return m.as<RecurrentImpl>()->forward(x); },
            [](int64_t rows, at::Generator& g) {
              return at::randint(0, 11, {rows, 5}, g);
            },
            fsdp::wrap::by_type<nn::LSTMImpl, nn::GRUImpl>()};
  if (name == "encoder")
    return {[] { return Encoder().ptr(); },
            [](nn::Module& m, const at::Tensor& x) { return m.as<EncoderImpl>()->forward(x); },
            [](int64_t rows, at::Generator& g) {
              return at::randint(0, 13, {rows, 6}, g);
            },
            fsdp::wrap::any_of({fsdp::wrap::by_type<nn::TransformerEncoderLayerImpl, nn::EmbeddingBagImpl>(),
                                fsdp::wrap::by_names({"frozen"})})};
  throw std::runtime_error("unknown model " + name);
}

// args: "model:STRATEGY" combos. float64 with SGD + momentum, so agreement is to rounding only.
FSDP_WORKER(zoo_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const int steps = 3, per_rank = 2;
  const double tol = 1e-10;
  for (const auto& combo : ctx.args) {
    const auto colon = combo.find(':');
    const std::string name = combo.substr(0, colon), strategy = combo.substr(colon + 1);
    const Zoo z = zoo(name);
    torch::manual_seed(5);
    auto reference = z.make();
    reference->to(at::kDouble);
    torch::manual_seed(5);
    auto model = z.make();
    model->to(at::kDouble);
    auto sharded = fsdp::fully_shard(
        model, pg,
        fsdp::Options().sharding_strategy(fsdp::parse_sharding_strategy(strategy)).auto_wrap_policy(z.policy));
    WORKER_CHECK(sharded->units().size() > 2, combo, ": the policy should make several units, got ",
                 sharded->units().size());
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD ref_opt(unique_parameters(*reference), sgd);
    torch::optim::SGD opt(sharded->parameters(), sgd);
    for (int step = 0; step < steps; ++step) {
      auto gen = at::detail::createCPUGenerator(100 + step);
      at::Tensor x = z.input(per_rank * ctx.world, gen);
      if (x.is_floating_point()) x = x.to(at::kDouble);
      at::Tensor target = at::randn({per_rank * ctx.world, 3}, gen).to(at::kDouble);
      ref_opt.zero_grad();
      torch::mse_loss(z.forward(*reference, x), target).backward();
      ref_opt.step();
      opt.zero_grad();
      const auto rows = [&](const at::Tensor& t) {
        return t.narrow(0, ctx.rank * per_rank, per_rank);
      };
      torch::mse_loss(z.forward(*model, rows(x)), rows(target)).backward();
      opt.step();
    }
    auto full = sharded->full_state_dict();
    int compared = 0;
    for (const auto& kv : reference->named_parameters()) {
      auto it = full.find(kv.key());
      WORKER_CHECK(it != full.end(), combo, ": parameter ", kv.key(), " missing from full_state_dict");
      const double d = rel_diff(it->second, kv.value().detach());
      WORKER_CHECK(d <= tol, combo, ": parameter ", kv.key(), " differs from local training by rel ", d);
      ++compared;
    }
    // The sharded model itself computes what the reference computes, outside training too.
    at::NoGradGuard no_grad;
    auto gen = at::detail::createCPUGenerator(7);
    at::Tensor x = z.input(per_rank, gen);
    if (x.is_floating_point()) x = x.to(at::kDouble);
    const double d = rel_diff(z.forward(*model, x), z.forward(*reference, x));
    WORKER_CHECK(d <= tol, combo, ": evaluation output differs from local by rel ", d);
    if (ctx.rank == 0) std::cout << combo << " ok (" << compared << " parameters)" << std::endl;
  }
}

class ZooTest : public ::testing::TestWithParam<const char*> {};

TEST_P(ZooTest, MatchesLocalTrainingAtWorld3) {
  const std::string model = GetParam();
  std::vector<std::string> combos;
  for (const char* s : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}) combos.push_back(model + ":" + s);
  auto r = launch("zoo_worker", 3, combos);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_NE(r.ranks[0].output.find(model + ":NO_SHARD ok"), std::string::npos) << r.report();
}

INSTANTIATE_TEST_SUITE_P(Models, ZooTest, ::testing::Values("conv", "recurrent", "encoder"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace fsdp_test
