#pragma once
// Hash64: the 64-bit checksum of checkpoint files, computed over fixed-size chunks so a reader can
// verify exactly the chunks it reads. Four lanes of an FNV-style multiply over little-endian
// 64-bit words; the exact definition is in Note [Checkpoint format] (docs/design.md).
#include <cstddef>
#include <cstdint>
#include <string>

namespace fsdp::checkpoint::detail {

class Hash64 {
 public:
  Hash64();
  void update(const void* data, size_t bytes);
  uint64_t digest() const;  // does not change the state

 private:
  void block(const unsigned char* p);
  uint64_t lanes_[4];
  unsigned char pending_[32];
  size_t pending_bytes_ = 0;
  uint64_t total_ = 0;
};

uint64_t hash64(const void* data, size_t bytes);
std::string to_hex(uint64_t v);                       // 16 lowercase hex digits
bool parse_hex(const std::string& s, uint64_t* out);  // exactly 16 hex digits

}  // namespace fsdp::checkpoint::detail
