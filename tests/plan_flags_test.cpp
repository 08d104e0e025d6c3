// The planner's command-line flags (include/fsdp/plan_flags.h): what PlanFlags::parse takes out of
// argv and what it refuses; plan_from_flags in a job: --plan reports on rank 0 and ends the
// program, --memory-budget chooses alike on every rank a configuration whose FSDP peaks the run
// then meets to the byte, and a budget nothing fits ends every rank with exit code 1.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/fsdp.h"
#include "fsdp/plan_flags.h"
#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// A command line as main() gets it; `left()` is what parsing leaves.
struct CommandLine {
  std::vector<std::string> strings;
  std::vector<char*> pointers;
  int argc = 0;
  explicit CommandLine(std::vector<std::string> args) : strings(std::move(args)) {
    for (std::string& s : strings) pointers.push_back(s.data());
    pointers.push_back(nullptr);
    argc = static_cast<int>(strings.size());
  }
  char** argv() { return pointers.data(); }
  std::vector<std::string> left() const { return {pointers.begin(), pointers.begin() + argc}; }
};

TEST(PlanFlags, TakesItsFlagsOutOfArgvAndLeavesTheProgramsOwn) {
  CommandLine line({"prog", "--steps", "10", "--memory-budget=2GiB", "--cluster", "a100-80g:1x8", "--plan", "-v",
                    "--memory-margin", "0.25", "--plan-file", "p.jsonl", "--", "--plan", "--cluster", "x"});
  const fsdp::PlanFlags flags = fsdp::PlanFlags::parse(line.argc, line.argv());
  EXPECT_TRUE(flags.plan());
  EXPECT_TRUE(flags.any());
  EXPECT_EQ(flags.memory_budget(), "2GiB");
  EXPECT_EQ(flags.cluster(), "a100-80g:1x8");
  EXPECT_DOUBLE_EQ(flags.memory_margin(), 0.25);
  EXPECT_EQ(flags.plan_file(), "p.jsonl");
  EXPECT_EQ(line.left(), (std::vector<std::string>{"prog", "--steps", "10", "-v", "--", "--plan", "--cluster", "x"}));
  EXPECT_EQ(line.argv()[line.argc], nullptr);

  CommandLine other({"prog", "--planet", "--cluster-size", "3", "--memory-budgets", "1"});
  const fsdp::PlanFlags none = fsdp::PlanFlags::parse(other.argc, other.argv());
  EXPECT_FALSE(none.any());
  EXPECT_DOUBLE_EQ(none.memory_margin(), 0.1);
  EXPECT_EQ(other.argc, 6);
  EXPECT_NE(fsdp::PlanFlags::help().find("--memory-budget SIZE"), std::string::npos);
}

