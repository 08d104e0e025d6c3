// Checkpoints: resume is bit-exact for every strategy; a checkpoint loads at other world sizes,
// strategies and wrap policies with the same model and optimizer state; bad input gives errors
// that name the problem; ranks killed during a save never leave a checkpoint that looks complete;
// the loader survives mutated manifests.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <limits>
#include <random>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "checkpoint/data_file.h"
#include "checkpoint/file_io.h"
#include "checkpoint/manifest.h"
#include "checkpoint/optimizer_state.h"
#include "fsdp/checkpoint.h"
#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

namespace ckpt = fsdp::checkpoint;

// "key=value" arguments by key (a bare "key" maps to "").
std::map<std::string, std::string> parse_args(const std::vector<std::string>& args) {
  std::map<std::string, std::string> out;
  for (const auto& a : args) {
    const auto eq = a.find('=');
    out[a.substr(0, eq)] = eq == std::string::npos ? "" : a.substr(eq + 1);
  }
  return out;
}

std::string arg(const std::map<std::string, std::string>& a, const std::string& key, const std::string& fallback = "") {
  auto it = a.find(key);
  return it == a.end() ? fallback : it->second;
}

// The models: "gpt" (tied embedding and head, a frozen table, 4 blocks), "gpt_wide" (same
// structure, other widths), "mlp".
std::shared_ptr<torch::nn::Module> checkpoint_model(const std::string& model, at::ScalarType dtype) {
  torch::manual_seed(11);
  std::shared_ptr<torch::nn::Module> m;
  if (model == "mlp")
    m = MLP(16, 32, 8, 3).ptr();
  else if (model == "big_mlp")
    m = MLP(64, 512, 64, 4).ptr();
  else if (model == "gpt_wide")
    m = TinyTransformer(32, 24, 2, 4, 8).ptr();
  else
    m = TinyTransformer(32, 16, 2, 4, 8).ptr();
  m->to(dtype);
  return m;
}

fsdp::Options make_options(const std::string& strategy, const std::string& wrap) {
  auto o = fsdp::Options().sharding_strategy(fsdp::parse_sharding_strategy(strategy));
  if (strategy == "HYBRID_SHARD") o.sharding_factor(2);
  if (wrap == "block") o.auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>());
  if (wrap == "linear") o.auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>());
  return o;
}

std::unique_ptr<torch::optim::Optimizer> checkpoint_optimizer(const std::string& name,
                                                              const std::vector<at::Tensor>& params) {
  if (name == "sgd")
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01));
  if (name == "adam")
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01).weight_decay(0.01));
  if (name == "rmsprop")
    return std::make_unique<torch::optim::RMSprop>(params,
                                                   torch::optim::RMSpropOptions(0.01).momentum(0.5).centered(true));
  if (name == "adagrad")
    return std::make_unique<torch::optim::Adagrad>(
        params, torch::optim::AdagradOptions(0.05).lr_decay(0.01).initial_accumulator_value(0.1));
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
}

// An optimizer whose state checkpoints do not know.
struct UnknownOptimizer : torch::optim::Optimizer {
  explicit UnknownOptimizer(const std::vector<at::Tensor>& params)
      : Optimizer({torch::optim::OptimizerParamGroup(params)}, std::make_unique<torch::optim::SGDOptions>(0.01)) {}
  at::Tensor step(LossClosure) override { return {}; }
};

constexpr int kGlobalRows = 12;  // divisible by every world size used here

at::Tensor step_loss(const std::string& model, torch::nn::Module& m, int step, int rank, int world,
                     at::ScalarType dtype) {
  auto gen = at::detail::createCPUGenerator(500 + step);
  const int rows = kGlobalRows / world;
  if (model == "mlp" || model == "big_mlp") {
    const int64_t in = model == "mlp" ? 16 : 64, out = model == "mlp" ? 8 : 64;
    auto x = at::randn({kGlobalRows, in}, gen).to(dtype).narrow(0, rank * rows, rows);
    auto y = at::randn({kGlobalRows, out}, gen).to(dtype).narrow(0, rank * rows, rows);
    return torch::mse_loss(m.as<MLPImpl>()->forward(x), y);
  }
  auto x = at::randint(0, 32, {kGlobalRows, 8}, gen).narrow(0, rank * rows, rows);
  auto y = at::randint(0, 32, {kGlobalRows, 8}, gen).narrow(0, rank * rows, rows);
  auto logits = m.as<TinyTransformerImpl>()->forward(x);
  return lm_loss(logits, y);
}

std::string hex_double(double v) {
  std::ostringstream o;
  o << std::hexfloat << v;
  return o.str();
}

