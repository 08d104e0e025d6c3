#pragma once
// UnitPlan: which modules become FSDP units and which parameters each unit's FlatParameters hold
// (paper 3.2.1), decided from the module tree, the wrap policy and the annotations alone: a pure
// function of one rank's model, with no communication.
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "fsdp/options.h"

namespace fsdp {

struct UnitPlan {
  struct Param {
    std::string name;                  // first qualified name in the module tree
    std::vector<std::string> aliases;  // further names of a shared (tied) parameter
    at::Tensor param;
    int unit = 0;
    bool full_precision = false;  // a module registering it keeps full precision (MixedPrecision)
  };
  struct Unit {
    std::string name;  // qualified module name; "" for the root
    torch::nn::Module* module = nullptr;
    int parent = -1;             // enclosing unit; -1 for the root (unit 0)
    std::vector<int> ancestors;  // enclosing units, nearest first
    std::vector<int> flat_params;
  };
  // One per (dtype, requires_grad, full precision) group of a unit's parameters, in module order;
  // ids in unit order.
  struct FlatParam {
    int unit = 0;
    std::vector<int> params;  // indices into `params`
    bool full_precision = false;
  };
  std::vector<Unit> units;
  std::vector<Param> params;
  std::vector<FlatParam> flat_params;
  // What Options::ignored_modules / ignored_parameters leave alone, in module order: parameters
  // (first name; unit -1) and the ignored modules' buffers.
  std::vector<Param> ignored_params;
  std::vector<std::pair<std::string, at::Tensor>> ignored_buffers;

  // One line per parameter (name, shape, dtype, frozen, full precision, unit or ignored): equal on
  // ranks with equal models.
  std::string describe() const;
};

// Plans the units of `root`. Parameters must be dense, on `device` (or meta, for deferred
// initialization), and floating point if they require grad; a parameter shared by modules of
// several units goes to their lowest common ancestor unit, or is refused (Options::shared_parameters).
UnitPlan plan_units(torch::nn::Module& root, const Options& options, c10::Device device);

// Per module of `root`'s tree, the parameter elements of its subtree that no nested unit takes when
// `policy` (and the model's explicit units) choose the units: what the policy is given for it.
std::map<const torch::nn::Module*, int64_t> unwrapped_counts(torch::nn::Module& root, const WrapPolicy& policy);

// Whether a strategy frees its non-root units' parameters after forward (FULL_SHARD, HYBRID_SHARD).
bool reshards_after_forward(ShardingStrategy strategy);

// Whether `unit` frees its parameters after forward: never the root; else the
// reshard_after_forward_policy's choice where it gives one, else the strategy's.
bool reshards_after_forward(const UnitPlan::Unit& unit, const Options& options);

}  // namespace fsdp
