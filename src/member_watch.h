#pragma once
// MemberWatch: which of a job's ranks run on this host and whether their processes have ended,
// from the identity each rank publishes when it arrives at the rendezvous. Communicators use it to
// fail at once when a member on this host dies (Note [Dead members] in docs/design.md).
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {

// What names this process among all of a job's: kernel boot, pid namespace, pid, start time.
std::string process_identity();
// The store key under which rank `rank` publishes its process_identity() on arrival.
std::string arrival_key(int rank);

class MemberWatch {
 public:
  MemberWatch(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size);

  // Rank r's pid and start time when it runs on this host (same kernel boot and pid namespace),
  // read from the store once; nothing for this rank or one elsewhere.
  std::optional<std::pair<std::string, std::string>> same_host_process(int r) const;
  // True when rank `r` is known to have exited: it ran on this host and its process is gone.
  bool exited(int r) const;
  // For a communicator over `ranks`: names a same-host member whose process has ended, or returns
  // empty; itself empty when no member shares this host.
  std::function<std::string()> exit_watch(const std::vector<int>& ranks) const;

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_, world_size_;
  mutable std::mutex mu_;
  mutable std::map<int, std::vector<std::string>> identities_;  // rank -> process_identity() fields
};

}  // namespace fsdp