// Trains steps [first, first + steps) of one schedule and prints "loss <step> <hexfloat>" (rank 0).
// args: model= strategy= wrap= optim= dtype= load= resave= first= steps= save= export=
FSDP_WORKER(ckpt_train) {
  const auto a = parse_args(ctx.args);
  const std::string model_name = arg(a, "model", "gpt"), optim = arg(a, "optim", "adamw");
  const auto dtype = arg(a, "dtype", "f32") == "f64" ? at::kDouble : at::kFloat;
  auto pg = fsdp::ProcessGroup::from_env();
  auto model = checkpoint_model(model_name, dtype);
  auto sharded = fsdp::fully_shard(model, pg, make_options(arg(a, "strategy", "FULL_SHARD"), arg(a, "wrap", "block")));
  auto opt = checkpoint_optimizer(optim, sharded->parameters());
  const int first = std::stoi(arg(a, "first", "0")), steps = std::stoi(arg(a, "steps", "0"));
  if (!arg(a, "load").empty()) {
    ckpt::Extra extra;
    ckpt::load(arg(a, "load"), *sharded, *opt, &extra);
    WORKER_CHECK(extra["step"] == std::to_string(first), "extra step ", extra["step"], " != first ", first);
    WORKER_CHECK(extra["bytes"] == std::string("\0\x01\xff", 3), "binary extra value did not survive");
  }
  if (!arg(a, "resave").empty()) ckpt::save(arg(a, "resave"), *sharded, *opt, {{"step", std::to_string(first)}});
  for (int step = first; step < first + steps; ++step) {
    opt->zero_grad();
    auto loss = step_loss(model_name, *model, step, ctx.rank, ctx.world, dtype);
    loss.backward();
    opt->step();
    at::Tensor mean = loss.detach().to(at::kDouble).reshape({1});
    pg->world()->all_reduce(mean)->wait();
    if (ctx.rank == 0) std::cout << "loss " << step << " " << hex_double(mean.item<double>() / ctx.world) << std::endl;
  }
  const std::string extra_step = std::to_string(first + steps);
  if (!arg(a, "save").empty())
    ckpt::save(arg(a, "save"), *sharded, *opt, {{"step", extra_step}, {"bytes", std::string("\0\x01\xff", 3)}});
  if (!arg(a, "export").empty()) ckpt::export_full(arg(a, "export"), *sharded);
}

// step -> loss (hex) from rank 0's output.
std::map<int, std::string> losses(const LaunchResult& r) {
  std::map<int, std::string> out;
  std::istringstream in(r.ranks.at(0).output);
  std::string word;
  while (in >> word)
    if (word == "loss") {
      int step;
      std::string value;
      in >> step >> value;
      out[step] = value;
    }
  return out;
}

// Everything a checkpoint holds, by logical name, independent of the layout it was saved at:
// "param:<name>" and "state:<name>:<tensor>" as the flattened tensor's bytes, "step:<name>",
// "buffer:<name>", "optimizer", "extra:<key>". Reading it verifies every chunk checksum read.
std::map<std::string, std::string> logical_contents(const std::string& dir) {
  using namespace fsdp::checkpoint::detail;
  const std::string mpath = dir + "/manifest.json";
  std::ifstream in(mpath);
  std::stringstream ss;
  ss << in.rdbuf();
  const Manifest m = parse_manifest(ss.str(), mpath);
  std::vector<std::unique_ptr<DataReader>> readers;
  for (const auto& f : m.files) readers.push_back(std::make_unique<DataReader>(dir + "/" + f.name, f, m.chunk_bytes));
  std::map<std::string, std::string> out;
  auto assemble = [&](const TensorEntry& t, const std::string& state) {
    const int64_t es = dtype_size(t.dtype);
    std::string bytes(static_cast<size_t>(t.numel * es), '\0');
    for (const auto& p : t.pieces) {
      const uint64_t off = state.empty() ? p.offset : p.state.at(state);
      readers[p.file]->read({{off, static_cast<uint64_t>((p.end - p.begin) * es), bytes.data() + p.begin * es}});
    }
    return bytes;
  };
  for (const auto& t : m.parameters) {
    out["param:" + t.name] = assemble(t, "");
    if (!t.pieces.empty() && t.pieces[0].has_state) {
      out["step:" + t.name] = std::to_string(t.pieces[0].step);
      for (const auto& kv : t.pieces[0].state) out["state:" + t.name + ":" + kv.first] = assemble(t, kv.first);
    }
  }
  for (const auto& b : m.buffers) out["buffer:" + b.name] = assemble(b, "");
  std::string groups = m.optimizer_kind;
  for (const auto& g : m.optimizer_groups) groups += g.dump();
  out["optimizer"] = groups;
  return out;
}

// Largest relative difference between two logical contents of float64 checkpoints (per tensor:
// max |a - b| / max |b|); also fails on differing keys or non-tensor entries.
double max_rel_diff(const std::map<std::string, std::string>& a, const std::map<std::string, std::string>& b,
                    std::string* worst) {
  EXPECT_EQ(a.size(), b.size());
  double worst_d = 0;
  for (const auto& [key, va] : a) {
    auto it = b.find(key);
    if (it == b.end()) {
      ADD_FAILURE() << "missing " << key;
      continue;
    }
    if (key.rfind("param:", 0) != 0 && key.rfind("state:", 0) != 0) {
      EXPECT_EQ(va, it->second) << key;
      continue;
    }
    const auto* x = reinterpret_cast<const double*>(va.data());
    const auto* y = reinterpret_cast<const double*>(it->second.data());
    const size_t n = va.size() / sizeof(double);
    EXPECT_EQ(va.size(), it->second.size()) << key;
    double diff = 0, scale = 0;
    for (size_t i = 0; i < n; ++i)
      diff = std::max(diff, std::abs(x[i] - y[i])), scale = std::max(scale, std::abs(y[i]));
    const double d = scale == 0 ? diff : diff / scale;
    if (d > worst_d) worst_d = d, *worst = key;
  }
  return worst_d;
}

// --- Resume is bit-exact -----------------------------------------------------------------------

struct ResumeCase {
  std::string strategy, optim;
  int world;
};

void PrintTo(const ResumeCase& c, std::ostream* os) { *os << c.strategy << " " << c.optim << " world " << c.world; }

class ResumeTest : public ::testing::TestWithParam<ResumeCase> {};

