#pragma once
// The job secret (FSDP_JOB_TOKEN) and what is built on it: HMAC-SHA-256 from OpenSSL's libcrypto
// (loaded at run time), random bytes from the kernel, a constant-time comparison. See
// docs/security.md.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace fsdp {

using Digest = std::array<uint8_t, 32>;

// FSDP_JOB_TOKEN, or "" when it is unset. Throws fsdp::Error when it is set but shorter than
// kMinJobTokenLength characters.
std::string job_token();
constexpr size_t kMinJobTokenLength = 16;

// HMAC-SHA-256 of `message` keyed by `key`.
Digest hmac_sha256(const std::string& key, const std::string& message);
// Whether a == b, in time independent of where they differ.
bool digests_equal(const Digest& a, const Digest& b);
// `n` bytes from the kernel's random source; throws fsdp::Error if it fails.
std::string random_bytes(size_t n);
// Lower-case hexadecimal of `bytes`.
std::string to_hex(const std::string& bytes);

}  // namespace fsdp
