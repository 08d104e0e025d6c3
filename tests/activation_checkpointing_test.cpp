// Activation checkpointing (fsdp::Checkpointed): alone and under every strategy, equal to training
// the same model without checkpointing (dropout included: the recompute replays the random
// numbers); each unit gathered once in backward, in the same order as without checkpointing; the
// activation memory a checkpointed block keeps.
#include <ATen/autocast_mode.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/version.h>

#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <tuple>

#include "counting_allocator.h"
#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// How the blocks (and the head) are written.
enum class Form {
  kPlain,         // Block, Linear head
  kCheckpointed,  // Checkpointed<Block>, Checkpointed<Linear> head (units by wrap policy)
  kSharded,       // Sharded<Checkpointed<Block>>, Checkpointed<Linear> head (explicit units)
};

Form parse_form(const std::string& s) {
  if (s == "plain") return Form::kPlain;
  if (s == "checkpointed") return Form::kCheckpointed;
  if (s == "sharded") return Form::kSharded;
  throw std::runtime_error("unknown form " + s);
}

// Embedding, blocks, and a head that is the model's last operation: with a checkpointed head the
// first gradient of backward arrives inside a recompute.
struct NetImpl : torch::nn::Module {
  NetImpl(Form form, int vocab, int d, int heads, int layers, double p) {
    tok = register_module("tok", torch::nn::Embedding(vocab, d));
    for (int i = 0; i < layers; ++i) {
      Block block(d, heads, p);
      if (form == Form::kPlain) {
        blocks->push_back(block);
        calls.push_back([block](const at::Tensor& x) mutable { return block->forward(x); });
      } else if (form == Form::kCheckpointed) {
        fsdp::Checkpointed<Block> c(block);
        blocks->push_back(c);
        checkpointed.push_back(c.get());
        calls.push_back([c](const at::Tensor& x) mutable { return c->forward(x); });
      } else {
        fsdp::Checkpointed<Block> c(block);
        fsdp::Sharded<fsdp::Checkpointed<Block>> s(c);
        blocks->push_back(s);
        checkpointed.push_back(c.get());
        calls.push_back([s](const at::Tensor& x) mutable { return s->forward(x); });
      }
    }
    register_module("blocks", blocks);
    torch::nn::Linear linear(d, vocab);
    if (form == Form::kPlain) {
      register_module("head", linear);
      head = [linear](const at::Tensor& x) mutable {
        return linear->forward(x);
      };
    } else {
      fsdp::Checkpointed<torch::nn::Linear> c(linear);
      register_module("head", c);
      checkpointed.push_back(c.get());
      head = [c](const at::Tensor& x) mutable {
        return c->forward(x);
      };
    }
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    auto x = tok(idx);
    for (auto& call : calls) x = call(x);
    return head(x);
  }
  torch::nn::Embedding tok{nullptr};
  torch::nn::ModuleList blocks;
  std::vector<std::function<at::Tensor(const at::Tensor&)>> calls;
  std::function<at::Tensor(const at::Tensor&)> head;
  std::vector<fsdp::CheckpointedBase*> checkpointed;
};
TORCH_MODULE(Net);

constexpr int kVocab = 32, kDim = 16, kHeads = 2, kLayers = 3, kContext = 8;
constexpr double kDropout = 0.25;

Net make_net(Form form, int seed = 5) {
  torch::manual_seed(seed);
  Net net(form, kVocab, kDim, kHeads, kLayers, kDropout);
  net->to(at::kDouble);
  return net;
}

// The dropout seed of rank r's rows in step s (the reference draws the same for the same rows).
uint64_t dropout_seed(int step, int rank) { return 1000 + 100 * step + rank; }

bool is_backward_gather(const fsdp::TraceEvent& e) {
  return e.kind == fsdp::TraceEvent::Kind::kUnshardIssued &&
         (e.label == "on demand backward" || e.label.rfind("prefetch backward", 0) == 0);
}

// ---------------------------------------------------------------------------------------------
// One rank, no FSDP.

TEST(ActivationCheckpointing, AloneEqualsNoCheckpointingWithDropout) {
  Net ref = make_net(Form::kPlain), model = make_net(Form::kCheckpointed);
  ASSERT_EQ(model->named_parameters().keys(), ref->named_parameters().keys()) << "names must not change";
  auto gen = at::detail::createCPUGenerator(3);
  const auto x = at::randint(0, kVocab, {4, kContext}, gen), y = at::randint(0, kVocab, {4, kContext}, gen);
  for (int step = 0; step < 2; ++step) {
    for (auto& p : ref->parameters()) p.mutable_grad().reset();
    for (auto& p : model->parameters()) p.mutable_grad().reset();
    torch::manual_seed(77 + step);
    auto ref_loss = lm_loss(ref->forward(x), y);
    ref_loss.backward();
    const auto ref_after = at::rand({8}, at::kDouble);  // the caller's random numbers go on unchanged
    torch::manual_seed(77 + step);
    auto out = model->forward(x);
    ASSERT_TRUE(out.grad_fn() && contains(out.grad_fn()->name(), "CheckpointFunction")) << out.grad_fn()->name();
    auto loss = lm_loss(out, y);
    loss.backward();
    const auto after = at::rand({8}, at::kDouble);
    EXPECT_EQ(loss.item<double>(), ref_loss.item<double>()) << "step " << step;
    EXPECT_TRUE(torch::equal(after, ref_after)) << "the caller's RNG state was not put back";
    auto ref_params = ref->named_parameters();
    for (const auto& kv : model->named_parameters()) {
      const auto& g = kv.value().grad();
      ASSERT_TRUE(g.defined()) << kv.key() << " got no gradient";
      EXPECT_LE(rel_diff(g, ref_params[kv.key()].grad()), 1e-12) << kv.key();
    }
  }
  // Dropout is on: another seed gives another loss (so the equality above needed the replay).
  torch::manual_seed(1);
  const double l1 = lm_loss(model->forward(x), y).item<double>();
  torch::manual_seed(2);
  const double l2 = lm_loss(model->forward(x), y).item<double>();
  EXPECT_NE(l1, l2);
}

