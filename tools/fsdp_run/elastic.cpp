#include "elastic.h"

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "exit_codes.h"
#include "job_token.h"
#include "launcher.h"
#include "output_mux.h"
#include "rendezvous.h"
#include "signals.h"
#include "store_server.h"
#include "store_wire.h"

namespace fsdp_run {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr milliseconds kHeartbeatPeriod(200);

milliseconds to_ms(double seconds) { return milliseconds(static_cast<int64_t>(seconds * 1000)); }

void say(const std::string& message) { OutputMux().say(message); }

bool is_loopback(const std::string& host) { return host.rfind("127.", 0) == 0 || host == "localhost" || host == "::1"; }

std::string rank_span(const Membership& m, int nproc) {
  return nproc == 1 ? "rank " + std::to_string(m.first_rank)
                    : "ranks " + std::to_string(m.first_rank) + "-" + std::to_string(m.first_rank + nproc - 1);
}

class ElasticAgent {
 public:
  explicit ElasticAgent(const Options& o) : opt_(o) {
    me_.id = o.node_rank;
    me_.nproc = o.nproc_per_node;
    me_.tag = fsdp::to_hex(fsdp::random_bytes(8));
    settings_.min_nodes = o.nnodes_min;
    settings_.max_nodes = o.nnodes;
    settings_.join_timeout = to_ms(o.join_timeout);
    settings_.last_call = to_ms(o.last_call);
    settings_.interrupted = [] {
      return g_got_sigint != 0 || g_got_sigterm != 0;
    };
  }

