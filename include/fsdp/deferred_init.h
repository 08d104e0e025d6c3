#pragma once
// Deferred initialization: build a model without allocating its parameters, then let fully_shard
// allocate, initialize and shard it one unit at a time, so no rank ever holds the whole model.
//
//   std::shared_ptr<GPTImpl> model;
//   {
//     fsdp::DeferredInit deferred;           // factory ops on this thread make meta tensors
//     model = std::make_shared<GPTImpl>(config);  // unmodified constructor: allocates nothing
//   }
//   auto sharded = fsdp::fully_shard(model, pg, fsdp::Options().param_init_fn(my_init));
//
// fully_shard walks the modules in pre-order (registration order). For each module with meta
// parameters or buffers of its own it gives them fresh, uninitialized CPU storage (identities kept)
// and calls the init function, which must write every one of them; each FlatParameter is built and
// sharded as soon as the last module registering one of its parameters has been visited. With
// standard modules and the default init (their reset_parameters()), the random draws happen in the
// order a plain construction makes them, so a seeded deferred model equals a seeded eager one.
#include <torch/torch.h>

#include <functional>
#include <string>

namespace fsdp {

// Initializes the parameters and buffers registered by `module` itself (not its children): every
// meta tensor of the module has been given uninitialized CPU storage and must be written (an
// in-place op such as normal_, zero_ or copy_; checked). `name` is the module's qualified name
// ("" for the root). Runs under NoGradGuard. Must not touch other modules' tensors: an earlier
// unit may already be sharded.
using ParamInitFn = std::function<void(const std::string& name, torch::nn::Module& module)>;

// While alive, factory operations on this thread (empty, zeros, ones, randn, ...) create tensors
// on the meta device: they have shapes and dtypes but no storage, and in-place ops on them
// (initializers) do nothing and draw no random numbers. Nestable.
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

// Single-process materialization (no sharding), with fully_shard's order and checks: e.g. the
// local reference of a model built under DeferredInit. Null `init` means reset_parameters. The
// tensors are allocated on `device` and initialized there (fully_shard uses its communicators' device).
void materialize(torch::nn::Module& module, const ParamInitFn& init = nullptr,
                 c10::Device device = c10::Device(c10::kCPU));

}  // namespace fsdp
