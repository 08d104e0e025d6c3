#include "rendezvous.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

namespace fsdp_run {

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kPoll(50);

void check_interrupted(const RendezvousSettings& s) {
  if (s.interrupted && s.interrupted()) throw Interrupted("interrupted while waiting for a rendezvous round");
}

std::string seconds_text(std::chrono::milliseconds t) {
  std::ostringstream out;
  out << t.count() / 1000.0 << " s";
  return out.str();
}

// "id nproc tag" as a node writes its entry.
std::string encode_entry(const NodeEntry& e) {
  return std::to_string(e.id) + " " + std::to_string(e.nproc) + " " + e.tag;
}
std::optional<NodeEntry> decode_entry(const std::string& text) {
  std::istringstream in(text);
  NodeEntry e;
  if (!(in >> e.id >> e.nproc >> e.tag) || e.nproc < 1) return std::nullopt;
  return e;
}

// Node 0's part: closes `round` and returns its members, or throws when too few nodes came.
std::vector<NodeEntry> close_round(NodeStore& store, const RendezvousSettings& s, int round,
                                   const std::function<std::optional<std::set<int>>()>& expected, int fail_code) {
  const auto start = Clock::now();
  std::optional<Clock::time_point> enough_since;
  std::vector<NodeEntry> joined;  // slots 1.. as read so far
  for (;;) {
    check_interrupted(s);
    const int64_t count = store.add(keys::joined(round), 0);
    while (static_cast<int64_t>(joined.size()) < count) {
      // A node adds to the count before it writes its entry.
      const std::string key = keys::entry(round, static_cast<int>(joined.size()) + 1);
      if (!store.wait({key}, std::chrono::seconds(10)))
        throw std::runtime_error("node slot " + key + " stayed empty in the rendezvous store");
      const std::optional<NodeEntry> e = decode_entry(store.get(key).value_or(""));
      joined.push_back(e.value_or(NodeEntry{-1, 1, "-"}));
    }
    std::vector<NodeEntry> chosen = choose_members(joined, s.max_nodes);
    const int n = static_cast<int>(chosen.size());
    const auto now = Clock::now();
    if (n >= s.min_nodes && !enough_since) enough_since = now;
    bool close = n >= s.max_nodes;
    if (!close && enough_since) {
      if (now - *enough_since >= s.last_call) close = true;
      if (const std::optional<std::set<int>> wanted = expected()) {
        std::set<int> have;
        for (const NodeEntry& e : chosen) have.insert(e.id);
        close = close || std::includes(have.begin(), have.end(), wanted->begin(), wanted->end());
      }
    }
    if (close) {
      store.set(keys::members(round), encode_members(chosen));
      return chosen;
    }
    if (!enough_since && now - start >= s.join_timeout) {
      store.set(keys::done(), std::to_string(fail_code));
      throw std::runtime_error("only " + std::to_string(n) + " of at least " + std::to_string(s.min_nodes) +
                               " nodes joined rendezvous " + std::to_string(round) + " within " +
                               seconds_text(s.join_timeout) +
                               " (--join-timeout); start the missing nodes' fsdp-run with the same --master-addr, "
                               "--master-port and FSDP_JOB_TOKEN, or lower MIN of --nnodes");
    }
    std::this_thread::sleep_for(kPoll);
  }
}

}  // namespace

namespace keys {
std::string open_round() { return "fsdp-run/round"; }
std::string done() { return "fsdp-run/done"; }
std::string heartbeat(int id) { return "fsdp-run/heartbeat/" + std::to_string(id); }
std::string left(int id) { return "fsdp-run/left/" + std::to_string(id); }
std::string joined(int round) { return "fsdp-run/" + std::to_string(round) + "/joined"; }
std::string entry(int round, int slot) { return "fsdp-run/" + std::to_string(round) + "/slot/" + std::to_string(slot); }
std::string members(int round) { return "fsdp-run/" + std::to_string(round) + "/members"; }
std::string failed(int round) { return "fsdp-run/" + std::to_string(round) + "/failed"; }
std::string finished(int round, int id) {
  return "fsdp-run/" + std::to_string(round) + "/finished/" + std::to_string(id);
}
}  // namespace keys

