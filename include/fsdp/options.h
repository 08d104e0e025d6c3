#pragma once
// Options for fully_shard() (TORCH_ARG setters with defaults, validated when FSDP is applied).
// Reference with every default: docs/usage.md.
#include <torch/arg.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "fsdp/deferred_init.h"
#include "fsdp/wrap_policy.h"

namespace fsdp {

enum class ShardingStrategy {
  kFullShard,    // shard parameters, gradients, optimizer state; reshard after forward
  kShardGradOp,  // like kFullShard, but parameters stay unsharded from forward until backward
  kNoShard,      // replicate (DDP): all-reduce gradients
  kHybridShard,  // shard within groups of F consecutive ranks, replicate across groups
};
std::string to_string(ShardingStrategy s);
// Accepts FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD (any case, '-' or '_').
ShardingStrategy parse_sharding_strategy(const std::string& name);

// When to all-gather the next unit in backward (paper 3.3.2); "next" follows the reverse of this
// iteration's forward order. See Note [Backward prefetch] in docs/design.md.
enum class BackwardPrefetch {
  kBackwardPre,   // when the current unit's backward starts, before its reduce-scatter
  kBackwardPost,  // when the current unit's gradients are complete, just before its reduce-scatter
  kNone,          // gather each unit when backward reaches it
};
std::string to_string(BackwardPrefetch p);
// Accepts BACKWARD_PRE, BACKWARD_POST, NONE (any case, '-' or '_').
BackwardPrefetch parse_backward_prefetch(const std::string& name);

// Where the optimizer step in backward runs (FullyShardedModule::set_step_in_backward).
enum class StepThread {
  kAuto,      // kOwn under CPU offload when the optimizer holds only this module's pieces; else kBackward
  kBackward,  // backward's own thread, between units' gradient computations
  kOwn,       // a host thread of the module's own, beside backward (the optimizer may hold only its pieces)
};

// Where a parameter that several units' modules share (e.g. tied embeddings) goes.
enum class SharedParameterPolicy {
  kLowestCommonAncestor,  // place it in the lowest unit that contains every module using it
  kError,                 // refuse, naming the parameter
};

// Which modules a MixedPrecision keeps in full precision (MixedPrecision::keep_full_precision).
using ModulePredicate = std::function<bool(const torch::nn::Module& module)>;

// Native mixed precision (paper 4.1): the optimizer steps full-precision shards; each shard is cast
// to param_dtype before its all-gather, forward and backward compute in param_dtype, and gradients
// are reduced in reduce_dtype into full-precision shard gradients. Modules that keep_full_precision
// selects (BatchNorm by default) keep their parameters and buffers in their own dtype. See Note
// [Mixed precision].
struct MixedPrecision {
  // Dtype of the unsharded parameters (floating-point ones only). Unset: the parameters' own.
  TORCH_ARG(c10::optional<at::ScalarType>, param_dtype) = c10::nullopt;
  // Dtype of the gradient reduction. Unset: param_dtype.
  TORCH_ARG(c10::optional<at::ScalarType>, reduce_dtype) = c10::nullopt;
  // Floating-point buffers are cast to it when FSDP is applied. Unset: left as they are.
  TORCH_ARG(c10::optional<at::ScalarType>, buffer_dtype) = c10::nullopt;
  // Explicit units (fsdp::Sharded) cast their floating-point tensor outputs to it. Unset: no cast.
  TORCH_ARG(c10::optional<at::ScalarType>, output_dtype) = c10::nullopt;
  // Explicit units and the root's forward through the handle (FullyShardedModuleOf::forward) cast
  // their floating-point tensor arguments to param_dtype.
  TORCH_ARG(bool, cast_forward_inputs) = true;
  // Modules whose own parameters and buffers stay in their dtype (no param_dtype, reduce_dtype or
  // buffer_dtype for them): their operators take low-precision inputs with full-precision weights
  // and statistics, as LibTorch's BatchNorm kernels do. Default: BatchNorm1d/2d/3d. Null: none.
  TORCH_ARG(ModulePredicate, keep_full_precision) = is_batch_norm;
  // The shard gradients the optimizer sees stay in reduce_dtype instead of the parameters' dtype
  // (less gradient memory; accumulation across backwards then also runs in reduce_dtype).
  TORCH_ARG(bool, keep_low_precision_grads) = false;

 public:
  // keep_full_precision for modules of these types (module or holder types, e.g. BatchNorm2d).
  template <typename... Modules>
  MixedPrecision& keep_full_precision_of() {
    keep_full_precision_ = [](const torch::nn::Module& m) {
      return (is_module_type<Modules>(m) || ...);
    };
    return *this;
  }

