#include "job_token.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "env_var.h"
#include "fsdp/check.h"

namespace fsdp {

std::string job_token() {
  const char* token = env_or_null("FSDP_JOB_TOKEN");
  if (token == nullptr) return "";
  const std::string t = token;
  FSDP_CHECK(t.size() >= kMinJobTokenLength, "FSDP_JOB_TOKEN has ", t.size(), " characters; use at least ",
             kMinJobTokenLength, " random ones (for example: export FSDP_JOB_TOKEN=$(openssl rand -hex 32))");
  return t;
}

Digest hmac_sha256(const std::string& key, const std::string& message) {
  Digest out{};
  unsigned int len = 0;
  const unsigned char* ok =
      HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), out.data(), &len);
  FSDP_CHECK(ok != nullptr && len == out.size(), "HMAC-SHA-256 failed (OpenSSL)");
  return out;
}

bool digests_equal(const Digest& a, const Digest& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

std::string random_bytes(size_t n) {
  std::string out(n, '\0');
  size_t done = 0;
  while (done < n) {
    const ssize_t got = getrandom(out.data() + done, n - done, 0);
    if (got < 0 && errno == EINTR) continue;
    FSDP_CHECK(got > 0, "getrandom failed: ", std::strerror(errno));
    done += static_cast<size_t>(got);
  }
  return out;
}

std::string to_hex(const std::string& bytes) {
  static const char* const kDigits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

}  // namespace fsdp
