// The network model (include/fsdp/network_model.h): communication slowed to a modeled network.
// Exact results, modeled completion times (strict lower bound, loose upper bound: the machine is
// shared), link selection, no CPU burnt while waiting, env parsing, and fully_shard running on a
// modeled hybrid network unchanged.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdlib>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);  // every thread of this process (the gloo worker and transport too)
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

std::vector<int> all_ranks(int world) {
  std::vector<int> r(world);
  for (int i = 0; i < world; ++i) r[i] = i;
  return r;
}

// A model whose single link is `gbps` GB/s with `latency_us` per step, for every group.
fsdp::NetworkModel uniform_model(double gbps, double latency_us = 0) {
  auto link = fsdp::Link().bandwidth_gbps(gbps).latency_us(latency_us);
  return fsdp::NetworkModel().intra(link).inter(link).ranks_per_host(1);
}

// ---------------------------------------------------------------------------------------------
// Parsing and formulas (in-process).

TEST(NetworkModelParse, ReadsEveryKey) {
  auto m = fsdp::NetworkModel::parse("intra_gbps=25, inter_gbps=12.5,ranks_per_host=8,latency_us=10");
  EXPECT_DOUBLE_EQ(m.intra().bandwidth_gbps(), 25);
  EXPECT_DOUBLE_EQ(m.inter().bandwidth_gbps(), 12.5);
  EXPECT_DOUBLE_EQ(m.intra().latency_us(), 10);
  EXPECT_DOUBLE_EQ(m.inter().latency_us(), 10);
  EXPECT_EQ(m.ranks_per_host(), 8);

  auto both = fsdp::NetworkModel::parse("GBPS=3,Inter_Latency_us=40");
  EXPECT_DOUBLE_EQ(both.intra().bandwidth_gbps(), 3);
  EXPECT_DOUBLE_EQ(both.inter().bandwidth_gbps(), 3);
  EXPECT_DOUBLE_EQ(both.intra().latency_us(), 0);
  EXPECT_DOUBLE_EQ(both.inter().latency_us(), 40);
  EXPECT_EQ(both.ranks_per_host(), 0);  // LOCAL_WORLD_SIZE, resolved by ProcessGroup

  auto over = fsdp::NetworkModel::parse("gbps=3,inter_gbps=1");
  EXPECT_DOUBLE_EQ(over.intra().bandwidth_gbps(), 3);
  EXPECT_DOUBLE_EQ(over.inter().bandwidth_gbps(), 1);
  EXPECT_TRUE(contains(m.describe(), "modeled"));
}