TEST_P(ResumeTest, TrainingTwoNStepsEqualsNStepsSaveRestartLoadNSteps) {
  const auto c = GetParam();
  const int N = 3;
  TempDir tmp;
  const std::vector<std::string> common{"model=gpt", "strategy=" + c.strategy, "wrap=block", "optim=" + c.optim};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), common.begin(), common.end());
    return extra;
  };
  auto whole =
      launch("ckpt_train", c.world, with({"first=0", "steps=" + std::to_string(2 * N), "save=" + (tmp / "whole")}));
  ASSERT_TRUE(whole.all_ok()) << whole.report();
  auto part1 = launch("ckpt_train", c.world, with({"first=0", "steps=" + std::to_string(N), "save=" + (tmp / "mid")}));
  ASSERT_TRUE(part1.all_ok()) << part1.report();
  ASSERT_TRUE(ckpt::is_complete(tmp / "mid"));
  auto part2 = launch("ckpt_train", c.world,
                      with({"load=" + (tmp / "mid"), "first=" + std::to_string(N), "steps=" + std::to_string(N),
                            "save=" + (tmp / "resumed")}));
  ASSERT_TRUE(part2.all_ok()) << part2.report();

  auto expected = losses(whole), got = losses(part1);
  for (const auto& kv : losses(part2)) got[kv.first] = kv.second;
  ASSERT_EQ(expected.size(), size_t(2 * N)) << whole.report();
  EXPECT_EQ(expected, got) << "losses of the resumed run differ";
  // Every parameter, optimizer state tensor and step count, bit for bit.
  const auto a = logical_contents(tmp / "whole"), b = logical_contents(tmp / "resumed");
  EXPECT_GT(a.size(), 10u);
  EXPECT_TRUE(a.count("state:tok.weight:exp_avg") || a.count("state:tok.weight:momentum_buffer") ||
              a.count("state:tok.weight:sum"));
  for (const auto& [key, value] : a) {
    auto it = b.find(key);
    ASSERT_NE(it, b.end()) << key;
    EXPECT_TRUE(value == it->second) << key << " differs after resuming";
  }
  EXPECT_EQ(a.size(), b.size());
}

INSTANTIATE_TEST_SUITE_P(Strategies, ResumeTest,
                         ::testing::Values(ResumeCase{"FULL_SHARD", "adamw", 2}, ResumeCase{"FULL_SHARD", "sgd", 3},
                                           ResumeCase{"SHARD_GRAD_OP", "adam", 2},
                                           ResumeCase{"HYBRID_SHARD", "adamw", 4}, ResumeCase{"NO_SHARD", "adamw", 2},
                                           ResumeCase{"FULL_SHARD", "adagrad", 3},
                                           ResumeCase{"SHARD_GRAD_OP", "rmsprop", 2}),
                         [](const auto& info) { return info.param.strategy + "_" + info.param.optim; });

// --- Resharding ---------------------------------------------------------------------------------

TEST(CheckpointReshard, SavedAtWorld4LoadsAtWorlds3And2And1WithOtherStrategiesAndUnits) {
  TempDir tmp;
  const std::vector<std::string> f64{"model=gpt", "optim=adamw", "dtype=f64"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), f64.begin(), f64.end());
    return extra;
  };
  auto saved = launch("ckpt_train", 4,
                      with({"strategy=FULL_SHARD", "wrap=block", "first=0", "steps=3", "save=" + (tmp / "w4")}));
  ASSERT_TRUE(saved.all_ok()) << saved.report();
  auto ref = launch("ckpt_train", 4,
                    with({"strategy=FULL_SHARD", "wrap=block", "load=" + (tmp / "w4"), "first=3", "steps=3",
                          "save=" + (tmp / "ref")}));
  ASSERT_TRUE(ref.all_ok()) << ref.report();
  const auto saved_contents = logical_contents(tmp / "w4");
  const auto ref_contents = logical_contents(tmp / "ref");
  const auto ref_losses = losses(ref);
  ASSERT_EQ(ref_losses.size(), 3u);

  struct Layout {
    int world;
    std::string strategy, wrap;
  };
  for (const Layout& l : {Layout{3, "FULL_SHARD", "block"}, Layout{2, "SHARD_GRAD_OP", "none"},
                          Layout{1, "FULL_SHARD", "none"}, Layout{4, "HYBRID_SHARD", "none"}}) {
    SCOPED_TRACE("world " + std::to_string(l.world) + " " + l.strategy + " wrap " + l.wrap);
    const std::string tag = std::to_string(l.world) + l.strategy;
    auto r = launch("ckpt_train", l.world,
                    with({"strategy=" + l.strategy, "wrap=" + l.wrap, "load=" + (tmp / "w4"),
                          "resave=" + (tmp / ("re" + tag)), "first=3", "steps=3", "save=" + (tmp / ("end" + tag))}));
    ASSERT_TRUE(r.all_ok()) << r.report();
    // What was loaded, saved again at this layout, is what was saved at world 4, bit for bit.
    const auto reloaded = logical_contents(tmp / ("re" + tag));
    ASSERT_EQ(reloaded.size(), saved_contents.size());
    for (const auto& [key, value] : saved_contents) EXPECT_TRUE(reloaded.at(key) == value) << key;
    // Continued training matches continued training at the original layout.
    const auto got = losses(r);
    ASSERT_EQ(got.size(), 3u);
    for (const auto& [step, value] : ref_losses) {
      const double x = std::strtod(got.at(step).c_str(), nullptr), y = std::strtod(value.c_str(), nullptr);
      EXPECT_LE(std::abs(x - y) / std::abs(y), 1e-12) << "step " << step << ": " << x << " vs " << y;
    }
    std::string worst;
    const double d = max_rel_diff(logical_contents(tmp / ("end" + tag)), ref_contents, &worst);
    EXPECT_LE(d, 1e-12) << "worst: " << worst;
  }
}

