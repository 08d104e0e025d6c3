#include "listening_sockets.h"

#include <arpa/inet.h>

#include <cstdint>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

#include "harness.h"

namespace fsdp_test {

std::vector<ListeningSocket> listening_sockets(int pid) {
  std::set<std::string> inodes;
  const std::string fd_dir = "/proc/" + std::to_string(pid) + "/fd";
  std::vector<std::string> fds;
  try {
    fds = list_dir(fd_dir);
  } catch (const std::runtime_error&) {  // the process is gone
  }
  for (const auto& fd : fds) {
    const std::string target = read_link(fd_dir + "/" + fd);
    if (target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
  }
  std::vector<ListeningSocket> found;
  for (const bool v6 : {false, true}) {
    std::ifstream table(v6 ? "/proc/net/tcp6" : "/proc/net/tcp");
    std::string line;
    std::getline(table, line);
    while (std::getline(table, line)) {
      std::istringstream f(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      if (!(f >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode))
        continue;
      if (state != "0A" || !inodes.count(inode)) continue;  // 0A: LISTEN
      char text[INET6_ADDRSTRLEN] = "?";
      const std::string hex = local.substr(0, local.find(':'));
      if (!v6) {
        in_addr a{};
        a.s_addr = static_cast<uint32_t>(std::stoul(hex, nullptr, 16));
        inet_ntop(AF_INET, &a, text, sizeof(text));
      } else {
        in6_addr a{};
        uint32_t w[4];
        for (int i = 0; i < 4; ++i) w[i] = static_cast<uint32_t>(std::stoul(hex.substr(8 * i, 8), nullptr, 16));
        std::memcpy(&a, w, sizeof(w));
        inet_ntop(AF_INET6, &a, text, sizeof(text));
      }
      found.push_back({text, std::stoi(local.substr(hex.size() + 1), nullptr, 16)});
    }
  }
  return found;
}

}  // namespace fsdp_test
