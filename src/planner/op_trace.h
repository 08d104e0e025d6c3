#pragma once
// The planner's operator trace: one forward of the user's model on the meta device, its operators
// counted (products' FLOPs, the tensors autograd keeps for backward) and charged to the module
// whose parameter was read last. See Note [Planner operator trace] in docs/design.md.
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdp::planner {

// One stretch of forward charged to one module, per token.
struct TracedSegment {
  std::string module;                 // qualified name; "" for the root
  double forward_flops = 0;           // matrix products and convolutions
  double activation_values = 0;       // kept for backward (first kept here), floating values in the compute dtype
  double activation_fixed_bytes = 0;  // kept integer tensors (indices), whose width no precision changes
  double input_values = 0;            // the stretch's first input (what a checkpointed unit keeps)
  bool reads_params = false;          // reads a parameter of its module (where the runtime enters its unit)
  bool grads_arrive =
      false;  // its backward brings a first gradient: it reads a parameter requiring grad for the first time
  bool backward_reads = false;        // autograd keeps a parameter for its backward (which then enters the unit)
  std::vector<const void*> arriving;  // the storage of the parameters requiring grad first read here
};

// The key the trace knows a tensor's storage by.
const void* storage_key(const at::Tensor& t);

// The segments in forward order; a module appears again where forward returns to it. An operator
// whose stand-ins take at most `probe_bytes` is run on them to learn what its backward keeps.
// Reading an `ignored` parameter (one FSDP leaves alone) enters no unit.
std::vector<TracedSegment> trace_forward(torch::nn::Module& root, const std::function<void()>& forward, int64_t tokens,
                                         int64_t probe_bytes, const std::vector<at::Tensor>& ignored);

}  // namespace fsdp::planner