// --- Bad input ----------------------------------------------------------------------------------

// The size of file `path` in bytes.
uint64_t file_size(const std::string& path) { return ckpt::detail::File::open_read(path).size(); }

// Cuts file `path` to `bytes` (or extends it with zeros).
void resize_file(const std::string& path, uint64_t bytes) {
  WORKER_CHECK(truncate(path.c_str(), static_cast<off_t>(bytes)) == 0, "truncate(", path, "): ", std::strerror(errno));
}

// A new file `to` (fails if it exists) with the bytes of file `from`.
void copy_file(const std::string& from, const std::string& to) {
  const std::string bytes = ckpt::detail::read_file(from, std::numeric_limits<uint64_t>::max());
  auto file = ckpt::detail::File::create(to);
  file.write_all(bytes.data(), bytes.size());
  file.close();
}

void copy_dir(const std::string& from, const std::string& to, const std::string& skip = "") {
  ckpt::detail::make_dirs(to);
  for (const auto& name : list_dir(from))
    if (name != skip) copy_file(from + "/" + name, to + "/" + name);
}

// A new file `path` holding `text`.
void write_text(const std::string& path, const std::string& text) {
  auto file = ckpt::detail::File::create(path);
  file.write_all(text.data(), text.size());
  file.close();
}

void flip_byte(const std::string& path, uint64_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char c = 0;
  f.read(&c, 1);
  c ^= 0x20;
  f.seekp(static_cast<std::streamoff>(at));
  f.write(&c, 1);
}

