#include "stop_signal.h"

#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <csignal>
#include <cstdint>

namespace fsdp_gpt {

namespace {

volatile std::sig_atomic_t g_stop_requested = 0;
void request_stop(int) { g_stop_requested = 1; }

}  // namespace

void install_stop_handler() {
  struct sigaction action {};
  action.sa_handler = request_stop;
  action.sa_flags = SA_RESTART;  // blocking calls in the communicators resume instead of failing
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
}

bool stop_requested_anywhere(fsdp::ProcessGroup& pg) {
  auto flag = torch::tensor({static_cast<int64_t>(g_stop_requested)}, torch::kLong);
  if (pg.size() > 1) pg.world()->all_reduce(flag)->wait();
  return flag.item<int64_t>() > 0;
}

}  // namespace fsdp_gpt
