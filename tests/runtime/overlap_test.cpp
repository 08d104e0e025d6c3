// Overlap options (backward and forward prefetch, rate limiter): exact, and ordered as promised.
// Exact results with every combination of the options, and the event trace showing the ordering.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

TEST(OverlapExact, EveryPrefetchAndLimiterCombinationMatchesLocalTraining) {
  // exact_worker (fully_shard_exact_test.cpp) compares 5 steps with local training on the global
  // batch. World 3 forces padding; a 4-block transformer gives prefetching a chain to follow.
  std::vector<std::string> combos;
  for (const char* backward : {"none", "pre", "post"})
    for (const char* forward : {"", "+fwd"})
      for (const char* limit : {"+nolim", "+lim1", "+lim2"})
        combos.push_back(std::string("gpt4:FULL_SHARD:adamw:f32:") + backward + forward + limit);
  combos.push_back("gpt4:SHARD_GRAD_OP:adamw:f32:pre+fwd+lim1");
  combos.push_back("gpt4:SHARD_GRAD_OP:sgd:f64:post+fwd+nolim");
  combos.push_back("gpt4:NO_SHARD:adamw:f32:pre+fwd+lim2");
  combos.push_back("mlp:FULL_SHARD:sgd:f64:pre+fwd+lim2");
  combos.push_back("gpt4:FULL_SHARD:adamw:f32:pre+fwd+lim3");  // two units ahead (Note [Prefetch depth])
  combos.push_back("gpt4:SHARD_GRAD_OP:adamw:f32:pre+fwd+lim4");
  auto r = launch("exact_worker", 3, combos);
  ASSERT_TRUE(r.all_ok()) << r.report();
  for (const auto& c : combos) EXPECT_TRUE(contains(r.ranks[0].output, c + " ok")) << c << "\n" << r.report();
}

// ---------------------------------------------------------------------------------------------
// Trace ordering. The MLP's units are its Linear layers (the root holds no parameters), run in
// module order, so backward visits them in reverse.

struct Found {
  int index = -1;  // position in the recorded event list
  double start_us = 0;
};

Found find_event(const fsdp::IterationTrace& t, fsdp::TraceEvent::Kind kind, int unit,
                 const std::string& label_part = "") {
  for (size_t i = 0; i < t.events.size(); ++i) {
    const auto& e = t.events[i];
    if (e.kind == kind && e.unit == unit && contains(e.label, label_part)) return {int(i), e.start_us};
  }
  return {};
}

// The n-th (from 1) event of this kind for `unit`.
Found nth_event(const fsdp::IterationTrace& t, fsdp::TraceEvent::Kind kind, int unit, int n) {
  for (size_t i = 0; i < t.events.size(); ++i) {
    const auto& e = t.events[i];
    if (e.kind == kind && e.unit == unit && --n == 0) return {int(i), e.start_us};
  }
  return {};
}

// All-gathers issued for `unit` in one iteration.
int gathers_of(const fsdp::IterationTrace& t, int unit) {
  int n = 0;
  for (const auto& e : t.events) n += e.kind == fsdp::TraceEvent::Kind::kUnshardIssued && e.unit == unit;
  return n;
}

// Replays the trace's instants: units unsharded or being gathered at once (root excluded).
int replayed_max_unsharded(const fsdp::IterationTrace& t) {
  std::set<int> live;
  size_t most = 0;
  for (const auto& e : t.events) {
    if (e.unit <= 0) continue;
    if (e.kind == fsdp::TraceEvent::Kind::kUnshardIssued) live.insert(e.unit);
    if (e.kind == fsdp::TraceEvent::Kind::kReshard) live.erase(e.unit);
    most = std::max(most, live.size());
  }
  return int(most);
}