// args: a directory to work in.
FSDP_WORKER(ckpt_bad_inputs) {
  const std::string dir = ctx.args.at(0);
  auto pg = fsdp::ProcessGroup::from_env();
  auto barrier = [&] {
    pg->world()->barrier();
  };
  auto model = checkpoint_model("gpt", at::kFloat);
  auto sharded = fsdp::fully_shard(model, pg, make_options("FULL_SHARD", "block"));
  auto opt = checkpoint_optimizer("adamw", sharded->parameters());
  opt->zero_grad();
  step_loss("gpt", *model, 0, ctx.rank, ctx.world, at::kFloat).backward();
  opt->step();
  const std::string good = dir + "/good";
  ckpt::save(good, *sharded, *opt, {{"step", "1"}});
  ckpt::save(dir + "/model_only", *sharded, nullptr);

  WORKER_CHECK(ckpt::read_extra(good) == (ckpt::Extra{{"step", "1"}}), "read_extra: not what save was given");
  expect_error([&] { ckpt::read_extra(dir + "/nothing"); }, "holds no complete checkpoint", "read_extra of nothing");
  expect_error([&] { ckpt::load(dir + "/nothing", *sharded, *opt); }, "does not exist", "missing directory");
  expect_error([&] { ckpt::save(good, *sharded, *opt); }, "exists", "saving over a checkpoint");
  if (ctx.rank == 0) {
    copy_dir(good, dir + "/no_manifest", "manifest.json");
    copy_dir(good, dir + "/unfinished.tmp-0123456789abcdef");
    copy_dir(good, dir + "/truncated");
    resize_file(dir + "/truncated/rank-00001.bin", file_size(dir + "/truncated/rank-00001.bin") - 8);
    copy_dir(good, dir + "/corrupted");
    flip_byte(dir + "/corrupted/rank-00001.bin", file_size(dir + "/corrupted/rank-00001.bin") / 2);
    copy_dir(good, dir + "/bad_manifest");
    flip_byte(dir + "/bad_manifest/manifest.json", file_size(dir + "/bad_manifest/manifest.json") / 2);
    copy_dir(good, dir + "/cut_manifest");
    resize_file(dir + "/cut_manifest/manifest.json", file_size(dir + "/cut_manifest/manifest.json") / 2);
    ckpt::detail::make_dirs(dir + "/empty_root/unfinished.tmp-0123456789abcdef");
    copy_dir(good, dir + "/split0/good");  // rank 0's root holds a checkpoint, rank 1's (split1) none
    ckpt::detail::make_dirs(dir + "/split1");
  }
  barrier();
  // latest() finds nothing: load("") says what that means, load_latest names the root.
  WORKER_CHECK(ckpt::latest(dir + "/empty_root").empty(), "latest() found '", ckpt::latest(dir + "/empty_root"), "'");
  expect_error([&] { ckpt::load(ckpt::latest(dir + "/empty_root"), *sharded, *opt); },
               "the checkpoint directory is \"\": checkpoint::latest(root) returns \"\" when root holds no complete",
               "load of latest() with no checkpoint");
  expect_error(
      [&] { ckpt::load_latest(dir + "/empty_root", *sharded, *opt); },
      "no complete checkpoint under '" + dir + "/empty_root' (saves that did not finish, *.tmp-*, do not count)",
      "load_latest with no checkpoint");
  expect_error([&] { ckpt::load_latest(dir + "/absent", *sharded, *opt); },
               "no complete checkpoint under '" + dir + "/absent' (the directory does not exist)",
               "load_latest of a missing directory");
  expect_error([&] { ckpt::load_latest(dir + "/split" + std::to_string(ctx.rank), *sharded, *opt); },
               "the ranks found different newest checkpoints", "load_latest where the ranks see different files");
  expect_error([&] { ckpt::load(dir + "/no_manifest", *sharded, *opt); }, "has no manifest.json", "no manifest");
  expect_error([&] { ckpt::load(dir + "/unfinished.tmp-0123456789abcdef", *sharded, *opt); }, "did not finish",
               "unfinished save");
  expect_error([&] { ckpt::load(dir + "/truncated", *sharded, *opt); }, "but the manifest says", "truncated file");
  expect_error([&] { ckpt::load(dir + "/corrupted", *sharded, *opt); }, "is corrupted", "corrupted file");
  expect_error([&] { ckpt::load(dir + "/corrupted", *sharded, *opt); }, "failed on rank 1",
               "corrupted file (agreement)");
  expect_error([&] { ckpt::load(dir + "/bad_manifest", *sharded, *opt); }, "manifest", "corrupted manifest");
  expect_error([&] { ckpt::load(dir + "/cut_manifest", *sharded, *opt); }, "not valid JSON", "truncated manifest");
  expect_error([&] { ckpt::load(dir + "/model_only", *sharded, *opt); }, "without optimizer state",
               "no optimizer state");
  auto sgd = checkpoint_optimizer("sgd", sharded->parameters());
  expect_error([&] { ckpt::load(good, *sharded, *sgd); }, "of kind 'adamw', but the optimizer given is of kind 'sgd'",
               "other optimizer kind");
  UnknownOptimizer unknown(sharded->parameters());
  expect_error([&] { ckpt::save(dir + "/unknown", *sharded, unknown); }, "AdamW", "unsupported optimizer");
  WORKER_CHECK(!path_exists(dir + "/unknown"), "a failed save left its directory");
  {
    auto other = checkpoint_model("gpt_wide", at::kFloat);
    auto other_sharded = fsdp::fully_shard(other, pg, make_options("FULL_SHARD", "block"));
    expect_error([&] { ckpt::load(good, *other_sharded, nullptr); }, "has shape", "another model's shapes");
    ckpt::export_full(dir + "/wide.safetensors", *other_sharded);
    expect_error([&] { ckpt::load_full(dir + "/wide.safetensors", *sharded); }, "has shape",
                 "load_full of another model");
  }
  {
    auto mlp = checkpoint_model("mlp", at::kFloat);
    auto mlp_sharded = fsdp::fully_shard(mlp, pg, make_options("FULL_SHARD", "none"));
    expect_error([&] { ckpt::load(good, *mlp_sharded, nullptr); }, "does not match the model", "another model");
    auto d = checkpoint_model("gpt", at::kDouble);
    auto d_sharded = fsdp::fully_shard(d, pg, make_options("FULL_SHARD", "none"));
    expect_error([&] { ckpt::load(good, *d_sharded, nullptr); }, "has dtype", "another dtype");
  }
  ckpt::export_full(dir + "/good.safetensors", *sharded);
  if (ctx.rank == 0) {
    copy_file(dir + "/good.safetensors", dir + "/cut.safetensors");
    resize_file(dir + "/cut.safetensors", 100);
  }
  barrier();
  expect_error([&] { ckpt::load_full(dir + "/none.safetensors", *sharded); }, "cannot open", "missing safetensors");
  expect_error([&] { ckpt::load_full(dir + "/cut.safetensors", *sharded); }, "safetensors file",
               "truncated safetensors");
  // overwrite(true) replaces a checkpoint, never a directory holding anything else, nor a file.
  if (ctx.rank == 0) {
    ckpt::detail::make_dirs(dir + "/sub/results");
    write_text(dir + "/sub/results/notes.txt", "keep me");
    write_text(dir + "/sub/plain", "a file");
    copy_dir(good, dir + "/sub/mixed");
    write_text(dir + "/sub/mixed/notes.txt", "keep me too");
  }
  barrier();
  const auto overwrite = ckpt::SaveOptions().overwrite(true);
  expect_error([&] { ckpt::save(dir + "/sub/results", *sharded, *opt, {}, overwrite); },
               "holds 'notes.txt' and no manifest.json, which is not part of a checkpoint", "overwriting a folder");
  expect_error([&] { ckpt::save(dir + "/sub/mixed", *sharded, *opt, {}, overwrite); },
               "holds 'notes.txt', which is not part of a checkpoint", "overwriting a checkpoint with a file added");
  expect_error([&] { ckpt::save(dir + "/sub/plain", *sharded, *opt, {}, overwrite); }, "is not a directory",
               "overwriting a file");
  WORKER_CHECK(path_exists(dir + "/sub/results/notes.txt") && path_exists(dir + "/sub/mixed/notes.txt") &&
                   ckpt::is_complete(dir + "/sub/mixed"),
               "a refused overwrite removed files");
  // Arguments that differ between ranks fail every rank before anything is written.
  expect_error(
      [&] { ckpt::save(dir + "/sub/rank" + std::to_string(ctx.rank), *sharded, *opt); },
      "the ranks name different directories (rank 0: '" + dir + "/sub/rank0', rank 1: '" + dir + "/sub/rank1')",
      "a directory per rank");
  WORKER_CHECK(!path_exists(dir + "/sub/rank" + std::to_string(ctx.rank)), "a refused save left a directory");
  torch::optim::Optimizer* some = ctx.rank == 0 ? opt.get() : nullptr;
  expect_error([&] { ckpt::save(dir + "/sub/some", *sharded, some); }, "the ranks pass different optimizers",
               "an optimizer on one rank only (save)");
  expect_error([&] { ckpt::load(good, *sharded, some); }, "the ranks pass different optimizers",
               "an optimizer on one rank only (load)");
  // A full state one rank refuses changes no rank's model; names the model lacks are refused.
  {
    const auto kept = sharded->full_state_dict();
    auto zeros = kept;
    for (auto& kv : zeros) kv.second = torch::zeros_like(kv.second);
    auto partial = zeros;
    if (ctx.rank == 1) partial.erase(partial.begin());
    expect_error([&] { sharded->load_full_state_dict(partial); }, "is missing from the state",
                 "a full state missing an entry on one rank");
    auto extra_entry = zeros;
    extra_entry["bogus"] = torch::zeros({2});
    expect_error([&] { sharded->load_full_state_dict(extra_entry); },
                 "the state holds 'bogus', which the model has neither as a parameter nor as a buffer",
                 "a full state with a name the model lacks");
    for (const auto& kv : sharded->full_state_dict())
      WORKER_CHECK(kv.second.equal(kept.at(kv.first)), "a refused load_full_state_dict changed ", kv.first);
  }
  // After all that, good files still load, on every rank, with the right values.
  const auto before = sharded->full_state_dict();
  ckpt::Extra extra;
  ckpt::load(good, *sharded, *opt, &extra);
  WORKER_CHECK(extra.at("step") == "1", "extra step");
  ckpt::load_full(dir + "/good.safetensors", *sharded);
  for (const auto& kv : sharded->full_state_dict())
    WORKER_CHECK(kv.second.equal(before.at(kv.first)), "after load_full, ", kv.first, " changed");
  // The newest save is model_only; copies of `good` carry its older time; the unfinished one is skipped.
  WORKER_CHECK(ckpt::latest(dir) == dir + "/model_only", "latest(", dir, ") is '", ckpt::latest(dir), "'");
  WORKER_CHECK(!ckpt::is_complete(dir + "/no_manifest") && !ckpt::is_complete(dir + "/truncated") &&
                   !ckpt::is_complete(dir + "/bad_manifest") && ckpt::is_complete(good),
               "is_complete");
  const std::string loaded = ckpt::load_latest(dir, *sharded, nullptr);
  WORKER_CHECK(loaded == dir + "/model_only", "load_latest(", dir, ") loaded '", loaded, "'");
  if (ctx.rank == 0) std::cout << "bad inputs ok" << std::endl;
}

