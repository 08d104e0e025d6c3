#include "member_watch.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "fsdp/check.h"

namespace fsdp {

namespace {

// A process's start time (clock ticks after boot) and state letter from /proc/<pid>/stat.
bool read_proc_stat(const std::string& pid, std::string& start_time, char& state) {
  std::ifstream in("/proc/" + pid + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return false;
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return false;
  std::istringstream fields(stat.substr(paren + 2));
  std::string field;
  fields >> state;  // field 3; the start time is field 22
  for (int i = 4; i <= 22 && fields >> field; ++i) start_time = field;
  return true;
}

// Whether the process `pid` that started at `start_time` (clock ticks after boot) has ended: it
// is gone, a zombie, or the pid now names a later process. A /proc entry that cannot be read (no
// file descriptor left, say) proves nothing: then only the kernel's "no such process" counts.
bool process_gone(const std::string& pid, const std::string& start_time) {
  std::string start;
  char state = '?';
  if (!read_proc_stat(pid, start, state))
    return ::kill(static_cast<pid_t>(std::strtol(pid.c_str(), nullptr, 10)), 0) != 0 && errno == ESRCH;
  return state == 'Z' || state == 'X' || start != start_time;
}

}  // namespace

// What names this process among all of a job's: kernel boot, pid namespace, pid, start time.
std::string process_identity() {
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  std::getline(boot, boot_id);
  char ns[128] = {0};
  const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  std::string start;
  char state = '?';
  const std::string pid = std::to_string(getpid());
  read_proc_stat(pid, start, state);
  return boot_id + " " + std::string(ns, n > 0 ? static_cast<size_t>(n) : 0) + " " + pid + " " + start;
}

std::string arrival_key(int rank) { return "fsdp/arrived/" + std::to_string(rank); }

MemberWatch::MemberWatch(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size)
    : store_(std::move(store)), rank_(rank), world_size_(world_size) {}

std::optional<std::pair<std::string, std::string>> MemberWatch::same_host_process(int r) const {
  if (r == rank_ || r < 0 || r >= world_size_) return std::nullopt;
  std::lock_guard<std::mutex> lock(mu_);
  auto& cached = identities_;
  if (!cached.count(rank_)) {
    std::istringstream in(process_identity());
    for (std::string f; in >> f;) cached[rank_].push_back(f);
  }
  if (!cached.count(r)) {
    const auto raw = store_->get(arrival_key(r));
    std::istringstream in(std::string(raw.begin(), raw.end()));
    for (std::string f; in >> f;) cached[r].push_back(f);
  }
  const auto& theirs = cached[r];
  const auto& mine = cached[rank_];
  if (theirs.size() != 4 || mine.size() != 4 || theirs[0] != mine[0] || theirs[1] != mine[1]) return std::nullopt;
  return std::make_pair(theirs[2], theirs[3]);
}

bool MemberWatch::exited(int r) const {
  const auto process = same_host_process(r);
  return process && process_gone(process->first, process->second);
}

std::function<std::string()> MemberWatch::exit_watch(const std::vector<int>& ranks) const {
  struct Member {
    int rank;
    std::string pid, start;
  };
  std::vector<Member> members;
  try {
    // Only members seen alive now. One whose /proc entry cannot be read from here (another user's,
    // under hidepid) is alive to process_gone until kill(pid, 0) answers ESRCH.
    for (int r : ranks)
      if (const auto process = same_host_process(r); process && !process_gone(process->first, process->second))
        members.push_back({r, process->first, process->second});
  } catch (const std::exception&) {
    return {};  // the store did not answer: no watch, Gloo's own detection remains
  }
  if (members.empty()) return {};
  return [members] {
    for (const auto& m : members)
      if (process_gone(m.pid, m.start)) return detail::compose("rank ", m.rank, " (pid ", m.pid, ") died");
    return std::string();
  };
}

}  // namespace fsdp