std::string parse_error(const std::string& spec) {
  try {
    fsdp::NetworkModel::parse(spec, "FSDP_NETWORK_MODEL");
  } catch (const fsdp::Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(NetworkModelParse, BadInputNamesTheProblemAndTheFix) {
  struct Case {
    const char* spec;
    const char* mentions;
  };
  for (const Case& c :
       {Case{"intra_gbps=25,inter_gbs=12.5", "unknown key 'inter_gbs'"}, Case{"intra_gbps=25", "inter_gbps=<GB/s>"},
        Case{"inter_gbps=25", "intra_gbps=<GB/s>"}, Case{"gbps=25GB/s", "not a plain number"},
        Case{"gbps=", "not a plain number"}, Case{"gbps=nan", "not a plain number"},
        Case{"gbps=0", "positive number of GB/s"}, Case{"gbps=-1", "positive number of GB/s"},
        Case{"gbps=1,latency_us=-5", "non-negative number of microseconds"},
        Case{"gbps=1,ranks_per_host=0", "whole number >= 1"}, Case{"gbps=1,ranks_per_host=2.5", "whole number >= 1"},
        Case{"gbps=1,gbps=2", "given twice"}, Case{"gbps", "not key=value"}, Case{",", "no settings"}}) {
    const std::string e = parse_error(c.spec);
    EXPECT_TRUE(contains(e, c.mentions)) << c.spec << " -> " << e;
    EXPECT_TRUE(contains(e, "FSDP_NETWORK_MODEL")) << c.spec << " -> " << e;
  }
}

TEST(NetworkModelParse, FromEnv) {
  ::unsetenv("FSDP_NETWORK_MODEL");
  EXPECT_FALSE(fsdp::NetworkModel::from_env());
  ::setenv("FSDP_NETWORK_MODEL", "off", 1);
  EXPECT_FALSE(fsdp::NetworkModel::from_env());
  ::setenv("FSDP_NETWORK_MODEL", "gbps=2", 1);
  auto m = fsdp::NetworkModel::from_env();
  ASSERT_TRUE(m);
  EXPECT_DOUBLE_EQ(m->inter().bandwidth_gbps(), 2);
  ::setenv("FSDP_NETWORK_MODEL", "bandwidth=2", 1);
  try {
    fsdp::NetworkModel::from_env();
    ADD_FAILURE() << "a bad FSDP_NETWORK_MODEL was accepted";
  } catch (const fsdp::Error& e) {
    EXPECT_TRUE(contains(e.what(), "FSDP_NETWORK_MODEL=\"bandwidth=2\"")) << e.what();
    EXPECT_TRUE(contains(e.what(), "example")) << e.what();
  }
  ::unsetenv("FSDP_NETWORK_MODEL");
}

TEST(NetworkModelFormula, RingCosts) {
  using fsdp::Collective;
  const auto link = fsdp::Link().bandwidth_gbps(2).latency_us(10);
  const int64_t B = 8000000;  // bytes
  // n = 4: all-gather/reduce-scatter 3 steps, 3/4 of B; all-reduce 6 steps, 6/4 of B.
  EXPECT_DOUBLE_EQ(fsdp::modeled_seconds(Collective::kAllGather, B, 4, link), 3 * 10e-6 + 0.75 * B / 2e9);
  EXPECT_DOUBLE_EQ(fsdp::modeled_seconds(Collective::kReduceScatter, B, 4, link), 3 * 10e-6 + 0.75 * B / 2e9);
  EXPECT_DOUBLE_EQ(fsdp::modeled_seconds(Collective::kAllReduce, B, 4, link), 6 * 10e-6 + 1.5 * B / 2e9);
  EXPECT_DOUBLE_EQ(fsdp::modeled_seconds(Collective::kBroadcast, B, 4, link), 3 * 10e-6 + 1.0 * B / 2e9);
  EXPECT_DOUBLE_EQ(fsdp::modeled_seconds(Collective::kBarrier, 0, 4, link), 6 * 10e-6);
  EXPECT_DOUBLE_EQ(fsdp::modeled_seconds(Collective::kAllReduce, B, 1, link), 0);
  EXPECT_DOUBLE_EQ(fsdp::modeled_wire_bytes(Collective::kAllGather, B, 4), 0.75 * B);
}

TEST(NetworkModelFormula, GroupsSpanningHostsRunOneRingPerRankOfAHost) {
  EXPECT_EQ(fsdp::fewest_per_host({0, 1, 2, 3}, 2), 2);
  EXPECT_EQ(fsdp::fewest_per_host({0, 2}, 2), 1);              // one rank of each host
  EXPECT_EQ(fsdp::fewest_per_host({4, 5, 6, 7, 8, 9}, 4), 2);  // 4 on one host, 2 on the next
  const fsdp::Link intra = fsdp::Link().bandwidth_gbps(300).latency_us(5);
  const fsdp::Link inter = fsdp::Link().bandwidth_gbps(25).latency_us(10);
  EXPECT_DOUBLE_EQ(fsdp::spanning_link(intra, inter, 1).bandwidth_gbps(), 25);
  EXPECT_DOUBLE_EQ(fsdp::spanning_link(intra, inter, 8).bandwidth_gbps(), 200);  // 8 links leave each host
  EXPECT_DOUBLE_EQ(fsdp::spanning_link(intra, inter, 8).latency_us(), 10);
  // Each ring's hops within a host carry 7/8 of the bytes: a slow intra link bounds them.
  EXPECT_DOUBLE_EQ(fsdp::spanning_link(fsdp::Link().bandwidth_gbps(70), inter, 8).bandwidth_gbps(), 80);
  EXPECT_THROW(fsdp::fewest_per_host({0}, 0), fsdp::Error);
}

// ---------------------------------------------------------------------------------------------
// Results are those of the unmodeled communicator, bit for bit.

FSDP_WORKER(modeled_exact_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  auto plain = pg->world();
  WORKER_CHECK(!fsdp::modeled_link_stats(*plain), "the plain communicator reports modeled statistics");
  auto modeled = fsdp::with_network_model(plain, all_ranks(ctx.world), uniform_model(2.0, 20));
  WORKER_CHECK(contains(modeled->name(), "modeled"), "name() does not say modeled: ", modeled->name());
  const int W = ctx.world;
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kLong}) {
    for (int64_t n : {1, 7, 4099}) {
      torch::manual_seed(100 + ctx.rank);
      auto opts = at::TensorOptions().dtype(dtype);
      at::Tensor in = dtype == at::kLong ? torch::randint(-1000, 1000, {n}, opts) : torch::randn({n}).to(dtype);
      at::Tensor big =
          dtype == at::kLong ? torch::randint(-1000, 1000, {W * n}, opts) : torch::randn({W * n}).to(dtype);

      at::Tensor ag_plain = torch::empty({W * n}, opts), ag_model = torch::empty({W * n}, opts);
      plain->all_gather_into(ag_plain, in)->wait();
      modeled->all_gather_into(ag_model, in)->wait();
      WORKER_CHECK(torch::equal(ag_plain, ag_model), "all_gather_into differs, dtype ", dtype, " n ", n);

      at::Tensor rs_plain = torch::empty({n}, opts), rs_model = torch::empty({n}, opts);
      plain->reduce_scatter(rs_plain, big.clone())->wait();
      modeled->reduce_scatter(rs_model, big.clone())->wait();
      WORKER_CHECK(torch::equal(rs_plain, rs_model), "reduce_scatter differs, dtype ", dtype, " n ", n);

      at::Tensor ar_plain = big.clone(), ar_model = big.clone();
      plain->all_reduce(ar_plain)->wait();
      modeled->all_reduce(ar_model)->wait();
      WORKER_CHECK(torch::equal(ar_plain, ar_model), "all_reduce differs, dtype ", dtype, " n ", n);

      at::Tensor bc_plain = in.clone(), bc_model = in.clone();
      plain->broadcast(bc_plain, W - 1)->wait();
      modeled->broadcast(bc_model, W - 1)->wait();
      WORKER_CHECK(torch::equal(bc_plain, bc_model), "broadcast differs, dtype ", dtype, " n ", n);
      modeled->barrier();
    }
  }
  // Argument errors come from the real communicator and book nothing on the link.
  const auto before = fsdp::modeled_link_stats(*modeled)->collectives;
  bool threw = false;
  try {
    modeled->all_gather_into(torch::empty({3}), torch::empty({2}));
  } catch (const fsdp::Error& e) {
    threw = contains(e.what(), "all_gather_into");
  }
  WORKER_CHECK(threw, "a wrongly sized all-gather was not refused");
  WORKER_CHECK(fsdp::modeled_link_stats(*modeled)->collectives == before, "a refused collective was booked");
  std::cout << "exact ok" << std::endl;
}

