#pragma once
// Measured computation times that replace the planner's nominal device rates
// (PlanRequest::calibration): fsdp::calibrate times a model's own forward, backward and optimizer
// step on this device. See Note [Planner calibration] in docs/design.md.
#include <torch/arg.h>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/comm.h"
#include "fsdp/options.h"

namespace fsdp {

// One precision's timings of the whole model on `Calibration::tokens` tokens.
struct PrecisionTiming {
  at::ScalarType precision = at::kFloat;
  double forward_s = 0;   // forward and loss
  double backward_s = 0;  // backward of that loss
  // The largest growth during forward and backward with the gradients allocated (activations and
  // every temporary of the passes): of the resident set for a model on the CPU, of the caching
  // allocator's allocated bytes for one on a CUDA device; 0: not measured.
  int64_t peak_bytes = 0;
  // The same with the model's fsdp::Checkpointed modules enabled; 0: none, or not measured.
  int64_t checkpointed_peak_bytes = 0;
  // The passes timed with those modules enabled (their forward without a graph, their backward
  // recomputing it); 0: none, or not timed.
  double checkpointed_forward_s = 0;
  double checkpointed_backward_s = 0;
  // The passes on `Calibration::small_tokens` tokens; 0: not timed.
  double small_forward_s = 0;
  double small_backward_s = 0;
};

// The FSDP runtime's own forward and backward at the job's world, in one configuration
// (calibrate_runtime), so the plan charges what the plain copy's passes leave out: FSDP's work per
// unit (hooks, casts, copies, allocation) and waits for peers beyond the modeled collectives.
// See Note [Planner runtime calibration] in docs/design.md.
struct RuntimeTiming {
  std::string wrap;  // the name of the PlanRequest wrap policy the timed copy was wrapped by
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int sharding_factor = 0;  // HYBRID_SHARD
  at::ScalarType precision = at::kFloat;
  bool activation_checkpointing = false;  // the copy's units checkpointed (as PlanEntry's candidates are)
  int micro_batch = 1;                    // sequences in the timed forward (PlanRequest::seq_len tokens each)
  int world = 1;                          // ranks of the timed job: plans for another world do not use it
  int all_gather_limit = 2;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  bool forward_prefetch = true;
  int reductions_in_flight = 2;
  double forward_s = 0;   // forward and loss through the runtime
  double backward_s = 0;  // its backward, the gradients reduced
  double exposed_s = -1;  // the compute thread's waits on collectives per iteration; < 0: not measured
  double step_s = -1;     // the optimizer's step over the copy's shard pieces; < 0: not timed
  // Timed on the transport beneath the job's modeled network (ProcessGroup::set_network_model with
  // nullopt): its waits on peers are those of the ranks without the modeled link.
  bool beneath_network_model = false;
};

// The library's own work of quantized communication per value, in one format, on this device
// (CalibrateOptions::quantizations): packing, unpacking and summing codes (memory-bound loops).
struct QuantizationTiming {
  QuantizedDtype dtype = QuantizedDtype::kInt8;
  int64_t block_size = 256;
  double pack_s = 0;           // per float32 value quantized into a packed slot
  double pack_feedback_s = 0;  // the same with error feedback's residual added and updated
  double unpack_s = 0;         // per value dequantized into float32
  double sum_s = 0;            // per packed value summed into a float32 total
};

struct Calibration {
  int64_t tokens = 0;        // tokens in each timed forward
  int64_t small_tokens = 0;  // tokens in the smaller batch's forward (fewer than `tokens`); 0: none
  int64_t parameters = 0;    // the calibrated model's parameter elements; 0: not recorded
  std::vector<PrecisionTiming> timings;
  double step_s_per_element = 0;  // the optimizer's step per parameter element; 0: not measured
  double link_gbps = 0;           // between the job's ranks (calibrate_link); 0: the cluster's links
  double link_latency_us = 0;     // per ring step, with link_gbps
  // The transport's own rate beneath a modeled link (calibrate_link on a with_network_model
  // communicator); 0: none known. On a CPU cluster the ranks' cores do that part of each collective.
  double link_copy_gbps = 0;
  double link_copy_latency_us = 0;  // per ring step, with link_copy_gbps
  // Within one host of `link_ranks_per_host` consecutive ranks, where the job spans several
  // (calibrate_link over a ProcessGroup); link_gbps is then the link between hosts. 0: one link.
  int link_ranks_per_host = 0;
  double intra_link_gbps = 0;
  double intra_link_latency_us = 0;    // per ring step, with intra_link_gbps
  std::vector<RuntimeTiming> runtime;  // calibrate_runtime's
  std::vector<QuantizationTiming> quantization;

