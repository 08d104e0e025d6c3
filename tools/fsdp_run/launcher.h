#pragma once
// Process spawning and supervision: one process per local rank, all stopped as soon as one
// fails or the launcher is interrupted.
#include <functional>
#include <optional>
#include <string>

#include "options.h"

namespace fsdp_run {

// How one start of this node's ranks ended.
struct Attempt {
  int code = 0;
  int lost = 0;              // the first failure was a rank killed by a signal: its slot is given up
  bool interrupted = false;  // the launcher got SIGINT or SIGTERM
};

// What an elastic job across nodes adds to one start (elastic.h); either may be empty.
struct StartHooks {
  std::function<void(const std::string& why)> on_failure;   // this node's ranks failed first (or were interrupted)
  std::function<std::optional<std::string>()> stop_reason;  // why the ranks must stop (another node failed), if so
};

// Starts this node's ranks of `options` once (restart number `restart`) and supervises them until
// all are gone and their output is forwarded. A wake-up of the signal self-pipe makes it consult
// `hooks.stop_reason`.
Attempt run_ranks(const Options& options, int restart, const StartHooks& hooks);

// Starts the ranks `options` describes and supervises them until all are gone and their output is
// forwarded; returns fsdp-run's exit code.
int launch(Options options);

}  // namespace fsdp_run
