// Option names: printing and parsing the enums of include/fsdp/options.h.
#include "fsdp/options.h"

#include <cctype>

#include "fsdp/check.h"

namespace fsdp {

namespace {
// "backward-pre" -> "BACKWARD_PRE": names are accepted in any case, with '-' or '_'.
std::string normalize_option_name(const std::string& name) {
  std::string n;
  for (char c : name) n += (c == '-') ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return n;
}
}  // namespace

std::string to_string(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kFullShard: return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp: return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard: return "NO_SHARD";
    case ShardingStrategy::kHybridShard: return "HYBRID_SHARD";
  }
  return "?";
}

ShardingStrategy parse_sharding_strategy(const std::string& name) {
  const std::string n = normalize_option_name(name);
  for (auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard,
                 ShardingStrategy::kHybridShard})
    if (n == to_string(s)) return s;
  FSDP_FAIL("unknown sharding strategy '", name, "'; use FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD");
}

std::string to_string(BackwardPrefetch p) {
  switch (p) {
    case BackwardPrefetch::kBackwardPre: return "BACKWARD_PRE";
    case BackwardPrefetch::kBackwardPost: return "BACKWARD_POST";
    case BackwardPrefetch::kNone: return "NONE";
  }
  return "?";
}

BackwardPrefetch parse_backward_prefetch(const std::string& name) {
  const std::string n = normalize_option_name(name);
  for (auto p : {BackwardPrefetch::kBackwardPre, BackwardPrefetch::kBackwardPost, BackwardPrefetch::kNone})
    if (n == to_string(p)) return p;
  FSDP_FAIL("unknown backward prefetch '", name, "'; use BACKWARD_PRE, BACKWARD_POST or NONE");
}

std::string to_string(QuantizedDtype d) { return d == QuantizedDtype::kInt8 ? "int8" : "fp8"; }

QuantizedDtype parse_quantized_dtype(const std::string& name) {
  const std::string n = normalize_option_name(name);
  if (n == "INT8") return QuantizedDtype::kInt8;
  if (n == "FP8" || n == "FLOAT8" || n == "FLOAT8_E4M3" || n == "E4M3") return QuantizedDtype::kFloat8E4M3;
  FSDP_FAIL("unknown quantized dtype '", name, "'; use int8 or fp8");
}

}  // namespace fsdp
