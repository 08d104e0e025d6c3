#pragma once
// Shared by the fault-injection tests: a small model with one unit per layer whose forward can
// skip its middle unit, and the checks every fault case makes (exit codes, time, /dev/shm).
#include <dirent.h>

#include <chrono>
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
    if (!skip_middle) h = torch::tanh(l1(h));
    return l2(h);
  }
  torch::nn::Linear l0{nullptr}, l1{nullptr}, l2{nullptr};
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

}  // namespace fsdp_test
