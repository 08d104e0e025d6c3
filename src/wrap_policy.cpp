#include "fsdp/wrap_policy.h"

#include <algorithm>

#include "fsdp/check.h"

namespace fsdp::wrap {

WrapPolicy by_size(int64_t min_num_params) {
  FSDP_CHECK(min_num_params > 0, "wrap::by_size: min_num_params must be positive, got ", min_num_params);
  return [min_num_params](const std::string&, const torch::nn::Module&, int64_t unwrapped) {
    return unwrapped >= min_num_params;
  };
}

WrapPolicy by_predicate(std::function<bool(const std::string&, const torch::nn::Module&)> pred) {
  FSDP_CHECK(static_cast<bool>(pred), "wrap::by_predicate: the predicate is empty");
  return [pred = std::move(pred)](const std::string& name, const torch::nn::Module& m, int64_t) {
    return pred(name, m);
  };
}

WrapPolicy by_names(std::vector<std::string> names) {
  return [names = std::move(names)](const std::string& name, const torch::nn::Module&, int64_t) {
    return std::find(names.begin(), names.end(), name) != names.end();
  };
}

WrapPolicy any_of(std::vector<WrapPolicy> policies) {
  return [policies = std::move(policies)](const std::string& name, const torch::nn::Module& m, int64_t n) {
    for (const auto& p : policies)
      if (p && p(name, m, n)) return true;
    return false;
  };
}

}  // namespace fsdp::wrap
