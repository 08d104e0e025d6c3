#pragma once
// The one error path of libfsdp: FSDP_CHECK(cond, parts...) throws fsdp::Error with a message
// composed from the parts, naming the problem and the fix. See Note [Errors] in docs/design.md.
#include <sstream>
#include <stdexcept>
#include <string>

namespace fsdp {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

namespace detail {
template <typename... Parts>
std::string compose(const Parts&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  return s.str();
}
[[noreturn]] void throw_error(const char* file, int line, const std::string& msg);
}  // namespace detail

}  // namespace fsdp

#define FSDP_CHECK(cond, ...)                                                                           \
  do {                                                                                                  \
    if (!(cond)) ::fsdp::detail::throw_error(__FILE__, __LINE__, ::fsdp::detail::compose(__VA_ARGS__)); \
  } while (0)

#define FSDP_FAIL(...) ::fsdp::detail::throw_error(__FILE__, __LINE__, ::fsdp::detail::compose(__VA_ARGS__))
