#pragma once
// Records the runtime's events of one iteration (Options::trace) and turns them into an
// IterationTrace at the end of backward. Collectives are kept as Work handles and resolved to
// their communicator-side timing once the iteration is over (they have all completed by then).
#include <chrono>
#include <string>
#include <vector>

#include "fsdp/comm.h"
#include "fsdp/trace.h"

namespace fsdp {

class Tracer {
 public:
  using Clock = std::chrono::steady_clock;

  void enable(bool on);
  bool enabled() const { return enabled_; }

  void instant(TraceEvent::Kind kind, int unit, std::string label);
  // A collective issued now: its span on the communicator is filled in at finish_iteration().
  void collective(TraceEvent::Kind kind, int unit, std::string label, std::string track, WorkPtr work);
  // A span of the compute thread waiting for a collective (exposed communication).
  void wait(int unit, std::string label, Clock::time_point start, Clock::time_point end);
  // A span of `track` (the compute thread, or the step's own) running the optimizer step of a
  // unit's shard in backward.
  void step(int unit, Clock::time_point start, Clock::time_point end, std::string track = "compute");
  // Compute spans: the computation entered `unit` (closing the previous span), or left all units.
  void enter_compute(int unit);
  void leave_compute();
  void note_unsharded_units(int count);

  // Completes the iteration that ends now and starts the next one.
  IterationTrace finish_iteration(int rank, const std::vector<std::string>& unit_names);

 private:
  double since_start_us(Clock::time_point t) const;
  struct PendingCollective {
    TraceEvent event;
    WorkPtr work;
  };
  bool enabled_ = false;
  Clock::time_point start_ = Clock::now();
  int64_t iteration_ = 0;
  std::vector<TraceEvent> events_;
  std::vector<PendingCollective> collectives_;
  double exposed_us_ = 0;
  int max_unsharded_ = 0;
  int compute_unit_ = -1;
  Clock::time_point compute_start_;
};

}  // namespace fsdp
