#include "formatting.h"

#include <cstddef>
#include <cstdint>
#include <iomanip>
#include <sstream>
#include <string>

namespace fsdp_gpt {

std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return (n < 0 ? "-" : "") + out;
}

std::string fixed(double v, int digits) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(digits) << v;
  return s.str();
}

std::string mib(int64_t bytes) { return fixed(bytes / (1024.0 * 1024.0), 2) + " MiB"; }

std::string printable(const std::string& bytes) {
  const std::string replacement = "\xEF\xBF\xBD";  // U+FFFD
  std::string out;
  size_t i = 0;
  auto byte = [&](size_t k) {
    return k < bytes.size() ? static_cast<unsigned char>(bytes[k]) : 0u;
  };
  while (i < bytes.size()) {
    const unsigned c = byte(i);
    if (c < 0x80) {
      out += (c >= 0x20 && c != 0x7f) || c == '\n' || c == '\t' ? std::string(1, static_cast<char>(c)) : replacement;
      ++i;
      continue;
    }
    // Length and the allowed range of the second byte (which rules out overlong forms and
    // surrogates); later bytes are 0x80-0xBF.
    size_t length = 0;
    unsigned low = 0x80, high = 0xBF;
    if (c >= 0xC2 && c <= 0xDF)
      length = 2;
    else if (c == 0xE0)
      length = 3, low = 0xA0;
    else if (c == 0xED)
      length = 3, high = 0x9F;
    else if (c >= 0xE1 && c <= 0xEF)
      length = 3;
    else if (c == 0xF0)
      length = 4, low = 0x90;
    else if (c >= 0xF1 && c <= 0xF3)
      length = 4;
    else if (c == 0xF4)
      length = 4, high = 0x8F;
    bool valid = length > 0 && byte(i + 1) >= low && byte(i + 1) <= high;
    for (size_t k = 2; valid && k < length; ++k) valid = byte(i + k) >= 0x80 && byte(i + k) <= 0xBF;
    if (valid) {
      out.append(bytes, i, length);
      i += length;
    } else {
      out += replacement;
      ++i;
    }
  }
  return out;
}

}  // namespace fsdp_gpt
