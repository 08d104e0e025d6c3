#pragma once
// This process's memory as Linux reports it in /proc/self/status.
#include <cstdint>
#include <fstream>
#include <string>

namespace fsdp::detail {

// A "<key>:  1234 kB" line of /proc/self/status (VmRSS, VmHWM), in bytes; 0 when absent.
inline int64_t status_bytes(const std::string& key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1)) * 1024;
  return 0;
}

}  // namespace fsdp::detail
