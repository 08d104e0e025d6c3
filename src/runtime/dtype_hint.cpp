#include "runtime/dtype_hint.h"

#include "fsdp/check.h"

namespace fsdp {

std::string mixed_precision_mismatch(const FsdpState& state, const at::RecordFunction& fn) {
  const auto& param_dtype = state.options().mixed_precision().param_dtype();
  if (!param_dtype) return "";
  const FlatParam* low = nullptr;  // a FlatParameter in param_dtype whose parameter the operator reads
  const ParamSlot* slot = nullptr;
  at::ScalarType wider = at::kFloat;
  bool has_wider = false;
  auto visit = [&](const at::Tensor& t) {
    if (!t.defined() || !t.is_floating_point()) return;
    const int f = t.has_storage() ? state.flat_param_of_storage(t.storage().unsafeGetStorageImpl()) : -1;
    if (f >= 0) {
      const FlatParam& fp = *state.flat_params()[f];
      if (!low && fp.compute_dtype() == *param_dtype && fp.compute_dtype() != fp.dtype()) {
        low = &fp;
        if (const auto* s = state.slot_of_param(t.unsafeGetTensorImpl())) slot = &fp.slots()[s->second];
      }
    } else if (c10::elementSize(t.scalar_type()) > c10::elementSize(*param_dtype)) {
      wider = t.scalar_type();
      has_wider = true;
    }
  };
  for (const c10::IValue& v : fn.inputs()) {
    if (v.isTensor()) {
      visit(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) visit(t);
    }
  }
  if (!low || !has_wider) return "";
  const std::string& unit = state.units()[low->unit()].name();
  return detail::compose(
      "operator ", fn.name(), " read ", slot ? "parameter '" + slot->name + "'" : std::string("a parameter"),
      " of unit '", unit.empty() ? "<root>" : unit, "' in ", *param_dtype, " (MixedPrecision::param_dtype) with a ",
      wider,
      " tensor (an input, a buffer or another tensor). Under mixed precision a unit computes in param_dtype: call the "
      "model through the handle "
      "fully_shard() returned, sharded->forward(x), which casts the root's inputs, or cast them with "
      "FullyShardedModule::cast_forward_input(x); a ",
      wider,
      " buffer or tensor inside the model promotes a cast "
      "input back: cast it too (MixedPrecision::buffer_dtype casts buffers), or keep its module in full "
      "precision (MixedPrecision::keep_full_precision)");
}

}  // namespace fsdp
