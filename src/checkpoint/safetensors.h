#pragma once
// The safetensors format (Hugging Face): an 8-byte little-endian header length N, N bytes of JSON
// ({name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {string: string}}, padded
// with spaces to a multiple of 8), then the tensors' raw little-endian bytes, offsets relative to
// the end of the header. Torch-free: building and validating headers (fuzzed on its own).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

constexpr uint64_t kMaxSafetensorsHeader = uint64_t(100) << 20;  // the Rust reader's limit too

struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range within the data section
};

struct SafetensorsHeader {
  uint64_t data_start = 0;                 // 8 + N
  std::vector<SafetensorsTensor> tensors;  // sorted by begin
  std::map<std::string, std::string> metadata;
};

// The 8-byte length and the JSON header for `tensors` (their offsets already assigned, in order).
std::string make_safetensors_header(const std::vector<SafetensorsTensor>& tensors,
                                    const std::map<std::string, std::string>& metadata);
// Validates a header read from a file of `file_bytes` bytes: `prefix` is its first 8 bytes (the
// length), `json_text` the N bytes after them. Throws fsdp::Error naming `where` and the problem.
uint64_t safetensors_header_length(const std::string& prefix, uint64_t file_bytes, const std::string& where);
SafetensorsHeader parse_safetensors_header(const std::string& json_text, uint64_t file_bytes, const std::string& where);

}  // namespace fsdp::checkpoint::detail