TEST(CheckpointErrors, BadInputNamesTheFileAndTheProblemOnEveryRank) {
  TempDir tmp;
  auto r = launch("ckpt_bad_inputs", 2, {tmp.path});
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_NE(r.ranks[0].output.find("bad inputs ok"), std::string::npos) << r.report();
}

// --- Asynchronous save ---------------------------------------------------------------------------

// Trains `first` steps, saves synchronously to <root>/sync, then async_saves to <root>/async and at
// once changes every shard and optimizer state in place and trains `more` steps before waiting:
// the async checkpoint must hold the state at the call. args: root strategy first more
FSDP_WORKER(ckpt_async) {
  const std::string root = ctx.args.at(0), strategy = ctx.args.at(1);
  const int first = std::stoi(ctx.args.at(2)), more = std::stoi(ctx.args.at(3));
  auto pg = fsdp::ProcessGroup::from_env();
  auto model = checkpoint_model("gpt", at::kFloat);
  auto sharded = fsdp::fully_shard(model, pg, make_options(strategy, "block"));
  auto opt = checkpoint_optimizer("adamw", sharded->parameters());
  auto train = [&](int step) {
    opt->zero_grad();
    step_loss("gpt", *model, step, ctx.rank, ctx.world, at::kFloat).backward();
    opt->step();
  };
  for (int step = 0; step < first; ++step) train(step);
  const ckpt::Extra extra{{"step", std::to_string(first)}};
  ckpt::save(root + "/sync", *sharded, *opt, extra);
  ckpt::SaveHandle handle = ckpt::async_save(root + "/async", *sharded, *opt, extra);
  {
    at::NoGradGuard no_grad;
    for (auto& p : sharded->parameters()) p.add_(1.0);
    using namespace fsdp::checkpoint::detail;
    for (auto& p : sharded->parameters()) {
      PieceState st = get_piece_state(OptimizerKind::kAdamW, *opt, p);
      for (auto& kv : st.tensors) kv.second.add_(1.0);
      st.step += 5;
      set_piece_state(OptimizerKind::kAdamW, *opt, p, st);
    }
  }
  for (int step = first; step < first + more; ++step) train(step);
  handle.wait();
  WORKER_CHECK(handle.done(), "a waited handle is not done");
  handle.wait();  // a second wait is a no-op
  // The async checkpoint loads and continues like the synchronous one.
  ckpt::Extra got;
  ckpt::load(root + "/async", *sharded, *opt, &got);
  WORKER_CHECK(got.at("step") == std::to_string(first), "extra step ", got.at("step"));
  for (int step = first; step < first + 2; ++step) {
    opt->zero_grad();
    auto loss = step_loss("gpt", *model, step, ctx.rank, ctx.world, at::kFloat);
    loss.backward();
    opt->step();
    at::Tensor mean = loss.detach().to(at::kDouble).reshape({1});
    pg->world()->all_reduce(mean)->wait();
    if (ctx.rank == 0) std::cout << "loss " << step << " " << hex_double(mean.item<double>() / ctx.world) << std::endl;
  }
}