// Two tensor arguments (one by const reference) and non-tensor ones, a dropout inside.
struct MixImpl : torch::nn::Module {
  MixImpl() {
    lin = register_module("lin", torch::nn::Linear(6, 6));
    drop = register_module("drop", torch::nn::Dropout(0.5));
  }
  torch::Tensor forward(torch::Tensor a, const torch::Tensor& b, double scale, int64_t power, bool flip) {
    auto h = drop(torch::tanh(lin(a))) * b * scale;
    h = h.pow(power);
    return flip ? -h : h;
  }
  torch::nn::Linear lin{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Mix);

TEST(ActivationCheckpointing, TensorAndNonTensorArgumentsAndInputsWithoutGrad) {
  torch::manual_seed(4);
  Mix plain;
  torch::manual_seed(4);
  fsdp::Checkpointed<Mix> checkpointed{Mix()};
  plain->to(at::kDouble);
  checkpointed->to(at::kDouble);
  for (const bool inputs_require_grad : {true, false}) {
    auto a = torch::randn({5, 6}, at::kDouble), b = torch::randn({5, 6}, at::kDouble);
    auto a1 = a.clone().requires_grad_(inputs_require_grad), b1 = b.clone().requires_grad_(inputs_require_grad);
    auto a2 = a.clone().requires_grad_(inputs_require_grad), b2 = b.clone().requires_grad_(inputs_require_grad);
    for (auto& p : plain->parameters()) p.mutable_grad().reset();
    for (auto& p : checkpointed->parameters()) p.mutable_grad().reset();
    torch::manual_seed(9);
    plain->forward(a1, b1, 0.5, 3, true).sum().backward();
    torch::manual_seed(9);
    auto out = checkpointed->forward(a2, b2, 0.5, 3, true);
    ASSERT_TRUE(out.requires_grad()) << "parameters must get gradients even if no input requires grad";
    out.sum().backward();
    if (inputs_require_grad) {
      EXPECT_LE(rel_diff(a2.grad(), a1.grad()), 1e-12);
      EXPECT_LE(rel_diff(b2.grad(), b1.grad()), 1e-12);
    } else {
      EXPECT_FALSE(a2.grad().defined());
    }
    auto plain_params = plain->named_parameters();
    for (const auto& kv : checkpointed->named_parameters()) {
      ASSERT_TRUE(kv.value().grad().defined()) << kv.key();
      EXPECT_LE(rel_diff(kv.value().grad(), plain_params[kv.key()].grad()), 1e-12) << kv.key();
    }
  }
  // Grad mode off: the wrapped forward, nothing recorded.
  {
    torch::NoGradGuard no_grad;
    auto a = torch::randn({5, 6}, at::kDouble);
    torch::manual_seed(1);
    auto expected = plain->forward(a, a, 2.0, 1, false);
    torch::manual_seed(1);
    auto out = checkpointed->forward(a, a, 2.0, 1, false);
    EXPECT_FALSE(out.grad_fn());
    EXPECT_TRUE(torch::equal(out, expected));
  }
  // Disabled: the wrapped forward, with its own graph.
  checkpointed->set_enabled(false);
  auto out = checkpointed->forward(torch::randn({5, 6}, at::kDouble), torch::ones({5, 6}, at::kDouble), 1.0, 1, false);
  ASSERT_TRUE(out.grad_fn());
  EXPECT_FALSE(contains(out.grad_fn()->name(), "CheckpointFunction")) << out.grad_fn()->name();
  checkpointed->set_enabled(true);
  // Higher-order gradients are refused with a clear error.
  auto a = torch::randn({5, 6}, at::kDouble).requires_grad_();
  auto y = checkpointed->forward(a, a, 1.0, 1, false).sum();
  try {
    torch::autograd::grad({y}, {a}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    ADD_FAILURE() << "create_graph must be refused";
  } catch (const std::exception& e) {
    EXPECT_TRUE(contains(e.what(), "create_graph")) << e.what();
  }
}

// A checkpoint inside a checkpointed forward runs plain there, and checkpoints in the recompute.
TEST(ActivationCheckpointing, NestedCheckpointsEqualNoCheckpointing) {
  torch::manual_seed(6);
  Block plain(kDim, kHeads, kDropout);
  torch::manual_seed(6);
  fsdp::Checkpointed<fsdp::Checkpointed<Block>> nested(fsdp::Checkpointed<Block>(Block(kDim, kHeads, kDropout)));
  ASSERT_EQ(nested->named_parameters().keys(), plain->named_parameters().keys());
  const auto x = torch::randn({3, kContext, kDim});
  auto x1 = x.clone().requires_grad_(), x2 = x.clone().requires_grad_();
  torch::manual_seed(8);
  plain->forward(x1).pow(2).sum().backward();
  torch::manual_seed(8);
  nested->forward(x2).pow(2).sum().backward();
  EXPECT_LE(rel_diff(x2.grad(), x1.grad()), 1e-6);
  auto plain_params = plain->named_parameters();
  for (const auto& kv : nested->named_parameters())
    EXPECT_LE(rel_diff(kv.value().grad(), plain_params[kv.key()].grad()), 1e-6) << kv.key();
}

// The recompute runs under the autocast state of the forward, not of the backward's caller.
// CPU autocast on or off (in bfloat16). LibTorch 2.4 takes the device type and deprecates the
// per-device functions.
void set_cpu_autocast(bool enabled) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  at::autocast::set_autocast_enabled(at::kCPU, enabled);
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
#else
  at::autocast::set_cpu_enabled(enabled);
  at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
#endif
}
bool cpu_autocast_enabled() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  return at::autocast::is_autocast_enabled(at::kCPU);
#else
  return at::autocast::is_cpu_enabled();
#endif
}

