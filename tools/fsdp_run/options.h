#pragma once
// fsdp-run's command line: the options, their checks, and the usage messages.
#include <optional>
#include <string>
#include <vector>

namespace fsdp_run {

struct Options {
  int nproc_per_node = 1;      // ranks started first (an elastic range's MAX)
  int nproc_min = 1;           // --nproc-per-node MIN:MAX: the fewest ranks a restart may run
  int max_restarts = 0;        // restarts after a failure, each with the ranks not lost
  int nnodes = 1;              // nodes taking part (an elastic range's MAX)
  int nnodes_min = 1;          // --nnodes MIN:MAX: the fewest nodes a rendezvous may close with
  bool elastic_nodes = false;  // --nnodes given as MIN:MAX: node 0's fsdp-run hosts a store for rounds
  int node_rank = 0;
  double join_timeout = 300;  // seconds a round waits for MIN nodes
  double last_call = 10;      // seconds a round waits for more once MIN have joined
  double node_timeout = 10;   // seconds without a heartbeat after which a node counts as lost
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool no_prefix = false;
  std::optional<int> threads_per_rank;
  double grace_seconds = 5.0;
  std::vector<std::string> command;  // PROGRAM ARGS...

  // Where this node's ranks sit in the job, filled in for each start: RANK of local rank 0, WORLD_SIZE.
  int first_rank = 0;
  int world_size = 1;
};

// "5 s": seconds as the launcher's messages print them.
std::string format_seconds(double seconds);

// Parses argv into `o`. Returns an exit code if the launcher should stop right
// away (help printed, or bad input), nothing if it should go on.
std::optional<int> parse_command_line(int argc, char** argv, Options& o);

}  // namespace fsdp_run