FSDP_WORKER(trace_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string mode = ctx.args.at(0);
  auto opts = fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()).trace(true);
  if (mode == "pre") opts.backward_prefetch(fsdp::BackwardPrefetch::kBackwardPre).limit_all_gathers(false);
  if (mode == "post") opts.backward_prefetch(fsdp::BackwardPrefetch::kBackwardPost).limit_all_gathers(false);
  if (mode == "none") opts.backward_prefetch(fsdp::BackwardPrefetch::kNone).limit_all_gathers(false);
  if (mode == "forward")
    opts.backward_prefetch(fsdp::BackwardPrefetch::kNone).forward_prefetch(true).limit_all_gathers(false);
  if (mode == "limit1") opts.forward_prefetch(true).all_gather_limit(1);
  if (mode == "limit2") opts.forward_prefetch(true).all_gather_limit(2);
  if (mode == "limit3") opts.forward_prefetch(true).all_gather_limit(3);
  torch::manual_seed(1);
  MLP model(8, 32, 4, 5);  // 6 Linear units
  auto sharded = fsdp::fully_shard(model, pg, opts);
  torch::optim::SGD opt(sharded->parameters(), 0.01);
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    // An input requiring grad: backward reads every unit, the first too (Note [Units backward does not read]).
    model->forward(torch::randn({4, 8}).requires_grad_()).pow(2).mean().backward();
    opt.step();
  }
  const fsdp::IterationTrace t = sharded->last_trace();
  const int n = int(sharded->units().size());
  WORKER_CHECK(n == 7 && sharded->units()[0].padded_bytes == 0, "expected an empty root and 6 Linear units, got ", n);
  WORKER_CHECK(!t.events.empty() && t.iteration == 2, "no trace of the third iteration");
  using K = fsdp::TraceEvent::Kind;
  for (int u = 1; u < n; ++u) {
    WORKER_CHECK(find_event(t, K::kReduceIssued, u).index >= 0, "unit ", u, ": no reduce-scatter issued");
    WORKER_CHECK(find_event(t, K::kReduce, u).index >= 0, "unit ", u, ": no reduce-scatter span");
    WORKER_CHECK(find_event(t, K::kCompute, u).index >= 0, "unit ", u, ": no compute span");
  }
  // Backward visits units n-1, ..., 1; "next" after unit u is u - 1.
  for (int u = n - 1; u >= 2; --u) {
    const Found reduce = find_event(t, K::kReduceIssued, u);
    const Found reshard = find_event(t, K::kReshard, u);
    const Found pre = find_event(t, K::kUnshardIssued, u - 1, "backward pre");
    const Found post = find_event(t, K::kUnshardIssued, u - 1, "backward post");
    if (mode == "pre") {
      WORKER_CHECK(pre.index >= 0 && pre.index < reduce.index, "BACKWARD_PRE: unit ", u - 1,
                   "'s all-gather must be issued before unit ", u, "'s reduce-scatter (", pre.index, " vs ",
                   reduce.index, ")");
    } else if (mode == "post") {
      WORKER_CHECK(post.index > reshard.index && post.index < reduce.index, "BACKWARD_POST: unit ", u - 1,
                   "'s all-gather must be issued after unit ", u, " is resharded and before its reduce-scatter");
    } else if (mode == "none" || mode == "forward") {
      WORKER_CHECK(pre.index < 0 && post.index < 0, "no backward prefetch expected");
    }
  }
  if (mode == "forward" || mode == "limit2") {
    // Forward prefetch (previous iteration's order): unit u+1's gather is issued before unit u computes.
    for (int u = 1; u + 1 < n; ++u) {
      const Found next = find_event(t, K::kUnshardIssued, u + 1, "prefetch forward");
      const Found compute = find_event(t, K::kCompute, u);
      WORKER_CHECK(next.index >= 0 && next.start_us <= compute.start_us, "forward prefetch: unit ", u + 1,
                   " must be issued before unit ", u, " computes");
    }
  }
  if (mode == "limit2" || mode == "limit3") {
    // Note [Prefetch depth]: prefetching looks ahead until the limiter stops it, and the unit it
    // stops is gathered as soon as a reshard makes room. Under K = 3 unit u+2 is gathered before
    // unit u computes, in forward and in backward; under K = 2 only after it. Either way a
    // backward gather is issued before the reduce-scatter of the unit that made room for it.
    const bool two_ahead = mode == "limit3";
    for (int u = 1; u + 2 < n; ++u) {
      const Found ahead = find_event(t, K::kUnshardIssued, u + 2, "prefetch forward");
      const Found compute = find_event(t, K::kCompute, u);
      WORKER_CHECK(ahead.index >= 0 && compute.index >= 0 && (ahead.index < compute.index) == two_ahead, mode,
                   ": unit ", u + 2, "'s forward prefetch must be issued ", two_ahead ? "before" : "after", " unit ", u,
                   " computes (events ", ahead.index, ", ", compute.index, ")");
    }
    for (int u = n - 1; u >= 3; --u) {
      const Found ahead = find_event(t, K::kUnshardIssued, u - 2, "backward pre");
      const Found compute = nth_event(t, K::kCompute, u, 2);  // its backward
      const Found reduce = find_event(t, K::kReduceIssued, u);
      WORKER_CHECK(ahead.index >= 0 && compute.index >= 0 && (ahead.index < compute.index) == two_ahead, mode,
                   ": unit ", u - 2, "'s backward prefetch must be issued ", two_ahead ? "before" : "after", " unit ",
                   u, "'s backward computes (events ", ahead.index, ", ", compute.index, ")");
      WORKER_CHECK(reduce.index >= 0 && ahead.index < reduce.index, mode, ": unit ", u - 2,
                   "'s backward prefetch must be issued before unit ", u, "'s reduce-scatter (events ", ahead.index,
                   ", ", reduce.index, ")");
    }
  }
  const int replayed = replayed_max_unsharded(t);
  WORKER_CHECK(replayed == t.max_unsharded_units, "trace reports ", t.max_unsharded_units,
               " units unsharded at most, its events show ", replayed);
  if (mode == "limit1")
    WORKER_CHECK(t.max_unsharded_units == 1, "limit 1: at most 1 unit unsharded, saw ", t.max_unsharded_units);
  if (mode == "limit2")
    WORKER_CHECK(t.max_unsharded_units == 2, "limit 2: at most 2 units unsharded, saw ", t.max_unsharded_units);
  if (mode == "limit3")
    WORKER_CHECK(t.max_unsharded_units == 3, "limit 3: 3 units unsharded at most, saw ", t.max_unsharded_units);
  if (mode == "limit1") {  // held back, not dropped: prefetches still happen after reshards
    bool any = false;
    for (const auto& e : t.events) any |= e.kind == K::kUnshardIssued && contains(e.label, "prefetch");
    WORKER_CHECK(any, "limit 1: prefetches must be deferred, not dropped");
  }
  WORKER_CHECK(t.comm_us > 0 && t.duration_us > 0 && t.exposed_comm_us >= 0, "empty summary figures");
  // The Chrome trace parses and has spans on the compute thread and a communicator thread.
  const std::string path = "/tmp/fsdp_trace_test_" + std::to_string(::getpid()) + ".json";
  t.write_chrome_json(path);
  std::ifstream in(path);
  const auto json = nlohmann::json::parse(in);
  std::remove(path.c_str());
  int compute_spans = 0, comm_spans = 0;
  for (const auto& e : json.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    (e.at("tid") == 0 ? compute_spans : comm_spans)++;
  }
  WORKER_CHECK(compute_spans >= n - 1 && comm_spans >= 2 * (n - 1), "chrome trace: ", compute_spans, " compute spans, ",
               comm_spans, " communicator spans");
  if (ctx.rank == 0) std::cout << "trace " << mode << " ok, max unsharded " << t.max_unsharded_units << std::endl;
}

