#pragma once
// The membership agreement of an elastic job across nodes (--nnodes MIN:MAX): numbered rounds in
// the store that node 0's fsdp-run hosts. Every node joins a round; node 0 closes it with the
// nodes present and publishes the members. See Note [Elastic rendezvous across nodes] in
// docs/design.md.
#include <chrono>
#include <functional>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "node_store.h"

namespace fsdp_run {

// One node as it joined a round: its --node-rank, its ranks, and a random tag telling it apart
// from another fsdp-run started with the same --node-rank.
struct NodeEntry {
  int id = 0;
  int nproc = 1;
  std::string tag;
};

// A closed round as one member sees it.
struct Membership {
  int round = 0;
  std::vector<NodeEntry> nodes;  // by id
  int node_rank = 0;             // this node's place in `nodes`
  int first_rank = 0;            // RANK of this node's local rank 0
  int world_size = 0;            // the ranks of all members
};

// The members' text in the store: "id:nproc:tag,...", and back (an empty list for malformed text).
std::string encode_members(const std::vector<NodeEntry>& nodes);
std::vector<NodeEntry> decode_members(const std::string& text);

// The membership of `me` among `nodes` (ranks numbered node by node in id order), or nothing if
// `me` is not one of them.
std::optional<Membership> place(int round, std::vector<NodeEntry> nodes, const NodeEntry& me);

// Which of the joined entries (in the order they joined) a round closes with: the host's entry
// (id 0) and the earliest others up to `max_nodes`, one per id, by id.
std::vector<NodeEntry> choose_members(const std::vector<NodeEntry>& joined, int max_nodes);

// The --node-rank of every node that joined `round` so far, members or not.
std::set<int> joined_ids(NodeStore& store, int round);

// The store's keys, all under "fsdp-run/".
namespace keys {
std::string open_round();                 // the round node 0 runs now
std::string done();                       // the job's exit code, once it ends
std::string heartbeat(int id);            // a counter each node's fsdp-run advances while alive
std::string left(int id);                 // set when the node's fsdp-run leaves the job
std::string joined(int round);            // the count of nodes that joined
std::string entry(int round, int slot);   // slot 1, 2, ...: who joined
std::string members(int round);           // set when the round closes
std::string failed(int round);            // the first failure of the round's run
std::string finished(int round, int id);  // the node's ranks all succeeded
}  // namespace keys

struct RendezvousSettings {
  int min_nodes = 1;
  int max_nodes = 1;
  std::chrono::milliseconds join_timeout{300'000};
  std::chrono::milliseconds last_call{10'000};
  std::function<bool()> interrupted;  // polled while waiting: true gives up with Interrupted
};

// Waiting for a round was given up: RendezvousSettings::interrupted said so.
struct Interrupted : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The result of joining a round.
struct JoinResult {
  std::optional<Membership> membership;  // nothing: the round closed without this node
  std::optional<int> done;               // the job ended (its exit code) before the round closed
};

// Joins round `round` as `me` and waits until it closes. Node 0 (the host) closes it: at
// max_nodes, or once min_nodes have joined and either every node in `expected()` has too or
// last_call has passed (expected() is nothing for the first round). Throws std::runtime_error
// when min_nodes do not join within join_timeout (the host also sets keys::done to `fail_code`).
JoinResult join_round(NodeStore& store, const RendezvousSettings& settings, int round, const NodeEntry& me,
                      const std::function<std::optional<std::set<int>>()>& expected, int fail_code);

}  // namespace fsdp_run
