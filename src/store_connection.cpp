#include "store_connection.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "job_token.h"
#include "store_wire.h"

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
                           "'s (or is set for one "
                           "and not the other). Start every rank with the same FSDP_JOB_TOKEN");
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
