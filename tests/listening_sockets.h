#pragma once
// The TCP sockets a process listens on, and a free loopback port: for tests of what a job exposes.
#include <string>
#include <vector>

namespace fsdp_test {

struct ListeningSocket {
  std::string address;  // e.g. "127.0.0.1" or "::1"
  int port = 0;
};

// The TCP sockets (IPv4 and IPv6) process `pid` listens on, from the kernel's socket tables;
// empty when the process is gone.
std::vector<ListeningSocket> listening_sockets(int pid);

}  // namespace fsdp_test