  // The timing for `precision`, or null.
  const PrecisionTiming* find(at::ScalarType precision) const;
  // The first runtime timing for `precision`, or null.
  const RuntimeTiming* find_runtime(at::ScalarType precision) const;
  // The quantization timing of `dtype` at `block_size`, else of `dtype` at another block size, or null.
  const QuantizationTiming* find_quantization(QuantizedDtype dtype, int64_t block_size) const;
  bool empty() const { return timings.empty(); }

  // {"tokens": N, "small_tokens": n, "parameters": M, "step_s_per_element": S, "link_gbps": G, "link_latency_us": L,
  // "link_copy_gbps": C, "link_copy_latency_us": l, "link_ranks_per_host": H, "intra_link_gbps": I,
  // "intra_link_latency_us": i, "timings":
  // [{"precision": "fp32"|"bf16"|"fp16", "forward_s": F, "backward_s": B, "peak_bytes": P,
  // "checkpointed_peak_bytes": C, "checkpointed_forward_s": cf, "checkpointed_backward_s": cb,
  // "small_forward_s": f, "small_backward_s": b}, ...],
  // "runtime": [{"wrap": W, "strategy": S, "sharding_factor": K, "precision": P, "activation_checkpointing": A,
  // "micro_batch": M, "world": N,
  // "all_gather_limit": A, "backward_prefetch": B, "forward_prefetch": F, "reductions_in_flight": R,
  // "forward_s": f, "backward_s": b, "exposed_s": e, "step_s": s, "beneath_network_model": U}, ...],
  // "quantization": [{"dtype": "int8"|"fp8", "block_size": B, "pack_s": p, "pack_feedback_s": q,
  // "unpack_s": u, "sum_s": s}, ...]}
  std::string to_json() const;
  // Throws fsdp::Error naming the bad field and `source`.
  static Calibration from_json(const std::string& text, const std::string& source = "calibration JSON");
  static Calibration from_file(const std::string& path);
  void save(const std::string& path) const;
};

using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

struct CalibrateOptions {
  /// Precisions to time the model in (it is cast to each in turn).
  TORCH_ARG(std::vector<at::ScalarType>, precisions) = {at::kFloat};
  /// Timed repetitions per precision after one untimed; the median counts.
  TORCH_ARG(int, repetitions) = 3;
  /// Each timer repeats past `repetitions` until this many seconds are timed (ten times `repetitions` at most), so short passes are timed over a span a passing disturbance does not fill.
  TORCH_ARG(double, min_timed_s) = 0.25;
  /// Builds the optimizer whose step is timed, over float32 parameters; null: the step is not timed.
  TORCH_ARG(OptimizerFactory, optimizer) = nullptr;
  /// One forward of a smaller batch, timed too, so that the plan tells the passes' fixed cost from their cost per token; null: none.
  TORCH_ARG(std::function<at::Tensor()>, smaller_loss) = nullptr;
  /// The tokens in `smaller_loss`'s forward: at least 1, fewer than calibrate()'s `tokens`.
  TORCH_ARG(int64_t, smaller_tokens) = 0;
  /// Quantized communication formats whose packing, unpacking and summing per value to time (QuantizationTiming); empty: none.
  TORCH_ARG(std::vector<Quantization>, quantizations) = {};
};

// Times `loss()` (one forward of `tokens` tokens through `model`, returning a scalar) and its
// backward in every precision of `options`, with `model`'s fsdp::Checkpointed modules disabled and
// (where it has any) enabled, measures their memory both ways (PrecisionTiming), and times the
// optimizer's step over `model`'s parameters, and the quantization formats of `options` over as
// many values as `model` has parameters (at least 2^16, at most 2^24).
// `model` is a throwaway copy on the device the job computes on; it is left in the last precision.
// The copy is cast to each precision in turn, its inputs are not: `loss()` casts floating inputs
// to the copy's dtype (a convolution refuses float32 images with bfloat16 weights).
// Collective-free: every rank of a job may calibrate at once (then the times include the ranks'
// sharing of the machine). Throws fsdp::Error on bad arguments.
Calibration calibrate(torch::nn::Module& model, const std::function<at::Tensor()>& loss, int64_t tokens,
                      const CalibrateOptions& options = {});

class ProcessGroup;

// Times all-gathers among `comm`'s ranks and sets `calibration`'s link: the latency per ring step from
// a gather of one value per rank, the bandwidth from one of `bytes_per_rank`; the mean over ranks, so
// every rank gets the same figures. Under a modeled network (FSDP_NETWORK_MODEL) it also times the
// real transport beneath it (link_copy_gbps, link_copy_latency_us). Collective: every rank calls it at once.
void calibrate_link(Calibration& calibration, Communicator& comm, int64_t bytes_per_rank = int64_t(1) << 20);
// The same over `pg`'s world, and where its ranks span hosts of several ranks each (the modeled
// network's ranks_per_host, else LOCAL_WORLD_SIZE), over each host's ranks too: intra_link_gbps,
// intra_link_latency_us and link_ranks_per_host, the mean over hosts. Collective over `pg`.
void calibrate_link(Calibration& calibration, ProcessGroup& pg, int64_t bytes_per_rank = int64_t(1) << 20);

// Makes `calibration`'s timings (calibrate()'s, per rank) the same on every rank of `comm`: each
// time the mean over ranks, each memory peak the largest (a plan must fit on every rank), so that
// every rank plans alike. Collective: every rank calls it at once, with timings for the same
// precisions (else fsdp::Error naming both lists).
void agree_across_ranks(Calibration& calibration, Communicator& comm);

// Times the library's quantized-communication loops in `format` over `values` values on `device`:
// packing (with and without error feedback's residual), unpacking and summing, each the median per
// value of `repetitions` runs or more (up to ten times as many, until `min_timed_s` is timed).
// Throws fsdp::Error when `values` or the block size is below 1.
QuantizationTiming calibrate_quantization(const Quantization& format, int64_t values, const at::Device& device,
                                          int repetitions = 3, double min_timed_s = 0.25);

class FullyShardedModule;

// Times training iterations of `sharded` (a throwaway copy of the model wrapped as `timed`
// describes): `loss()` (one forward of `timed.micro_batch` sequences), its backward through the FSDP
// runtime with the event trace on for the waits, and `step()` (the optimizer's step over the copy's
// shard pieces; null: none), and records them (the mean over ranks, the median of `repetitions`
// after one untimed, or of more, up to ten times as many, where the untimed iteration's time over
// the ranks says they take less than `min_timed_s`) as a runtime timing of `calibration` at `pg`'s world, replacing one of the
// same precision, strategy, sharding factor, wrap policy, checkpointing and network model. Two strategies timed in a precision
// (FULL_SHARD and NO_SHARD, say) let the plan tell FSDP's work per unit from its work per
// collective; one also timed with another wrap policy (another number of units), its work per unit
// from its work per pass; one configuration timed with and without its units checkpointed gives what
// checkpointing changes in the passes.
// Collective over `pg`: every rank calls it at once. Throws fsdp::Error when `sharded`'s strategy
// or sharding factor is not `timed`'s.
void calibrate_runtime(Calibration& calibration, FullyShardedModule& sharded, const ProcessGroup& pg,
                       const std::function<at::Tensor()>& loss, RuntimeTiming timed, int repetitions = 3,
                       const std::function<void()>& step = nullptr, double min_timed_s = 0.25);

}  // namespace fsdp
