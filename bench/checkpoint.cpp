// fsdp_bench_checkpoint: sharded checkpoint save and load throughput of the example GPT against the
// disk's own sequential bandwidth measured in the same run (dd with conv=fsync; reads after the
// page cache was emptied for the file), the time a synchronous and an asynchronous save cost the
// training loop, and the peak memory of the streamed rank-0 safetensors export against (resident
// shards + one unit + one tensor). Results: bench/results/checkpoint.md.
//
//   fsdp-run --nproc-per-node 4 ./fsdp_bench_checkpoint --dir /var/tmp/ckpt_bench --layers 8 --width 512
//
// Page cache: without root (drop_caches) the files are evicted with posix_fadvise(DONTNEED) after
// their fsync, and mincore() reports how much stayed resident (printed as "resident before read").
#include <c10/core/CPUAllocator.h>
#include <fcntl.h>
#include <fsdp/checkpoint.h>
#include <fsdp/fsdp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>
#include "counting_allocator.h"
#include "posix_files.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "model.h"

using Clock = std::chrono::steady_clock;

namespace {

using bench_files::list_dir;
using bench_files::make_dirs;
using bench_files::remove_all;
using bench_files::system_error;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Drops the file's pages from the page cache (they are clean after fsync); returns the fraction
// still resident afterwards (mincore), so the report says how well that worked.
double evict(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return 1.0;
  struct stat st {};
  ::fstat(fd, &st);
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  double resident = 0.0;
  if (st.st_size > 0) {
    void* map = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
    if (map != MAP_FAILED) {
      const long page = ::sysconf(_SC_PAGESIZE);
      std::vector<unsigned char> vec((static_cast<size_t>(st.st_size) + page - 1) / page);
      if (::mincore(map, static_cast<size_t>(st.st_size), vec.data()) == 0) {
        size_t in = 0;
        for (auto v : vec) in += v & 1;
        resident = static_cast<double>(in) / static_cast<double>(vec.size());
      }
      ::munmap(map, static_cast<size_t>(st.st_size));
    }
  }
  ::close(fd);
  return resident;
}

int64_t dir_bytes(const std::string& dir) {
  int64_t n = 0;
  for (const auto& p : list_dir(dir)) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) throw system_error("cannot stat", p);
    n += static_cast<int64_t>(st.st_size);
  }
  return n;
}

// Runs a shell command, returns its wall time in seconds (throws if it fails).
double timed_shell(const std::string& command) {
  const auto start = Clock::now();
  if (std::system(command.c_str()) != 0) throw std::runtime_error("failed: " + command);
  return seconds_since(start);
}