TEST(NetworkModel, ResultsEqualTheUnmodeledCommunicator) {
  auto r = launch("modeled_exact_worker", 2, {}, 120);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "exact ok")) << r.report();
}

// ---------------------------------------------------------------------------------------------
// Timing: completion no earlier than the model, close to it when the model dominates; the link is
// shared serially; waiting sleeps.

FSDP_WORKER(modeled_timing_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const int W = ctx.world;
  // 0.01 GB/s: a 4 MiB all-gather output is modeled at (W-1)/W * 4 MiB / 1e7 B/s = 0.21 s for
  // W = 2, while loopback gloo moves it in a few milliseconds: the model dominates.
  auto model = uniform_model(0.01);
  auto comm = fsdp::with_network_model(pg->world(), all_ranks(W), model);
  const int64_t n = (1 << 20) / W;  // floats per rank: 4 MiB of output
  at::Tensor in = torch::full({n}, float(ctx.rank)), out = torch::empty({W * n});
  const double d = fsdp::modeled_seconds(fsdp::Collective::kAllGather, out.nbytes(), W, model.inter());
  const double slack = std::max(0.3, 0.5 * d);  // upper bound: loose, the machine is shared
  comm->barrier();

  {  // one collective: lower bound strict, upper loose; completed() follows the model
    const auto t0 = Clock::now();
    auto work = comm->all_gather_into(out, in);
    WORKER_CHECK(!work->completed(), "completed() is true right after issue, before the modeled time");
    const double cpu0 = cpu_seconds();
    const auto w0 = Clock::now();
    work->wait();
    const double wall = seconds_since(w0), cpu = cpu_seconds() - cpu0;
    const double t = seconds_since(t0);
    WORKER_CHECK(work->completed(), "completed() is false after wait()");
    WORKER_CHECK(t >= d, "all-gather finished after ", t, " s, before its modeled ", d, " s");
    WORKER_CHECK(t <= d + slack, "all-gather took ", t, " s, far above its modeled ", d, " s");
    // A busy wait would burn ~wall seconds of CPU; sleeping burns only what the real transfer and
    // the process's other threads use, well under half the wait even on a loaded machine.
    WORKER_CHECK(cpu < 0.5 * wall, "waiting for the model used ", cpu, " s of CPU in ", wall, " s");
    for (int r = 0; r < W; ++r)
      WORKER_CHECK(out.narrow(0, r * n, n).eq(float(r)).all().item<bool>(), "wrong all-gather result");
    std::cout << "single: modeled " << d << " s, measured " << t << " s, cpu " << cpu << " s" << std::endl;
  }
  comm->barrier();
  {  // three back to back share the link: the last completes >= 3 modeled durations after issue
    const auto t0 = Clock::now();
    std::vector<fsdp::WorkPtr> works;
    for (int i = 0; i < 3; ++i) works.push_back(comm->all_gather_into(out, in));
    works.back()->wait();
    const double t = seconds_since(t0);
    WORKER_CHECK(t >= 3 * d, "three collectives on one link finished after ", t, " s, before 3 x ", d, " s");
    WORKER_CHECK(t <= 3 * d + slack, "three collectives took ", t, " s, far above 3 x ", d, " s");
    for (auto& w : works) WORKER_CHECK(w->completed(), "an earlier collective is not complete after the last");
  }
  comm->barrier();
  {                                                 // latency: a tiny all-reduce costs 2(W-1) steps
    auto lat_model = uniform_model(1000.0, 50000);  // 50 ms per step
    auto lat = fsdp::with_network_model(pg->world(), all_ranks(W), lat_model);
    at::Tensor t4 = torch::ones({4});
    const double dl = fsdp::modeled_seconds(fsdp::Collective::kAllReduce, t4.nbytes(), W, lat_model.inter());
    const auto t0 = Clock::now();
    lat->all_reduce(t4)->wait();
    const double t = seconds_since(t0);
    WORKER_CHECK(t >= dl && dl >= 2 * (W - 1) * 0.05, "tiny all-reduce: ", t, " s vs modeled ", dl, " s");
    WORKER_CHECK(t <= dl + slack, "tiny all-reduce took ", t, " s, far above its modeled ", dl, " s");
    WORKER_CHECK(t4.eq(float(W)).all().item<bool>(), "wrong all-reduce result");
  }
  // Statistics: 1 + 3 all-gathers and 3 barriers so far.
  auto s = fsdp::modeled_link_stats(*comm);
  WORKER_CHECK(s && s->link == "inter" && s->collectives == 7, "unexpected statistics");
  WORKER_CHECK(s->wire_bytes == 4 * int64_t(fsdp::modeled_wire_bytes(fsdp::Collective::kAllGather, out.nbytes(), W)),
               "wire bytes ", s->wire_bytes);
  const double busy = 4 * d + 3 * fsdp::modeled_seconds(fsdp::Collective::kBarrier, 0, W, model.inter());
  WORKER_CHECK(std::abs(s->modeled_busy_s - busy) < 1e-9, "modeled busy ", s->modeled_busy_s, " vs ", busy);

  // A model far faster than loopback: the real transport sets the time, and that is counted.
  auto fast = fsdp::with_network_model(pg->world(), all_ranks(W), uniform_model(1e6));
  at::Tensor big_in = torch::ones({1 << 22}), big_out = torch::empty({W << 22});
  fast->all_gather_into(big_out, big_in)->wait();
  WORKER_CHECK(fsdp::modeled_link_stats(*fast)->real_exceeded_model == 1,
               "a 16 MiB-per-rank all-gather modeled at 1e6 GB/s was not seen outlasting its model");
  std::cout << "timing ok" << std::endl;
}

