#include "store_wire.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

namespace fsdp::store_wire {

Digest client_proof(const std::string& token, const std::string& server_nonce, const std::string& client_nonce) {
  return hmac_sha256(token, std::string("fsdp-store client\n") + server_nonce + client_nonce);
}

Digest server_proof(const std::string& token, const std::string& server_nonce, const std::string& client_nonce) {
  return hmac_sha256(token, std::string("fsdp-store server\n") + client_nonce + server_nonce);
}

namespace {

bool send_all(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t sent = ::send(fd, data, n, MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return false;
    data += sent;
    n -= static_cast<size_t>(sent);
  }
  return true;
}

ReadStatus read_all(int fd, char* data, size_t n, Clock::time_point deadline) {
  while (n > 0) {
    if (deadline != Clock::time_point::max()) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return ReadStatus::kTimeout;
      pollfd p{fd, POLLIN, 0};
      const int ready = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1 << 30)));
      if (ready < 0 && errno == EINTR) continue;
      if (ready < 0) return ReadStatus::kClosed;
      if (ready == 0) return ReadStatus::kTimeout;
    }
    const ssize_t got = ::recv(fd, data, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return ReadStatus::kClosed;
    data += got;
    n -= static_cast<size_t>(got);
  }
  return ReadStatus::kOk;
}

}  // namespace

bool send_frame(int fd, const std::string& payload) {
  // One send per frame: a separate header would wait for the peer's delayed acknowledgement.
  const uint32_t n = static_cast<uint32_t>(payload.size());
  std::string frame = {char(n >> 24), char(n >> 16), char(n >> 8), char(n)};
  frame += payload;
  return send_all(fd, frame.data(), frame.size());
}

void set_no_delay(int fd) {
  const int on = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
}

ReadStatus read_frame(int fd, std::string& payload, size_t max_bytes, Clock::time_point deadline) {
  unsigned char head[4];
  if (const ReadStatus s = read_all(fd, reinterpret_cast<char*>(head), 4, deadline); s != ReadStatus::kOk) return s;
  const size_t n = (size_t(head[0]) << 24) | (size_t(head[1]) << 16) | (size_t(head[2]) << 8) | head[3];
  if (n > max_bytes) return ReadStatus::kTooLong;
  payload.assign(n, '\0');
  return read_all(fd, payload.data(), n, deadline);
}

Writer& Writer::u8(uint8_t v) {
  out_ += static_cast<char>(v);
  return *this;
}

Writer& Writer::u32(uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out_ += static_cast<char>(v >> s);
  return *this;
}

Writer& Writer::i64(int64_t v) {
  const auto u = static_cast<uint64_t>(v);
  for (int s = 56; s >= 0; s -= 8) out_ += static_cast<char>(u >> s);
  return *this;
}

Writer& Writer::bytes(const std::string& v) {
  u32(static_cast<uint32_t>(v.size()));
  out_ += v;
  return *this;
}

Writer& Writer::keys(const std::vector<std::string>& v) {
  u32(static_cast<uint32_t>(v.size()));
  for (const auto& k : v) bytes(k);
  return *this;
}

uint8_t Reader::u8() {
  if (in_.size() - pos_ < 1) throw Malformed();
  return static_cast<uint8_t>(in_[pos_++]);
}

uint32_t Reader::u32() {
  if (in_.size() - pos_ < 4) throw Malformed();
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v = (v << 8) | static_cast<uint8_t>(in_[pos_++]);
  return v;
}

int64_t Reader::i64() {
  if (in_.size() - pos_ < 8) throw Malformed();
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | static_cast<uint8_t>(in_[pos_++]);
  return static_cast<int64_t>(v);
}

std::string Reader::bytes() {
  const uint32_t n = u32();
  if (in_.size() - pos_ < n) throw Malformed();
  std::string v = in_.substr(pos_, n);
  pos_ += n;
  return v;
}

std::vector<std::string> Reader::keys() {
  const uint32_t n = u32();
  if (n > in_.size() - pos_) throw Malformed();  // every key takes at least 4 bytes
  std::vector<std::string> v;
  for (uint32_t i = 0; i < n; ++i) v.push_back(bytes());
  return v;
}

std::vector<uint8_t> to_vector(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

}  // namespace fsdp::store_wire

