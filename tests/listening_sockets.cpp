#include "listening_sockets.h"

#include <arpa/inet.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

namespace fsdp_test {

std::vector<ListeningSocket> listening_sockets(int pid) {
  std::set<std::string> inodes;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
    std::error_code link_ec;
    const std::string target = std::filesystem::read_symlink(e.path(), link_ec).string();
    if (!link_ec && target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
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