class TraceOrder : public ::testing::TestWithParam<std::string> {};

TEST_P(TraceOrder, ShowsThePromisedOrdering) {
  auto r = launch("trace_worker", 2, {GetParam()});
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "trace " + GetParam() + " ok")) << r.report();
}

INSTANTIATE_TEST_SUITE_P(Modes, TraceOrder,
                         ::testing::Values("pre", "post", "none", "forward", "limit1", "limit2", "limit3"),
                         [](const auto& info) { return info.param; });

// The root's own parameters are used between units (like a transformer's root-level LayerNorms):
// backward touches the root again after each unit has finished. BACKWARD_PRE must then prefetch
// the next unit still to run, never re-gather one whose backward is done (on the GPT, the last
// block's MLP would be gathered a third time and held until the end of backward).
struct RootBetweenImpl : torch::nn::Module {
  RootBetweenImpl() {
    scale = register_parameter("scale", torch::ones({16}));
    for (int i = 0; i < 4; ++i) layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(16, 16)));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& l : layers) x = torch::tanh(l(x)) * scale;
    return x;
  }
  at::Tensor scale;
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(RootBetween);

FSDP_WORKER(root_between_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  for (auto prefetch : {fsdp::BackwardPrefetch::kBackwardPre, fsdp::BackwardPrefetch::kBackwardPost}) {
    torch::manual_seed(2);
    RootBetween ref;
    torch::manual_seed(2);
    RootBetween model;
    auto sharded = fsdp::fully_shard(model, pg,
                                     fsdp::Options()
                                         .auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>())
                                         .backward_prefetch(prefetch)
                                         .trace(true));
    torch::optim::SGD ref_opt(ref->parameters(), 0.05), opt(sharded->parameters(), 0.05);
    for (int step = 0; step < 3; ++step) {
      const auto x = torch::randn({2 * ctx.world, 16}, at::detail::createCPUGenerator(7 + step));
      step_side_by_side(ref, ref_opt, model, opt, x, ctx.rank, 2);
    }
    const auto t = sharded->last_trace();
    const int n = int(sharded->units().size());
    WORKER_CHECK(n == 5, "expected the root and 4 Linear units, got ", n);
    for (int u = 1; u < n; ++u) {
      const int gathers = gathers_of(t, u);
      WORKER_CHECK(gathers <= 2, fsdp::to_string(prefetch), ": unit ", u, " was gathered ", gathers,
                   " times in one iteration (forward and backward: at most 2)");
    }
    WORKER_CHECK(t.max_unsharded_units <= 2, "at most 2 non-root units unsharded, saw ", t.max_unsharded_units);
    auto full = sharded->full_state_dict();
    for (const auto& kv : ref->named_parameters()) {
      const double d = rel_diff(full.at(kv.key()), kv.value().detach());
      WORKER_CHECK(d <= 1e-5, "parameter ", kv.key(), " differs from local training by rel ", d);
    }
  }
  if (ctx.rank == 0) std::cout << "root between ok" << std::endl;
}