  bool enabled() const { return param_dtype_.has_value() || reduce_dtype_.has_value(); }
  // Whether `module`'s own parameters and buffers keep their dtype under this policy.
  bool keeps_full_precision(const torch::nn::Module& module) const {
    return enabled() && keep_full_precision_ && keep_full_precision_(module);
  }
  // The default of keep_full_precision.
  static bool is_batch_norm(const torch::nn::Module& m) {
    return is_module_type<torch::nn::BatchNorm1dImpl>(m) || is_module_type<torch::nn::BatchNorm2dImpl>(m) ||
           is_module_type<torch::nn::BatchNorm3dImpl>(m);
  }

 private:
  // Whether `m` is a `M` (a module type or a ModuleHolder of one).
  template <typename M>
  static bool is_module_type(const torch::nn::Module& m) {
    if constexpr (std::is_base_of_v<torch::nn::Module, M>) {
      return dynamic_cast<const M*>(&m) != nullptr;
    } else {
      static_assert(std::is_base_of_v<torch::nn::Module, typename M::ContainedType>,
                    "MixedPrecision::keep_full_precision_of<M...>: each M must be a module type (e.g. "
                    "torch::nn::BatchNorm2dImpl) or a module holder (e.g. torch::nn::BatchNorm2d)");
      return dynamic_cast<const typename M::ContainedType*>(&m) != nullptr;
    }
  }
};

// CPU offload (ZeRO-Offload, FSDP2's CPUOffloadPolicy): sharded parameters, their gradients and so
// the optimizer state in host memory, for a process group that computes on a CUDA device. On a
// CPU process group everything is in host memory already and fully_shard() refuses it with the
// fix. See Note [CPU offload] in docs/design.md.
struct CpuOffload {
  bool enabled() const { return params_; }

  // Keep the sharded parameters and their gradients in host memory.
  TORCH_ARG(bool, params) = false;
  // Page-locked host memory, so copies to and from the device run asynchronously.
  TORCH_ARG(bool, pin_memory) = true;
  // Under mixed precision, cast each shard to the compute dtype on the host before its copy to the
  // device (fewer bytes over the link); false: copy it in its own dtype and cast on the device.
  TORCH_ARG(bool, cast_on_host) = true;
};

// Per-unit exception to the strategy's reshard-after-forward: asked with each non-root unit's
// qualified name and module; true frees its parameters after its forward (FULL_SHARD's way), false
// keeps them until its backward (SHARD_GRAD_OP's way), nullopt keeps the strategy's choice.
using ReshardPolicy =
    std::function<c10::optional<bool>(const std::string& qualified_name, const torch::nn::Module& module)>;

// The 8-bit codes of quantized communication: int8, or float8 e4m3 (LibTorch 2.1 and later).
enum class QuantizedDtype { kInt8, kFloat8E4M3 };
std::string to_string(QuantizedDtype d);
QuantizedDtype parse_quantized_dtype(const std::string& name);  // "int8", "fp8"; throws fsdp::Error
bool has_float8();  // whether this LibTorch has the 8-bit float type kFloat8E4M3 needs

// Which units' all-gathers a Quantization applies to: asked with each unit's qualified name ("" for
// the root) and module.
using UnitFilter = std::function<bool(const std::string& qualified_name, const torch::nn::Module& module)>;

// Quantized communication (ZeRO++'s qwZ): values travel as 8-bit codes with one float32 scale per
// block of block_size values, rounded to nearest. The full-precision shards stay the optimizer's
// master copy. See Note [Quantized communication] in docs/design.md.
struct Quantization {
  // Quantize at all.
  TORCH_ARG(bool, enabled) = false;
  TORCH_ARG(QuantizedDtype, dtype) = QuantizedDtype::kInt8;
  // Values per scale.
  TORCH_ARG(int64_t, block_size) = 256;
  // The units whose collectives are quantized; null: every unit but the root (which holds the
  // embeddings and output head of typical models).
  TORCH_ARG(UnitFilter, units) = nullptr;
  // reduce_quantization only: each rank keeps, per flat parameter, what quantizing its gradient
  // (and its part of the sum) dropped and adds it to the next reduction's values before quantizing.
  TORCH_ARG(bool, error_feedback) = false;