TEST(PlanFlags, RefusesAFlagWithoutItsValueOrWithABadOne) {
  auto refused = [](std::vector<std::string> args, const std::string& needle) {
    args.insert(args.begin(), "prog");
    CommandLine line(args);
    try {
      fsdp::PlanFlags::parse(line.argc, line.argv());
      ADD_FAILURE() << args[1] << ": accepted";
    } catch (const fsdp::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused({"--memory-budget"}, "--memory-budget needs a value, e.g. --memory-budget 40GiB");
  refused({"--memory-budget="}, "--memory-budget needs a value");
  refused({"--memory-budget", "12QB"}, "--memory-budget 12QB: '12QB' is not a size");
  refused({"--memory-budget", "0GiB"}, "--memory-budget 0GiB: give the bytes each rank may use, above 0");
  refused({"--memory-margin", "-1", "--plan"}, "--memory-margin -1: give a share of the peak from 0 to 10");
  refused({"--memory-margin", "0.1x", "--plan"}, "--memory-margin 0.1x:");
  refused({"--cluster", "tpu:1x8", "--plan"}, "--cluster tpu:1x8:");
  refused({"--plan-file", "p.jsonl"}, "--plan-file p.jsonl writes the predictions of --plan or --memory-budget");
  refused({"--calibration-file", "/nonexistent/calibration.json", "--plan"},
          "--calibration-file /nonexistent/calibration.json:");
  refused({"--calibrate"}, "--calibrate times the model for --plan or --memory-budget");
  refused({"--calibrate", "--plan", "--cluster", "h100:1x8"},
          "--calibrate holds this machine's times, but --cluster h100:1x8 plans for another");
}

// Plans the tiny transformer from a command line (ctx.args), inside a DeferredInit scope, and trains
// what --memory-budget chose for three steps; prints what it decided and measured.
FSDP_WORKER(plan_flags_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  std::vector<std::string> args{"prog"};
  args.insert(args.end(), ctx.args.begin(), ctx.args.end());
  CommandLine line(args);
  const fsdp::PlanFlags flags = fsdp::PlanFlags::parse(line.argc, line.argv());
  auto make = [] {
    return TinyTransformer(50, 16, 2, 3, 8);
  };
  std::optional<fsdp::DeferredInit> deferred(std::in_place);  // plan_from_flags runs inside the scope too
  auto meta = make();
  const auto request = fsdp::PlanRequest().batch_per_rank(2).seq_len(8).activation_checkpointing({false}).wrap_policies(
      {{"block", fsdp::wrap::by_type<BlockImpl>()}, {"none", nullptr}});
  // --calibrate: a real copy's passes in both precisions, on one micro-batch of the run's size.
  auto calibrate = [&] {
    auto copy = make();
    auto x = torch::randint(50, {2, 8}, torch::kLong);
    return fsdp::calibrate(
        *copy, [&] { return lm_loss(copy->forward(x), x); }, 2 * 8,
        fsdp::CalibrateOptions().precisions({at::kFloat, at::kBFloat16}).repetitions(2).min_timed_s(0.02));
  };
  const auto left = line.left();  // the worker's own flag: no calibration function
  const bool without = std::find(left.begin(), left.end(), "--without-calibration") != left.end();
  const fsdp::PlanDecision decision =
      fsdp::plan_from_flags(flags, *pg, *meta, request, without ? fsdp::CalibrationFn() : calibrate);
  deferred.reset();
  std::cout << "decision: exit " << decision.exit << ", code " << decision.exit_code << std::endl;
  if (!decision.chosen) return;
  const fsdp::PlanEntry& chosen = *decision.chosen;
  const fsdp::Candidate& c = chosen.candidate;
  std::cout << "chose: " << c.describe() << std::endl;
  torch::manual_seed(5);
  auto model = make();
  auto sharded = fsdp::fully_shard(model, pg, c.options());
  torch::optim::SGD opt(sharded->parameters(), 0.01);
  if (c.step_in_backward) sharded->set_step_in_backward(&opt);
  for (int step = 0; step < 3; ++step) {
    sharded->reset_peak_memory_stats();
    opt.zero_grad();  // as the request assumes: LibTorch 1 zeroes in place, 2 drops them
    for (int m = 0; m < c.accumulation; ++m) {
      std::optional<fsdp::FullyShardedModule::NoSyncGuard> no_sync;
      if (c.no_sync && m + 1 < c.accumulation) no_sync.emplace(sharded->no_sync());
      if (c.replica_deferred) sharded->set_requires_all_reduce(m + 1 == c.accumulation);
      if (c.keep_unsharded) sharded->set_reshard_after_backward(m + 1 == c.accumulation);
      auto x = torch::randint(50, {c.micro_batch, 8}, torch::kLong);
      lm_loss(sharded->forward(x), x).backward();
    }
    opt.step();
  }
  const auto m = sharded->memory_stats();  // the last step's: a steady one
  WORKER_CHECK(m.param_peak_bytes == chosen.memory.params && m.grad_peak_bytes == chosen.memory.grads, c.describe(),
               ": peaks measured ", m.param_peak_bytes, " and ", m.grad_peak_bytes, ", predicted ",
               chosen.memory.params, " and ", chosen.memory.grads);
  WORKER_CHECK(chosen.fits && chosen.memory.peak * 1.1 <= fsdp::parse_bytes(flags.memory_budget()), c.describe(),
               ": predicted peak ", chosen.memory.peak, " with the margin is over the budget");
  std::cout << "peaks as predicted" << std::endl;
}

TEST(PlanFlags, ABudgetTrainsTheChosenConfigurationAtItsPredictedPeaks) {
  TempDir dir;
  const std::string file = dir.path + "/plan.jsonl";
  auto r = launch("plan_flags_worker", 3, {"--memory-budget", "4GiB", "--plan-file", file});
  ASSERT_TRUE(r.all_ok()) << r.report();
  const std::string chose = lines_starting_with("chose: ", r.ranks[0].output);
  ASSERT_FALSE(chose.empty()) << r.report();
  for (const RankResult& rank : r.ranks) {
    EXPECT_EQ(lines_starting_with("chose: ", rank.output), chose) << r.report();
    EXPECT_TRUE(contains(rank.output, "peaks as predicted")) << r.report();
  }
  const std::string configuration = chose.substr(7, chose.find('\n') - 7);
  EXPECT_TRUE(contains(r.ranks[0].output, "planned for 4.00 GiB per rank: " + configuration)) << r.report();
  EXPECT_FALSE(contains(r.ranks[1].output, "planned for")) << "only rank 0 reports\n" << r.report();
  std::ifstream in(file);
  std::string first, second;
  ASSERT_TRUE(std::getline(in, first)) << "no plan file";
  EXPECT_FALSE(std::getline(in, second)) << "the plan file holds more than the chosen configuration";
  EXPECT_TRUE(contains(first, "\"configuration\":\"" + configuration + "\"")) << first;
}

TEST(PlanFlags, PlanPrintsOnRankZeroAndEndsTheProgram) {
  TempDir dir;
  const std::string file = dir.path + "/plan.jsonl";
  auto r = launch("plan_flags_worker", 2, {"--plan", "--plan-file", file, "--cluster", "a100-80g:2x8"});
  ASSERT_TRUE(r.all_ok()) << r.report();
  for (const RankResult& rank : r.ranks) EXPECT_TRUE(contains(rank.output, "decision: exit 1, code 0")) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "Plan for A100-80GB: 2 nodes x 8 ranks")) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "best: ")) << r.report();
  EXPECT_FALSE(contains(r.ranks[1].output, "Plan for")) << r.report();
  std::ifstream in(file);
  int lines = 0;
  for (std::string l; std::getline(in, l);) lines += contains(l, "\"configuration\"") ? 1 : 0;
  EXPECT_GT(lines, 4);
  EXPECT_TRUE(contains(r.ranks[0].output, "| " + std::to_string(lines) + " | ")) << "the table and the file differ\n"
                                                                                 << r.report();
}

