#include "checkpoint/hash.h"

#include <algorithm>
#include <cstring>

namespace fsdp::checkpoint::detail {

namespace {
constexpr uint64_t kPrime = 0x100000001b3ULL;  // FNV-1a's 64-bit prime
constexpr uint64_t kBasis = 0xcbf29ce484222325ULL;

uint64_t load_le64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Bijective steps only, so a change confined to one word (or one lane) always survives.
uint64_t mix_in(uint64_t lane, uint64_t word) {
  lane = (lane ^ word) * kPrime;
  return lane ^ (lane >> 29);
}

uint64_t finalize(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
}  // namespace

Hash64::Hash64() {
  for (int i = 0; i < 4; ++i) lanes_[i] = kBasis + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(i);
}

void Hash64::block(const unsigned char* p) {
  for (int i = 0; i < 4; ++i) lanes_[i] = mix_in(lanes_[i], load_le64(p + 8 * i));
}

void Hash64::update(const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  total_ += bytes;
  if (pending_bytes_ > 0) {
    const size_t take = std::min(bytes, sizeof(pending_) - pending_bytes_);
    std::memcpy(pending_ + pending_bytes_, p, take);
    pending_bytes_ += take;
    p += take;
    bytes -= take;
    if (pending_bytes_ < sizeof(pending_)) return;
    block(pending_);
    pending_bytes_ = 0;
  }
  for (; bytes >= 32; p += 32, bytes -= 32) block(p);
  std::memcpy(pending_, p, bytes);
  pending_bytes_ = bytes;
}

uint64_t Hash64::digest() const {
  uint64_t l0 = lanes_[0];
  for (size_t i = 0; i < pending_bytes_; ++i) l0 = mix_in(l0, pending_[i]);
  uint64_t h = finalize(l0 ^ total_);
  for (int i = 1; i < 4; ++i) h = finalize(h ^ lanes_[i]);
  return h;
}

uint64_t hash64(const void* data, size_t bytes) {
  Hash64 h;
  h.update(data, bytes);
  return h.digest();
}

std::string to_hex(uint64_t v) {
  static const char* digits = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) s[i] = digits[v & 15];
  return s;
}

bool parse_hex(const std::string& s, uint64_t* out) {
  if (s.size() != 16) return false;
  uint64_t v = 0;
  for (char c : s) {
    int d;
    if (c >= '0' && c <= '9')
      d = c - '0';
    else if (c >= 'a' && c <= 'f')
      d = c - 'a' + 10;
    else
      return false;
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  *out = v;
  return true;
}

}  // namespace fsdp::checkpoint::detail
