#include "checkpointing.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fsdp/checkpoint.h>
#include <fsdp/fsdp.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "formatting.h"
#include "timing.h"

namespace fsdp_gpt {

namespace {

// A double as its 8 bytes (exact), and back.
std::string double_bytes(double v) { return std::string(reinterpret_cast<const char*>(&v), sizeof(v)); }
double double_of_bytes(const std::string& s, const std::string& what) {
  if (s.size() != sizeof(double)) throw std::runtime_error("checkpoint field " + what + " is not 8 bytes");
  double v;
  std::memcpy(&v, s.data(), sizeof(v));
  return v;
}

// The trainer's part of a checkpoint (collective: gathers every rank's loss window).
fsdp::checkpoint::Extra progress_extra(fsdp::ProcessGroup& pg, const TrainConfig& c, const Progress& p,
                                       const fsdp::GradScaler* scaler) {
  auto losses = torch::zeros({pg.size()}, torch::kDouble);
  losses[pg.rank()] = p.window_loss;
  if (pg.size() > 1) pg.world()->all_reduce(losses)->wait();  // every rank's, in rank order
  auto generator = at::detail::getDefaultCPUGenerator();
  at::Tensor rng;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    rng = generator.get_state();
  }
  fsdp::checkpoint::Extra extra{
      {"step", std::to_string(p.step)},
      {"window_steps", std::to_string(p.window_steps)},
      {"global_batch", std::to_string(c.batch.global)},
      {"window_loss", std::string(static_cast<const char*>(losses.data_ptr()), losses.nbytes())},
      {"cpu_rng_state", std::string(static_cast<const char*>(rng.data_ptr()), rng.nbytes())},
      {"seed", std::to_string(c.seed)},
      {"heads", std::to_string(c.heads)},
      {"deterministic", c.deterministic ? "1" : "0"},
      {"world_size", std::to_string(pg.size())}};
  if (scaler) {  // --mixed-precision fp16: the loss scale and its growth count continue on resume
    extra["grad_scale"] = double_bytes(scaler->get_scale());
    extra["grad_scaler_growth_tracker"] = std::to_string(scaler->growth_tracker());
  }
  return extra;
}

}  // namespace

void PendingSave::finish(const fsdp::ProcessGroup& pg) {
  if (dir.empty()) return;
  handle.wait();
  if (pg.rank() == 0) std::cout << "checkpoint: saved step " << step << " to " << dir << " (in the background)\n";
  dir.clear();
}

void save_checkpoint(fsdp::ProcessGroup& pg, const TrainConfig& c, fsdp::FullyShardedModule& sharded,
                     torch::optim::Optimizer& optimizer, const Progress& p, const fsdp::GradScaler* scaler,
                     bool background, PendingSave& pending) {
  pending.finish(pg);
  const auto start = Clock::now();
  char name[32];
  std::snprintf(name, sizeof(name), "step-%08d", p.step);
  const std::string dir = c.save_dir + "/" + name;
  const auto options = fsdp::checkpoint::SaveOptions().overwrite(true);
  if (background) {
    pending.handle = fsdp::checkpoint::async_save(dir, sharded, optimizer, progress_extra(pg, c, p, scaler), options);
    pending.dir = dir;
    pending.step = p.step;
    if (pg.rank() == 0)
      std::cout << "checkpoint: saving step " << p.step << " to " << dir << " in the background (training paused "
                << fixed(seconds_since(start), 3) << " s)\n"
                << std::flush;
    return;
  }
  fsdp::checkpoint::save(dir, sharded, optimizer, progress_extra(pg, c, p, scaler), options);
  if (pg.rank() == 0)
    std::cout << "checkpoint: saved step " << p.step << " to " << dir << " in " << fixed(seconds_since(start), 2)
              << " s\n"
              << std::flush;
}