TEST(NetworkModel, CompletesNoEarlierThanModeledAndSleepsMeanwhile) {
  auto r = launch("modeled_timing_worker", 2, {}, 120);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "timing ok")) << r.report();
}

// ---------------------------------------------------------------------------------------------
// Link selection through ProcessGroup (options or FSDP_NETWORK_MODEL), 4 ranks, 2 per host.

// args[0]: "options" (model in ProcessGroupOptions, 4 ranks, 2 per host) or "env-default-hosts"
// (FSDP_NETWORK_MODEL without ranks_per_host: LOCAL_WORLD_SIZE, one host). FSDP_NETWORK_MODEL with
// ranks_per_host is covered by the hybrid training test below.
FSDP_WORKER(modeled_link_worker) {
  const std::string how = ctx.args.at(0);
  fsdp::ProcessGroupOptions o;
  if (how == "options")
    o.network_model = fsdp::NetworkModel()
                          .intra(fsdp::Link().bandwidth_gbps(0.1))
                          .inter(fsdp::Link().bandwidth_gbps(0.004))
                          .ranks_per_host(2);
  auto pg = fsdp::ProcessGroup::from_env(o);
  WORKER_CHECK(pg->options().network_model, "no network model configured");
  const auto& model = *pg->options().network_model;
  auto world = fsdp::modeled_link_stats(*pg->world());
  if (how == "env-default-hosts") {
    WORKER_CHECK(model.ranks_per_host() == ctx.world, "ranks_per_host resolved to ", model.ranks_per_host());
    WORKER_CHECK(world && world->link == "intra", "one host: the world group is intra");
    std::cout << "link ok" << std::endl;
    return;
  }
  const int r = ctx.rank;
  auto host_group = pg->new_group({r / 2 * 2, r / 2 * 2 + 1}, "host");  // {0,1} or {2,3}
  auto cross_group = pg->new_group({r % 2, r % 2 + 2}, "cross");        // {0,2} or {1,3}
  auto host = fsdp::modeled_link_stats(*host_group);
  auto cross = fsdp::modeled_link_stats(*cross_group);
  WORKER_CHECK(world && host && cross, "ProcessGroup did not wrap every communicator in the model");
  WORKER_CHECK(model.ranks_per_host() == 2, "ranks_per_host ", model.ranks_per_host());
  WORKER_CHECK(world->link == "inter" && cross->link == "inter", "groups spanning hosts must be inter");
  WORKER_CHECK(host->link == "intra", "a group on one host must be intra");
  WORKER_CHECK(host->params.bandwidth_gbps() == model.intra().bandwidth_gbps(), "intra bandwidth");
  WORKER_CHECK(cross->params.bandwidth_gbps() == model.inter().bandwidth_gbps(), "inter bandwidth");
  // The world group has 2 ranks on each host: two rings, each crossing on its own rank's link.
  WORKER_CHECK(world->params.bandwidth_gbps() == 2 * model.inter().bandwidth_gbps(), "world group bandwidth ",
               world->params.bandwidth_gbps(), ", not 2 x inter");

  // The selection shows in time: 1 MiB gathered over 2 ranks is 0.5 MiB on the wire,
  // 5 ms at 0.1 GB/s (intra) and 131 ms at 0.004 GB/s (inter).
  const int64_t n = 1 << 17;
  at::Tensor in = torch::full({n}, float(r)), out = torch::empty({2 * n});
  auto timed = [&](const fsdp::CommunicatorPtr& c) {
    c->barrier();
    const auto t0 = Clock::now();
    c->all_gather_into(out, in)->wait();
    return seconds_since(t0);
  };
  const double d_intra = fsdp::modeled_seconds(fsdp::Collective::kAllGather, out.nbytes(), 2, model.intra());
  const double d_inter = fsdp::modeled_seconds(fsdp::Collective::kAllGather, out.nbytes(), 2, model.inter());
  const double t_host = timed(host_group), t_cross = timed(cross_group);
  WORKER_CHECK(t_host >= d_intra && t_cross >= d_inter, "host ", t_host, " s (modeled ", d_intra, "), cross ", t_cross,
               " s (modeled ", d_inter, ")");
  WORKER_CHECK(t_host < d_inter, "the intra-host group took ", t_host, " s, as long as the inter-host model ", d_inter,
               " s");
  std::cout << "link ok: intra " << t_host << " s (modeled " << d_intra << "), inter " << t_cross << " s (modeled "
            << d_inter << ")" << std::endl;
}

