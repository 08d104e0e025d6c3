// Collectives benchmark in nccl-tests form (size, count, type, time, algbw, busbw, #wrong): libfsdp's
// communicator (shared memory within a host unless FSDP_TRANSPORT=tcp) against Gloo over TCP
// (loopback on one machine), launched with fsdp-run:
//
//   build/tools/fsdp-run --nproc-per-node 4 build/bench/fsdp_bench_collectives [flags]
//
// Sections (--sections):
//   memcpy          the machine's memcpy bandwidth: the physical reference for loopback transfers
//   allgather       paper Fig. 2a: all-gather into one buffer (ours, raw gloo) vs c10d's list
//                   all-gather vs uneven inputs (gloo allgatherv; c10d one broadcast per rank)
//   reduce_scatter  ours vs the raw references (Gloo's own reduce-scatter; gloo / c10d all-reduce, alone and + slice)
//   split           paper Fig. 2b: a fixed total all-gathered in collectives of varying size
//   hd_race         (only when named) Gloo's halving-doubling reduce-scatter alone, every call checked
//   model           the network model (include/fsdp/network_model.h): modeled time vs formula
//
// Every path is checked for correctness (one run, every element compared) before it is timed.
// Times are per rank, from leaving a barrier to completion; the slowest rank's time counts; the
// median over interleaved iterations (round-robin over paths) is reported: at least --iters,
// more for small sizes until a path's runs take about --min-seconds (at most --max-iters). algbw =
// bytes / time; busbw follows nccl-tests: all-gather and reduce-scatter algbw * (n-1)/n,
// all-reduce algbw * 2(n-1)/n. "vs best raw" = our busbw / the best busbw among the raw gloo and
// c10d reference paths at the same size. The program exits 1 if any #wrong > 0, except on the one
// reference path whose wrong results are Gloo's own race (Note [Gloo halving-doubling race]).
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/math.h>
#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "fsdp/fsdp.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Flags {
  std::vector<std::string> sections{"memcpy", "allgather", "reduce_scatter", "split", "model"};
  uint64_t min_bytes = 4 << 10;
  uint64_t max_bytes = 256 << 20;
  int factor = 4;
  int iters = 5;
  int warmup = 2;
  double min_seconds = 0.25;  // per path and size: more iterations for small sizes (up to max_iters)
  int max_iters = 200;
  std::vector<int64_t> uneven_shift{1, 1000000};
  uint64_t split_total = uint64_t(1) << 28;  // elements
  uint64_t split_min = uint64_t(1) << 14;    // elements per collective
  uint64_t split_max = uint64_t(1) << 28;
  int split_iters = 3;
  int split_warmup = 0;  // the correctness pass already warms every path up
  uint64_t memcpy_bytes = 256 << 20;
  std::string model;  // a network model spec; default: FSDP_NETWORK_MODEL, else kDefaultModel
  uint64_t model_min_bytes = 64 << 10;
  uint64_t model_max_bytes = 16 << 20;
  int model_factor = 16;
  bool inject_wrong = false;  // self-test of the #wrong check: corrupt one element of ours
  std::string only;           // run only the paths whose name contains this
  bool cpu_idle = false;      // print the machine's idle share of CPU time during each path's timed runs
};
constexpr const char* kDefaultModel = "gbps=0.25,latency_us=20";

// ---------------------------------------------------------------------------------------------
// Known data. All-gather inputs: rank r's element i is r * 2^20 + i mod 1000003 (exact in
// float). Reduce-scatter / all-reduce inputs: rank q's element i is (q + 1) * (i mod 1000), so
// the sum over ranks is W(W+1)/2 * (i mod 1000), exact too.

at::Tensor gather_values(int r, int64_t idx0, int64_t n) {
  return torch::arange(idx0, idx0 + n, at::kLong).remainder_(1000003).add_(int64_t(r) << 20).to(at::kFloat);
}
at::Tensor reduce_values(int64_t scale, int64_t idx0, int64_t n) {
  return torch::arange(idx0, idx0 + n, at::kLong).remainder_(1000).mul_(scale).to(at::kFloat);
}

constexpr int64_t kCheckChunk = int64_t(1) << 22;

// Elements of `actual` (1-D) that differ from gather_values(r, idx0, ...).
int64_t wrong_gathered(const at::Tensor& actual, int r, int64_t idx0) {
  int64_t wrong = 0;
  for (int64_t off = 0; off < actual.numel(); off += kCheckChunk) {
    const int64_t len = std::min(kCheckChunk, actual.numel() - off);
    wrong += actual.narrow(0, off, len).ne(gather_values(r, idx0 + off, len)).sum().item<int64_t>();
  }
  return wrong;
}
int64_t wrong_reduced(const at::Tensor& actual, int64_t scale, int64_t idx0) {
  int64_t wrong = 0;
  for (int64_t off = 0; off < actual.numel(); off += kCheckChunk) {
    const int64_t len = std::min(kCheckChunk, actual.numel() - off);
    wrong += actual.narrow(0, off, len).ne(reduce_values(scale, idx0 + off, len)).sum().item<int64_t>();
  }
  return wrong;
}

