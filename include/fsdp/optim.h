#pragma once
// FusedAdamW: LibTorch's AdamW (same options, parameter groups, state and state dict) whose step,
// for CUDA parameters on LibTorch 2.x, runs PyTorch's fused multi-tensor AdamW kernel: one pass
// over each parameter, gradient and moment tensor, against roughly ten elementwise kernels per
// parameter in torch::optim::AdamW::step. Elsewhere (CPU parameters, sparse gradients, amsgrad,
// LibTorch 1.x) it is torch::optim::AdamW::step itself. Use it over FSDP's shards
// (FullyShardedModule::parameters()) or any model's parameters.
#include <torch/torch.h>

#include <unordered_map>

namespace fsdp {

class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
  // Whether the last step() ran the fused kernel (false: the reference implementation).
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
