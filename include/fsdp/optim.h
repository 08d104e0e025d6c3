#pragma once
// FusedAdamW: torch::optim::AdamW whose step updates each parameter in one pass: libfsdp's own
// single-pass kernel for float32 CPU parameters, PyTorch's fused AdamW kernel for CUDA
// parameters on LibTorch 2.x, and AdamW's own step elsewhere. See Note [FusedAdamW] in docs/design.md.
#include <torch/torch.h>

#include <unordered_map>

namespace fsdp {

class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
  // Whether the last step() ran a fused kernel (false: the reference implementation).
  bool last_step_fused() const { return last_step_fused_; }

 private:
  struct DeviceStep {
    at::Tensor count;  // float32 scalar on the parameter's device, read by the fused kernel
    int64_t synced = -1;
  };
  std::unordered_map<const void*, DeviceStep> device_steps_;
  bool last_step_fused_ = false;
};

}  // namespace fsdp
