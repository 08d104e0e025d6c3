#pragma once
// The wire format of the job's rendezvous store (store_server.h, store_client.h): length-prefixed
// frames, the encoding of requests and replies, and the mutual challenge-response that opens each
// connection, with a client's connect-and-authenticate step. Free of LibTorch, so that fsdp-run
// uses it too. See Note [Rendezvous store] in docs/design.md.
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "job_token.h"

namespace fsdp::store_wire {

using Clock = std::chrono::steady_clock;

enum Op : uint8_t { kSet = 1, kGet, kAdd, kCompareSet, kDelete, kCheck, kNumKeys, kWait };

// The server's greeting: this text, then its nonce.
constexpr char kGreeting[] = "fsdp-store-1";
constexpr size_t kNonceBytes = 32;
// Frames before authentication are short; after it, a value may be large.
constexpr size_t kMaxHandshakeFrame = 256;
constexpr size_t kMaxFrame = size_t(1) << 30;

// A client's proof that it holds the token, over both nonces; the server's, the other way round.
Digest client_proof(const std::string& token, const std::string& server_nonce, const std::string& client_nonce);
Digest server_proof(const std::string& token, const std::string& server_nonce, const std::string& client_nonce);

// Sends one frame (its length as 4 bytes, big-endian, then `payload`); false if the peer is gone.
bool send_frame(int fd, const std::string& payload);

// Sends small frames at once (TCP_NODELAY): every request waits for its reply.
void set_no_delay(int fd);

enum class ReadStatus { kOk, kClosed, kTimeout, kTooLong };
// Reads one frame of at most `max_bytes` before `deadline`.
ReadStatus read_frame(int fd, std::string& payload, size_t max_bytes, Clock::time_point deadline);

// Builds a request or reply.
class Writer {
 public:
  Writer& u8(uint8_t v);
  Writer& i64(int64_t v);
  Writer& bytes(const std::string& v);
  Writer& bytes(const std::vector<uint8_t>& v) { return bytes(std::string(v.begin(), v.end())); }
  Writer& keys(const std::vector<std::string>& v);
  const std::string& str() const { return out_; }

 private:
  Writer& u32(uint32_t v);
  std::string out_;
};

// Reads one; a malformed message throws Malformed.
class Reader {
 public:
  struct Malformed : std::runtime_error {
    Malformed() : std::runtime_error("malformed store message") {}
  };
  explicit Reader(const std::string& in) : in_(in) {}
  uint8_t u8();
  int64_t i64();
  std::string bytes();
  std::vector<std::string> keys();
  bool at_end() const { return pos_ == in_.size(); }

 private:
  uint32_t u32();
  const std::string& in_;
  size_t pos_ = 0;
};

std::vector<uint8_t> to_vector(const std::string& s);

}  // namespace fsdp::store_wire

namespace fsdp {

// The store and this client do not share the job token.
struct StoreAuthError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A socket to `host`:`port` (retrying while nothing listens there, until `timeout`) on which both
// sides have proven that they hold `token`. Throws StoreAuthError when either proof fails,
// std::runtime_error for anything else; `owner` ("rank 0") names the store's host in messages.
int connect_to_store(const std::string& host, int port, const std::string& token, std::chrono::milliseconds timeout,
                     const std::string& owner);

// "1.500 s": a timeout as the store's messages print it.
std::string store_seconds_text(std::chrono::milliseconds t);

}  // namespace fsdp
