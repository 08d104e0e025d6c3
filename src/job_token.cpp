#include "job_token.h"

#include <dlfcn.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "env_var.h"
#include "fsdp/check.h"

namespace fsdp {

namespace {

// The functions of OpenSSL's libcrypto that the job token needs, loaded at run time (Note
// [Rendezvous store] in docs/design.md): EVP_sha256, HMAC, CRYPTO_memcmp.
struct Crypto {
  using Sha256 = const void* (*)();
  using Hmac = unsigned char* (*)(const void*, const void*, int, const unsigned char*, size_t, unsigned char*,
                                  unsigned int*);
  using MemCmp = int (*)(const void*, const void*, size_t);
  Sha256 sha256 = nullptr;
  Hmac hmac = nullptr;
  MemCmp memcmp = nullptr;
  std::string error;  // why none could be loaded
};

const Crypto& crypto() {
  static const Crypto loaded = [] {
    Crypto c;
    for (const char* name : {"libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.so"}) {
      void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib == nullptr) {
        c.error += std::string(c.error.empty() ? "" : "; ") + dlerror();
        continue;
      }
      c.sha256 = reinterpret_cast<Crypto::Sha256>(dlsym(lib, "EVP_sha256"));
      c.hmac = reinterpret_cast<Crypto::Hmac>(dlsym(lib, "HMAC"));
      c.memcmp = reinterpret_cast<Crypto::MemCmp>(dlsym(lib, "CRYPTO_memcmp"));
      if (c.sha256 && c.hmac && c.memcmp) {
        c.error.clear();
        return c;
      }
      c.error += std::string(c.error.empty() ? "" : "; ") + name + " lacks EVP_sha256, HMAC or CRYPTO_memcmp";
    }
    c.sha256 = nullptr;
    return c;
  }();
  FSDP_CHECK(loaded.sha256 != nullptr,
             "libfsdp needs OpenSSL's libcrypto at run time (HMAC-SHA-256 for the rendezvous store, "
             "docs/security.md) and could not load it (",
             loaded.error, "); install it (Debian: libssl3)");
  return loaded;
}

}  // namespace

std::string job_token() {
  const char* token = env_or_null("FSDP_JOB_TOKEN");
  if (token == nullptr) return "";
  std::string t = token;
  FSDP_CHECK(t.size() >= kMinJobTokenLength, "FSDP_JOB_TOKEN has ", t.size(), " characters; use at least ",
             kMinJobTokenLength, " random ones (for example: export FSDP_JOB_TOKEN=$(openssl rand -hex 32))");
  return t;
}

Digest hmac_sha256(const std::string& key, const std::string& message) {
  const Crypto& c = crypto();
  Digest out{};
  unsigned int len = 0;
  const unsigned char* ok =
      c.hmac(c.sha256(), key.data(), static_cast<int>(key.size()),
             reinterpret_cast<const unsigned char*>(message.data()), message.size(), out.data(), &len);
  FSDP_CHECK(ok != nullptr && len == out.size(), "HMAC-SHA-256 failed (OpenSSL's libcrypto)");
  return out;
}

bool digests_equal(const Digest& a, const Digest& b) { return crypto().memcmp(a.data(), b.data(), a.size()) == 0; }

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
