// The runtime calibration's correction: the timed configurations against their replays
// (evaluate.h). See Note [Planner runtime calibration] in docs/design.md.
#include <algorithm>
#include <array>
#include <cmath>
#include <utility>
#include <vector>

#include "planner/evaluate.h"

namespace fsdp::planner {
namespace {

// The configuration a runtime timing describes, as a candidate.
Candidate timed_candidate(const TimedConfiguration& t) {
  const RuntimeTiming& timing = *t.timing;
  Candidate c;
  c.strategy = timing.strategy;
  c.sharding_factor = timing.sharding_factor;
  c.wrap = t.wrap;
  c.precision = timing.precision;
  c.activation_checkpointing = timing.activation_checkpointing;
  c.all_gather_limit = timing.all_gather_limit;
  c.backward_prefetch = timing.backward_prefetch;
  c.forward_prefetch = timing.forward_prefetch;
  c.reductions_in_flight = timing.reductions_in_flight;
  c.micro_batch = timing.micro_batch;
  return c;
}

// The request with the calibrated link replaced by the transport beneath the modeled network.
PlanRequest beneath_the_model(PlanRequest request) {
  Calibration calibration = request.calibration();
  calibration.link_gbps = calibration.link_copy_gbps;
  calibration.link_latency_us = calibration.link_copy_latency_us;
  calibration.link_copy_gbps = calibration.link_copy_latency_us = 0;
  calibration.link_ranks_per_host = 0;  // one transport within and between the modeled hosts
  return request.calibration(calibration);
}

// The rate of waits beside the links' time whose replays of the timings taken beneath the modeled
// network expose, in sum, what those timings measured (bisection: exposure grows with the rate).
double beside_waits(const std::vector<const TimedConfiguration*>& beneath, const Cluster& cluster, int world,
                    const PlanRequest& request) {
  const PlanRequest copy_link = beneath_the_model(request);
  double measured = 0, computation = 0;
  for (const TimedConfiguration* t : beneath) {
    measured += t->timing->exposed_s;
    computation += t->timing->forward_s + t->timing->backward_s - t->timing->exposed_s;
  }
  auto exposed = [&](double rate) {
    RuntimeCorrection with;
    with.beside_waits_per_compute_s = rate;
    double sum = 0;
    for (const TimedConfiguration* t : beneath) {
      Replayed replay;
      evaluate(t->model, timed_candidate(*t), cluster, world, copy_link, &with, &replay);
      sum += replay.exposed_s;
    }
    return sum;
  };
  if (computation <= 0 || exposed(0) >= measured) return 0;
  double low = 0, high = measured / computation;
  for (int i = 0; i < 30 && exposed(high) < measured; ++i) low = high, high *= 2;
  for (int i = 0; i < 40; ++i) {
    const double middle = (low + high) / 2;
    (exposed(middle) < measured ? low : high) = middle;
  }
  return (low + high) / 2;
}

// One timing's FSDP work beside what it spreads over: its units, its collectives and one pass.
struct WorkRow {
  std::array<double, 3> counts;
  double work = 0;
};

// Least squares of `rows`' work over the counts `use` selects; false where those do not determine it.
bool least_squares(const std::vector<WorkRow>& rows, const std::array<bool, 3>& use,
                   std::array<double, 3>& coefficients, double& residual) {
  std::vector<int> cols;
  for (int j = 0; j < 3; ++j)
    if (use[j]) cols.push_back(j);
  const size_t n = cols.size();
  if (rows.size() < n) return false;
  // The normal equations, solved by elimination with partial pivoting.
  std::array<std::array<double, 4>, 3> m{};
  double scale = 0;
  for (size_t a = 0; a < n; ++a) {
    for (size_t b = 0; b < n; ++b)
      for (const auto& row : rows) m[a][b] += row.counts[cols[a]] * row.counts[cols[b]];
    for (const auto& row : rows) m[a][n] += row.counts[cols[a]] * row.work;
    scale = std::max(scale, m[a][a]);
  }
  for (size_t k = 0; k < n; ++k) {
    size_t pivot = k;
    for (size_t r = k + 1; r < n; ++r)
      if (std::abs(m[r][k]) > std::abs(m[pivot][k])) pivot = r;
    if (std::abs(m[pivot][k]) <= 1e-9 * scale) return false;
    std::swap(m[k], m[pivot]);
    for (size_t r = 0; r < n; ++r) {
      if (r == k) continue;
      const double f = m[r][k] / m[k][k];
      for (size_t c = k; c <= n; ++c) m[r][c] -= f * m[k][c];
    }
  }
  coefficients = {0, 0, 0};
  for (size_t k = 0; k < n; ++k) coefficients[cols[k]] = m[k][n] / m[k][k];
  residual = 0;
  for (const auto& row : rows) {
    double fitted = 0;
    for (int j = 0; j < 3; ++j) fitted += coefficients[j] * row.counts[j];
    residual += (row.work - fitted) * (row.work - fitted);
  }
  return true;
}

// The costs per unit, per collective and per pass whose sum fits the timings' work best with none
// negative: every subset of the three tried, the earlier of equal fits kept, so that timings which
// cannot tell a cost per pass from one per unit (every timing with the same units) charge it per unit.
std::array<double, 3> nonnegative_work_fit(const std::vector<WorkRow>& rows) {
  static constexpr std::array<std::array<bool, 3>, 7> kSubsets{{{true, true, true},
                                                                {true, true, false},
                                                                {true, false, true},
                                                                {false, true, true},
                                                                {true, false, false},
                                                                {false, true, false},
                                                                {false, false, true}}};
  std::array<double, 3> best{0, 0, 0};
  double best_residual = -1, total = 0;
  for (const auto& row : rows) total += row.work * row.work;
  for (const auto& use : kSubsets) {
    std::array<double, 3> fit{};
    double residual = 0;
    if (!least_squares(rows, use, fit, residual)) continue;
    if (fit[0] < 0 || fit[1] < 0 || fit[2] < 0) continue;
    if (best_residual < 0 || residual < best_residual - 1e-12 * total) best = fit, best_residual = residual;
  }
  return best;
}

}  // namespace

RuntimeCorrection runtime_correction(const std::vector<TimedConfiguration>& timed, const Cluster& cluster, int world,
                                     const PlanRequest& request) {
  RuntimeCorrection out;
  // Per timing: the replay of its configuration, the waits beyond the replay's exposed collectives,
  // and the rest of the difference (FSDP's work), with the units and collectives it spreads over.
  double waits = 0, computation = 0, steps = 0, forward_share = -1, replay_compute = 0;
  int stepped = 0;
  std::vector<WorkRow> rows;
  std::vector<const TimedConfiguration*> checkpointed, beneath;
  // Beneath a modeled link on a CPU cluster, the waits the ranks have without the link (timed
  // beneath it) stand beside the link's time; the modeled timings' waits beyond those are added.
  const Calibration& calibration = request.calibration();
  for (const TimedConfiguration& t : timed)
    if (t.timing->beneath_network_model && !t.timing->activation_checkpointing && t.timing->exposed_s >= 0)
      beneath.push_back(&t);
  if (cluster.device_is_host && calibration.link_gbps > 0 && calibration.link_copy_gbps > calibration.link_gbps &&
      !beneath.empty())
    out.beside_waits_per_compute_s = beside_waits(beneath, cluster, world, request);
  RuntimeCorrection beside;
  beside.beside_waits_per_compute_s = out.beside_waits_per_compute_s;
  for (const TimedConfiguration& t : timed) {
    const RuntimeTiming& timing = *t.timing;
    if (timing.beneath_network_model) continue;  // another link than the job's: its waits only, above
    if (timing.activation_checkpointing) {       // not FSDP's work: what checkpointing changes, below
      checkpointed.push_back(&t);
      continue;
    }
    Replayed replay;
    evaluate(t.model, timed_candidate(t), cluster, world, request, &beside, &replay);
    if (replay.units == 0) continue;
    if (timing.step_s >= 0) steps += timing.step_s - replay.optimizer_s, ++stepped;
    const bool waits_measured = timing.exposed_s >= 0 && replay.collectives > 0 && replay.wait_weight > 0;
    const double wait = waits_measured ? timing.exposed_s - replay.exposed_s : 0;
    // The waits' time: those blocked are their collectives' mean weight of it (Note [Planner waits by group]).
    const double blocked_share = waits_measured ? replay.wait_weight / replay.collectives : 1.0;
    const double wait_s = cluster.device_is_host ? wait / blocked_share : wait;
    if (waits_measured) {  // a candidate's waits: the rate times its computation and its blocked share
      waits += wait;
      computation += (timing.forward_s + timing.backward_s - replay.exposed_s - wait_s) * blocked_share;
    }
    const double replay_backward = replay.passes_s - replay.forward_s;
    replay_compute += replay.passes_s - replay.exposed_s;
    rows.push_back({{static_cast<double>(replay.units), static_cast<double>(replay.collectives), 1.0},
                    timing.forward_s + timing.backward_s - replay.passes_s - wait_s});
    if (forward_share < 0) {  // the first timing's passes apportion the per-unit work
      const double forward_gap = timing.forward_s - replay.forward_s,
                   backward_gap = timing.backward_s - replay_backward;
      forward_share = forward_gap > 0 && backward_gap > 0 ? forward_gap / (forward_gap + backward_gap)
                      : forward_gap > 0                   ? 1.0
                      : backward_gap > 0                  ? 0.0
                                                          : timing.forward_s / (timing.forward_s + timing.backward_s);
    }
  }
  if (rows.empty()) return out;
  if (stepped > 0) out.per_step_s = steps / stepped;
  double units = 0, work = 0;
  for (const WorkRow& row : rows) units += row.counts[0], work += row.work;
  // work = per_unit * units + per_collective * collectives + per_pass, none negative (Note [Planner
  // runtime calibration]); a total below the replay, all of it per unit (scaled below).
  double per_unit = work / units, per_collective_work = 0, per_pass = 0;
  if (work > 0) {
    const std::array<double, 3> fit = nonnegative_work_fit(rows);
    per_unit = fit[0], per_collective_work = fit[1], per_pass = fit[2];
  }
  // Less than the replay: the runtime computes faster than the copy's passes were timed. A fixed
  // amount per unit would take a smaller micro-batch's computation to nothing; a share of the
  // computation scales with it (Note [Planner runtime calibration]).
  if (per_unit < 0 && replay_compute > 0) {
    const double scale = 1 + per_unit * units / replay_compute;
    if (scale > 0) out.compute_scale = scale;
    per_unit = 0;
  }
  // Checkpointing's change: a checkpointed timing against the plain one of the same configuration,
  // the waits on peers left out, per second of the forward computation checkpointing covered.
  auto busy = [](const RuntimeTiming& r) {
    return r.forward_s + r.backward_s - std::max(0.0, r.exposed_s);
  };
  double forward_change = 0, backward_change = 0;
  int paired = 0;
  for (const TimedConfiguration* t : checkpointed) {
    const RuntimeTiming& with = *t->timing;
    for (const TimedConfiguration& plain : timed) {
      const RuntimeTiming& without = *plain.timing;
      if (without.activation_checkpointing || without.beneath_network_model || without.strategy != with.strategy ||
          without.sharding_factor != with.sharding_factor || without.wrap != with.wrap ||
          without.micro_batch != with.micro_batch)
        continue;
      Replayed replay;
      evaluate(t->model, timed_candidate(*t), cluster, world, request, nullptr, &replay);
      if (replay.checkpointed_forward_s <= 0) break;
      const double forward = with.forward_s - without.forward_s;
      forward_change += forward / replay.checkpointed_forward_s;
      backward_change += (busy(with) - busy(without) - forward) / replay.checkpointed_forward_s;
      ++paired;
      break;
    }
  }
  if (paired > 0) {
    out.checkpointing_measured = true;
    out.checkpointed_forward_change = forward_change / paired;
    out.checkpointed_backward_change = backward_change / paired;
  }
  out.waits_per_compute_s = computation > 0 ? waits / computation : 0;
  out.per_collective_work_s = per_collective_work;
  out.forward_per_unit_s = per_unit * forward_share;
  out.backward_per_unit_s = per_unit * (1 - forward_share);
  out.forward_per_pass_s = per_pass * forward_share;
  out.backward_per_pass_s = per_pass * (1 - forward_share);
  return out;
}

}  // namespace fsdp::planner
