#pragma once
// Per-iteration event trace of the FSDP runtime (Options::trace), exportable as Chrome-trace JSON
// (Perfetto). See docs/usage.md (Tracing) and Note [Event trace] in docs/design.md.
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace fsdp {

struct TraceEvent {
  enum class Kind {
    kUnshardIssued,  // instant, compute thread: an all-gather was issued (label says prefetch or not)
    kUnshard,        // span, communicator track: the all-gather ran
    kCompute,        // span, compute thread: the computation was inside this unit
    kWait,           // span, compute thread: blocked on a collective (label says which)
    kReshard,        // instant, compute thread: the unsharded parameters were freed
    kReduceIssued,   // instant, compute thread: the gradient reduction was issued
    kReduce,         // span, communicator track: the reduce-scatter / all-reduce ran
    kStep,           // span, compute or optimizer thread: the optimizer stepped the unit's shard (step in backward)
  };
  Kind kind;
  int unit = -1;           // unit index (FullyShardedModule::units()); -1 if none
  std::string label;       // e.g. "prefetch backward", "all-gather", "reduce-scatter"
  std::string track;       // "compute" or the communicator's name
  double start_us = 0;     // since the iteration began (end of the previous backward)
  double duration_us = 0;  // 0 for instants
};
const char* to_string(TraceEvent::Kind kind);

struct IterationTrace {
  int rank = 0;
  int64_t iteration = 0;
  std::vector<std::string> unit_names;
  std::vector<TraceEvent> events;  // in the order they were recorded
  double duration_us = 0;          // from the end of the previous backward to the end of this one
  double comm_us = 0;              // sum of the collectives' durations on their communicators
  double exposed_comm_us = 0;      // sum of the compute thread's waits on collectives
  int max_unsharded_units = 0;     // most non-root units unsharded or being gathered at once

  // Chrome trace JSON: one process per rank, a "compute" thread and one thread per communicator.
  void write_chrome_json(std::ostream& out) const;
  void write_chrome_json(const std::string& path) const;
};

}  // namespace fsdp