TEST(NetworkModel, IntraAndInterHostLinksFromOptions) {
  auto r = launch("modeled_link_worker", 4, {"options"}, 120);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "link ok")) << r.report();
}

TEST(NetworkModel, EnvWithoutRanksPerHostMeansOneHostPerLocalWorld) {
  auto r = launch("modeled_link_worker", 2, {"env-default-hosts"}, 120, {"FSDP_NETWORK_MODEL=gbps=0.1"});
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "link ok")) << r.report();
}

FSDP_WORKER(bad_env_worker) {
  try {
    fsdp::ProcessGroup::from_env();
  } catch (const fsdp::Error& e) {
    std::cout << "error: " << e.what() << std::endl;
    return;
  }
  throw std::runtime_error("a bad FSDP_NETWORK_MODEL was accepted");
}

TEST(NetworkModel, BadEnvironmentIsAClearError) {
  auto r = launch("bad_env_worker", 1, {}, 60, {"FSDP_NETWORK_MODEL=intra_gbps=25,inter_gbps=fast"});
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "FSDP_NETWORK_MODEL=\"intra_gbps=25,inter_gbps=fast\": inter_gbps='fast' "
                                          "is not a plain number"))
      << r.report();
}

// ---------------------------------------------------------------------------------------------
// fully_shard on a modeled network, switched on only by FSDP_NETWORK_MODEL: HYBRID_SHARD over 4
// ranks, 2 per modeled host, trains exactly like local training, with the shard groups on the
// intra-host link and the replica groups on the inter-host link.

