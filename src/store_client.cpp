#include "store_client.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

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

std::string seconds_text(std::chrono::milliseconds t) { return std::to_string(t.count() / 1000.0).substr(0, 5) + " s"; }

}  // namespace

StoreClient::StoreClient(const std::string& host, int port, const std::string& token, std::chrono::milliseconds timeout,
                         std::unique_ptr<StoreServer> server)
    : c10d::Store(timeout), where_(host + ":" + std::to_string(port)), server_(std::move(server)) {
  const auto deadline = wire::Clock::now() + timeout;
  std::string error;
  for (auto pause = std::chrono::milliseconds(10);; pause = std::min(pause * 2, std::chrono::milliseconds(500))) {
    fd_ = connect_once(host, port, deadline, error);
    if (fd_ >= 0 || wire::Clock::now() + pause >= deadline) break;
    std::this_thread::sleep_for(pause);  // rank 0 may not listen yet
  }
  if (fd_ < 0)
    throw std::runtime_error("cannot connect to " + where_ + " within " + seconds_text(timeout) + ": " + error);
  // The server speaks first: its greeting and nonce; this client answers with its nonce and proof.
  std::string greeting, verdict;
  const wire::ReadStatus s = wire::read_frame(fd_, greeting, wire::kMaxHandshakeFrame, deadline);
  const std::string expected = wire::kGreeting;
  if (s == wire::ReadStatus::kClosed)
    throw std::runtime_error(where_ + " closed the connection at once (another user's process is refused there)");
  if (s == wire::ReadStatus::kTimeout)
    throw std::runtime_error("something accepted the connection at " + where_ +
                             " but did not answer as libfsdp's rendezvous store within " + seconds_text(timeout));
  if (s != wire::ReadStatus::kOk || greeting.size() != expected.size() + wire::kNonceBytes ||
      greeting.rfind(expected, 0) != 0)
    throw std::runtime_error("what answers at " + where_ + " is not libfsdp's rendezvous store");
  const std::string server_nonce = greeting.substr(expected.size()), client_nonce = random_bytes(wire::kNonceBytes);
  const Digest proof = wire::client_proof(token, server_nonce, client_nonce);
  wire::send_frame(fd_, client_nonce + std::string(proof.begin(), proof.end()));
  if (wire::read_frame(fd_, verdict, wire::kMaxHandshakeFrame, deadline) != wire::ReadStatus::kOk)
    throw std::runtime_error(where_ + " closed the connection during authentication");
  std::string theirs;
  bool accepted = false;
  try {
    wire::Reader in(verdict);
    accepted = in.u8() == 1;
    theirs = in.bytes();
  } catch (const wire::Reader::Malformed&) {
  }
  if (!accepted)
    throw StoreAuthError("the rendezvous store at " + where_ +
                         " refused this process's job token: FSDP_JOB_TOKEN differs from rank 0's (or is set for one "
                         "and not the other). Start every rank with the same FSDP_JOB_TOKEN");
  Digest proven{};
  if (theirs.size() == proven.size()) std::memcpy(proven.data(), theirs.data(), proven.size());
  if (theirs.size() != proven.size() || !digests_equal(proven, wire::server_proof(token, server_nonce, client_nonce)))
    throw StoreAuthError("the rendezvous store at " + where_ +
                         " does not know this job's token: another program, not rank 0, answers there");
}

StoreClient::~StoreClient() {
  if (fd_ >= 0) close(fd_);
  server_.reset();
}

std::string StoreClient::call(const std::string& request, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string reply;
  if (!wire::send_frame(fd_, request))
    throw std::runtime_error("lost the connection to the rendezvous store at " + where_ + " (rank 0 is gone)");
  const wire::ReadStatus s = wire::read_frame(fd_, reply, wire::kMaxFrame, wire::Clock::now() + timeout);
  if (s == wire::ReadStatus::kTimeout)
    throw std::runtime_error("the rendezvous store at " + where_ + " did not answer within " + seconds_text(timeout));
  if (s != wire::ReadStatus::kOk)
    throw std::runtime_error("lost the connection to the rendezvous store at " + where_ + " (rank 0 is gone)");
  return reply;
}

void StoreClient::set(const std::string& key, const std::vector<uint8_t>& value) {
  call(wire::Writer().u8(wire::kSet).bytes(key).bytes(value).str(), timeout_);
}

std::vector<uint8_t> StoreClient::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                             const std::vector<uint8_t>& desired) {
  const std::string reply =
      call(wire::Writer().u8(wire::kCompareSet).bytes(key).bytes(expected).bytes(desired).str(), timeout_);
  wire::Reader in(reply);
  in.u8();
  return wire::to_vector(in.bytes());
}

std::vector<uint8_t> StoreClient::get(const std::string& key) {
  if (!wait_for({key}, timeout_))
    throw std::runtime_error("key '" + key + "' did not appear in the rendezvous store within " +
                             seconds_text(timeout_));
  const std::string reply = call(wire::Writer().u8(wire::kGet).bytes(key).str(), timeout_);
  wire::Reader in(reply);
  if (in.u8() != 1) throw std::runtime_error("key '" + key + "' was deleted from the rendezvous store");
  return wire::to_vector(in.bytes());
}

int64_t StoreClient::add(const std::string& key, int64_t value) {
  const std::string reply = call(wire::Writer().u8(wire::kAdd).bytes(key).i64(value).str(), timeout_);
  wire::Reader in(reply);
  in.u8();
  return in.i64();
}

bool StoreClient::deleteKey(const std::string& key) {
  return wire::Reader(call(wire::Writer().u8(wire::kDelete).bytes(key).str(), timeout_)).u8() == 1;
}

bool StoreClient::check(const std::vector<std::string>& keys) {
  return wire::Reader(call(wire::Writer().u8(wire::kCheck).keys(keys).str(), timeout_)).u8() == 1;
}

int64_t StoreClient::getNumKeys() {
  const std::string reply = call(wire::Writer().u8(wire::kNumKeys).str(), timeout_);
  wire::Reader in(reply);
  in.u8();
  return in.i64();
}

bool StoreClient::wait_for(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const std::string reply =
      call(wire::Writer().u8(wire::kWait).keys(keys).i64(timeout.count()).str(), timeout + std::chrono::seconds(10));
  return wire::Reader(reply).u8() == 1;
}

void StoreClient::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void StoreClient::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  // c10d's kNoTimeout (zero) waits for good.
  const auto bound = timeout.count() > 0 ? timeout : std::chrono::milliseconds(std::chrono::hours(24 * 365));
  if (!wait_for(keys, bound))
    throw std::runtime_error("waiting for " + std::to_string(keys.size()) + " key(s) in the rendezvous store (" +
                             (keys.empty() ? std::string() : keys.front()) + (keys.size() > 1 ? ", ..." : "") +
                             ") timed out after " + seconds_text(timeout));
}

}  // namespace fsdp