Progress resume(fsdp::ProcessGroup& pg, const TrainConfig& c, fsdp::FullyShardedModule& sharded,
                torch::optim::Optimizer& optimizer, fsdp::GradScaler* scaler) {
  const std::string dir = fsdp::checkpoint::latest(c.save_dir);
  // Every rank must pick the same one (a shared file system): compare a hash of the path.
  const double h = static_cast<double>(std::hash<std::string>{}(dir) % 1000003);
  auto moments = torch::tensor({h, h * h}, torch::kDouble);
  if (pg.size() > 1) pg.world()->all_reduce(moments)->wait();
  if (moments[1].item<double>() * pg.size() != moments[0].item<double>() * moments[0].item<double>())
    throw std::runtime_error("ranks found different checkpoints under --save-dir " + c.save_dir +
                             "; put it on a file system every rank sees");
  Progress p;
  if (dir.empty()) {
    if (pg.rank() == 0) std::cout << "checkpoint: none complete under " << c.save_dir << "; starting at step 1\n";
    return p;
  }
  fsdp::checkpoint::Extra extra;
  fsdp::checkpoint::load(dir, sharded, optimizer, &extra);
  if (extra.at("seed") != std::to_string(c.seed))
    throw std::runtime_error(dir + " was written with --seed " + extra.at("seed") + "; resume with the same flags");
  // Flags the parameters' shapes do not show (checkpoints of older runs do not record them).
  if (extra.count("heads") != 0 && extra.at("heads") != std::to_string(c.heads))
    throw std::runtime_error(dir + " was written with --heads " + extra.at("heads") +
                             " (the same weights split into other attention heads are another model); resume with "
                             "--heads " +
                             extra.at("heads"));
  if (extra.count("deterministic") != 0 && (extra.at("deterministic") == "1") != c.deterministic)
    throw std::runtime_error(dir + " was written " + (c.deterministic ? "without" : "with") +
                             " --deterministic, which decides how the batch and the logged loss are split over "
                             "ranks; resume " +
                             (c.deterministic ? "without" : "with") + " it");
  p.step = std::stoi(extra.at("step"));
  p.window_steps = std::stoi(extra.at("window_steps"));
  const std::string& losses = extra.at("window_loss");
  std::vector<double> per_rank(losses.size() / sizeof(double));
  std::memcpy(per_rank.data(), losses.data(), per_rank.size() * sizeof(double));
  if (c.deterministic && !per_rank.empty()) {
    p.window_loss = per_rank[0];  // every rank held the same sum of global losses
  } else if (static_cast<int>(per_rank.size()) == pg.size()) {
    p.window_loss = per_rank[pg.rank()];
  } else {  // another world size: every rank holds the saved ranks' mean, so the mean over ranks is kept
    for (double l : per_rank) p.window_loss += l;
    p.window_loss /= static_cast<double>(per_rank.size());
  }
  if (extra.count("global_batch")) p.global_batch = std::stoi(extra.at("global_batch"));
  p.dir = dir;
  if (scaler && extra.count("grad_scale"))  // a checkpoint of a run without fp16 starts the scaler afresh
    scaler->load(double_of_bytes(extra.at("grad_scale"), "grad_scale"),
                 std::stoll(extra.at("grad_scaler_growth_tracker")));
  const std::string& rng = extra.at("cpu_rng_state");
  auto state = torch::empty({static_cast<int64_t>(rng.size())}, torch::kByte);
  std::memcpy(state.data_ptr(), rng.data(), rng.size());
  auto generator = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(state);
  }
  if (pg.rank() == 0)
    std::cout << "checkpoint: resumed from " << dir << " at step " << p.step << " (saved by " << extra.at("world_size")
              << (extra.at("world_size") == "1" ? " rank" : " ranks") << ", resumed on " << pg.size() << ")\n"
              << (p.step >= c.steps ? "checkpoint: step " + std::to_string(p.step) + " is at or past --steps " +
                                          std::to_string(c.steps) + ": nothing left to train (raise --steps to go on)\n"
                                    : "")
              << std::flush;
  return p;
}

void check_save_dir(const TrainConfig& c) {
  if (c.save_dir.empty()) return;
  for (size_t at = c.save_dir.find('/', 1);; at = c.save_dir.find('/', at + 1)) {
    const std::string prefix = c.save_dir.substr(0, at);
    if (!prefix.empty() && ::mkdir(prefix.c_str(), 0777) != 0 && errno != EEXIST)
      throw std::runtime_error("--save-dir " + c.save_dir + ": cannot make " + prefix + ": " + std::strerror(errno));
    if (at == std::string::npos) break;
  }
  struct stat st {};
  errno = 0;
  if (::stat(c.save_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || ::access(c.save_dir.c_str(), W_OK | X_OK) != 0)
    throw std::runtime_error("--save-dir " + c.save_dir + " is not a directory this process may write into" +
                             (errno != 0 ? std::string(" (") + std::strerror(errno) + ")" : std::string()) +
                             "; give another, or fix its permissions");
}

void export_model(const TrainConfig& config, fsdp::FullyShardedModule& sharded, bool is_main) {
  fsdp::checkpoint::export_full(config.export_file, sharded);
  if (is_main) std::cout << "exported the model to " << config.export_file << " (safetensors)\n" << std::flush;
}

}  // namespace fsdp_gpt