TEST(ActivationCheckpointing, RecomputeUsesTheForwardsAutocastState) {
  auto make = [] {
    torch::manual_seed(6);
    return Block(kDim, kHeads, kDropout);
  };
  Block plain = make(), plain_f32 = make();
  torch::manual_seed(6);
  fsdp::Checkpointed<Block> checkpointed(Block(kDim, kHeads, kDropout));
  const auto x = torch::randn({3, kContext, kDim});
  auto run = [&](auto& module, bool autocast) {
    set_cpu_autocast(autocast);
    torch::manual_seed(8);
    auto out = module->forward(x);
    set_cpu_autocast(false);
    at::autocast::clear_cache();
    out.pow(2).sum().backward();
  };
  run(plain, true);
  run(checkpointed, true);
  run(plain_f32, false);
  EXPECT_FALSE(cpu_autocast_enabled());
  auto plain_params = plain->named_parameters(), f32_params = plain_f32->named_parameters();
  for (const auto& kv : checkpointed->named_parameters()) {
    EXPECT_LE(rel_diff(kv.value().grad(), plain_params[kv.key()].grad()), 1e-6) << kv.key();
    if (contains(kv.key(), "fc1.weight")) {  // bfloat16 matmuls: autocast made a difference
      EXPECT_GT(rel_diff(kv.value().grad(), f32_params[kv.key()].grad()), 1e-4) << kv.key();
    }
  }
}

TEST(ActivationCheckpointing, ApplyByPolicyEnablesTheSelectedWrappersOnly) {
  Net net = make_net(Form::kCheckpointed);
  ASSERT_EQ(net->checkpointed.size(), size_t(kLayers + 1));
  for (auto* c : net->checkpointed) EXPECT_TRUE(c->enabled()) << "enabled by default";
  EXPECT_EQ(fsdp::apply_activation_checkpointing(*net, fsdp::wrap::by_type<BlockImpl>()), kLayers);
  for (int i = 0; i < kLayers; ++i) EXPECT_TRUE(net->checkpointed[i]->enabled());
  EXPECT_FALSE(net->checkpointed[kLayers]->enabled()) << "the head is a Linear";
  EXPECT_EQ(fsdp::apply_activation_checkpointing(*net, fsdp::wrap::by_names({"blocks.1", "head"})), 2);
  EXPECT_TRUE(net->checkpointed[1]->enabled() && net->checkpointed[kLayers]->enabled());
  EXPECT_FALSE(net->checkpointed[0]->enabled() || net->checkpointed[2]->enabled());
  // The wrapper's own type selects it too; by_type sees through it.
  EXPECT_EQ(fsdp::apply_activation_checkpointing(*net, fsdp::wrap::by_type<fsdp::CheckpointedImpl<Block>>()), kLayers);
  EXPECT_TRUE(fsdp::wrap::by_type<BlockImpl>()("blocks.0", *net->blocks[0], 0));
  EXPECT_FALSE(fsdp::wrap::by_type<torch::nn::LinearImpl>()("blocks.0", *net->blocks[0], 0));
}