// ---------------------------------------------------------------------------------------------

// Runs jobs on one thread that does nothing else, and waits for each. Our communicator and c10d
// both run collectives on such threads; raw gloo called from the main thread (which also fills
// and checks buffers) waits a whole scheduler tick per small collective on an oversubscribed
// machine, a scheduling artifact rather than a property of gloo.
class CommThread {
 public:
  CommThread() : thread_([this] { loop(); }) {}
  ~CommThread() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void run(const std::function<void()>& job) {
    std::unique_lock<std::mutex> l(mu_);
    job_ = &job;
    error_ = nullptr;
    cv_.notify_all();
    cv_.wait(l, [&] { return job_ == nullptr; });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      cv_.wait(l, [&] { return stop_ || job_ != nullptr; });
      if (stop_) return;
      l.unlock();
      std::exception_ptr error;
      try {
        (*job_)();
      } catch (...) {
        error = std::current_exception();
      }
      l.lock();
      error_ = error;
      job_ = nullptr;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void()>* job_ = nullptr;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;
};

struct Bench {
  Flags flags;
  CommThread raw_thread;  // raw gloo collectives run here
  fsdp::ProcessGroupPtr pg;
  fsdp::CommunicatorPtr ours;
  std::shared_ptr<gloo::rendezvous::Context> raw;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> c10d;
  int rank = 0, world = 1;
  std::optional<fsdp::NetworkModel> env_model;  // FSDP_NETWORK_MODEL, read before it is cleared
  bool any_wrong = false;
  bool peer_race_seen = false;