namespace fsdp {

namespace {

namespace wire = store_wire;

// A connected socket to one of `host`'s addresses, or -1 with the reason in `error`.
int connect_once(const std::string& host, int port, wire::Clock::time_point deadline, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found); rc != 0) {
    error = gai_strerror(rc);
    return -1;
  }
  int result = -1;
  for (addrinfo* a = found; a && result < 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    int rc = connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - wire::Clock::now()).count();
      int err = ETIMEDOUT;
      socklen_t len = sizeof(err);
      if (poll(&p, 1, static_cast<int>(std::max<int64_t>(0, left))) == 1)
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc == 0 && fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) == 0) {
      wire::set_no_delay(fd);
      result = fd;
    } else {
      error = std::strerror(errno);
      close(fd);
    }
  }
  freeaddrinfo(found);
  return result;
}

}  // namespace

std::string store_seconds_text(std::chrono::milliseconds t) {
  return std::to_string(t.count() / 1000.0).substr(0, 5) + " s";
}

int connect_to_store(const std::string& host, int port, const std::string& token, std::chrono::milliseconds timeout,
                     const std::string& owner) {
  const std::string where = host + ":" + std::to_string(port);
  int fd = -1;
  try {
    const auto deadline = wire::Clock::now() + timeout;
    std::string error;
    for (auto pause = std::chrono::milliseconds(10);; pause = std::min(pause * 2, std::chrono::milliseconds(500))) {
      fd = connect_once(host, port, deadline, error);
      if (fd >= 0 || wire::Clock::now() + pause >= deadline) break;
      std::this_thread::sleep_for(pause);  // the store may not listen yet
    }
    if (fd < 0)
      throw std::runtime_error("cannot connect to " + where + " within " + store_seconds_text(timeout) + ": " + error);
    // The server speaks first: its greeting and nonce; this client answers with its nonce and proof.
    std::string greeting, verdict;
    const wire::ReadStatus s = wire::read_frame(fd, greeting, wire::kMaxHandshakeFrame, deadline);
    const std::string expected = wire::kGreeting;
    if (s == wire::ReadStatus::kClosed)
      throw std::runtime_error(where + " closed the connection at once (another user's process is refused there)");
    if (s == wire::ReadStatus::kTimeout)
      throw std::runtime_error("something accepted the connection at " + where +
                               " but did not answer as libfsdp's rendezvous store within " +
                               store_seconds_text(timeout));
    if (s != wire::ReadStatus::kOk || greeting.size() != expected.size() + wire::kNonceBytes ||
        greeting.rfind(expected, 0) != 0)
      throw std::runtime_error("what answers at " + where + " is not libfsdp's rendezvous store");
    const std::string server_nonce = greeting.substr(expected.size()), client_nonce = random_bytes(wire::kNonceBytes);
    const Digest proof = wire::client_proof(token, server_nonce, client_nonce);
    wire::send_frame(fd, client_nonce + std::string(proof.begin(), proof.end()));
    if (wire::read_frame(fd, verdict, wire::kMaxHandshakeFrame, deadline) != wire::ReadStatus::kOk)
      throw std::runtime_error(where + " closed the connection during authentication");
    std::string theirs;
    bool accepted = false;
    try {
      wire::Reader in(verdict);
      accepted = in.u8() == 1;
      theirs = in.bytes();
    } catch (const wire::Reader::Malformed&) {
    }
    if (!accepted)
      throw StoreAuthError("the rendezvous store at " + where +
                           " refused this process's job token: FSDP_JOB_TOKEN differs from " + owner +
                           "'s (or is set for one and not the other), or another job's store holds this "
                           "address. Start every rank with the same FSDP_JOB_TOKEN, on a MASTER_PORT (fsdp-run "
                           "--master-port) no other job uses");
    Digest proven{};
    if (theirs.size() == proven.size()) std::memcpy(proven.data(), theirs.data(), proven.size());
    if (theirs.size() != proven.size() || !digests_equal(proven, wire::server_proof(token, server_nonce, client_nonce)))
      throw StoreAuthError("the rendezvous store at " + where +
                           " does not know this job's token: another program, not " + owner + ", answers there");
  } catch (...) {
    if (fd >= 0) close(fd);
    throw;
  }
  return fd;
}

}  // namespace fsdp
