#pragma once
// Pieces of deferred initialization shared by fully_shard and fsdp::materialize.
#include <string>
#include <vector>

#include "fsdp/deferred_init.h"

namespace fsdp::detail {

struct ModuleVisit {
  torch::nn::Module* module;
  std::string name;  // qualified; "" for the root
};

// Every module once (a module registered twice is visited at its first place), parents first,
// children in registration order.
std::vector<ModuleVisit> modules_in_preorder(torch::nn::Module& root);

// Gives the module's own meta parameters and buffers fresh CPU storage in place and runs `init`
// (null: reset_parameters) on the module; throws if it left one of them unwritten. Returns false,
// without calling init, if the module had no meta tensor of its own.
bool materialize_own_tensors(const ModuleVisit& visit, const ParamInitFn& init,
                             c10::Device device = c10::Device(c10::kCPU));

bool deferring();  // a DeferredInit scope is open on this thread

// Inside a DeferredInit scope on this thread, while alive: an operator on meta tensors that has no
// meta kernel runs on CPU stand-ins of its arguments, its results handed back as meta tensors of
// the same shapes (Note [Meta shape pass] in docs/design.md). For shape passes (the planner's trace).
class MetaShapePass {
 public:
  MetaShapePass();
  ~MetaShapePass();
  MetaShapePass(const MetaShapePass&) = delete;
  MetaShapePass& operator=(const MetaShapePass&) = delete;
};
bool in_stand_in();  // an operator runs on CPU stand-ins on this thread now

// While alive: operators on this thread run on the devices of their arguments, as inside a
// stand-in, and in_stand_in() is true (for work on real tensors inside a shape pass).
class StandInScope {
 public:
  StandInScope();
  ~StandInScope();
  StandInScope(const StandInScope&) = delete;
  StandInScope& operator=(const StandInScope&) = delete;
};
void check_not_deferring(const char* what);

}  // namespace fsdp::detail