TEST(TraceOrder, BackwardPrefetchNeverRegathersAFinishedUnit) {
  auto r = launch("root_between_worker", 2);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "root between ok")) << r.report();
}

// Note [Units backward does not read]: an embedding's backward scatters its gradient without
// reading the table, and a bias's backward sums the gradient without reading the bias. From the
// second iteration on, neither unit is gathered for backward (BACKWARD_PRE and BACKWARD_POST), nor
// kept from forward for it (the shift unit runs last), and training equals local training.
struct EmbedThenShiftImpl : torch::nn::Module {
  struct ShiftImpl : torch::nn::Module {
    ShiftImpl() { bias = register_parameter("bias", torch::zeros({16})); }
    at::Tensor forward(const at::Tensor& x) { return x + bias; }
    at::Tensor bias;
  };
  TORCH_MODULE(Shift);
  EmbedThenShiftImpl() {
    embedding = register_module("embedding", torch::nn::Embedding(32, 16));
    first = register_module("first", torch::nn::Linear(16, 16));
    second = register_module("second", torch::nn::Linear(16, 16));
    shift = register_module("shift", Shift());
  }
  at::Tensor forward(const at::Tensor& tokens) { return shift(second(torch::tanh(first(embedding(tokens))))).sum(1); }
  torch::nn::Embedding embedding{nullptr};
  torch::nn::Linear first{nullptr}, second{nullptr};
  Shift shift{nullptr};
};
TORCH_MODULE(EmbedThenShift);