FSDP_WORKER(modeled_hybrid_training_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const int per_rank = 2, steps = 3;
  torch::manual_seed(7);
  MLP reference(6, 10, 3, 2);
  torch::manual_seed(7);
  MLP model(6, 10, 3, 2);
  reference->to(at::kDouble);
  model->to(at::kDouble);
  auto sharded = fsdp::fully_shard(model, pg,
                                   fsdp::Options()
                                       .sharding_strategy(fsdp::ShardingStrategy::kHybridShard)
                                       .sharding_factor(2)
                                       .auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  torch::optim::SGD ref_opt(reference->parameters(), 0.1);
  torch::optim::SGD opt(sharded->parameters(), 0.1);
  for (int step = 0; step < steps; ++step) {
    torch::manual_seed(1000 + step);
    auto x = torch::randn({per_rank * ctx.world, 6}, at::kDouble);
    auto y = torch::randn({per_rank * ctx.world, 3}, at::kDouble);
    ref_opt.zero_grad();
    auto ref_loss = torch::mse_loss(reference->forward(x), y);
    ref_loss.backward();
    ref_opt.step();
    opt.zero_grad();
    auto loss = torch::mse_loss(model->forward(x.narrow(0, ctx.rank * per_rank, per_rank)),
                                y.narrow(0, ctx.rank * per_rank, per_rank));
    loss.backward();
    opt.step();
  }
  auto full = sharded->full_state_dict();
  for (const auto& kv : reference->named_parameters()) {
    const double d = rel_diff(full.at(kv.key()), kv.value().detach());
    WORKER_CHECK(d <= 1e-12, "parameter ", kv.key(), " differs from local training by rel ", d);
  }
  const int r = ctx.rank;
  auto shard = fsdp::modeled_link_stats(*pg->new_group({r / 2 * 2, r / 2 * 2 + 1}, "shard"));
  auto replicate = fsdp::modeled_link_stats(*pg->new_group({r % 2, r % 2 + 2}, "replicate"));
  WORKER_CHECK(shard && shard->link == "intra" && shard->collectives > 0, "shard group not on the modeled intra link");
  WORKER_CHECK(replicate && replicate->link == "inter" && replicate->collectives > 0,
               "replica group not on the modeled inter link");
  std::cout << "hybrid ok: shard group " << shard->collectives << " collectives, " << shard->modeled_busy_s
            << " s modeled busy; replica group " << replicate->collectives << " collectives, "
            << replicate->modeled_busy_s << " s modeled busy" << std::endl;
}

TEST(NetworkModel, HybridShardTrainsExactlyOnAModeledNetwork) {
  auto r = launch("modeled_hybrid_training_worker", 4, {}, 120,
                  {"FSDP_NETWORK_MODEL=intra_gbps=1,inter_gbps=0.5,ranks_per_host=2,latency_us=100"});
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "hybrid ok")) << r.report();
}

}  // namespace
}  // namespace fsdp_test