std::string encode_members(const std::vector<NodeEntry>& nodes) {
  std::string out;
  for (const NodeEntry& e : nodes)
    out += (out.empty() ? "" : ",") + std::to_string(e.id) + ":" + std::to_string(e.nproc) + ":" + e.tag;
  return out;
}

std::vector<NodeEntry> decode_members(const std::string& text) {
  std::vector<NodeEntry> nodes;
  std::istringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    std::replace(item.begin(), item.end(), ':', ' ');
    const std::optional<NodeEntry> e = decode_entry(item);
    if (!e) return {};
    nodes.push_back(*e);
  }
  return nodes;
}

std::optional<Membership> place(int round, std::vector<NodeEntry> nodes, const NodeEntry& me) {
  std::stable_sort(nodes.begin(), nodes.end(), [](const NodeEntry& a, const NodeEntry& b) { return a.id < b.id; });
  Membership m;
  m.round = round;
  bool found = false;
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i].id == me.id && nodes[i].tag == me.tag) {
      found = true;
      m.node_rank = static_cast<int>(i);
      m.first_rank = m.world_size;
    }
    m.world_size += nodes[i].nproc;
  }
  if (!found) return std::nullopt;
  m.nodes = std::move(nodes);
  return m;
}

std::vector<NodeEntry> choose_members(const std::vector<NodeEntry>& joined, int max_nodes) {
  std::vector<NodeEntry> chosen;
  std::set<int> ids;
  auto take = [&](const NodeEntry& e) {
    if (e.id >= 0 && static_cast<int>(chosen.size()) < max_nodes && ids.insert(e.id).second) chosen.push_back(e);
  };
  for (const NodeEntry& e : joined)  // the host first: the job cannot run without its store
    if (e.id == 0) take(e);
  for (const NodeEntry& e : joined) take(e);
  std::sort(chosen.begin(), chosen.end(), [](const NodeEntry& a, const NodeEntry& b) { return a.id < b.id; });
  return chosen;
}

std::set<int> joined_ids(NodeStore& store, int round) {
  std::set<int> ids;
  const int64_t count = store.add(keys::joined(round), 0);
  for (int slot = 1; slot <= count; ++slot)
    if (const std::optional<std::string> text = store.get(keys::entry(round, slot)))
      if (const std::optional<NodeEntry> e = decode_entry(*text)) ids.insert(e->id);
  return ids;
}

JoinResult join_round(NodeStore& store, const RendezvousSettings& settings, int round, const NodeEntry& me,
                      const std::function<std::optional<std::set<int>>()>& expected, int fail_code) {
  const int64_t slot = store.add(keys::joined(round), 1);
  store.set(keys::entry(round, static_cast<int>(slot)), encode_entry(me));
  std::vector<NodeEntry> members;
  if (me.id == 0) {
    members = close_round(store, settings, round, expected, fail_code);
  } else {
    // Node 0 gives up after join_timeout; the margin covers its last call.
    const auto deadline = Clock::now() + settings.join_timeout + settings.last_call + std::chrono::seconds(30);
    for (;;) {
      if (store.wait({keys::members(round)}, std::chrono::milliseconds(200))) break;
      check_interrupted(settings);
      if (const std::optional<std::string> done = store.get(keys::done()))
        return {std::nullopt, std::atoi(done->c_str())};
      if (Clock::now() >= deadline)
        throw std::runtime_error("rendezvous " + std::to_string(round) + " did not close within " +
                                 seconds_text(settings.join_timeout + settings.last_call) +
                                 "; is node 0's fsdp-run running the same job (same --nnodes and --master-port)?");
    }
    members = decode_members(store.get(keys::members(round)).value_or(""));
  }
  JoinResult result;
  result.membership = place(round, members, me);
  if (!result.membership)
    for (const NodeEntry& e : members)
      if (e.id == me.id)
        throw std::runtime_error("another fsdp-run joined with --node-rank " + std::to_string(me.id) +
                                 "; give every node a distinct --node-rank");
  return result;
}

}  // namespace fsdp_run