FSDP_WORKER(unread_in_backward_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  for (auto prefetch : {fsdp::BackwardPrefetch::kBackwardPre, fsdp::BackwardPrefetch::kBackwardPost}) {
    torch::manual_seed(3);
    EmbedThenShift ref;
    torch::manual_seed(3);
    EmbedThenShift model;
    auto sharded = fsdp::fully_shard(
        model, pg,
        fsdp::Options()
            .auto_wrap_policy(
                fsdp::wrap::by_type<torch::nn::EmbeddingImpl, torch::nn::LinearImpl, EmbedThenShiftImpl::ShiftImpl>())
            .backward_prefetch(prefetch)
            .trace(true));
    torch::optim::SGD ref_opt(ref->parameters(), 0.05), opt(sharded->parameters(), 0.05);
    for (int step = 0; step < 3; ++step) {
      const auto x = torch::randint(32, {2 * ctx.world, 4}, at::detail::createCPUGenerator(11 + step));
      step_side_by_side(ref, ref_opt, model, opt, x, ctx.rank, 2);
    }
    const auto t = sharded->last_trace();
    WORKER_CHECK(sharded->units().size() == 5, "expected the root and 4 units, got ", sharded->units().size());
    for (int u = 1; u <= 4; ++u) {
      const std::string& name = sharded->units()[u].name;
      const int expected = name == "embedding" || name == "shift" ? 1 : 2;
      WORKER_CHECK(gathers_of(t, u) == expected, fsdp::to_string(prefetch), ": unit ", name, " was gathered ",
                   gathers_of(t, u), " times in one iteration, expected ", expected);
    }
    auto full = sharded->full_state_dict();
    for (const auto& kv : ref->named_parameters()) {
      const double d = rel_diff(full.at(kv.key()), kv.value().detach());
      WORKER_CHECK(d <= 1e-5, "parameter ", kv.key(), " differs from local training by rel ", d);
    }
  }
  if (ctx.rank == 0) std::cout << "unread in backward ok" << std::endl;
}

TEST(TraceOrder, UnitsBackwardDoesNotReadAreNotGatheredForIt) {
  for (int world : {2, 3}) {
    auto r = launch("unread_in_backward_worker", world);
    ASSERT_TRUE(r.all_ok()) << r.report();
    EXPECT_TRUE(contains(r.ranks[0].output, "unread in backward ok")) << r.report();
  }
}

