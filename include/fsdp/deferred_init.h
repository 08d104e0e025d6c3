#pragma once
// Deferred initialization: build a model without allocating it; fully_shard then allocates,
// initializes and shards it one unit at a time (materialize: without sharding). Usage:
// docs/usage.md; order and checks: Note [Deferred initialization] in docs/design.md.
#include <torch/torch.h>

#include <functional>
#include <string>

namespace fsdp {

// Initializes the tensors `module` registers itself (not its children's), freshly allocated and
// uninitialized: must write every one in place (checked) and touch no other module's tensors.
// `name`: qualified name ("" for the root). Runs under NoGradGuard.
using ParamInitFn = std::function<void(const std::string& name, torch::nn::Module& module)>;

// While alive, factory operations on this thread create meta tensors (no storage; initializers on
// them do nothing and draw no random numbers). Nestable.
class DeferredInit {
 public:
  DeferredInit();
  ~DeferredInit();
  DeferredInit(const DeferredInit&) = delete;
  DeferredInit& operator=(const DeferredInit&) = delete;
  // False if this LibTorch lacks the dispatch key it relies on (then the constructor throws).
  static bool supported();

 private:
  bool previous_;
};

// The default ParamInitFn: calls reset_parameters() (reset_running_stats() included for batch
// norms) of the LibTorch modules that have one: Linear, Bilinear, Embedding, EmbeddingBag,
// Conv{1,2,3}d, ConvTranspose{1,2,3}d, LayerNorm, GroupNorm, BatchNorm{1,2,3}d,
// InstanceNorm{1,2,3}d, RNN, LSTM, GRU. Throws for any other module type, naming it.
void reset_parameters(const std::string& name, torch::nn::Module& module);

// True if `module` or any submodule still has a parameter or buffer on the meta device.
bool has_deferred_tensors(const torch::nn::Module& module);

// Materializes without sharding, in fully_shard's order and with its checks, on `device`.
// Null `init`: reset_parameters.
void materialize(torch::nn::Module& module, const ParamInitFn& init = nullptr,
                 c10::Device device = c10::Device(c10::kCPU));

}  // namespace fsdp
