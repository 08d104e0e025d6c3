#pragma once
// Shared by the fault-injection tests: a small model with one unit per layer whose forward can
// skip its middle unit and call back inside forward and backward, and the checks every fault case
// makes (exit codes, time, /dev/shm, process states).
#include <dirent.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "harness.h"

namespace fsdp_test {

struct SkippyImpl : torch::nn::Module {
  SkippyImpl() {
    l0 = register_module("l0", torch::nn::Linear(8, 16));
    l1 = register_module("l1", torch::nn::Linear(16, 16));
    l2 = register_module("l2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(const torch::Tensor& x, bool skip_middle = false) {
    auto h = torch::tanh(l0(x));
    if (in_forward) in_forward();  // between units: l0's gathered, l1's not yet
    if (!skip_middle) h = torch::tanh(l1(h));
    // Runs in backward once l2's gradients exist (its reduction issued), before l1's backward.
    if (in_backward && h.requires_grad()) h.register_hook([this](const torch::Tensor&) { in_backward(); });
    return l2(h);
  }
  torch::nn::Linear l0{nullptr}, l1{nullptr}, l2{nullptr};
  std::function<void()> in_forward, in_backward;
};
TORCH_MODULE(Skippy);

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Names of /dev/shm entries a rank with one of `pids` created (ours are "fsdp-<creator pid>-...").
inline std::vector<std::string> leftover_segments(const std::vector<int>& pids) {
  std::vector<std::string> left;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      for (int pid : pids)
        if (name.rfind("fsdp-" + std::to_string(pid) + "-", 0) == 0) left.push_back(name);
    }
    closedir(d);
  }
  return left;
}

// The state letter of process `pid` in /proc (R, S, T stopped, Z exited, ...), or '?' if gone.
inline char process_state(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  std::getline(in, stat);
  const size_t paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() ? '?' : stat[paren + 2];
}

// Whether a survivor's output names the dead member: its death seen by this rank, a peer that saw
// it and failed first, or its closed connection (Gloo over TCP).
inline bool names_dead_member(const std::string& out) {
  for (const char* part : {") died", "failed a collective", "Connection", "connection"})
    if (out.find(part) != std::string::npos) return true;
  return false;
}

}  // namespace fsdp_test