// Note [Kept for backward]: from the second iteration on, the unit backward needs first (the last
// Linear, which the root's scale follows) stays unsharded from its forward to its backward, so it
// is gathered once per iteration instead of twice; the parameter peak does not grow. A
// ReshardPolicy turns it off; a forward without grad keeps nothing and gathers each unit once; a
// second forward before backward trains exactly.
FSDP_WORKER(kept_for_backward_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const int rows = 2;
  int64_t eval_bytes[2] = {-1, -1};
  for (const bool with_policy : {false, true}) {
    auto opts = fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()).trace(true);
    if (with_policy)
      opts.reshard_after_forward_policy(
          [](const std::string&, const torch::nn::Module&) { return c10::optional<bool>(); });
    torch::manual_seed(3);
    RootBetween ref;
    torch::manual_seed(3);
    RootBetween model;
    auto sharded = fsdp::fully_shard(model, pg, opts);
    const int n = int(sharded->units().size());
    WORKER_CHECK(n == 5, "expected the root and 4 Linear units, got ", n);
    const int last = n - 1;
    const int64_t resting = sharded->memory_stats().param_bytes;
    int64_t unkept = -1;  // parameter bytes after the first forward, which keeps nothing
    const int64_t last_bytes = sharded->units()[last].padded_bytes;
    torch::optim::SGD ref_opt(ref->parameters(), 0.05), opt(sharded->parameters(), 0.05);
    std::vector<int64_t> peaks;
    for (int step = 0; step < 4; ++step) {
      const auto x = torch::randn({rows * ctx.world, 16}, at::detail::createCPUGenerator(11 + step));
      const auto mine = x.narrow(0, int64_t(ctx.rank) * rows, rows);
      ref_opt.zero_grad();
      opt.zero_grad();
      sharded->reset_peak_memory_stats();
      at::Tensor ref_loss, loss;
      if (step == 3) {  // two forwards, one backward
        ref_loss = ref->forward(x).pow(2).mean() + ref->forward(x * 0.5).pow(2).mean();
        loss = model->forward(mine).pow(2).mean() + model->forward(mine * 0.5).pow(2).mean();
      } else {
        ref_loss = ref->forward(x).pow(2).mean();
        loss = model->forward(mine).pow(2).mean();
      }
      const int64_t after_forward = sharded->memory_stats().param_bytes;
      if (step == 0) unkept = after_forward;
      const bool keeps = !with_policy && step >= 1;
      WORKER_CHECK(after_forward == unkept + (keeps ? last_bytes : 0), "policy ", with_policy, ", step ", step, ": ",
                   after_forward, " parameter bytes after forward, expected ", unkept + (keeps ? last_bytes : 0),
                   keeps ? " (the first forward's and the last unit)" : " (the first forward's)");
      ref_loss.backward();
      loss.backward();
      ref_opt.step();
      opt.step();
      WORKER_CHECK(sharded->memory_stats().param_bytes == resting, "step ", step, ": not resharded after backward");
      peaks.push_back(sharded->memory_stats().param_peak_bytes);
      const auto t = sharded->last_trace();
      if (step == 3) continue;  // two forwards gather every unit twice in forward
      for (int u = 1; u < n; ++u) {
        // The first unit's backward reads no parameter (its input requires no grad): from the
        // second iteration on it is not gathered for it (Note [Units backward does not read]).
        const int expected = (keeps && u == last) || (u == 1 && step >= 1) ? 1 : 2;
        WORKER_CHECK(gathers_of(t, u) == expected, "policy ", with_policy, ", step ", step, ": unit ", u, " gathered ",
                     gathers_of(t, u), " times, expected ", expected);
      }
    }
    WORKER_CHECK(peaks[2] == peaks[0], "the parameter peak grew from ", peaks[0], " to ", peaks[2],
                 " bytes when the last unit was kept");
    auto full = sharded->full_state_dict();
    for (const auto& kv : ref->named_parameters()) {
      const double d = rel_diff(full.at(kv.key()), kv.value().detach());
      WORKER_CHECK(d <= 1e-5, "parameter ", kv.key(), " differs from local training by rel ", d);
    }
    {  // a forward without grad (evaluation) keeps nothing: as much is unsharded as under the policy
      torch::NoGradGuard no_grad;
      model->forward(torch::randn({rows, 16}));
      eval_bytes[with_policy] = sharded->memory_stats().param_bytes;
      // Forward prefetching must not gather again what this forward already ran (the root is
      // entered between its children), and leaves no gather in flight.
      const int64_t root_bytes = sharded->units()[0].padded_bytes;
      WORKER_CHECK(eval_bytes[with_policy] == resting + root_bytes, "policy ", with_policy,
                   ": after a forward without grad ", eval_bytes[with_policy], " parameter bytes, expected ",
                   resting + root_bytes, " (the resting shards and the root's unsharded parameters)");
    }
  }
  WORKER_CHECK(eval_bytes[0] == eval_bytes[1], "after a forward without grad ", eval_bytes[0],
               " parameter bytes are unsharded, ", eval_bytes[1], " under a ReshardPolicy");
  if (ctx.rank == 0) std::cout << "kept for backward ok" << std::endl;
}

