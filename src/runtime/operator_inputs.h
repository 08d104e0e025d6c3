#pragma once
// What the operator hook reads of an operator call (RecordFunction): whether it writes its first
// input in place, and its tensor inputs.
#include <ATen/record_function.h>

#include <cstddef>
#include <cstring>

namespace fsdp {

// True for an operator that writes its first input ("add_", set_data), not for one that changes
// autograd metadata only (requires_grad_, detach_).
inline bool is_inplace_op(const char* name) {
  if (std::strcmp(name, "aten::set_data") == 0) return true;  // replaces the tensor's storage
  const size_t n = std::strlen(name);
  if (n < 2 || name[n - 1] != '_' || name[n - 2] == '_') return false;  // "add_" yes, "__iadd__" no
  return std::strcmp(name, "aten::requires_grad_") != 0 && std::strcmp(name, "aten::detach_") != 0;
}

// Calls visit(i, t) for every tensor with storage among fn's inputs: input i, or an element of the
// tensor list that input i is.
template <typename Visit>
void for_each_input_tensor(const at::RecordFunction& fn, Visit&& visit) {
  auto inputs = fn.inputs();
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto one = [&](const at::Tensor& t) {
      if (t.defined() && t.has_storage()) visit(i, t);
    };
    const c10::IValue& v = inputs[i];
    if (v.isTensor()) {
      one(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) one(t);
    }
  }
}

}  // namespace fsdp