// A size policy counts for each wrapper what fully_shard's auto-wrap counts: the parameters no
// nested unit takes, so the wrappers it enables are those of the units it makes.
struct SizedBlockImpl : torch::nn::Module {
  SizedBlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 64));  // 1088 parameters
    fc2 = register_module("fc2", torch::nn::Linear(64, 16));  // 1040
    inner = register_module("inner", fsdp::Checkpointed<torch::nn::Linear>(torch::nn::Linear(16, 16)));  // 272
  }
  at::Tensor forward(const at::Tensor& x) { return inner(fc2(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  fsdp::Checkpointed<torch::nn::Linear> inner{nullptr};
};
TORCH_MODULE(SizedBlock);

TEST(ActivationCheckpointing, ApplyBySizeCountsWhatNoNestedUnitTakes) {
  torch::nn::Sequential net{fsdp::Checkpointed<SizedBlock>(SizedBlock{})};
  auto& outer = *net->ptr<fsdp::CheckpointedImpl<SizedBlock>>(0);
  auto& inner = *outer.inner()->inner;
  // 1000: both products become units, the block keeps the inner layer's 272: no wrapper is a unit.
  EXPECT_EQ(fsdp::apply_activation_checkpointing(*net, fsdp::wrap::by_size(1000)), 0);
  // 2000: no product is one; the block's 2400 are.
  EXPECT_EQ(fsdp::apply_activation_checkpointing(*net, fsdp::wrap::by_size(2000)), 1);
  EXPECT_TRUE(outer.enabled() && !inner.enabled());
  // 200: every Linear is a unit, the inner one as its wrapper (which holds its parameters); the
  // block keeps none.
  EXPECT_EQ(fsdp::apply_activation_checkpointing(*net, fsdp::wrap::by_size(200)), 1);
  EXPECT_TRUE(!outer.enabled() && inner.enabled());
}

// Deferred initialization initializes a wrapper's tensors as those of the module it wraps.
struct WrappedLinearsImpl : torch::nn::Module {
  WrappedLinearsImpl() : a(torch::nn::Linear(4, 5)), b(fsdp::Checkpointed<torch::nn::Linear>(torch::nn::Linear(5, 3))) {
    register_module("a", a);
    register_module("b", b);
  }
  fsdp::Checkpointed<torch::nn::Linear> a;
  fsdp::Sharded<fsdp::Checkpointed<torch::nn::Linear>> b;
};
TORCH_MODULE(WrappedLinears);

TEST(ActivationCheckpointing, DeferredInitInitializesTheWrappedModule) {
  if (!fsdp::DeferredInit::supported()) GTEST_SKIP() << "this LibTorch has no DispatchKey::DeferredInit";
  torch::manual_seed(4);
  WrappedLinears eager;
  torch::manual_seed(4);
  WrappedLinears deferred(nullptr);
  {
    fsdp::DeferredInit scope;
    deferred = WrappedLinears();
  }
  fsdp::materialize(*deferred);
  const auto deferred_params = deferred->named_parameters();
  ASSERT_EQ(deferred_params.size(), 4u);
  for (const auto& kv : eager->named_parameters())
    EXPECT_TRUE(torch::equal(kv.value(), deferred_params[kv.key()])) << "parameter " << kv.key();
}

// ---------------------------------------------------------------------------------------------
// With FSDP: equal to local training without checkpointing, one gather per unit in backward.

fsdp::Options options(const std::string& strategy, bool unit_per_block) {
  auto o = fsdp::Options().sharding_strategy(fsdp::parse_sharding_strategy(strategy)).trace(true);
  if (unit_per_block) o.auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>());
  if (strategy == "HYBRID_SHARD") o.sharding_factor(2);
  return o;
}

// The backward's gathers of the last iteration as "unit:label", in order.
std::vector<std::string> backward_gathers(const fsdp::IterationTrace& t) {
  std::vector<std::string> out;
  for (const auto& e : t.events)
    if (is_backward_gather(e)) out.push_back(std::to_string(e.unit) + ":" + e.label);
  return out;
}

// Every gather, reshard and reduction the compute thread issued, in order.
std::vector<std::string> schedule(const fsdp::IterationTrace& t) {
  using K = fsdp::TraceEvent::Kind;
  std::vector<std::string> out;
  for (const auto& e : t.events)
    if (e.kind == K::kUnshardIssued || e.kind == K::kReshard || e.kind == K::kReduceIssued)
      out.push_back(std::string(fsdp::to_string(e.kind)) + " " + std::to_string(e.unit) + " " + e.label);
  return out;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return "[" + s + "]";
}

// args: strategy, form ("checkpointed" or "sharded"), units ("blocks": one per block, by the wrap
// policy for the "checkpointed" form; "root": the whole model is one unit). Trains the checkpointed
// model and the same model with checkpointing disabled, each against local training of the plain
// model, and compares the two runs' schedules.
FSDP_WORKER(ac_exact_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0);
  const Form form = parse_form(ctx.args.at(1));
  const bool unit_per_block = ctx.args.at(2) == "blocks";
  const int expected_units = unit_per_block ? kLayers + 1 : 1;
  const int rows = 2, steps = 3;
  std::vector<std::string> gathers_with, gathers_without, schedule_with, schedule_without;
  for (const bool checkpointing : {true, false}) {
    const std::string what = strategy + " " + ctx.args.at(1) + " " + ctx.args.at(2) +
                             (checkpointing ? " checkpointed" : " not checkpointed");
    Net ref = make_net(Form::kPlain), model = make_net(form);
    const int enabled = fsdp::apply_activation_checkpointing(
        *model, [&](const std::string&, const torch::nn::Module&, int64_t) { return checkpointing; });
    WORKER_CHECK(enabled == (checkpointing ? kLayers + 1 : 0), what, ": ", enabled, " wrappers enabled");
    auto sharded = fsdp::fully_shard(model, pg, options(strategy, unit_per_block && form == Form::kCheckpointed));
    const int n_units = int(sharded->units().size());
    WORKER_CHECK(n_units == expected_units, what, ": expected ", expected_units, " units:\n", sharded->describe());
    torch::optim::AdamW ref_opt(unique_parameters(*ref), torch::optim::AdamWOptions(0.01));
    torch::optim::AdamW opt(sharded->parameters(), torch::optim::AdamWOptions(0.01));
    for (int step = 0; step < steps; ++step) {
      auto gen = at::detail::createCPUGenerator(500 + step);
      const auto x = at::randint(0, kVocab, {rows * ctx.world, kContext}, gen),
                 y = at::randint(0, kVocab, {rows * ctx.world, kContext}, gen);
      // Local training on the global batch, its rows in the ranks' blocks so that each block's
      // dropout draws what that rank draws; the mean of the blocks' mean losses is the global mean.
      ref_opt.zero_grad();
      double ref_loss = 0;
      at::Tensor ref_after;
      for (int r = 0; r < ctx.world; ++r) {
        torch::manual_seed(dropout_seed(step, r));
        auto l = lm_loss(ref->forward(x.narrow(0, r * rows, rows)), y.narrow(0, r * rows, rows));
        (l / ctx.world).backward();
        if (r == ctx.rank) {
          ref_loss = l.item<double>();
          ref_after = at::rand({4}, at::kDouble);
        }
      }
      ref_opt.step();
      opt.zero_grad();
      torch::manual_seed(dropout_seed(step, ctx.rank));
      auto loss = lm_loss(model->forward(x.narrow(0, ctx.rank * rows, rows)), y.narrow(0, ctx.rank * rows, rows));
      loss.backward();
      const auto after = at::rand({4}, at::kDouble);
      opt.step();
      WORKER_CHECK(std::abs(loss.item<double>() - ref_loss) <= 1e-12 * std::abs(ref_loss), what, " step ", step,
                   ": loss ", loss.item<double>(), " vs local ", ref_loss);
      WORKER_CHECK(torch::equal(after, ref_after), what, ": the caller's random numbers changed after backward");
    }
    auto full = sharded->full_state_dict();
    for (const auto& kv : ref->named_parameters()) {
      const double d = rel_diff(full.at(kv.key()), kv.value().detach());
      WORKER_CHECK(d <= 1e-12, what, ": parameter ", kv.key(), " differs from local training by rel ", d);
    }
    const auto t = sharded->last_trace();
    // One end of backward per step: a callback run at the end of a recompute's nested backward
    // would finish an iteration early.
    WORKER_CHECK(t.iteration == steps - 1, what, ": ", t.iteration + 1, " iterations traced in ", steps, " steps");
    const bool gathers = sharded->sharding_factor() > 1 && strategy != "SHARD_GRAD_OP";
    // The root stays unsharded from forward to the end of backward, and so does the last block,
    // which backward needs first (Note [Kept for backward]).
    for (int u = 0; u < n_units; ++u) {
      int n = 0;
      for (const auto& e : t.events) n += is_backward_gather(e) && e.unit == u;
      WORKER_CHECK(n == (gathers && u > 0 && u < n_units - 1 ? 1 : 0), what, ": unit ", u, " gathered ", n,
                   " times in backward: ", join(backward_gathers(t)));
    }
    (checkpointing ? gathers_with : gathers_without) = backward_gathers(t);
    (checkpointing ? schedule_with : schedule_without) = schedule(t);
    if (ctx.rank == 0)
      std::cout << what << ": backward gathers " << join(backward_gathers(t)) << ", max unsharded units "
                << t.max_unsharded_units << std::endl;
  }
  // The same gathers, in the same order, for the same reasons (prefetch or on demand).
  WORKER_CHECK(gathers_with == gathers_without, "backward gathers with checkpointing ", join(gathers_with),
               " vs without ", join(gathers_without));
  // The whole iteration's schedule too: every gather, reshard and reduction, in order.
  WORKER_CHECK(schedule_with == schedule_without, "schedule with checkpointing ", join(schedule_with), "\nvs without ",
               join(schedule_without));
  if (ctx.rank == 0) std::cout << strategy << " " << ctx.args.at(1) << " " << ctx.args.at(2) << " ok" << std::endl;
}