TEST(CheckpointAsync, HoldsTheStateAtTheCallWhileTrainingChangesItAndResumesExactly) {
  for (const auto& [strategy, world] :
       {std::pair<std::string, int>{"FULL_SHARD", 3}, {"HYBRID_SHARD", 4}, {"NO_SHARD", 2}}) {
    SCOPED_TRACE(strategy);
    TempDir tmp;
    auto r = launch("ckpt_async", world, {tmp.path, strategy, "3", "2"});
    ASSERT_TRUE(r.all_ok()) << r.report();
    ASSERT_TRUE(ckpt::is_complete(tmp / "async"));
    const auto sync = logical_contents(tmp / "sync"), async = logical_contents(tmp / "async");
    EXPECT_GT(sync.size(), 10u);
    EXPECT_EQ(sync.size(), async.size());
    for (const auto& [key, value] : sync) {
      auto it = async.find(key);
      ASSERT_NE(it, async.end()) << key;
      EXPECT_TRUE(value == it->second) << key << " differs between the synchronous and the asynchronous save";
    }
    // Continuing from the async checkpoint equals the uninterrupted schedule (ckpt_train).
    auto whole = launch("ckpt_train", world,
                        {"model=gpt", "strategy=" + strategy, "wrap=block", "optim=adamw", "first=0", "steps=5"});
    ASSERT_TRUE(whole.all_ok()) << whole.report();
    const auto expected = losses(whole), got = losses(r);
    ASSERT_EQ(got.size(), 2u) << r.report();
    for (const auto& [step, loss] : got) EXPECT_EQ(expected.at(step), loss) << "step " << step;
  }
}

// Rank `victim` may write only a few KiB (RLIMIT_FSIZE), so its background write fails: every
// rank's wait() throws the same error naming that rank and its file, nothing is published, and
// the next save works. args: root victim
FSDP_WORKER(ckpt_async_fails) {
  const std::string root = ctx.args.at(0);
  const int victim = std::stoi(ctx.args.at(1));
  auto pg = fsdp::ProcessGroup::from_env();
  auto model = checkpoint_model("gpt", at::kFloat);
  auto sharded = fsdp::fully_shard(model, pg, make_options("FULL_SHARD", "block"));
  auto opt = checkpoint_optimizer("adamw", sharded->parameters());
  opt->zero_grad();
  step_loss("gpt", *model, 0, ctx.rank, ctx.world, at::kFloat).backward();
  opt->step();
  struct rlimit old_limit {};
  getrlimit(RLIMIT_FSIZE, &old_limit);
  if (ctx.rank == victim) {
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit small = old_limit;
    small.rlim_cur = 4096;
    setrlimit(RLIMIT_FSIZE, &small);
  }
  ckpt::SaveHandle handle = ckpt::async_save(root + "/failed", *sharded, *opt);
  std::string error;
  try {
    handle.wait();
  } catch (const fsdp::Error& e) {
    error = e.what();
  }
  WORKER_CHECK(!error.empty(), "the failed background save did not throw");
  std::cout << "error: " << error << std::endl;
  if (ctx.rank == victim) setrlimit(RLIMIT_FSIZE, &old_limit);
  ckpt::save(root + "/after", *sharded, *opt);
}

TEST(CheckpointAsync, ABackgroundWriteFailingOnOneRankFailsEveryRanksWait) {
  TempDir tmp;
  auto r = launch("ckpt_async_fails", 3, {tmp.path, "1"});
  ASSERT_TRUE(r.all_ok()) << r.report();
  for (int rank = 0; rank < 3; ++rank) {
    const std::string& out = r.ranks.at(rank).output;
    EXPECT_NE(out.find("checkpoint::async_save('" + (tmp / "failed") + "') failed on rank 1"), std::string::npos)
        << out;
    EXPECT_NE(out.find("rank-00001.bin"), std::string::npos) << out;
  }
  EXPECT_FALSE(path_exists(tmp / "failed"));
  for (const auto& name : list_dir(tmp.path))
    EXPECT_EQ(name.find(".tmp-"), std::string::npos) << std::quoted(tmp / name) << " was left behind";
  EXPECT_TRUE(ckpt::is_complete(tmp / "after"));
}

// --- Killed saves -------------------------------------------------------------------------------

// Saves <root>/step-<k> for k = 1, 2, ... until killed (at most args[1] saves), training a step
// before every fourth, so that nearly all the time is spent saving. args[2] "async": with
// async_save, each waited for before the next (the kill lands in the background writer).
FSDP_WORKER(ckpt_save_forever) {
  const std::string root = ctx.args.at(0);
  const int most = std::stoi(ctx.args.at(1));
  const bool async = ctx.args.size() > 2 && ctx.args[2] == "async";
  auto pg = fsdp::ProcessGroup::from_env();
  auto model = checkpoint_model("big_mlp", at::kFloat);
  auto sharded = fsdp::fully_shard(model, pg, make_options("FULL_SHARD", "linear"));
  auto opt = checkpoint_optimizer("adamw", sharded->parameters());
  for (int k = 1; k <= most; ++k) {
    if (k % 4 == 1) {
      opt->zero_grad();
      step_loss("big_mlp", *model, k, ctx.rank, ctx.world, at::kFloat).backward();
      opt->step();
    }
    char name[32];
    std::snprintf(name, sizeof(name), "/step-%04d", k);
    if (async)
      ckpt::async_save(root + name, *sharded, *opt, {{"step", std::to_string(k)}}).wait();
    else
      ckpt::save(root + name, *sharded, *opt, {{"step", std::to_string(k)}});
  }
}

// args: directories; loads each at this world size and checks its extra step.
FSDP_WORKER(ckpt_load_dirs) {
  auto pg = fsdp::ProcessGroup::from_env();
  auto model = checkpoint_model("big_mlp", at::kFloat);
  auto sharded = fsdp::fully_shard(model, pg, make_options("FULL_SHARD", "none"));
  auto opt = checkpoint_optimizer("adamw", sharded->parameters());
  for (const auto& dir : ctx.args) {
    ckpt::Extra extra;
    ckpt::load(dir, *sharded, *opt, &extra);
    const std::string name = ckpt::detail::last_component(dir);
    WORKER_CHECK(std::stoi(name.substr(5)) == std::stoi(extra.at("step")), dir, ": extra step ", extra.at("step"));
  }
  if (ctx.rank == 0) std::cout << "loaded " << ctx.args.size() << std::endl;
}

