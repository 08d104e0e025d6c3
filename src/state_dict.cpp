#include "state_dict.h"

#include <sstream>

#include "flat_param_collectives.h"
#include "fsdp/check.h"
#include "internal_op_guard.h"

namespace fsdp {

namespace {
std::string shape_str(at::IntArrayRef s) {
  std::ostringstream o;
  o << s;
  return o.str();
}
}  // namespace

std::unordered_map<std::string, at::Tensor> full_state_dict(FsdpState& state) {
  RuntimeCall call(state);
  std::unordered_map<std::string, at::Tensor> out;
  // From the shards (full precision under mixed precision), one FlatParameter at a time.
  for (auto& fp : state.flat_params()) {
    const at::Tensor full = gather_full_values(*fp);
    for (const auto& s : fp->slots()) {
      out[s.name] = full.narrow(0, s.offset, s.numel).view(s.shape).clone();
      for (const auto& alias : s.aliases) out[alias] = out[s.name];
    }
  }
  for (const auto& w : state.whole_tensors()) {
    out[w.name] = w.tensor.detach().clone();
    for (const auto& alias : w.aliases) out[alias] = out[w.name];
  }
  return out;
}

void load_full_state_dict(FsdpState& state, const std::unordered_map<std::string, at::Tensor>& values) {
  std::lock_guard<std::recursive_mutex> lock(state.mutex());
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  state.scheduler().reshard_all();
  state.scheduler().forget_last_used();
  for (auto& fp : state.flat_params()) {
    at::Tensor full = at::zeros({fp->padded_numel()}, at::TensorOptions().dtype(fp->dtype()));
    for (const auto& s : fp->slots()) {
      auto it = values.find(s.name);
      FSDP_CHECK(it != values.end(), "load_full_state_dict: parameter '", s.name, "' is missing from the state");
      FSDP_CHECK(it->second.sizes().vec() == s.shape, "load_full_state_dict: parameter '", s.name, "' has shape ",
                 shape_str(it->second.sizes()), " in the state but ", shape_str(s.shape), " in the model");
      full.narrow(0, s.offset, s.numel).copy_(it->second.reshape({-1}));
    }
    fp->copy_full_into_shard(full);
  }
  for (const auto& w : state.whole_tensors()) {
    auto it = values.find(w.name);
    FSDP_CHECK(it != values.end(), "load_full_state_dict: ", w.kind, " '", w.name, "' is missing from the state");
    w.tensor.detach().copy_(it->second);
  }
}

}  // namespace fsdp