  void barrier() {
    if (world == 1) return;
    gloo::BarrierOptions o(raw);
    gloo::barrier(o);
  }
  // Element-wise max (times) or sum (counts) over ranks, through c10d.
  void reduce(at::Tensor t, c10d::ReduceOp op) {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = op;
    c10d->allreduce(v, o)->wait();
  }
  template <typename... A>
  void print(const char* fmt, A... a) {
    if (rank == 0) std::printf(fmt, a...);
  }
  void flush() {
    if (rank == 0) std::fflush(stdout);
  }
};

// Called on b.raw_thread.
void raw_allgather(Bench& b, const at::Tensor& out, const at::Tensor& in) {
  gloo::AllgatherOptions o(b.raw);
  o.setInput(static_cast<float*>(in.data_ptr()), in.numel());
  o.setOutput(static_cast<float*>(out.data_ptr()), out.numel());
  gloo::allgather(o);
}

void raw_allreduce(Bench& b, const at::Tensor& t) {
  gloo::AllreduceOptions o(b.raw);
  o.setOutput(static_cast<float*>(t.data_ptr()), t.numel());
  using F = void (*)(void*, const void*, const void*, size_t);
  o.setReduceFunction(static_cast<F>(&gloo::sum<float>));
  gloo::allreduce(o);
}

// One path through a collective at one size.
struct Path {
  std::string name;
  bool raw_reference = false;      // counts as a raw gloo/c10d reference for "vs best raw"
  bool ours = false;               // gets a "vs best raw" figure
  double bus_factor = 1;           // busbw = algbw * bus_factor
  std::function<void()> prepare;   // untimed, before every run (e.g. restore an input used as scratch)
  std::function<void()> run;       // timed
  std::function<int64_t()> wrong;  // this rank's wrong elements after one run
  bool known_race = false;         // a peer's documented race: its #wrong is shown but does not fail the run
  // filled by measure():
  int64_t total_wrong = 0;
  double seconds = 0;
  double idle_ticks = 0, all_ticks = 0;  // machine-wide, rank 0's reading over the timed runs
};

// Idle (+ iowait) and total CPU ticks of the whole machine so far, from /proc/stat.
std::pair<double, double> cpu_ticks() {
  std::ifstream f("/proc/stat");
  std::string cpu;
  double v[8] = {0}, all = 0;
  f >> cpu;
  for (double& x : v) f >> x, all += x;
  return {v[3] + v[4], all};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Keeps only the paths --only names. Checks every path once, then time them interleaved. Sets total_wrong and seconds. Runs at least
// `iters` timed iterations, more (up to max_iters) while the slowest path's correctness run says
// they fit in min_seconds: small collectives are noisy on a shared machine.
int measure(Bench& b, std::vector<Path>& paths, int warmup, int iters, double min_seconds = 0, int max_iters = 0) {
  if (!b.flags.only.empty()) {
    std::vector<Path> kept;
    for (auto& p : paths)
      if (p.name.find(b.flags.only) != std::string::npos) kept.push_back(p);
    paths = std::move(kept);
  }
  const int P = static_cast<int>(paths.size());
  at::Tensor wrong = torch::zeros({P}, at::kLong);
  at::Tensor first = torch::zeros({1}, at::kDouble);
  for (int p = 0; p < P; ++p) {
    if (paths[p].prepare) paths[p].prepare();
    b.barrier();
    const auto t0 = Clock::now();
    paths[p].run();
    first[0] = std::max(first[0].item<double>(), seconds_since(t0));
    wrong[p] = paths[p].wrong();
  }
  b.reduce(wrong, c10d::ReduceOp::SUM);
  b.reduce(first, c10d::ReduceOp::MAX);  // every rank must run the same number of iterations
  if (min_seconds > 0 && max_iters > iters)
    iters = std::clamp(static_cast<int>(min_seconds / std::max(first[0].item<double>(), 1e-9)), iters, max_iters);
  for (int p = 0; p < P; ++p) {
    paths[p].total_wrong = wrong[p].item<int64_t>();
    if (paths[p].total_wrong && !paths[p].known_race) b.any_wrong = true;
    if (paths[p].total_wrong && paths[p].known_race) b.peer_race_seen = true;
  }
  for (int w = 0; w < warmup; ++w)
    for (auto& path : paths) {
      if (path.prepare) path.prepare();
      b.barrier();
      path.run();
    }
  at::Tensor times = torch::zeros({P, iters}, at::kDouble);
  for (int i = 0; i < iters; ++i)
    for (int p = 0; p < P; ++p) {
      if (paths[p].prepare) paths[p].prepare();
      b.barrier();
      const auto ticks0 = b.flags.cpu_idle ? cpu_ticks() : std::pair<double, double>{};
      const auto t0 = Clock::now();
      paths[p].run();
      times[p][i] = seconds_since(t0);
      if (b.flags.cpu_idle) {
        const auto ticks = cpu_ticks();
        paths[p].idle_ticks += ticks.first - ticks0.first;
        paths[p].all_ticks += ticks.second - ticks0.second;
      }
    }
  b.reduce(times, c10d::ReduceOp::MAX);  // a collective is done when its slowest rank is
  for (int p = 0; p < P; ++p) {
    std::vector<double> v(iters);
    for (int i = 0; i < iters; ++i) v[i] = times[p][i].item<double>();
    paths[p].seconds = median(v);
  }
  return iters;
}

void print_header(Bench& b, const char* iters_title, const char* extra) {
  b.print("%14s %12s %6s  %-38s %11s %8s %8s %7s %5s  %s\n", "size(B)", "count", "type", "path", "time(us)", "algbw",
          "busbw", "#wrong", iters_title, extra);
  b.print("%14s %12s %6s  %-38s %11s %8s %8s %7s\n", "", "(elements)", "", "", "(median)", "(GB/s)", "(GB/s)", "");
}

// Prints one row per path at a size of `bytes` (count elements); ours get "vs best raw".
void print_rows(Bench& b, int64_t bytes, int64_t count, const std::vector<Path>& paths, int iters) {
  double best_raw = 0;
  std::string best_name;
  for (const auto& p : paths) {
    const double bus = bytes / p.seconds / 1e9 * p.bus_factor;
    if (p.raw_reference && bus > best_raw) best_raw = bus, best_name = p.name;
  }
  for (const auto& p : paths) {
    const double alg = bytes / p.seconds / 1e9, bus = alg * p.bus_factor;
    char vs[160] = "";
    if (p.ours && best_raw > 0) std::snprintf(vs, sizeof(vs), "  %.2f of %s", bus / best_raw, best_name.c_str());
    if (b.flags.cpu_idle && p.all_ticks > 0)
      std::snprintf(vs + std::strlen(vs), sizeof(vs) - std::strlen(vs), "  [cpu idle %.0f%%]",
                    100 * p.idle_ticks / p.all_ticks);
    b.print("%14lld %12lld %6s  %-38s %11.1f %8.3f %8.3f %7lld %5d%s\n", (long long)bytes, (long long)count, "float",
            p.name.c_str(), p.seconds * 1e6, alg, bus, (long long)p.total_wrong, iters, vs);
  }
  b.flush();
}

std::vector<uint64_t> sweep(uint64_t lo, uint64_t hi, uint64_t factor) {
  std::vector<uint64_t> v;
  for (uint64_t s = lo; s <= hi; s *= factor) {
    v.push_back(s);
    if (factor <= 1) break;
  }
  return v;
}

// ---------------------------------------------------------------------------------------------

void memcpy_section(Bench& b) {
  const int64_t bytes = static_cast<int64_t>(b.flags.memcpy_bytes);
  std::vector<char> src(bytes, 1), dst(bytes, 0);  // written once: pages are touched
  auto copy_rate = [&] {
    std::vector<double> rates;
    for (int i = 0; i < 5; ++i) {
      const auto t0 = Clock::now();
      std::memcpy(dst.data(), src.data(), bytes);
      rates.push_back(bytes / seconds_since(t0) / 1e9);
    }
    return median(rates);
  };
  b.print("\n## memcpy bandwidth (physical reference; GB/s = 1e9 bytes copied per second, median of 5 copies of %lld "
          "bytes)\n",
          (long long)bytes);
  b.barrier();
  double alone = 0;
  if (b.rank == 0) alone = copy_rate();  // the other ranks wait in a (sleeping) barrier
  b.barrier();
  at::Tensor concurrent = torch::zeros({b.world}, at::kDouble);
  concurrent[b.rank] = copy_rate();
  b.reduce(concurrent, c10d::ReduceOp::SUM);
  b.print("memcpy, one rank alone:            %8.2f GB/s\n", alone);
  b.print("memcpy, all %d ranks at once:       %8.2f GB/s per rank (min), %.2f GB/s summed\n", b.world,
          concurrent.min().item<double>(), concurrent.sum().item<double>());
  b.print("(loopback TCP copies every byte at least twice - into the kernel and out of it - on the same cores)\n");
  b.flush();
}

void allgather_section(Bench& b) {
  const int W = b.world, r = b.rank;
  b.print("\n## all-gather (paper Fig. 2a): one buffer vs list vs uneven; %d ranks; iters >= %d (>= %.2f s per path, "
          "<= %d), warmup %d\n",
          W, b.flags.iters, b.flags.min_seconds, b.flags.max_iters, b.flags.warmup);
  b.print("# size = total output bytes; busbw = algbw*(n-1)/n. Uneven: +d elements on rank 0, -d on rank 1 (same "
          "total).\n");
  print_header(b, "iters", "vs best raw");
  for (uint64_t target : sweep(b.flags.min_bytes, b.flags.max_bytes, b.flags.factor)) {
    const int64_t n = std::max<int64_t>(1, static_cast<int64_t>(target / (4 * W)));  // per rank
    const int64_t total = n * W;
    at::Tensor in = gather_values(r, 0, n);
    at::Tensor out = torch::empty({total});
    auto fill_nan = [out] {
      out.fill_(std::numeric_limits<float>::quiet_NaN());
    };
    auto check_even = [&b, out, n, W] {
      int64_t wrong = 0;
      for (int q = 0; q < W; ++q) wrong += wrong_gathered(out.narrow(0, q * n, n), q, 0);
      return wrong;
    };
    const double bus = double(W - 1) / W;
    std::vector<Path> paths;
    paths.push_back({"fsdp all_gather_into (one buffer)", false, true, bus, fill_nan,
                     [&b, out, in] {
                       b.ours->all_gather_into(out, in)->wait();
                       if (b.flags.inject_wrong && b.rank == 0) out[0].add_(1);
                     },
                     check_even});
    paths.push_back({"gloo allgather (raw, one buffer)", true, false, bus, fill_nan,
                     [&b, out, in] { b.raw_thread.run([&] { raw_allgather(b, out, in); }); }, check_even});
    std::vector<at::Tensor> views;
    for (int q = 0; q < W; ++q) views.push_back(out.narrow(0, q * n, n));
    paths.push_back({"c10d allgather (list of W outputs)", true, false, bus, fill_nan,
                     [&b, views, in] {
                       std::vector<std::vector<at::Tensor>> outs{views};
                       std::vector<at::Tensor> ins{in};
                       b.c10d->allgather(outs, ins)->wait();
                     },
                     check_even});
    for (int64_t d : b.flags.uneven_shift) {
      if (W < 2 || d <= 0 || d >= n) continue;
      std::vector<int64_t> counts(W, n), offsets(W, 0);
      counts[0] += d;
      counts[1] -= d;
      for (int q = 1; q < W; ++q) offsets[q] = offsets[q - 1] + counts[q - 1];
      at::Tensor uin = gather_values(r, 0, counts[r]);
      auto check_uneven = [out, counts, offsets, W] {
        int64_t wrong = 0;
        for (int q = 0; q < W; ++q) wrong += wrong_gathered(out.narrow(0, offsets[q], counts[q]), q, 0);
        return wrong;
      };
      const std::string tag = d == 1 ? "+1" : "+" + std::to_string(d);
      paths.push_back({"gloo allgatherv (uneven " + tag + ")", false, false, bus, fill_nan,
                       [&b, out, uin, counts] {
                         b.raw_thread.run([&] {
                           gloo::AllgathervOptions o(b.raw);
                           o.setInput(static_cast<float*>(uin.data_ptr()), uin.numel());
                           o.setOutput(static_cast<float*>(out.data_ptr()),
                                       std::vector<size_t>(counts.begin(), counts.end()));
                           gloo::allgatherv(o);
                         });
                       },
                       check_uneven});
      // What PyTorch's ProcessGroup does for uneven all-gather (paper §3.2.1): one broadcast per
      // rank, each rank's input copied into its slot first.
      paths.push_back({"c10d broadcast x W (uneven " + tag + ")", false, false, bus, fill_nan,
                       [&b, out, uin, counts, offsets, r, W] {
                         out.narrow(0, offsets[r], counts[r]).copy_(uin);
                         std::vector<c10::intrusive_ptr<c10d::Work>> works;
                         for (int q = 0; q < W; ++q) {
                           std::vector<at::Tensor> t{out.narrow(0, offsets[q], counts[q])};
                           c10d::BroadcastOptions o;
                           o.rootRank = q;
                           works.push_back(b.c10d->broadcast(t, o));
                         }
                         for (auto& w : works) w->wait();
                       },
                       check_uneven});
    }
    const int iters = measure(b, paths, b.flags.warmup, b.flags.iters, b.flags.min_seconds, b.flags.max_iters);
    print_rows(b, total * 4, total, paths, iters);
  }
}

void reduce_scatter_section(Bench& b) {
  const int W = b.world, r = b.rank;
  b.print("\n## reduce-scatter vs raw references; %d ranks; iters >= %d (>= %.2f s per path, <= %d), warmup %d\n", W,
          b.flags.iters, b.flags.min_seconds, b.flags.max_iters, b.flags.warmup);
  b.print("# size = total input bytes. busbw: reduce-scatter rows algbw*(n-1)/n (the +slice rows are all-reduces\n"
          "# counted as the reduce-scatter they stand in for), all-reduce rows algbw*2(n-1)/n.\n");
  print_header(b, "iters", "vs best raw");
  const int64_t sum_scale = int64_t(W) * (W + 1) / 2;
  for (uint64_t target : sweep(b.flags.min_bytes, b.flags.max_bytes, b.flags.factor)) {
    const int64_t n = std::max<int64_t>(1, static_cast<int64_t>(target / (4 * W)));  // output per rank
    const int64_t total = n * W;
    at::Tensor pristine = reduce_values(r + 1, 0, total);
    at::Tensor in = torch::empty({total}), out = torch::empty({n});
    auto restore = [in, pristine, out] {
      in.copy_(pristine);
      out.fill_(std::numeric_limits<float>::quiet_NaN());
    };
    auto check_out = [out, sum_scale, r, n] {
      return wrong_reduced(out, sum_scale, int64_t(r) * n);
    };
    auto check_full = [in, sum_scale] {
      return wrong_reduced(in, sum_scale, 0);
    };
    const double rs_bus = double(W - 1) / W, ar_bus = 2.0 * (W - 1) / W;
    auto c10d_allreduce = [&b](const at::Tensor& t) {
      std::vector<at::Tensor> v{t};
      b.c10d->allreduce(v)->wait();
    };
    std::vector<Path> paths;
    paths.push_back({"fsdp reduce_scatter", false, true, rs_bus, restore,
                     [&b, out, in] { b.ours->reduce_scatter(out, in)->wait(); }, check_out});
    paths.push_back({"gloo allreduce + slice (raw)", true, false, rs_bus, restore,
                     [&b, out, in, r, n] {
                       b.raw_thread.run([&] { raw_allreduce(b, in); });
                       out.copy_(in.narrow(0, r * n, n));
                     },
                     check_out});
    paths.push_back({"c10d allreduce + slice", true, false, rs_bus, restore,
                     [c10d_allreduce, out, in, r, n] {
                       c10d_allreduce(in);
                       out.copy_(in.narrow(0, r * n, n));
                     },
                     check_out});
    // Gloo's own reduce-scatter (h-d: halving-doubling, bound buffers): built untimed before each run,
    // its result (left at the front of `in`) moved to `out` untimed by the check. It can return wrong
    // sums on a loaded machine (Note [Gloo halving-doubling race]), shown in #wrong without failing the run.
    auto halving_doubling = std::make_shared<std::unique_ptr<gloo::ReduceScatterHalvingDoubling<float>>>();
    paths.push_back({"gloo reduce_scatter h-d (raw)", true, false, rs_bus,
                     [&b, restore, halving_doubling, in, W, n] {
                       restore();
                       b.raw_thread.run([&] {
                         halving_doubling->reset();
                         *halving_doubling = std::make_unique<gloo::ReduceScatterHalvingDoubling<float>>(
                             b.raw, std::vector<float*>{in.data_ptr<float>()}, static_cast<int>(W * n),
                             std::vector<int>(W, static_cast<int>(n)));
                       });
                     },
                     [&b, halving_doubling] { b.raw_thread.run([&] { (*halving_doubling)->run(); }); },
                     [check_out, out, in, n] {
                       out.copy_(in.narrow(0, 0, n));  // it leaves every rank's result at the front
                       return check_out();
                     }});
    paths.back().known_race = true;
    paths.push_back({"gloo allreduce (raw) [all-reduce]", true, false, ar_bus, restore,
                     [&b, in] { b.raw_thread.run([&] { raw_allreduce(b, in); }); }, check_full});
    paths.push_back({"c10d allreduce [all-reduce]", true, false, ar_bus, restore,
                     [c10d_allreduce, in] { c10d_allreduce(in); }, check_full});
    const int iters = measure(b, paths, b.flags.warmup, b.flags.iters, b.flags.min_seconds, b.flags.max_iters);
    print_rows(b, total * 4, total, paths, iters);
  }
}

// Gloo's halving-doubling reduce-scatter alone, `--iters` calls at `--max-bytes`, each checked:
// how often it returns wrong sums (Note [Gloo halving-doubling race]). Not a failure of the run.
void hd_race_section(Bench& b) {
  const int W = b.world, r = b.rank;
  const int64_t n = std::max<int64_t>(1, static_cast<int64_t>(b.flags.max_bytes / (4 * W)));
  const int64_t scale = int64_t(W) * (W + 1) / 2;
  const at::Tensor pristine = reduce_values(r + 1, 0, n * W);
  at::Tensor in = torch::empty({n * W});
  at::Tensor wrong_calls = torch::zeros({W}, at::kLong), wrong_elements = torch::zeros({W}, at::kLong);
  for (int i = 0; i < b.flags.iters; ++i) {
    in.copy_(pristine);
    b.barrier();
    b.raw_thread.run([&] {
      gloo::ReduceScatterHalvingDoubling<float> hd(b.raw, std::vector<float*>{in.data_ptr<float>()},
                                                   static_cast<int>(W * n), std::vector<int>(W, static_cast<int>(n)));
      hd.run();
    });
    const int64_t wrong = wrong_reduced(in.narrow(0, 0, n), scale, int64_t(r) * n);
    if (wrong) wrong_calls[r] += 1, wrong_elements[r] += wrong;
  }
  b.reduce(wrong_calls, c10d::ReduceOp::SUM);
  b.reduce(wrong_elements, c10d::ReduceOp::SUM);
  b.print("\n## gloo reduce_scatter h-d (raw) alone; %d ranks; %lld bytes per rank; %d calls\n", W,
          (long long)(n * W * 4), b.flags.iters);
  for (int q = 0; q < W; ++q)
    b.print("rank %d: wrong in %lld of %d calls (%lld wrong elements)\n", q, (long long)wrong_calls[q].item<int64_t>(),
            b.flags.iters, (long long)wrong_elements[q].item<int64_t>());
}

void split_section(Bench& b) {
  const int W = b.world, r = b.rank;
  b.print("\n## fixed total, varying all-gather size (paper Fig. 2b); %d ranks; iters %d, warmup %d\n", W,
          b.flags.split_iters, b.flags.split_warmup);
  const int64_t total_target = static_cast<int64_t>(b.flags.split_total);
  b.print("# %lld float elements (%.3f GiB) of output per rank in total, gathered by collectives of `count`\n"
          "# elements each (total/count of them, issued back to back; ours asynchronously, then all waited).\n"
          "# time = per collective (total time / number of collectives); busbw = algbw*(n-1)/n.\n",
          (long long)total_target, total_target * 4.0 / (1 << 30));
  print_header(b, "iters", "collectives  total(s)  vs best raw");
  const int64_t in_total = total_target / W;
  at::Tensor in = gather_values(r, 0, in_total);
  at::Tensor out = torch::empty({in_total * W});
  for (uint64_t s : sweep(b.flags.split_min, b.flags.split_max, 2)) {
    const int64_t piece = std::max<int64_t>(1, static_cast<int64_t>(s) / W);  // per rank per collective
    const int64_t calls = in_total / piece;
    if (calls < 1) break;
    const int64_t count = piece * W;
    auto fill_nan = [out] {
      out.fill_(std::numeric_limits<float>::quiet_NaN());
    };
    auto check = [out, calls, piece, W] {
      int64_t wrong = 0;
      for (int64_t i = 0; i < calls; ++i)
        for (int q = 0; q < W; ++q) wrong += wrong_gathered(out.narrow(0, (i * W + q) * piece, piece), q, i * piece);
      return wrong;
    };
    const double bus = double(W - 1) / W;
    std::vector<Path> paths;
    paths.push_back({"fsdp all_gather_into", false, true, bus, fill_nan,
                     [&b, out, in, calls, piece, count] {
                       std::vector<fsdp::WorkPtr> works;
                       works.reserve(calls);
                       for (int64_t i = 0; i < calls; ++i)
                         works.push_back(
                             b.ours->all_gather_into(out.narrow(0, i * count, count), in.narrow(0, i * piece, piece)));
                       for (auto& w : works) w->wait();
                     },
                     check});
    paths.push_back({"gloo allgather (raw)", true, false, bus, fill_nan,
                     [&b, out, in, calls, piece, count] {
                       b.raw_thread.run([&] {
                         for (int64_t i = 0; i < calls; ++i)
                           raw_allgather(b, out.narrow(0, i * count, count), in.narrow(0, i * piece, piece));
                       });
                     },
                     check});
    measure(b, paths, b.flags.split_warmup, b.flags.split_iters);
    double best_raw = 0;
    for (auto& p : paths) best_raw = std::max(best_raw, p.raw_reference ? 1 / p.seconds : 0.0);
    for (auto& p : paths) {
      const double per_call = p.seconds / calls;
      const double alg = count * 4.0 / per_call / 1e9;
      char vs[64] = "";
      if (p.ours) std::snprintf(vs, sizeof(vs), "  %.2f", (1 / p.seconds) / best_raw);
      b.print("%14lld %12lld %6s  %-38s %11.1f %8.3f %8.3f %7lld %5d  %11lld %9.3f%s\n", (long long)(count * 4),
              (long long)count, "float", p.name.c_str(), per_call * 1e6, alg, alg * bus, (long long)p.total_wrong,
              b.flags.split_iters, (long long)calls, p.seconds, vs);
    }
    b.flush();
  }
}

void model_section(Bench& b) {
  const int W = b.world, r = b.rank;
  fsdp::NetworkModel model =
      b.env_model ? *b.env_model
                  : fsdp::NetworkModel::parse(b.flags.model.empty() ? kDefaultModel : b.flags.model, "--model");
  const char* source = b.env_model ? "FSDP_NETWORK_MODEL" : (b.flags.model.empty() ? "default" : "--model");
  if (model.ranks_per_host() == 0) model.ranks_per_host(b.pg->env().local_world_size);
  std::vector<int> ranks(W);
  for (int q = 0; q < W; ++q) ranks[q] = q;
  auto modeled = fsdp::with_network_model(b.ours, ranks, model);
  const auto link = *fsdp::modeled_link_stats(*modeled);
  b.print("\n## network model (MODELED, not measured hardware): %s [from %s]\n", model.describe().c_str(), source);
  b.print(
      "# the world group of %d ranks is on the modeled %s-host link, %g GB/s per rank. Rows: our all-gather on the\n"
      "# real loopback"
      " transport, the same through the model, and the model's formula (n-1)*latency + (n-1)/n*size/bandwidth.\n"
      "# The model is a floor: where the real transport is slower than the formula, it sets the time.\n",
      W, link.link.c_str(), link.params.bandwidth_gbps());
  print_header(b, "iters", "measured/formula");
  for (uint64_t target : sweep(b.flags.model_min_bytes, b.flags.model_max_bytes, b.flags.model_factor)) {
    const int64_t n = std::max<int64_t>(1, static_cast<int64_t>(target / (4 * W)));
    const int64_t total = n * W;
    at::Tensor in = gather_values(r, 0, n);
    at::Tensor out = torch::empty({total});
    auto fill_nan = [out] {
      out.fill_(std::numeric_limits<float>::quiet_NaN());
    };
    auto check = [out, n, W] {
      int64_t wrong = 0;
      for (int q = 0; q < W; ++q) wrong += wrong_gathered(out.narrow(0, q * n, n), q, 0);
      return wrong;
    };
    const double bus = double(W - 1) / W;
    std::vector<Path> paths;
    paths.push_back({"fsdp all_gather_into (real)", false, false, bus, fill_nan,
                     [&b, out, in] { b.ours->all_gather_into(out, in)->wait(); }, check});
    paths.push_back({"fsdp all_gather_into (MODELED)", false, false, bus, fill_nan,
                     [modeled, out, in] { modeled->all_gather_into(out, in)->wait(); }, check});
    const int iters = measure(b, paths, b.flags.warmup, b.flags.iters, b.flags.min_seconds, b.flags.max_iters);
    print_rows(b, total * 4, total, paths, iters);
    const double formula = fsdp::modeled_seconds(fsdp::Collective::kAllGather, total * 4, W, link.params);
    const double fa = total * 4 / formula / 1e9;
    b.print("%14lld %12lld %6s  %-38s %11.1f %8.3f %8.3f %7s %5s  %.3f\n", (long long)(total * 4), (long long)total,
            "float", "model formula (MODELED)", formula * 1e6, fa, fa * bus, "-", "-", paths[1].seconds / formula);
    b.flush();
  }
  const auto s = *fsdp::modeled_link_stats(*modeled);
  b.print("# modeled link on rank 0: %lld collectives, %.3f s modeled busy, %lld seen running past the model\n",
          (long long)s.collectives, s.modeled_busy_s, (long long)s.real_exceeded_model);
}

std::string read_first_line_with(const char* path, const char* key) {
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return line.substr(line.find(':') + 1);
  return "?";
}
std::string read_all(const char* path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  Bench b;
  Flags& f = b.flags;
  CLI::App app{"libfsdp collectives benchmark (nccl-tests form). Launch with fsdp-run."};
  app.add_option("--sections", f.sections, "memcpy, allgather, reduce_scatter, split, model; hd_race (not by default)")
      ->delimiter(',')
      ->check(CLI::IsMember({"memcpy", "allgather", "reduce_scatter", "split", "model", "hd_race"}))
      ->capture_default_str();
  app.add_option("-b,--min-bytes", f.min_bytes, "smallest collective, bytes (allgather, reduce_scatter)")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("-e,--max-bytes", f.max_bytes, "largest collective, bytes")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("-f,--factor", f.factor, "size multiplier between rows")
      ->check(CLI::Range(2, 1 << 20))
      ->capture_default_str();
  app.add_option("-n,--iters", f.iters, "timed iterations per path and size (median reported)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("-w,--warmup", f.warmup, "untimed iterations per path and size")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  app.add_option("--min-seconds", f.min_seconds,
                 "more iterations (up to --max-iters) until a path's timed runs take about this long")
      ->check(CLI::Range(0.0, 3600.0))
      ->capture_default_str();
  app.add_option("--max-iters", f.max_iters)->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--only", f.only, "run only the paths whose name contains this text (e.g. to profile one path)");
  app.add_flag("--cpu-idle", f.cpu_idle,
               "after each row, the machine's idle share of CPU time during that path's timed runs (/proc/stat, "
               "rank 0's reading; all processes)");
  app.add_option("--uneven-shift", f.uneven_shift, "elements moved from rank 1 to rank 0 for the uneven paths")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--split-total", f.split_total, "Fig. 2b: total output elements per rank (K/M/G suffixes = 2^10..)")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--split-min", f.split_min, "Fig. 2b: smallest collective, elements")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--split-max", f.split_max, "Fig. 2b: largest collective, elements")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--split-iters", f.split_iters, "Fig. 2b: timed passes per size")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--split-warmup", f.split_warmup,
                 "Fig. 2b: untimed passes per size (the correctness pass is one more)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  app.add_option("--memcpy-bytes", f.memcpy_bytes, "buffer for the memcpy reference")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--model", f.model,
                 std::string("network model for the model section (FSDP_NETWORK_MODEL syntax); default: "
                             "FSDP_NETWORK_MODEL if set, else ") +
                     kDefaultModel);
  app.add_option("--model-min-bytes", f.model_min_bytes)->transform(CLI::AsSizeValue(false))->capture_default_str();
  app.add_option("--model-max-bytes", f.model_max_bytes)->transform(CLI::AsSizeValue(false))->capture_default_str();
  app.add_option("--model-factor", f.model_factor)->check(CLI::Range(2, 1 << 20))->capture_default_str();
  app.add_flag("--inject-wrong", f.inject_wrong,
               "self-test: corrupt one element of our all-gather's output on rank 0, so #wrong > 0 and the "
               "benchmark fails (used by ctest to show the check works)");
  CLI11_PARSE(app, argc, argv);

  auto has = [&](const char* s) {
    return std::find(f.sections.begin(), f.sections.end(), s) != f.sections.end();
  };
  try {
    FSDP_CHECK(f.min_bytes >= 1 && f.min_bytes <= f.max_bytes, "--min-bytes ", f.min_bytes,
               " must be in [1, --max-bytes ", f.max_bytes, "]");
    FSDP_CHECK(f.split_min >= 1 && f.split_min <= f.split_max && f.split_min <= f.split_total, "--split-min ",
               f.split_min, " must be in [1, min(--split-max, --split-total)]");
    // The model section models explicitly; every other path must run on the real transport.
    b.env_model = fsdp::NetworkModel::from_env();
    ::unsetenv("FSDP_NETWORK_MODEL");
    if (!f.model.empty()) fsdp::NetworkModel::parse(f.model, "--model");  // fail before any work

    b.pg = fsdp::ProcessGroup::from_env();
    b.rank = b.pg->rank();
    b.world = b.pg->size();
    b.ours = b.pg->world();
    FSDP_CHECK(b.world >= 2, "the collectives benchmark needs at least 2 ranks; launch it with "
                             "fsdp-run --nproc-per-node 2 (or more)");
    const std::string host = b.pg->env().master_addr;
    const bool loopback = host == "localhost" || host.rfind("127.", 0) == 0;
    auto device = loopback ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                           : c10d::ProcessGroupGloo::createDefaultDevice();
    auto opts = c10d::ProcessGroupGloo::Options::create(b.pg->options().timeout);
    opts->devices = {device};
    opts->threads = 2;
    b.c10d = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("bench/c10d", b.pg->store()), b.rank, b.world, opts);
    c10d::ProcessGroupGloo::GlooStore raw_store(c10::make_intrusive<c10d::PrefixStore>("bench/raw", b.pg->store()));
    b.raw = std::make_shared<gloo::rendezvous::Context>(b.rank, b.world);
    b.raw->setTimeout(b.pg->options().timeout);
    b.raw->connectFullMesh(raw_store, device);

    // "fsdp" rows run on the process group's communicator (FSDP_TRANSPORT: shared memory within a
    // host by default); the raw and c10d reference rows always run Gloo over TCP.
    const bool fsdp_shm = b.pg->world()->shared_memory_bytes() > 0;
    b.print("# libfsdp collectives benchmark: %d ranks; fsdp rows on %s, reference rows on Gloo over TCP (%s)\n",
            b.world, fsdp_shm ? "shared memory" : "Gloo over TCP", loopback ? "loopback" : host.c_str());
    b.print("# cpu:%s, %ld online cores; load average at start: %s\n",
            read_first_line_with("/proc/cpuinfo", "model name").c_str(), sysconf(_SC_NPROCESSORS_ONLN),
            read_all("/proc/loadavg").c_str());
    b.flush();
    if (has("memcpy")) memcpy_section(b);
    if (has("allgather")) allgather_section(b);
    if (has("reduce_scatter")) reduce_scatter_section(b);
    if (has("hd_race")) hd_race_section(b);
    if (has("split")) split_section(b);
    if (has("model")) model_section(b);
    b.print("\n# load average at end: %s\n", read_all("/proc/loadavg").c_str());
    if (b.peer_race_seen)
      b.print("# gloo reduce_scatter h-d (raw) returned wrong sums: Gloo's own race, not a failure of this run "
              "(Note [Gloo halving-doubling race] in docs/design.md)\n");
    if (b.any_wrong) b.print("# FAILED: some path produced wrong results (#wrong > 0)\n");
    b.flush();
    b.barrier();
    return b.any_wrong ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", b.rank, e.what());
    return 2;
  }
}