int64_t status_kib(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(std::string(key).size()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Sharded checkpoint save / load throughput and export memory", "fsdp_bench_checkpoint"};
  std::string dir = "/var/tmp/fsdp_ckpt_bench";
  int layers = 8, width = 512, heads = 8, context = 64, batch = 4, steps = 4, reps = 3, cadence = 100;
  app.add_option("--dir", dir, "Scratch directory on the disk to measure")->capture_default_str();
  app.add_option("--layers", layers)->capture_default_str();
  app.add_option("--width", width)->capture_default_str();
  app.add_option("--heads", heads)->capture_default_str();
  app.add_option("--context", context)->capture_default_str();
  app.add_option("--batch-per-rank", batch)->capture_default_str();
  app.add_option("--steps", steps, "Timed training steps (after one warm-up)")->capture_default_str();
  app.add_option("--reps", reps, "Saves and loads timed")->capture_default_str();
  app.add_option("--cadence", cadence, "Steps between saves, for the fraction of training time lost")
      ->capture_default_str();
  bool export_only = false;
  app.add_flag("--export-only", export_only, "Measure the export's memory only (no training, saves or loads)");
  CLI11_PARSE(app, argc, argv);

  // Counts every CPU tensor byte (installed before any tensor exists): the export's transient
  // memory is measured as the growth of live tensor bytes, whatever holds them.
  auto* counting = new fsdp_bench::CountingAllocator(c10::GetCPUAllocator());
  c10::SetCPUAllocator(counting, /*priority=*/100);
  auto pg = fsdp::ProcessGroup::from_env();
  const int rank = pg->rank(), world = pg->size();
  auto barrier = [&] {
    pg->world()->barrier();
  };
  torch::manual_seed(1);
  gpt::GPTConfig config;
  config.layers = layers, config.width = width, config.heads = heads, config.context = context;
  gpt::GPT model(nullptr);
  {
    fsdp::DeferredInit deferred;
    model = gpt::GPT(config);
  }
  const int64_t parameter_count = gpt::count_parameters(*model);
  auto sharded = fsdp::fully_shard(
      model, pg,
      fsdp::Options()
          .auto_wrap_policy(fsdp::wrap::by_type<gpt::BlockImpl>())
          .param_init_fn([&](const std::string& name, torch::nn::Module& m) { gpt::initialize(config, name, m); }));
  torch::optim::AdamW optimizer(sharded->parameters(), torch::optim::AdamWOptions(1e-4));

  // Training steps: the time a save is compared with.
  auto train_step = [&](int s) {
    auto gen = at::detail::createCPUGenerator(100 + s);
    auto tokens = torch::randint(0, 256, {batch, context + 1}, gen);
    optimizer.zero_grad();
    auto logits = model->forward(tokens.narrow(1, 0, context));
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                     tokens.narrow(1, 1, context).reshape({-1}));
    loss.backward();
    optimizer.step();
    return loss.item<double>();
  };
  double step_s = 0, dd_write_s = 0, dd_read_s = 0, dd_resident = 0, resident_before_load = 0;
  std::vector<double> save_s, load_s, async_pause_s, async_lost_s;
  int64_t ckpt_bytes = 0, dd_mib = 0;
  int overlap_steps = 0;
  auto start = Clock::now();
  if (rank == 0) make_dirs(dir);
  barrier();
  if (!export_only) {
    train_step(0);
    barrier();
    start = Clock::now();
    for (int s = 1; s <= steps; ++s) train_step(s);
    barrier();
    step_s = seconds_since(start) / steps;

    // Saves.
    for (int r = 0; r < reps; ++r) {
      const std::string d = dir + "/save" + std::to_string(r);
      if (rank == 0) remove_all(d);
      barrier();
      start = Clock::now();
      fsdp::checkpoint::save(d, *sharded, optimizer, {{"step", std::to_string(r)}});
      save_s.push_back(seconds_since(start));
      if (rank == 0) ckpt_bytes = dir_bytes(d);
    }
    // Asynchronous saves: the loop's pause in async_save, then enough steps to cover the background
    // write (the same count on every rank: training's collectives stay in step), then wait(). The
    // time lost is everything beyond the same steps run without a save just before.
    overlap_steps =
        std::max(2, static_cast<int>(std::ceil(2 * *std::max_element(save_s.begin(), save_s.end()) / step_s)) + 1);
    {  // Computed from this rank's timings: every rank takes the largest, or their steps would diverge.
      at::Tensor mine = torch::tensor({static_cast<double>(overlap_steps)}, torch::kDouble);
      at::Tensor all = torch::zeros({world}, torch::kDouble);
      pg->world()->all_gather_into(all, mine)->wait();
      overlap_steps = static_cast<int>(all.max().item<double>());
    }
    for (int r = 0; r < reps; ++r) {
      const std::string d = dir + "/async" + std::to_string(r);
      if (rank == 0) remove_all(d);
      barrier();
      start = Clock::now();  // the same steps without a save, just before: the baseline
      for (int s = 0; s < overlap_steps; ++s) train_step(1 + s);
      barrier();
      const double baseline_s = seconds_since(start);
      start = Clock::now();
      auto handle = fsdp::checkpoint::async_save(d, *sharded, optimizer, {{"step", std::to_string(r)}});
      async_pause_s.push_back(seconds_since(start));
      for (int s = 0; s < overlap_steps; ++s) train_step(1 + s);
      handle.wait();
      barrier();
      async_lost_s.push_back(seconds_since(start) - baseline_s);
      if (rank == 0) remove_all(d);
    }
    // Loads, each after the checkpoint's files were evicted from the page cache.
    for (int r = 0; r < reps; ++r) {
      const std::string d = dir + "/save" + std::to_string(r);
      if (rank == 0)
        for (const auto& p : list_dir(d)) resident_before_load = std::max(resident_before_load, evict(p));
      barrier();
      start = Clock::now();
      fsdp::checkpoint::load(d, *sharded, optimizer);
      load_s.push_back(seconds_since(start));
    }
    barrier();

    // The disk's own sequential bandwidth, one dd stream of the checkpoint's size (rank 0; the
    // others wait).
    dd_mib = std::max<int64_t>(64, ckpt_bytes >> 20);
    if (rank == 0) {
      const std::string f = dir + "/dd.bin";
      dd_write_s =
          timed_shell("dd if=/dev/zero of=" + f + " bs=1M count=" + std::to_string(dd_mib) + " conv=fsync status=none");
      dd_resident = evict(f);
      dd_read_s = timed_shell("dd if=" + f + " of=/dev/null bs=1M status=none");
      if (::unlink(f.c_str()) != 0 && errno != ENOENT) throw system_error("cannot remove", f);
    }
    barrier();
  }

  // Export memory: the streamed rank-0 export against shards + one unit + one tensor.
  sharded->release_cached_memory();
  sharded->reset_peak_memory_stats();
  { std::ofstream("/proc/self/clear_refs") << "5"; }  // resets VmHWM to the current RSS
  const int64_t rss_before = status_kib("VmRSS:") * 1024;
  counting->reset_peak();
  const int64_t live_before = counting->live();
  start = Clock::now();
  fsdp::checkpoint::export_full(dir + "/model.safetensors", *sharded);
  const double export_s = seconds_since(start);
  const int64_t live_growth = counting->peak() - live_before;
  const auto after = sharded->memory_stats();
  const int64_t hwm = status_kib("VmHWM:") * 1024;
  int64_t shard_bytes = 0, largest_unit = 0, largest_tensor = 0;
  for (const auto& u : sharded->units()) {
    shard_bytes += u.shard_bytes;
    largest_unit = std::max(largest_unit, u.padded_bytes);
  }
  for (const auto& p : model->named_parameters())
    largest_tensor = std::max<int64_t>(largest_tensor, p.value().nbytes());
  const int64_t bound = shard_bytes + largest_unit + largest_tensor;
  const bool within = live_growth <= largest_unit + largest_tensor && after.param_peak_bytes <= bound;
  std::ostringstream export_line;
  {
    const double mib = 1024.0 * 1024.0;
    export_line << std::fixed << std::setprecision(3) << "export_full: " << export_s
                << " s; rank 0 live tensor bytes at peak exceeded those before by " << live_growth / mib
                << " MiB (bound: largest unit " << largest_unit / mib << " + largest tensor " << largest_tensor / mib
                << " = " << (largest_unit + largest_tensor) / mib << " MiB) over " << live_before / mib
                << " MiB live before (shards " << shard_bytes / mib << " MiB, the rest optimizer state); FSDP "
                << "parameter peak " << after.param_peak_bytes / mib << " MiB (bound " << bound / mib
                << " MiB); RSS growth " << (hwm - rss_before) / mib << " MiB: " << (within ? "within" : "OVER")
                << " the bound\n";
  }

  if (rank == 0 && export_only) {
    std::cout << std::fixed << std::setprecision(3) << "model: " << parameter_count << " parameters (" << layers
              << " layers, width " << width << "), world " << world << ", FULL_SHARD, per-block units\n"
              << export_line.str();
    nlohmann::json j{{"parameters", parameter_count},
                     {"world", world},
                     {"export_s", export_s},
                     {"export_param_peak_bytes", after.param_peak_bytes},
                     {"export_bound_bytes", bound},
                     {"export_rss_growth_bytes", hwm - rss_before},
                     {"export_one_unit_one_tensor_bytes", largest_unit + largest_tensor}};
    std::cout << "json: " << j.dump() << "\n";
    remove_all(dir);
  }
  if (rank == 0 && !export_only) {
    auto mean = [](const std::vector<double>& v) {
      double s = 0;
      for (double x : v) s += x;
      return s / v.size();
    };
    auto best = [](const std::vector<double>& v) {
      return *std::min_element(v.begin(), v.end());
    };
    const double mib = 1024.0 * 1024.0;
    const double dd_w = dd_mib / dd_write_s, dd_r = dd_mib / dd_read_s;
    const double save_bw = ckpt_bytes / mib / mean(save_s), load_bw = ckpt_bytes / mib / mean(load_s);
    std::cout << std::fixed << std::setprecision(3);
    std::cout << "model: " << parameter_count << " parameters (" << layers << " layers, width " << width << "), world "
              << world << ", FULL_SHARD, per-block units, AdamW\n"
              << "checkpoint: " << ckpt_bytes / mib << " MiB (" << world << " data files + manifest)\n"
              << "step: " << step_s << " s (mean of " << steps << ")\n"
              << "save: " << mean(save_s) << " s mean, " << best(save_s) << " s best of " << reps << " -> " << save_bw
              << " MiB/s = " << save_bw / dd_w << " x dd write (" << dd_w << " MiB/s, conv=fsync, " << dd_mib
              << " MiB)\n"
              << "load: " << mean(load_s) << " s mean, " << best(load_s) << " s best of " << reps << " -> " << load_bw
              << " MiB/s = " << load_bw / dd_r << " x dd read (" << dd_r << " MiB/s); resident before "
              << "read: checkpoint files <= " << 100 * resident_before_load << "%, dd file " << 100 * dd_resident
              << "%\n"
              << "synchronous save every " << cadence << " steps: " << 100.0 * mean(save_s) / (cadence * step_s)
              << "% of training time (" << mean(save_s) / step_s << " steps per save)\n"
              << "asynchronous save: training paused " << mean(async_pause_s) << " s mean in async_save; time lost "
              << "over the call and " << overlap_steps << " steps to wait() " << mean(async_lost_s)
              << " s mean = " << 100.0 * mean(async_lost_s) / step_s << "% of a step; every " << cadence
              << " steps: " << 100.0 * mean(async_lost_s) / (cadence * step_s) << "% of training time\n"
              << export_line.str();
    nlohmann::json j{{"parameters", parameter_count},
                     {"world", world},
                     {"checkpoint_bytes", ckpt_bytes},
                     {"step_s", step_s},
                     {"save_s", save_s},
                     {"load_s", load_s},
                     {"async_pause_s", async_pause_s},
                     {"async_lost_s", async_lost_s},
                     {"async_overlap_steps", overlap_steps},
                     {"dd_write_mib_s", dd_w},
                     {"dd_read_mib_s", dd_r},
                     {"save_fraction_of_dd", save_bw / dd_w},
                     {"load_fraction_of_dd", load_bw / dd_r},
                     {"resident_before_load", resident_before_load},
                     {"export_s", export_s},
                     {"export_param_peak_bytes", after.param_peak_bytes},
                     {"export_bound_bytes", bound},
                     {"export_rss_growth_bytes", hwm - rss_before},
                     {"export_live_growth_bytes", live_growth}};
    std::cout << "json: " << j.dump() << "\n";
    remove_all(dir);
  }
  barrier();
  return within ? 0 : 3;
}
