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

// While alive, factory operations on this thread make ordinary tensors again, inside a DeferredInit
// scope too (for the real tensors a planning step needs between meta ones).
class DeferralPause {
 public:
  DeferralPause();
  ~DeferralPause();
  DeferralPause(const DeferralPause&) = delete;
  DeferralPause& operator=(const DeferralPause&) = delete;

 private:
  bool previous_;
};

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

// Operator argument `v` with each tensor in it (a tensor, a tensor list, a list of optional
// tensors) replaced by `stand_in(tensor)`, and the meta device by the CPU.
template <class F>
c10::IValue with_stand_ins(const c10::IValue& v, F&& stand_in) {
  if (v.isTensor()) return c10::IValue(stand_in(v.toTensor()));
  if (v.isTensorList()) {
    std::vector<at::Tensor> list = v.toTensorVector();
    for (at::Tensor& t : list) t = stand_in(t);
    return c10::IValue(list);
  }
  if (v.isList()) {
    c10::impl::GenericList list(v.toList().elementType());
    for (const c10::IValue& e : v.toListRef()) list.push_back(e.isTensor() ? c10::IValue(stand_in(e.toTensor())) : e);
    return c10::IValue(list);
  }
  if (v.isDevice() && v.toDevice().is_meta()) return c10::IValue(c10::Device(c10::kCPU));
  return v;
}

// Fills CPU tensor `c`, over its whole storage, with one half where floating (zero otherwise, so
// indices stay in range), then, where `positive_definite`, raises the diagonal of each square matrix
// in its last two dimensions by their size: for an operator that refuses a singular matrix.
void fill_stand_in(const at::Tensor& c, bool positive_definite);

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
