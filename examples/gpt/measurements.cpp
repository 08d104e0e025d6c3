#include "measurements.h"

#include <fsdp/fsdp.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <string>

#include "timing.h"

namespace fsdp_gpt {

namespace {

// Matmul throughput of this rank in FLOP/s: a few 1024x1024 float matmuls, 2 * n^3 FLOPs each,
// on the rank's own thread count. All ranks measure at the same time (after a barrier), so ranks
// sharing a host also share its cores as they will while training, and the sum over ranks is the
// job's peak:  peak = sum over ranks r of 2 * n^3 * reps / seconds_r
//                   (= per-rank rate x ranks per host x hosts, for identical hosts).
// MFU = achieved model FLOP/s / peak. The fastest of several matmuls counts: a peak is what the
// hardware can do, and a slower one was interrupted (other processes on a shared machine),
// which would understate the peak and overstate MFU.
double measure_matmul_flops() {
  const int64_t n = 1024, reps = 8;
  auto a = torch::randn({n, n}), b = torch::randn({n, n});
  auto c = torch::mm(a, b);  // warm-up: thread pool start, page faults
  double fastest = 1e30;
  for (int i = 0; i < reps; ++i) {
    const auto start = Clock::now();
    c = torch::mm(a, b);
    fastest = std::min(fastest, seconds_since(start));
  }
  return 2.0 * n * n * n / fastest;
}

}  // namespace

namespace {

// A "<key>:  1234 kB" line of /proc/self/status, in bytes; 0 when absent.
int64_t status_bytes(const std::string& key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1)) * 1024;
  return 0;
}

}  // namespace

int64_t resident_bytes() { return status_bytes("VmRSS"); }

int64_t peak_resident_bytes() { return status_bytes("VmHWM"); }

void restart_resident_peak() {
  std::ofstream reset("/proc/self/clear_refs");
  reset << "5" << std::flush;  // where Linux refuses, the peak keeps counting from the start
}

int64_t minor_page_faults() {
  rusage usage{};
  return getrusage(RUSAGE_SELF, &usage) == 0 ? static_cast<int64_t>(usage.ru_minflt) : 0;
}

double training_flops_per_token(int64_t parameters, const TrainConfig& c) {
  return 6.0 * static_cast<double>(parameters) + 12.0 * c.layers * c.context * c.width;
}

MatmulPeak measure_peak(fsdp::ProcessGroup& pg) {
  if (pg.size() > 1) pg.world()->barrier();
  auto peak = torch::tensor({measure_matmul_flops()}, torch::kDouble);
  MatmulPeak result;
  result.rank0_flops = peak.item<double>();
  if (pg.size() > 1) pg.world()->all_reduce(peak)->wait();
  result.job_flops = peak.item<double>();
  return result;
}

}  // namespace fsdp_gpt
