#pragma once
// The planner trace's probe: what an operator's backward keeps, read from one run of the operator
// on CPU stand-ins of its arguments with grad (Note [Planner operator trace] in docs/design.md).
#include <ATen/core/ivalue.h>
#include <ATen/core/operator_name.h>

#include <cstddef>
#include <optional>
#include <vector>

namespace fsdp::planner {

// An operator's tensors by position: tensors and tensor lists (undefined ones too) and the tensors
// in lists of optional tensors, in argument order.
template <class Values>
std::vector<at::Tensor> flat_tensors(const Values& values) {
  std::vector<at::Tensor> flat;
  for (const c10::IValue& v : values) {
    if (v.isTensor()) {
      flat.push_back(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) flat.push_back(t);
    } else if (v.isList()) {
      for (const c10::IValue& e : v.toListRef())
        if (e.isTensor()) flat.push_back(e.toTensor());
    }
  }
  return flat;
}

// What an operator's backward keeps, learned from one run on CPU stand-ins: positions among its
// flat tensors (flat_tensors) of its arguments and of its results.
struct Probed {
  std::vector<size_t> arguments;
  std::vector<size_t> results;
};

// The bytes of the CPU stand-ins a probe makes for the meta tensors among `arguments`.
size_t stand_in_bytes(const std::vector<c10::IValue>& arguments);

// What the backward of operator `name` keeps when run on `arguments` (meta tensors and the rest):
// none for views, out= forms and composite operators, and where the operator fails on them.
std::optional<Probed> probe_kept(const c10::OperatorName& name, const std::vector<c10::IValue>& arguments);

}  // namespace fsdp::planner
