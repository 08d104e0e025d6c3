#include "state_dict.h"

#include <algorithm>
#include <sstream>
#include <unordered_set>

#include "checkpoint/collective.h"
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

std::vector<std::string> full_state_names(const FsdpState& state) {
  std::vector<std::string> names;
  for (const auto& fp : state.flat_params())
    for (const auto& s : fp->slots()) {
      names.push_back(s.name);
      names.insert(names.end(), s.aliases.begin(), s.aliases.end());
    }
  for (const auto& w : state.whole_tensors()) {
    names.push_back(w.name);
    names.insert(names.end(), w.aliases.begin(), w.aliases.end());
  }
  return names;
}

void visit_full_state(FsdpState& state, const std::vector<std::string>& names,
                      const std::function<void(const std::string&, const at::Tensor&)>& visit) {
  RuntimeCall call(state);
  struct Where {
    int flat = -1, slot = -1;  // a FlatParameter's slot, or (flat -1) whole tensor `slot`
  };
  std::unordered_map<std::string, Where> where;
  const auto& flats = state.flat_params();
  for (size_t f = 0; f < flats.size(); ++f)
    for (size_t i = 0; i < flats[f]->slots().size(); ++i) {
      const auto& s = flats[f]->slots()[i];
      where[s.name] = {static_cast<int>(f), static_cast<int>(i)};
      for (const auto& alias : s.aliases) where[alias] = {static_cast<int>(f), static_cast<int>(i)};
    }
  for (size_t i = 0; i < state.whole_tensors().size(); ++i) {
    const auto& w = state.whole_tensors()[i];
    where[w.name] = {-1, static_cast<int>(i)};
    for (const auto& alias : w.aliases) where[alias] = {-1, static_cast<int>(i)};
  }
  int gathered = -1;
  at::Tensor full;
  for (const auto& name : names) {
    const auto it = where.find(name);
    FSDP_CHECK(it != where.end(), "visit_full_state: '", name, "' is neither a parameter nor a buffer of the model");
    const Where w = it->second;
    if (w.flat < 0) {
      visit(name, state.whole_tensors()[w.slot].tensor.detach());
      continue;
    }
    if (w.flat != gathered) {
      full = at::Tensor();  // the previous FlatParameter's values go first
      full = gather_full_values(*flats[w.flat]);
      gathered = w.flat;
    }
    const auto& s = flats[w.flat]->slots()[w.slot];
    visit(name, full.narrow(0, s.offset, s.numel).view(s.shape));
  }
}

namespace {

// Every entry the model takes is in `values` with its shape, and `values` holds nothing else.
void check_full_state(const FsdpState& state, const std::unordered_map<std::string, at::Tensor>& values) {
  auto present = [&](const std::string& name, const char* kind, at::IntArrayRef shape) {
    const auto it = values.find(name);
    FSDP_CHECK(it != values.end(), "load_full_state_dict: ", kind, " '", name,
               "' is missing from the state; give every entry full_state_dict() names");
    FSDP_CHECK(it->second.defined() && it->second.sizes() == shape, "load_full_state_dict: ", kind, " '", name,
               "' has shape ", it->second.defined() ? shape_str(it->second.sizes()) : "(undefined)",
               " in the state but ", shape_str(shape), " in the model");
  };
  for (const auto& fp : state.flat_params())
    for (const auto& s : fp->slots()) present(s.name, "parameter", s.shape);
  for (const auto& w : state.whole_tensors()) present(w.name, w.kind, w.tensor.sizes());
  const std::vector<std::string> names = full_state_names(state);
  const std::unordered_set<std::string> known(names.begin(), names.end());
  std::vector<std::string> unknown;
  for (const auto& [name, value] : values)
    if (known.count(name) == 0) unknown.push_back(name);
  if (unknown.empty()) return;
  std::sort(unknown.begin(), unknown.end());
  std::ostringstream o;
  for (size_t i = 0; i < unknown.size() && i < 3; ++i) o << (i ? ", '" : "'") << unknown[i] << "'";
  if (unknown.size() > 3) o << " and " << unknown.size() - 3 << " more";
  FSDP_FAIL("load_full_state_dict: the state holds ", o.str(),
            ", which the model has neither as a parameter nor as a buffer; load a state of this model "
            "(full_state_dict() names its entries), without the others");
}

}  // namespace

void load_full_state_dict(FsdpState& state, const std::unordered_map<std::string, at::Tensor>& values) {
  std::lock_guard<std::recursive_mutex> lock(state.mutex());
  // Checked on every rank before anything changes: a state one rank refuses leaves every model as it was.
  checkpoint::detail::run_agreed(*state.groups().world_comm, "load_full_state_dict",
                                 [&] { check_full_state(state, values); });
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  state.scheduler().reshard_all();
  state.scheduler().forget_last_used();
  for (auto& fp : state.flat_params()) {
    at::Tensor full = at::zeros({fp->padded_numel()}, at::TensorOptions().dtype(fp->dtype()));
    for (const auto& s : fp->slots()) full.narrow(0, s.offset, s.numel).copy_(values.at(s.name).reshape({-1}));
    fp->copy_full_into_shard(full);
  }
  for (const auto& w : state.whole_tensors()) w.tensor.detach().copy_(values.at(w.name));
  state.drop_feedback_residuals();
}

}  // namespace fsdp
