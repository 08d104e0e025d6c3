// fsdp::calibrate_link: the job's links timed by all-gathers among its ranks.
#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "fsdp/calibration.h"
#include "fsdp/check.h"
#include "fsdp/network_model.h"
#include "fsdp/process_group.h"
#include "planner/timing_stats.h"

namespace fsdp {
namespace {

using planner::Clock;
using planner::median;
using planner::seconds_since;

// The mean over `comm`'s ranks of their link's latency per ring step (us) and bandwidth (GB/s), from
// all-gathers of one value and of `values` values per rank.
std::pair<double, double> time_link(Communicator& comm, int64_t values) {
  const int n = comm.size();
  auto gather_s = [&](int64_t count, int repetitions) {
    auto in = torch::ones({count}), out = torch::empty({count * n});
    std::vector<double> times;
    for (int i = 0; i <= repetitions; ++i) {
      comm.barrier();
      const auto start = Clock::now();
      comm.all_gather_into(out, in)->wait();
      if (i > 0) times.push_back(seconds_since(start));
    }
    return median(times);
  };
  const double small = gather_s(1, 15), large = gather_s(values, 5);
  auto both = torch::tensor({small, large}, torch::kDouble);
  comm.all_reduce(both)->wait();
  const double mean_small = both[0].item<double>() / n, mean_large = both[1].item<double>() / n;
  // Inverts modeled_seconds' ring model: (n - 1) steps of latency plus the wire bytes at the bandwidth.
  const double per_latency_us = modeled_seconds(Collective::kAllGather, 0, n, Link().latency_us(1));
  const double per_gbps = modeled_seconds(Collective::kAllGather, values * 4 * n, n, Link().bandwidth_gbps(1));
  return {mean_small / per_latency_us, per_gbps / std::max(mean_large - mean_small, 1e-9)};
}

}  // namespace

void calibrate_link(Calibration& calibration, Communicator& comm, int64_t bytes_per_rank) {
  FSDP_CHECK(bytes_per_rank >= 4, "fsdp::calibrate_link: bytes_per_rank must be at least 4, got ", bytes_per_rank);
  if (comm.size() < 2) return;  // one rank: nothing crosses a link
  std::tie(calibration.link_latency_us, calibration.link_gbps) = time_link(comm, bytes_per_rank / 4);
  const CommunicatorPtr real = modeled_inner(comm);
  std::tie(calibration.link_copy_latency_us, calibration.link_copy_gbps) =
      real ? time_link(*real, bytes_per_rank / 4) : std::pair<double, double>(0, 0);
}

void calibrate_link(Calibration& calibration, ProcessGroup& pg, int64_t bytes_per_rank) {
  calibrate_link(calibration, *pg.world(), bytes_per_rank);
  calibration.link_ranks_per_host = 0;
  calibration.intra_link_gbps = calibration.intra_link_latency_us = 0;
  const int n = pg.size();
  const auto& model = pg.options().network_model;
  const int per_host = model ? model->ranks_per_host() : pg.env().local_world_size;
  if (per_host <= 1 || per_host >= n) return;  // one rank per host, or one host: one link
  const int first = pg.rank() / per_host * per_host;
  std::vector<int> host;
  for (int r = first; r < std::min(n, first + per_host); ++r) host.push_back(r);
  // Every host's ranks at once; a host of one rank (the last, where per_host does not divide the
  // world) times nothing. Then the mean over the hosts that timed.
  auto sums = torch::zeros({3}, torch::kDouble);
  if (host.size() > 1) {
    const CommunicatorPtr comm = pg.new_group(host, "fsdp.calibrate_link.host");
    const auto [latency_us, gbps] = time_link(*comm, bytes_per_rank / 4);
    sums = torch::tensor({latency_us, gbps, 1.0}, torch::kDouble);
  }
  pg.world()->all_reduce(sums)->wait();
  const double timed = sums[2].item<double>();
  if (timed == 0) return;
  calibration.link_ranks_per_host = per_host;
  calibration.intra_link_latency_us = sums[0].item<double>() / timed;
  calibration.intra_link_gbps = sums[1].item<double>() / timed;
}

}  // namespace fsdp