TEST(PlanFlags, ABudgetNothingFitsEndsEveryRankNamingTheSmallest) {
  auto r = launch("plan_flags_worker", 2, {"--memory-budget", "1KiB"});
  ASSERT_TRUE(r.all_ok()) << r.report();
  for (const RankResult& rank : r.ranks) EXPECT_TRUE(contains(rank.output, "decision: exit 1, code 1")) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "no configuration fits in 1.00 KiB per rank")) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "the smallest needs")) << r.report();
  EXPECT_FALSE(contains(r.ranks[1].output, "no configuration fits")) << r.report();
}

TEST(PlanFlags, CalibrateTimesTheModelOnEveryRankAndSavesTheTimes) {
  TempDir dir;
  const std::string saved = dir.path + "/calibration.json";
  auto r = launch("plan_flags_worker", 2, {"--memory-budget", "4GiB", "--calibrate", "--calibration-file", saved});
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_EQ(lines_starting_with("chose: ", r.ranks[0].output), lines_starting_with("chose: ", r.ranks[1].output))
      << r.report();
  const fsdp::Calibration times = fsdp::Calibration::from_file(saved);
  ASSERT_NE(times.find(at::kFloat), nullptr);
  ASSERT_NE(times.find(at::kBFloat16), nullptr);
  EXPECT_GT(times.find(at::kFloat)->forward_s, 0);
  EXPECT_GT(times.link_gbps, 0) << "the link between the ranks is timed too";
  // The saved times plan again without measuring, and the plan uses them: it says nothing of them.
  auto again = launch("plan_flags_worker", 2, {"--plan", "--calibration-file", saved});
  ASSERT_TRUE(again.all_ok()) << again.report();
  EXPECT_TRUE(contains(again.ranks[0].output, "best: ")) << again.report();
  EXPECT_FALSE(contains(again.ranks[0].output, "note: ")) << again.report();
  auto none = launch("plan_flags_worker", 2, {"--plan", "--calibrate", "--without-calibration"});
  EXPECT_FALSE(none.all_ok()) << none.report();
  EXPECT_TRUE(
      contains(none.ranks[0].output, "--calibrate: this program passes plan_from_flags no calibration function"))
      << none.report();
}

TEST(PlanFlags, AFileRankZeroCannotWriteEndsEveryRankBeforeAnyWork) {
  auto r = launch("plan_flags_worker", 2, {"--memory-budget", "4GiB", "--plan-file", "/nonexistent/plan.jsonl"});
  EXPECT_FALSE(r.all_ok()) << r.report();
  for (const RankResult& rank : r.ranks) {
    EXPECT_TRUE(contains(rank.output, "--plan-file /nonexistent/plan.jsonl: rank 0 cannot write it")) << r.report();
    EXPECT_FALSE(contains(rank.output, "chose: ")) << r.report();
  }
}

TEST(PlanFlags, TrainingPlansForTheJobsOwnRanksAndDevices) {
  auto r = launch("plan_flags_worker", 2, {"--memory-budget", "70GiB", "--cluster", "a100-80g:1x8"});
  EXPECT_FALSE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "--cluster a100-80g:1x8 has 8 ranks but the job has 2")) << r.report();
  auto d = launch("plan_flags_worker", 2, {"--memory-budget", "70GiB", "--cluster", "a100-80g:1x2"});
  EXPECT_FALSE(d.all_ok()) << d.report();
  EXPECT_TRUE(contains(d.ranks[0].output, "plans for A100-80GB devices, but this job trains on cpu")) << d.report();
}

}  // namespace
}  // namespace fsdp_test
