#include "options.h"

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "exit_codes.h"

namespace fsdp_run {

std::string format_seconds(double seconds) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g s", seconds);
  return buf;
}

namespace {

// "N" or "MIN:MAX" into lo and hi (N: both); false if it is neither.
bool parse_range(const std::string& text, int& lo_out, int& hi_out) {
  const size_t colon = text.find(':');
  try {
    size_t used = 0;
    const int lo = std::stoi(text.substr(0, colon), &used);
    if (used != (colon == std::string::npos ? text.size() : colon)) return false;
    int hi = lo;
    if (colon != std::string::npos) {
      const std::string rest = text.substr(colon + 1);
      hi = std::stoi(rest, &used);
      if (used != rest.size()) return false;
    }
    lo_out = lo;
    hi_out = hi;
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// Returns an explanation of the first invalid setting, or "" if all are fine.
std::string validate(const Options& o) {
  auto s = [](auto v) {
    return std::to_string(v);
  };
  if (o.nproc_per_node < 1 || o.nproc_min < 1 || o.nproc_min > o.nproc_per_node)
    return "--nproc-per-node must be at least 1, or a range MIN:MAX with 1 <= MIN <= MAX (got " +
           (o.nproc_min == o.nproc_per_node ? s(o.nproc_per_node) : s(o.nproc_min) + ":" + s(o.nproc_per_node)) +
           "); pass the number of ranks to start on this node, e.g. --nproc-per-node 2 or 3:4";
  if (o.max_restarts < 0) return "--max-restarts must be 0 or more (got " + s(o.max_restarts) + ")";
  if (o.nproc_min < o.nproc_per_node && o.nnodes > 1 && !o.elastic_nodes)
    return "an elastic --nproc-per-node range needs a single node or an elastic --nnodes MIN:MAX (got --nnodes " +
           s(o.nnodes) + "); give each node a fixed --nproc-per-node, or pass --nnodes as a range";
  if (o.nnodes < 1 || o.nnodes_min < 1 || o.nnodes_min > o.nnodes)
    return "--nnodes must be at least 1, or a range MIN:MAX with 1 <= MIN <= MAX (got " +
           (o.elastic_nodes ? s(o.nnodes_min) + ":" + s(o.nnodes) : s(o.nnodes)) +
           "); pass the number of machines taking part, e.g. --nnodes 2 or 1:2, or leave it out for a single machine";
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    return "--node-rank must be between 0 and " + std::string(o.elastic_nodes ? "MAX" : "--nnodes") +
           " - 1 = " + s(o.nnodes - 1) + " (got " + s(o.node_rank) + "); give every node a distinct rank below " +
           (o.elastic_nodes ? "MAX" : "--nnodes");
  for (const auto& [name, value] : {std::pair<const char*, double>{"--join-timeout", o.join_timeout},
                                    {"--last-call", o.last_call},
                                    {"--node-timeout", o.node_timeout}})
    if (!std::isfinite(value) || value <= 0)
      return std::string(name) + " must be a positive number of seconds (got " + format_seconds(value) + ")";
  if (o.master_addr.empty()) return "--master-addr must not be empty; pass the host name or IP address of node 0";
  if (o.master_port < 1 || o.master_port > 65535)
    return "--master-port must be between 1 and 65535 (got " + s(o.master_port) +
           "); pick a free TCP port, e.g. --master-port 29500";
  if (o.elastic_nodes && o.master_port == 65535)
    return "--master-port must be below 65535 with --nnodes MIN:MAX (the ranks' rendezvous uses the next port)";
  if (o.threads_per_rank && *o.threads_per_rank < 1)
    return "--threads-per-rank must be at least 1 (got " + s(*o.threads_per_rank) +
           "); or leave it out to split the CPU cores evenly between the ranks";
  if (!std::isfinite(o.grace_seconds) || o.grace_seconds < 0)
    return "--grace-seconds must be a non-negative number of seconds (got " + format_seconds(o.grace_seconds) +
           "), e.g. --grace-seconds 5";
  if (o.command.empty())
    return "no program given; usage: fsdp-run [OPTIONS] PROGRAM [ARGS...], "
           "e.g. fsdp-run --nproc-per-node 2 ./train --epochs 1";
  return "";
}

void print_usage_error(const std::string& what) {
  std::fprintf(stderr, "fsdp-run: %s\nRun 'fsdp-run --help' for all options.\n", what.c_str());
}

// CLI11 knows nothing of PROGRAM (it is taken via prefix_command), so spell
// out the usage line ourselves.
class UsageFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string name) const override {
    return "Usage: " + name + " [OPTIONS] PROGRAM [ARGS...]\n";
  }
};

}  // namespace