TEST(ActivationCheckpointing, WithFsdpEqualsLocalTrainingWithoutCheckpointing) {
  for (int world : {1, 2, 3})
    for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"})
      for (const char* form : {"checkpointed", "sharded"}) {
        auto r = launch("ac_exact_worker", world, {strategy, form, "blocks"});
        ASSERT_TRUE(r.all_ok()) << strategy << " " << form << " world " << world << "\n" << r.report();
        EXPECT_TRUE(contains(r.ranks[0].output, std::string(strategy) + " " + form + " blocks ok")) << r.report();
      }
  for (const char* form : {"checkpointed", "sharded"}) {
    auto r = launch("ac_exact_worker", 4, {"HYBRID_SHARD", form, "blocks"});
    ASSERT_TRUE(r.all_ok()) << "HYBRID_SHARD " << form << "\n" << r.report();
  }
}

// Checkpointed blocks inside a larger unit: the unit expects the gradients of parameters read only
// in a checkpointed forward (run without grad), so it is reduced once, when they are all in.
TEST(ActivationCheckpointing, WholeModelAsOneUnit) {
  for (const char* strategy : {"FULL_SHARD", "NO_SHARD"}) {
    auto r = launch("ac_exact_worker", 2, {strategy, "checkpointed", "root"});
    ASSERT_TRUE(r.all_ok()) << strategy << "\n" << r.report();
  }
}

