#include "env_var.h"

#include <cerrno>
#include <cstdlib>
#include <string>

#include "fsdp/check.h"

namespace fsdp {

const char* env_or_null(const char* name) {
  const char* v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

int parse_env_int(const char* name, const char* value, int lo, int hi) {
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(value, &end, 10);
  const bool setting = std::string(name).rfind("FSDP_", 0) == 0;  // the user's, not the launcher's
  FSDP_CHECK(errno == 0 && end && *end == '\0' && end != value, "environment variable ", name, "='", value,
             "' is not an integer; ",
             setting ? "give it a whole number (docs/launchers.md lists the FSDP_* settings)"
                     : "the launcher (fsdp-run, torchrun, mpirun, srun) sets it to one");
  FSDP_CHECK(v >= lo && v <= hi, "environment variable ", name, "=", v, " is out of range [", lo, ", ", hi, "]");
  return static_cast<int>(v);
}

}  // namespace fsdp