TEST(CheckpointKill, KilledSavesNeverLookCompleteAndThePreviousCheckpointLoads) {
  const char* env = std::getenv("FSDP_CKPT_KILL_TRIALS");
  const int trials = env ? std::atoi(env) : 8;
  std::mt19937 rng(std::random_device{}());
  TempDir tmp;
  std::vector<std::string> latest_dirs;
  int killed_during_save = 0;
  for (int t = 0; t < trials; ++t) {
    const bool kill_all = t % 2 == 1, async = t % 4 >= 2;
    const std::string root = tmp / ("trial" + std::to_string(t));
    ckpt::detail::make_dirs(root);
    RunningRanks running = start("ckpt_save_forever", 2, {root, "400", async ? "async" : "sync"});
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (ckpt::latest(root).empty() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ASSERT_FALSE(ckpt::latest(root).empty()) << "no first checkpoint within 120 s";
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 150)(rng)));
    const int victim = std::uniform_int_distribution<int>(0, 1)(rng);
    for (int r = 0; r < 2; ++r)
      if (kill_all || r == victim) kill(running.pids[r], SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the survivor runs on into its collective
    for (int r = 0; r < 2; ++r)
      if (running.pids[r]) kill(running.pids[r], SIGKILL);
    wait_for(running, 30);

    // Every directory is either an unfinished save (*.tmp-*) or a complete, intact checkpoint.
    std::string newest;
    for (const auto& name : list_dir(root)) {
      if (name.find(".tmp-") != std::string::npos) {
        ++killed_during_save;
        continue;
      }
      const std::string path = root + "/" + name;
      ASSERT_TRUE(ckpt::is_complete(path)) << name << " looks like a checkpoint but is incomplete";
      EXPECT_NO_THROW(logical_contents(path)) << name;  // every chunk checksum
      newest = std::max(newest, path);
    }
    EXPECT_EQ(ckpt::latest(root), newest);
    latest_dirs.push_back(ckpt::latest(root));
  }
  // The newest checkpoint of every trial loads (at another world size and wrap policy).
  auto r = launch("ckpt_load_dirs", 1, latest_dirs);
  ASSERT_TRUE(r.all_ok()) << r.report();
  std::cout << trials << " trials, " << killed_during_save << " killed during a save (left a *.tmp-* directory)\n";
  // Nearly all of the workers' time is spent saving: a run where no kill landed in a save tested
  // nothing. (After a kill of one rank, rank 0 sees the failed collective and removes its *.tmp-*
  // directory itself, so mostly the kills of all ranks leave one.)
  EXPECT_GT(killed_during_save, 0);
}

// --- Python interop (driven by tests/checkpoint_interop.py) ------------------------------------

std::string hex_of(const at::Tensor& t) {
  static const char* digits = "0123456789abcdef";
  at::Tensor c = t.detach().contiguous();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  std::string out;
  for (int64_t i = 0; i < static_cast<int64_t>(c.nbytes()); ++i) out += digits[p[i] >> 4], out += digits[p[i] & 15];
  return out;
}

// args: safetensors file to write, JSON file for the reference values. Trains one step, exports,
// and writes full_state_dict() (every name, aliases included): {name: {dtype, shape, hex}}.
FSDP_WORKER(ckpt_interop_export) {
  auto pg = fsdp::ProcessGroup::from_env();
  auto model = checkpoint_model("gpt", at::kFloat);
  auto sharded = fsdp::fully_shard(model, pg, make_options("FULL_SHARD", "block"));
  auto opt = checkpoint_optimizer("adamw", sharded->parameters());
  opt->zero_grad();
  step_loss("gpt", *model, 0, ctx.rank, ctx.world, at::kFloat).backward();
  opt->step();
  ckpt::export_full(ctx.args.at(0), *sharded);
  const auto full = sharded->full_state_dict();
  if (ctx.rank != 0) return;
  nlohmann::json ref = nlohmann::json::object();
  for (const auto& [name, t] : full)
    ref[name] = {
        {"dtype", t.scalar_type() == at::kFloat ? "F32" : "other"}, {"shape", t.sizes().vec()}, {"hex", hex_of(t)}};
  std::ofstream(ctx.args.at(1)) << ref.dump();
}

// args: safetensors file written by Python, JSON of the values expected after load_full.
FSDP_WORKER(ckpt_interop_load) {
  auto pg = fsdp::ProcessGroup::from_env();
  auto model = checkpoint_model("gpt", at::kFloat);
  auto sharded = fsdp::fully_shard(model, pg, make_options("FULL_SHARD", "block"));
  ckpt::load_full(ctx.args.at(0), *sharded);
  std::ifstream in(ctx.args.at(1));
  const auto expected = nlohmann::json::parse(in);
  const auto full = sharded->full_state_dict();
  for (const auto& [name, t] : full) {
    WORKER_CHECK(expected.contains(name), "no expected value for ", name);
    WORKER_CHECK(hex_of(t) == expected[name]["hex"].get<std::string>(), name, " differs from what Python wrote");
  }
  if (ctx.rank == 0) std::cout << "python file loaded: " << full.size() << " tensors equal" << std::endl;
}

}  // namespace
}  // namespace fsdp_test