  ~ElasticAgent() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      quit_ = true;
    }
    wake_.notify_all();
    if (watcher_.joinable()) watcher_.join();
  }

  int run() {
    const std::string token = fsdp::job_token();
    if (token.empty() && !is_loopback(opt_.master_addr))
      say("FSDP_JOB_TOKEN is not set: the rendezvous store at --master-addr accepts any client that reaches it; "
          "set the same FSDP_JOB_TOKEN on every node (docs/security.md)");
    const milliseconds connect_timeout = settings_.join_timeout;
    if (host()) {
      try {
        server_ =
            std::make_unique<fsdp::StoreServer>(is_loopback(opt_.master_addr) ? opt_.master_addr : "", opt_.master_port,
                                                token, std::chrono::seconds(10), "fsdp-run node 0: the node store");
      } catch (const std::exception& e) {
        throw std::runtime_error(std::string("node 0 cannot host the rendezvous store: ") + e.what() +
                                 "; pick a free --master-port (the ranks use it + 1 as MASTER_PORT)");
      }
    }
    try {
      store_ = std::make_unique<NodeStore>(opt_.master_addr, opt_.master_port, token, connect_timeout);
      watch_store_ = std::make_unique<NodeStore>(opt_.master_addr, opt_.master_port, token, connect_timeout);
    } catch (const fsdp::StoreAuthError&) {
      throw;
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string("cannot reach the rendezvous store: ") + e.what() +
                               "; start fsdp-run --node-rank 0 on the host of --master-addr " + opt_.master_addr +
                               " (it hosts the store at --master-port)");
    }
    int round = 0;
    if (host()) {
      store_->set(keys::open_round(), "0");
    } else {
      if (!store_->wait({keys::open_round()}, connect_timeout))
        throw std::runtime_error("node 0 opened no rendezvous within " + format_seconds(opt_.join_timeout));
      round = std::atoi(store_->get(keys::open_round()).value_or("0").c_str());
    }
    watcher_ = std::thread([this] { watch(); });
    return rounds(round);
  }

 private:
  bool host() const { return me_.id == 0; }

  // Joins `round` and those after it until the job ends; returns the exit code.
  int rounds(int round) {
    for (;;) {
      round_ = round;
      JoinResult joined;
      try {
        joined = join_round(
            *store_, settings_, round, me_, [&] { return expected(round); }, kExitInternal);
      } catch (const Interrupted&) {
        return leave_interrupted();
      }
      if (joined.done) return leave(*joined.done, "the job ended before this node joined");
      if (!joined.membership) {
        say("rendezvous " + std::to_string(round) +
            " closed before this node joined; waiting for the next one (after a failure)");
        const std::optional<int> next = wait_for_next_round(round);
        if (settings_.interrupted()) return leave_interrupted();
        if (!next) return leave(std::atoi(store_->get(keys::done()).value_or("1").c_str()), "the job ended");
        round = *next;
        continue;
      }
      const Membership m = *joined.membership;
      say("rendezvous " + std::to_string(round) + ": " + std::to_string(m.nodes.size()) + " node" +
          (m.nodes.size() == 1 ? "" : "s") + ", world size " + std::to_string(m.world_size) + "; this is node " +
          std::to_string(m.node_rank) + " with " + rank_span(m, me_.nproc));
      std::optional<int> code = run_round(m);
      if (code) return *code;
      ++round;
      if (host()) store_->set(keys::open_round(), std::to_string(round));
      say("joining rendezvous " + std::to_string(round) + " (restart " + std::to_string(round) + " of " +
          std::to_string(opt_.max_restarts) + ")");
    }
  }

  // Runs this node's ranks in the round `m`; returns the exit code when this node is done, nothing
  // when it joins the next round.
  std::optional<int> run_round(const Membership& m) {
    Options o = opt_;
    o.node_rank = m.node_rank;
    o.nnodes = static_cast<int>(m.nodes.size());
    o.nproc_per_node = me_.nproc;
    o.first_rank = m.first_rank;
    o.world_size = m.world_size;
    o.master_port = opt_.master_port + 1;  // the store of the job's rank 0
    {
      std::lock_guard<std::mutex> lock(mu_);
      members_ = m.nodes;
      for (const NodeEntry& e : m.nodes) known_.insert(e.id);
      stop_reason_.reset();
      watched_round_ = m.round;
    }
    StartHooks hooks;
    hooks.on_failure = [&](const std::string& why) {
      try {
        store_->compare_set(keys::failed(m.round), "", "node " + std::to_string(me_.id) + ": " + why);
      } catch (const StoreLost&) {  // the watcher reports it
      }
    };
    hooks.stop_reason = [&]() -> std::optional<std::string> {
      std::lock_guard<std::mutex> lock(mu_);
      return stop_reason_;
    };
    const Attempt attempt = run_ranks(o, m.round, hooks);
    check_store();
    if (attempt.code == 0) {
      store_->set(keys::finished(m.round, me_.id), "1");
      if (std::optional<int> code = wait_for_the_others(m)) return code;
    }
    const int code = attempt.code != 0 ? attempt.code : kExitInternal;
    if (attempt.interrupted) return leave(code, "fsdp-run was interrupted");
    if (me_.nproc - attempt.lost < opt_.nproc_min)
      return leave(code, std::to_string(me_.nproc - attempt.lost) + " of this node's ranks left, fewer than the " +
                             std::to_string(opt_.nproc_min) + " --nproc-per-node allows");
    if (m.round >= opt_.max_restarts)
      return leave(code, "no restart left (--max-restarts " + std::to_string(opt_.max_restarts) + ")");
    me_.nproc -= attempt.lost;
    return std::nullopt;
  }

  // After this node's ranks succeeded: the job's exit code once every member's have, nothing
  // when another node failed first (the round is run again).
  std::optional<int> wait_for_the_others(const Membership& m) {
    for (;;) {
      if (store_->get(keys::failed(m.round))) return std::nullopt;
      if (host()) {
        bool all = true;
        for (const NodeEntry& e : m.nodes) all = all && store_->get(keys::finished(m.round, e.id)).has_value();
        if (all) return leave(0, "");
      } else if (const std::optional<std::string> done = store_->get(keys::done())) {
        return leave(std::atoi(done->c_str()), "");
      }
      if (settings_.interrupted()) return leave_interrupted();
      std::this_thread::sleep_for(kHeartbeatPeriod);
      check_store();
    }
  }

  // Leaves after SIGINT or SIGTERM outside a run of the ranks, with the shell's code for it.
  int leave_interrupted() {
    const bool sigint = g_got_sigint != 0;
    return leave(128 + (sigint ? SIGINT : SIGTERM), std::string("received ") + (sigint ? "SIGINT" : "SIGTERM"));
  }

  // Ends this node's part with `code`, saying why (unless `why` is empty). Node 0 ends the job:
  // it publishes the code and waits (briefly) until the other nodes of the round have read it.
  int leave(int code, const std::string& why) {
    if (!why.empty()) say(std::string(host() ? "ending the job" : "leaving the job") + ": " + why);
    if (!host()) {
      store_->set(keys::left(me_.id), "1");
      return code;
    }
    store_->set(keys::done(), std::to_string(code));
    std::set<int> ids = joined_ids(*store_, round_);  // those waiting for a later round too
    for (const NodeEntry& e : members()) ids.insert(e.id);
    const auto deadline = Clock::now() + to_ms(opt_.grace_seconds) + to_ms(opt_.node_timeout);
    for (;;) {
      bool all = true;
      for (int id : ids)
        if (id != me_.id && !store_->get(keys::left(id)) && fresh(id)) all = false;
      if (all || Clock::now() >= deadline) return code;
      std::this_thread::sleep_for(kHeartbeatPeriod);
    }
  }

  // Node 0, for round `round` > 0: the members of the round before that are still alive and have
  // not left; nothing for the first round.
  std::optional<std::set<int>> expected(int round) {
    if (round == 0) return std::nullopt;
    std::set<int> ids;
    for (const NodeEntry& e : members())
      if (fresh(e.id) && !store_->get(keys::left(e.id))) ids.insert(e.id);
    return ids;
  }

  // A node that came late: the next round's number once node 0 opens it, nothing if the job ends.
  std::optional<int> wait_for_next_round(int round) {
    for (;;) {
      if (store_->get(keys::done())) return std::nullopt;
      const int open = std::atoi(store_->get(keys::open_round()).value_or("0").c_str());
      if (open > round || settings_.interrupted()) return open;
      std::this_thread::sleep_for(kHeartbeatPeriod);
      check_store();
    }
  }

  // The watcher thread: advances this node's heartbeat; stops the ranks when the round failed
  // elsewhere or the store is lost; on node 0, fails the round of a node whose heartbeat stopped.
  void watch() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!quit_) {
      const int round = watched_round_;
      const std::vector<NodeEntry> nodes = members_;
      const std::set<int> known = known_;
      lock.unlock();
      std::optional<std::string> reason;
      try {
        watch_store_->add(keys::heartbeat(me_.id), 1);
        if (host()) reason = check_heartbeats(round, nodes, known);
        if (round >= 0)
          if (std::optional<std::string> failed = watch_store_->get(keys::failed(round))) reason = *failed;
      } catch (const std::exception& e) {
        store_lost_ = true;
        reason = std::string(e.what());
      }
      lock.lock();
      if (reason && !stop_reason_ && round == watched_round_) {
        stop_reason_ = reason;
        const char byte = 1;
        (void)!::write(g_wake_pipe[1], &byte, 1);
      }
      if (store_lost_) return;
      wake_.wait_for(lock, kHeartbeatPeriod, [&] { return quit_; });
    }
  }

  // Node 0's watcher: reads every known node's heartbeat; fails `round` when a member's stopped.
  std::optional<std::string> check_heartbeats(int round, const std::vector<NodeEntry>& nodes,
                                              const std::set<int>& known) {
    const auto now = Clock::now();
    for (int id : known) {
      if (id == me_.id) continue;
      const std::string beat = watch_store_->get(keys::heartbeat(id)).value_or("");
      std::lock_guard<std::mutex> lock(liveness_mu_);
      auto [it, added] = liveness_.try_emplace(id, Beat{beat, now});
      if (!added && it->second.value != beat) it->second = Beat{beat, now};
    }
    if (round < 0) return std::nullopt;
    for (const NodeEntry& e : nodes)
      if (e.id != me_.id && !fresh(e.id) && !watch_store_->get(keys::left(e.id))) {
        const std::string why = "node " + std::to_string(e.id) + " sent no heartbeat for " +
                                format_seconds(opt_.node_timeout) + " (its fsdp-run is gone)";
        watch_store_->compare_set(keys::failed(round), "", why);
        return why;
      }
    return std::nullopt;
  }

  bool fresh(int id) {
    std::lock_guard<std::mutex> lock(liveness_mu_);
    const auto it = liveness_.find(id);
    return it == liveness_.end() || Clock::now() - it->second.changed < to_ms(opt_.node_timeout);
  }

  std::vector<NodeEntry> members() {
    std::lock_guard<std::mutex> lock(mu_);
    return members_;
  }

  void check_store() {
    if (store_lost_) throw StoreLost("lost the connection to the rendezvous store at " + store_->where());
  }

  struct Beat {
    std::string value;
    Clock::time_point changed;
  };

  Options opt_;
  NodeEntry me_;
  RendezvousSettings settings_;
  int round_ = 0;                              // the round this node joined last
  std::unique_ptr<fsdp::StoreServer> server_;  // node 0 only
  std::unique_ptr<NodeStore> store_;           // the main thread's connection
  std::unique_ptr<NodeStore> watch_store_;     // the watcher's
  std::thread watcher_;
  std::atomic<bool> store_lost_{false};

  std::mutex mu_;  // guards what follows
  std::condition_variable wake_;
  bool quit_ = false;
  int watched_round_ = -1;
  std::vector<NodeEntry> members_;  // of the latest round this node ran
  std::set<int> known_;             // every node that was a member
  std::optional<std::string> stop_reason_;

  std::mutex liveness_mu_;  // guards liveness_
  std::map<int, Beat> liveness_;
};

}  // namespace

int launch_elastic(const Options& options) {
  try {
    return ElasticAgent(options).run();
  } catch (const StoreLost& e) {
    say(std::string(e.what()) +
        ": node 0's fsdp-run, which hosts it, is gone, and an elastic job ends with it; start the job again on "
        "every node (fsdp_gpt --resume continues from the newest complete checkpoint)");
  } catch (const std::exception& e) {
    say(e.what());
  }
  return kExitInternal;
}

}  // namespace fsdp_run