// args: form. Mixed precision (bfloat16 parameters and compute, float32 reduction): the
// checkpointed model trains exactly as the same model without checkpointing, with the same schedule.
FSDP_WORKER(ac_mixed_precision_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const Form form = parse_form(ctx.args.at(0));
  const int rows = 2, steps = 3;
  std::vector<double> losses[2];
  std::vector<std::string> schedules[2];
  std::map<std::string, at::Tensor> params[2];
  for (const bool checkpointing : {true, false}) {
    torch::manual_seed(5);
    Net model(form, kVocab, kDim, kHeads, kLayers, kDropout);
    fsdp::apply_activation_checkpointing(
        *model, [&](const std::string&, const torch::nn::Module&, int64_t) { return checkpointing; });
    auto o = options("FULL_SHARD", form == Form::kCheckpointed)
                 .mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
    auto sharded = fsdp::fully_shard(model, pg, o);
    torch::optim::AdamW opt(sharded->parameters(), torch::optim::AdamWOptions(0.01));
    for (int step = 0; step < steps; ++step) {
      auto gen = at::detail::createCPUGenerator(500 + step);
      const auto x = at::randint(0, kVocab, {rows * ctx.world, kContext}, gen),
                 y = at::randint(0, kVocab, {rows * ctx.world, kContext}, gen);
      opt.zero_grad();
      torch::manual_seed(dropout_seed(step, ctx.rank));
      auto logits = model->forward(x.narrow(0, ctx.rank * rows, rows));
      auto loss = lm_loss(logits.to(at::kFloat), y.narrow(0, ctx.rank * rows, rows));
      loss.backward();
      opt.step();
      losses[checkpointing].push_back(loss.item<double>());
    }
    schedules[checkpointing] = schedule(sharded->last_trace());
    for (const auto& kv : sharded->full_state_dict()) params[checkpointing][kv.first] = kv.second;
  }
  for (int step = 0; step < steps; ++step)
    WORKER_CHECK(std::abs(losses[1][step] - losses[0][step]) <= 1e-6 * std::abs(losses[0][step]), "step ", step,
                 ": loss ", losses[1][step], " with checkpointing vs ", losses[0][step], " without");
  for (const auto& kv : params[0])
    WORKER_CHECK(rel_diff(params[1].at(kv.first), kv.second) <= 1e-6, "parameter ", kv.first, " differs by ",
                 rel_diff(params[1].at(kv.first), kv.second));
  WORKER_CHECK(schedules[1] == schedules[0], "schedule with checkpointing ", join(schedules[1]), "\nvs without ",
               join(schedules[0]));
  if (ctx.rank == 0) std::cout << ctx.args.at(0) << " mixed precision ok" << std::endl;
}

TEST(ActivationCheckpointing, WithMixedPrecisionEqualsNoCheckpointing) {
  for (const char* form : {"checkpointed", "sharded"}) {
    auto r = launch("ac_mixed_precision_worker", 2, {form});
    ASSERT_TRUE(r.all_ok()) << form << "\n" << r.report();
    EXPECT_TRUE(contains(r.ranks[0].output, std::string(form) + " mixed precision ok")) << r.report();
  }
}

// ---------------------------------------------------------------------------------------------
// Buffers: a recompute leaves them as the forward left them, so BatchNorm's running statistics and
// num_batches_tracked (and a block's own buffers) end as without checkpointing.

// NormBlocks (models.h), each written as `form` says, then a Linear head.
struct NormNetImpl : torch::nn::Module {
  NormNetImpl(Form form, int d, int layers) {
    for (int i = 0; i < layers; ++i) {
      NormBlock block(d);
      if (form == Form::kPlain) {
        blocks->push_back(block);
        calls.push_back([block](const at::Tensor& x) mutable { return block->forward(x); });
      } else if (form == Form::kCheckpointed) {
        fsdp::Checkpointed<NormBlock> c(block);
        blocks->push_back(c);
        calls.push_back([c](const at::Tensor& x) mutable { return c->forward(x); });
      } else {
        fsdp::Sharded<fsdp::Checkpointed<NormBlock>> s{fsdp::Checkpointed<NormBlock>(block)};
        blocks->push_back(s);
        calls.push_back([s](const at::Tensor& x) mutable { return s->forward(x); });
      }
    }
    register_module("blocks", blocks);
    head = register_module("head", torch::nn::Linear(d, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x;
    for (auto& call : calls) h = call(h);
    return head(h);
  }
  torch::nn::ModuleList blocks;
  std::vector<std::function<at::Tensor(const at::Tensor&)>> calls;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(NormNet);

constexpr int kNormDim = 6, kNormLayers = 3, kNormSteps = 6, kMicroBatches = 2, kNormRows = 4;

NormNet make_norm_net(Form form) {
  torch::manual_seed(12);
  NormNet net(form, kNormDim, kNormLayers);
  net->to(at::kDouble);
  return net;
}

// Micro-batch m of step s: kNormRows rows for each of `world` ranks, and their targets.
std::pair<at::Tensor, at::Tensor> norm_batch(int step, int micro, int world) {
  auto gen = at::detail::createCPUGenerator(700 + 10 * step + micro);
  const auto x = at::randn({kNormRows * world, kNormDim}, gen, at::kDouble) * 2 + 1;
  return {x, at::randn({kNormRows * world, 1}, gen, at::kDouble)};
}

// The first tensor of `a` that differs from the one of the same name in `b` (integer ones exactly,
// floating ones beyond `tol` by rel_diff), or "" if none does.
std::string first_difference(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b,
                             double tol) {
  if (a.size() != b.size()) return std::to_string(a.size()) + " tensors against " + std::to_string(b.size());
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end()) return "no " + name + " in the other";
    const bool same = t.is_floating_point() ? rel_diff(t, it->second) <= tol : torch::equal(t, it->second);
    if (!same) {
      std::ostringstream o;
      o << name << ": " << t << " against " << it->second;
      return o.str();
    }
  }
  return "";
}

std::map<std::string, at::Tensor> buffers_of(const torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& kv : m.named_buffers()) out[kv.key()] = kv.value().clone();
  return out;
}

