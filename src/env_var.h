#pragma once
// Reading libfsdp's and the launchers' environment variables.
namespace fsdp {

// The variable's value, or null when it is unset or empty.
const char* env_or_null(const char* name);
// `value` (of variable `name`) as an integer in [lo, hi]; throws fsdp::Error naming the variable.
int parse_env_int(const char* name, const char* value, int lo, int hi);

}  // namespace fsdp