TEST(TraceOrder, TheUnitBackwardNeedsFirstIsKeptFromForward) {
  for (int world : {2, 3}) {
    auto r = launch("kept_for_backward_worker", world);
    ASSERT_TRUE(r.all_ok()) << "world " << world << "\n" << r.report();
    EXPECT_TRUE(contains(r.ranks[0].output, "kept for backward ok")) << r.report();
  }
}

// The root's own parameters read first and last, around four Linear units.
struct RootAroundImpl : torch::nn::Module {
  RootAroundImpl() {
    w_in = register_parameter("w_in", torch::randn({16, 16}) * 0.25);
    w_out = register_parameter("w_out", torch::randn({16, 16}) * 0.25);
    for (int i = 0; i < 4; ++i) layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(16, 16)));
  }
  at::Tensor forward(at::Tensor x) {
    x = x.matmul(w_in);
    for (auto& l : layers) x = torch::tanh(l(x));
    return x.matmul(w_out);
  }
  at::Tensor w_in, w_out;
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(RootAround);

// Note [Forward prefetch]: forwards without grad (evaluation) between training steps gather each
// unit once and leave only the root unsharded, with the root read first and last or between its
// children, at rate limits 2 and 3; training around them stays exact.
template <typename Model>
void train_and_evaluate(const WorkerContext& ctx, const fsdp::ProcessGroupPtr& pg, int limit, const char* name) {
  torch::manual_seed(5);
  Model ref;
  torch::manual_seed(5);
  Model model;
  auto sharded = fsdp::fully_shard(
      model, pg,
      fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()).all_gather_limit(limit));
  const int64_t resting = sharded->memory_stats().param_bytes;
  const int64_t root_bytes = sharded->units()[0].padded_bytes;
  torch::optim::SGD ref_opt(ref->parameters(), 0.05), opt(sharded->parameters(), 0.05);
  for (int step = 0; step < 3; ++step) {
    const auto x = torch::randn({2 * ctx.world, 16}, at::detail::createCPUGenerator(21 + step));
    step_side_by_side(ref, ref_opt, model, opt, x, ctx.rank, 2);
    for (int eval = 0; eval < 2; ++eval) {
      torch::NoGradGuard no_grad;
      const auto y = model->forward(torch::randn({2, 16}, at::detail::createCPUGenerator(31 + eval)));
      const auto want = ref->forward(torch::randn({2, 16}, at::detail::createCPUGenerator(31 + eval)));
      WORKER_CHECK(rel_diff(y, want) <= 1e-5, name, ", limit ", limit, ": an evaluation forward differs from local");
      const int64_t bytes = sharded->memory_stats().param_bytes;
      WORKER_CHECK(bytes == resting + root_bytes, name, ", limit ", limit, ", step ", step, ", evaluation ", eval, ": ",
                   bytes, " parameter bytes unsharded after a forward without grad, expected ", resting + root_bytes,
                   " (the shards and the root)");
    }
  }
  expect_same_parameters(*ref, *sharded, 1e-5, std::string(name) + ", limit " + std::to_string(limit));
}

FSDP_WORKER(evaluation_forward_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  for (int limit : {2, 3}) {
    train_and_evaluate<RootAround>(ctx, pg, limit, "root first and last");
    train_and_evaluate<RootBetween>(ctx, pg, limit, "root between its children");
  }
  if (ctx.rank == 0) std::cout << "evaluation forward ok" << std::endl;
}

TEST(TraceOrder, AForwardWithoutGradGathersEachUnitOnce) {
  auto r = launch("evaluation_forward_worker", 2);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "evaluation forward ok")) << r.report();
}

}  // namespace
}  // namespace fsdp_test
