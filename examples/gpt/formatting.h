#pragma once
// Numbers and generated text as rank 0 prints them.
#include <cstdint>
#include <string>

namespace fsdp_gpt {

// 1234567 as "1,234,567".
std::string with_commas(int64_t n);

// `v` with `digits` digits after the point.
std::string fixed(double v, int digits);

// Bytes as "1.23 MiB".
std::string mib(int64_t bytes);

// The sample for printing: the model emits arbitrary bytes, and invalid UTF-8 or control
// characters garble terminals and break log readers that decode UTF-8 (torchrun's log tailer
// stops at the first bad byte). Each such byte becomes U+FFFD; valid UTF-8, newlines and tabs stay.
std::string printable(const std::string& bytes);

}  // namespace fsdp_gpt