TEST(ActivationCheckpointing, AloneLeavesBuffersAsWithoutCheckpointing) {
  NormNet ref = make_norm_net(Form::kPlain), model = make_norm_net(Form::kCheckpointed);
  ASSERT_EQ(buffers_of(*model).size(), size_t(kNormLayers * 5)) << "each block: 3 BatchNorm buffers and 2 of its own";
  ASSERT_TRUE(model->blocks[0]->as<fsdp::CheckpointedImpl<NormBlock>>()->enabled());
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(0.01));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.01));
  for (int step = 0; step < kNormSteps; ++step) {
    ref_opt.zero_grad();
    opt.zero_grad();
    for (int micro = 0; micro < kMicroBatches; ++micro) {
      const auto [x, y] = norm_batch(step, micro, 1);
      auto ref_loss = torch::mse_loss(ref->forward(x), y) / kMicroBatches;
      ref_loss.backward();
      auto loss = torch::mse_loss(model->forward(x), y) / kMicroBatches;
      loss.backward();
      EXPECT_EQ(loss.item<double>(), ref_loss.item<double>()) << "step " << step << " micro-batch " << micro;
    }
    ref_opt.step();
    opt.step();
  }
  const auto buffers = buffers_of(*model);
  for (int i = 0; i < kNormLayers; ++i) {
    const std::string block = "blocks." + std::to_string(i) + ".";
    EXPECT_EQ(buffers.at(block + "bn.num_batches_tracked").item<int64_t>(), kNormSteps * kMicroBatches) << block;
    EXPECT_EQ(buffers.at(block + "calls").item<int64_t>(), kNormSteps * kMicroBatches) << block;
  }
  EXPECT_EQ(first_difference(buffers, buffers_of(*ref), 1e-12), "");
  auto ref_params = ref->named_parameters();
  for (const auto& kv : model->named_parameters())
    EXPECT_LE(rel_diff(kv.value(), ref_params[kv.key()]), 1e-12) << kv.key();
  // Evaluation uses the running statistics.
  ref->eval();
  model->eval();
  const auto x = norm_batch(99, 0, 1).first;
  EXPECT_LE(rel_diff(model->forward(x), ref->forward(x)), 1e-12);
}

// args: strategy, form ("checkpointed": units by the wrap policy; "sharded": explicit units).
// Trains with checkpointing and without, kMicroBatches backwards per step: the same losses,
// parameters and buffers.
FSDP_WORKER(ac_buffers_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0);
  const Form form = parse_form(ctx.args.at(1));
  std::vector<double> losses[2];
  std::map<std::string, at::Tensor> state[2];
  for (const bool checkpointing : {true, false}) {
    NormNet model = make_norm_net(form);
    fsdp::apply_activation_checkpointing(
        *model, [&](const std::string&, const torch::nn::Module&, int64_t) { return checkpointing; });
    auto o = fsdp::Options().sharding_strategy(fsdp::parse_sharding_strategy(strategy));
    if (form == Form::kCheckpointed) o.auto_wrap_policy(fsdp::wrap::by_type<NormBlockImpl>());
    if (strategy == "HYBRID_SHARD") o.sharding_factor(2);
    auto sharded = fsdp::fully_shard(model, pg, o);
    WORKER_CHECK(sharded->units().size() == size_t(kNormLayers + 1), sharded->describe());
    torch::optim::AdamW opt(sharded->parameters(), torch::optim::AdamWOptions(0.01));
    for (int step = 0; step < kNormSteps; ++step) {
      opt.zero_grad();
      for (int micro = 0; micro < kMicroBatches; ++micro) {
        const auto [x, y] = norm_batch(step, micro, ctx.world);
        auto out = model->forward(x.narrow(0, ctx.rank * kNormRows, kNormRows));
        auto loss = torch::mse_loss(out, y.narrow(0, ctx.rank * kNormRows, kNormRows)) / kMicroBatches;
        loss.backward();
        losses[checkpointing].push_back(loss.item<double>());
      }
      opt.step();
    }
    for (const auto& kv : sharded->full_state_dict()) state[checkpointing][kv.first] = kv.second;
    for (const auto& kv : model->named_buffers())
      if (contains(kv.key(), "num_batches_tracked") || contains(kv.key(), "calls"))
        WORKER_CHECK(kv.value().item<int64_t>() == kNormSteps * kMicroBatches, kv.key(), " is ",
                     kv.value().item<int64_t>(), (checkpointing ? " with" : " without"), " checkpointing");
  }
  for (size_t i = 0; i < losses[0].size(); ++i)
    WORKER_CHECK(std::abs(losses[1][i] - losses[0][i]) <= 1e-12 * std::abs(losses[0][i]), "micro-batch ", i, ": loss ",
                 losses[1][i], " with checkpointing, ", losses[0][i], " without");
  const std::string d = first_difference(state[1], state[0], 1e-12);
  WORKER_CHECK(d.empty(), "with checkpointing and without, the state differs: ", d);
  if (ctx.rank == 0) std::cout << ctx.args.at(0) << " " << ctx.args.at(1) << " buffers ok" << std::endl;
}