std::optional<int> parse_command_line(int argc, char** argv, Options& o) {
  CLI::App app{"Start PROGRAM once per local rank with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,\n"
               "GROUP_RANK, NODE_RANK, MASTER_ADDR, MASTER_PORT and OMP_NUM_THREADS set, forward the\n"
               "ranks' output prefixed with '[rank R] ', and stop every rank as soon as one fails.\n",
               "fsdp-run"};
  // Everything from PROGRAM on belongs to the program, including its flags.
  app.prefix_command();
  app.formatter(std::make_shared<UsageFormatter>());
  app.footer("Exit code: 0 if all ranks succeed, else the first failing rank's code (of the last try)\n"
             "(128+N for a rank killed by signal N), 130/143 if fsdp-run got SIGINT/SIGTERM,\n"
             "2 for bad options, 127 if PROGRAM cannot be executed.");

  std::string nproc = "1";
  app.add_option("--nproc-per-node", nproc,
                 "Ranks to start on this node; MIN:MAX: start MAX, and let a restart run with fewer\n"
                 "(the ranks not lost), down to MIN")
      ->capture_default_str();
  app.add_option("--max-restarts", o.max_restarts,
                 "After a rank fails, stop the others and start the job again, at most this many times;\n"
                 "each restart sets FSDP_RESTART_COUNT and runs without the ranks killed by a signal")
      ->capture_default_str();
  std::string nnodes = "1";
  app.add_option("--nnodes", nnodes,
                 "Number of nodes taking part; MIN:MAX: elastic, node 0's fsdp-run hosts a rendezvous\n"
                 "store and each start runs on the nodes present, at least MIN")
      ->capture_default_str();
  app.add_option("--node-rank", o.node_rank, "Index of this node, 0..nnodes-1 (0..MAX-1 for a range)")
      ->capture_default_str();
  app.add_option("--join-timeout", o.join_timeout, "With --nnodes MIN:MAX: seconds to wait for MIN nodes")
      ->capture_default_str();
  app.add_option("--last-call", o.last_call,
                 "With --nnodes MIN:MAX: seconds to wait for more nodes once MIN have joined")
      ->capture_default_str();
  app.add_option("--node-timeout", o.node_timeout,
                 "With --nnodes MIN:MAX: seconds without a heartbeat after which a node counts as lost")
      ->capture_default_str();
  app.add_option("--master-addr", o.master_addr, "Address of node 0 (MASTER_ADDR)")->capture_default_str();
  app.add_option("--master-port", o.master_port,
                 "Port on node 0 (MASTER_PORT; with --nnodes MIN:MAX the launchers' store, and MASTER_PORT is\n"
                 "one more)")
      ->capture_default_str();
  app.add_flag("--no-prefix", o.no_prefix, "Do not prefix output lines with '[rank R] '");
  app.add_option("--threads-per-rank", o.threads_per_rank,
                 "OMP_NUM_THREADS for each rank (default: keep an existing OMP_NUM_THREADS,\n"
                 "else CPU cores / nproc-per-node, at least 1)");
  app.add_option("--grace-seconds", o.grace_seconds, "Seconds between SIGTERM and SIGKILL when stopping ranks")
      ->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    print_usage_error(e.what());
    return kExitUsage;
  }
  if (!parse_range(nproc, o.nproc_min, o.nproc_per_node)) {
    print_usage_error("--nproc-per-node takes a number or a range MIN:MAX (got '" + nproc + "'), e.g. 4 or 3:4");
    return kExitUsage;
  }
  if (!parse_range(nnodes, o.nnodes_min, o.nnodes)) {
    print_usage_error("--nnodes takes a number or a range MIN:MAX (got '" + nnodes + "'), e.g. 2 or 1:2");
    return kExitUsage;
  }
  o.elastic_nodes = nnodes.find(':') != std::string::npos;

  o.command = app.remaining();
  // "fsdp-run [options] -- PROGRAM ...": the separator is not part of the command.
  if (!o.command.empty() && o.command.front() == "--") o.command.erase(o.command.begin());
  // With prefix_command() CLI11 hands unknown launcher options over as if they
  // were the program; a program name starting with '-' is almost surely a typo.
  if (!o.command.empty() && o.command.front().size() > 1 && o.command.front()[0] == '-') {
    print_usage_error("unknown option '" + o.command.front() +
                      "'; put launcher options before PROGRAM, see the list below --help");
    return kExitUsage;
  }
  if (std::string problem = validate(o); !problem.empty()) {
    print_usage_error(problem);
    return kExitUsage;
  }
  return std::nullopt;
}

}  // namespace fsdp_run
