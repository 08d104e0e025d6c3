#include "parameter_hash.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <vector>

namespace fsdp_gpt {

namespace {

constexpr uint64_t kFnvOffset = 14695981039346656037ULL, kFnvPrime = 1099511628211ULL;

void mix(uint64_t& h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * kFnvPrime;
}

}  // namespace

uint64_t parameter_hash(fsdp::FullyShardedModule& sharded) {
  std::vector<std::string> names = sharded.full_state_names();
  std::sort(names.begin(), names.end());
  uint64_t h = kFnvOffset;
  // One unit's full values at a time, visited in name order.
  sharded.visit_full_state(names, [&h](const std::string& name, const at::Tensor& value) {
    const at::Tensor t = value.detach().cpu().contiguous();
    mix(h, name.data(), name.size() + 1);  // with its terminating zero
    const auto dtype = static_cast<int8_t>(t.scalar_type());
    mix(h, &dtype, 1);
    for (const int64_t d : t.sizes()) mix(h, &d, sizeof(d));
    mix(h, t.data_ptr(), t.nbytes());
  });
  return h;
}

std::string hex16(uint64_t value) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(value));
  return buf;
}

}  // namespace fsdp_gpt