TEST(ActivationCheckpointing, WithFsdpLeavesBuffersAsWithoutCheckpointing) {
  const std::vector<std::tuple<int, const char*, const char*>> runs = {
      {1, "FULL_SHARD", "checkpointed"},    {2, "FULL_SHARD", "checkpointed"},  {2, "FULL_SHARD", "sharded"},
      {2, "SHARD_GRAD_OP", "checkpointed"}, {2, "NO_SHARD", "sharded"},         {3, "FULL_SHARD", "checkpointed"},
      {3, "SHARD_GRAD_OP", "sharded"},      {4, "HYBRID_SHARD", "checkpointed"}};
  for (const auto& [world, strategy, form] : runs) {
    auto r = launch("ac_buffers_worker", world, {strategy, form});
    ASSERT_TRUE(r.all_ok()) << strategy << " " << form << " world " << world << "\n" << r.report();
    EXPECT_TRUE(contains(r.ranks[0].output, std::string(strategy) + " " + form + " buffers ok")) << r.report();
  }
}

// ---------------------------------------------------------------------------------------------
// Activation memory: bytes a stack of blocks keeps from forward to backward, counted by a CPU
// allocator that records every live tensor byte.

FSDP_WORKER(ac_memory_worker) {
  auto* counter = new fsdp_bench::CountingAllocator(c10::GetCPUAllocator());
  c10::SetCPUAllocator(counter, /*priority=*/100);
  const int64_t B = 8, T = 32, D = 64, heads = 4, layers = 4;
  const int64_t input_bytes = B * T * D * int64_t(sizeof(float));
  const int64_t rng_bytes = at::detail::getDefaultCPUGenerator().get_state().nbytes();
  for (const bool checkpointing : {false, true}) {
    torch::manual_seed(1);
    std::vector<std::function<at::Tensor(const at::Tensor&)>> blocks;
    std::vector<std::shared_ptr<torch::nn::Module>> keep;
    for (int i = 0; i < layers; ++i) {
      Block b(D, heads, 0.1);
      if (checkpointing) {
        fsdp::Checkpointed<Block> c(b);
        keep.push_back(c.ptr());
        blocks.push_back([c](const at::Tensor& x) mutable { return c->forward(x); });
      } else {
        keep.push_back(b.ptr());
        blocks.push_back([b](const at::Tensor& x) mutable { return b->forward(x); });
      }
    }
    const auto x = torch::randn({B, T, D}).requires_grad_();
    const int64_t before = counter->live();
    counter->reset_peak();
    at::Tensor h = x;
    for (auto& b : blocks) h = b(h);
    const int64_t kept = counter->live() - before;  // the outputs and what autograd saved
    const int64_t forward_peak = counter->peak() - before;
    counter->reset_peak();
    h.sum().backward();
    const int64_t backward_peak = counter->peak() - before;
    const int64_t per_block = kept / layers;
    std::cout << (checkpointing ? "checkpointed" : "plain") << ": kept after forward " << kept << " bytes ("
              << per_block << " per block, block input " << input_bytes << ", RNG state " << rng_bytes
              << "), forward peak " << forward_peak << ", backward peak " << backward_peak << std::endl;
    if (checkpointing) {
      // Each block keeps its output (the next block's saved input, or the result) and the RNG
      // state for the replay, nothing else.
      WORKER_CHECK(kept == layers * (input_bytes + rng_bytes), "checkpointed blocks keep ", kept, " bytes, expected ",
                   layers, " x (", input_bytes, " + ", rng_bytes, ")");
    } else {
      WORKER_CHECK(per_block > 4 * input_bytes, "a plain block keeps ", per_block, " bytes");
    }
  }
  std::cout << "memory ok" << std::endl;
}

TEST(ActivationCheckpointing, ABlockKeepsOnlyItsInputAndTheRngState) {
  auto r = launch("ac_memory_worker", 1);
  ASSERT_TRUE(r.all_ok()) << r.report();
  std::cout << r.ranks[0].output;
  EXPECT_TRUE(contains(r.ranks[0].output, "memory ok")) << r.report();
}

}  // namespace
}  // namespace fsdp_test