 public:
  static Quantization int8(int64_t block_size = 256) { return Quantization().enabled(true).block_size(block_size); }
  static Quantization float8(int64_t block_size = 256) {
    return Quantization().enabled(true).dtype(QuantizedDtype::kFloat8E4M3).block_size(block_size);
  }
  // Whether the unit `qualified_name` (module `module`; "" the root) is quantized.
  bool applies_to(const std::string& qualified_name, const torch::nn::Module& module) const {
    return enabled_ && (units_ ? units_(qualified_name, module) : !qualified_name.empty());
  }
};

struct Options {
  TORCH_ARG(ShardingStrategy, sharding_strategy) = ShardingStrategy::kFullShard;
  // kHybridShard: ranks per shard group (consecutive ranks); 0 = LOCAL_WORLD_SIZE. Other
  // strategies shard over the whole world (kNoShard: not at all).
  TORCH_ARG(int, sharding_factor) = 0;
  // Which submodules become units (wrap_policy.h). Null: only the root.
  TORCH_ARG(WrapPolicy, auto_wrap_policy) = nullptr;
  // These submodules become units too (manual annotation).
  TORCH_ARG(std::vector<std::shared_ptr<torch::nn::Module>>, wrap_modules) = {};
  TORCH_ARG(SharedParameterPolicy, shared_parameters) = SharedParameterPolicy::kLowestCommonAncestor;
  // Submodules FSDP leaves alone, with their children: their parameters and buffers are not
  // flattened, sharded, gathered, reduced, broadcast or cast (PyTorch FSDP's ignored_modules).
  TORCH_ARG(std::vector<std::shared_ptr<torch::nn::Module>>, ignored_modules) = {};
  // Parameters FSDP leaves alone, as ignored_modules does (set one of the two, not both).
  TORCH_ARG(std::vector<at::Tensor>, ignored_parameters) = {};
  // Broadcast rank 0's parameters and buffers when FSDP is applied.
  TORCH_ARG(bool, sync_module_states) = true;
  // Broadcast rank 0's buffers at the end of every backward (DDP's broadcast_buffers).
  TORCH_ARG(bool, broadcast_buffers) = true;
  // Initializer for a model built under fsdp::DeferredInit (deferred_init.h), called per module.
  // Null: fsdp::reset_parameters.
  TORCH_ARG(ParamInitFn, param_init_fn) = nullptr;

  // Overlap of communication with computation (paper 3.3, 3.4); see docs/usage.md.
  TORCH_ARG(BackwardPrefetch, backward_prefetch) = BackwardPrefetch::kBackwardPre;
  // Gather the next unit (previous iteration's forward order) before computing the current one.
  // See Note [Forward prefetch] in docs/design.md.
  TORCH_ARG(bool, forward_prefetch) = true;
  // Per-unit reshard after forward (ReshardPolicy above); null: the strategy decides for every
  // unit, and keeps the unit backward needs first (Note [Kept for backward]). The root always
  // keeps its parameters from forward to backward (paper 3.3.1).
  TORCH_ARG(ReshardPolicy, reshard_after_forward_policy) = nullptr;
  // Units that reshard after forward keep their parameters sharded over groups of this many
  // consecutive ranks (e.g. one host's) until their backward, whose all-gather then stays inside
  // the group (hpZ; FSDP2's integer reshard_after_forward). A divisor of the shard group's size,
  // strictly between 1 and it; 0: free them completely. See Note [Reshard to a smaller group].
  TORCH_ARG(int, reshard_after_forward_size) = 0;
  // Rate limiter: hold a prefetch back while all_gather_limit non-root units are unsharded or
  // being gathered; gathers needed now are never held back. Prefetching looks ahead until that
  // many are. See Notes [Rate limiter] and [Prefetch depth] in docs/design.md.
  TORCH_ARG(bool, limit_all_gathers) = true;
  TORCH_ARG(int, all_gather_limit) = 2;
  // Most gradient reductions left in flight during backward; their buffers are freed by count,
  // never on completion, so gradient memory does not depend on timing. 0: wait for each.
  // See Note [Reductions in flight] in docs/design.md.
  TORCH_ARG(int, reductions_in_flight) = 2;
  // Keep released unsharded buffers for reuse by size (MemoryStats::cached_bytes); off: free them
  // at once. See Note [Buffer reuse] in docs/design.md.
  TORCH_ARG(bool, reuse_buffers) = true;
  // Mixed precision (MixedPrecision above); off by default.
  TORCH_ARG(MixedPrecision, mixed_precision) = {};
  // CPU offload (CpuOffload above); off by default.
  TORCH_ARG(CpuOffload, offload) = {};
  // The parameter all-gathers carry 8-bit codes (Quantization above); off by default.
  TORCH_ARG(Quantization, all_gather_quantization) = {};
  // The gradient reductions carry 8-bit codes, summed in float32 on arrival (reduce-scatters; the
  // all-reduces of NO_SHARD and of HYBRID_SHARD's replicas also gather the sums as codes); off by
  // default.
  TORCH_ARG(Quantization, reduce_quantization) = {};
  // Record an event trace of every iteration (FullyShardedModule::last_trace()).
  TORCH_ARG(bool, trace) = false;
  // Gradients summed exactly, in any order, over every backward pass of every rank since the last
  // reduction, and divided by the number of those passes (not by the world size): the same bits at
  // any world size and strategy. Losses must not be divided by the number of micro-batches; no
  // quantized communication. See Note [Deterministic training] in docs/design.md.
  TORCH_ARG(bool, deterministic) = false;
};

}  // namespace fsdp
