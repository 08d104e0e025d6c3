#include "store_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <vector>

#include "store_wire.h"

namespace fsdp {

namespace {

namespace wire = store_wire;

// Connections in their handshake at once; more are closed at once, so that a flood of strangers
// costs rank 0 a bounded number of threads.
constexpr int kMaxUnauthenticated = 64;

// A socket address as /proc/net/tcp{,6} prints it ("0100007F:1F90"), IPv4-mapped IPv6 as IPv4;
// sets `v6` to which table holds it. "" for other families.
std::string proc_net_address(const sockaddr_storage& a, bool& v6) {
  char buf[64];
  if (a.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(a);
    std::snprintf(buf, sizeof(buf), "%08X:%04X", in.sin_addr.s_addr, ntohs(in.sin_port));
    v6 = false;
    return buf;
  }
  if (a.ss_family != AF_INET6) return "";
  const auto& in6 = reinterpret_cast<const sockaddr_in6&>(a);
  uint32_t w[4];
  std::memcpy(w, &in6.sin6_addr, sizeof(w));
  if (IN6_IS_ADDR_V4MAPPED(&in6.sin6_addr)) {
    std::snprintf(buf, sizeof(buf), "%08X:%04X", w[3], ntohs(in6.sin6_port));
    v6 = false;
  } else {
    std::snprintf(buf, sizeof(buf), "%08X%08X%08X%08X:%04X", w[0], w[1], w[2], w[3], ntohs(in6.sin6_port));
    v6 = true;
  }
  return buf;
}

bool is_loopback_peer(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) return (ntohl(reinterpret_cast<const sockaddr_in&>(a).sin_addr.s_addr) >> 24) == 127;
  if (a.ss_family != AF_INET6) return false;
  const auto& addr = reinterpret_cast<const sockaddr_in6&>(a).sin6_addr;
  return IN6_IS_ADDR_LOOPBACK(&addr) || (IN6_IS_ADDR_V4MAPPED(&addr) && addr.s6_addr[12] == 127);
}

// For a connection from this host's loopback: whether the process at the other end runs as this
// user, read from the kernel's socket table (the client's socket is the row whose local address
// is our peer and whose remote address is us). Unknown (a table that cannot be read): nothing.
std::optional<bool> loopback_peer_is_same_user(int fd, std::string& peer) {
  sockaddr_storage self{}, other{};
  socklen_t ls = sizeof(self), lo = sizeof(other);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&self), &ls) != 0 ||
      getpeername(fd, reinterpret_cast<sockaddr*>(&other), &lo) != 0)
    return false;
  char host[INET6_ADDRSTRLEN] = "?";
  const void* raw = other.ss_family == AF_INET
                        ? static_cast<const void*>(&reinterpret_cast<sockaddr_in&>(other).sin_addr)
                        : static_cast<const void*>(&reinterpret_cast<sockaddr_in6&>(other).sin6_addr);
  inet_ntop(other.ss_family, raw, host, sizeof(host));
  peer = std::string(host) + ":" +
         std::to_string(ntohs(other.ss_family == AF_INET ? reinterpret_cast<sockaddr_in&>(other).sin_port
                                                         : reinterpret_cast<sockaddr_in6&>(other).sin6_port));
  if (!is_loopback_peer(other)) return true;  // another host: the token alone decides
  bool v6_self = false, v6_other = false;
  const std::string local = proc_net_address(other, v6_other), remote = proc_net_address(self, v6_self);
  std::ifstream table(v6_other ? "/proc/net/tcp6" : "/proc/net/tcp");
  if (!table) return std::nullopt;
  std::string line;
  std::getline(table, line);  // the header
  while (std::getline(table, line)) {
    std::istringstream f(line);
    std::string slot, l, r, state, queues, timer, retransmits;
    long uid = -1;
    if (!(f >> slot >> l >> r >> state >> queues >> timer >> retransmits >> uid)) continue;
    // An IPv4 client of a dual-stack listener appears as IPv4 in its own row.
    if (l == local && (r == remote || v6_self != v6_other)) return uid == static_cast<long>(geteuid());
  }
  return false;
}

}  // namespace

StoreServer::StoreServer(const std::string& host, int port, std::string token,
                         std::chrono::milliseconds handshake_timeout, std::string owner)
    : token_(std::move(token)), owner_(std::move(owner)), handshake_timeout_(handshake_timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found); rc != 0)
    throw std::runtime_error("cannot resolve " + host + ": " + gai_strerror(rc));
  // Every interface: the IPv6 wildcard, which takes IPv4 too, before the IPv4 one.
  std::vector<addrinfo*> order;
  for (addrinfo* a = found; a; a = a->ai_next)
    if (a->ai_family == AF_INET6 || a->ai_family == AF_INET) order.push_back(a);
  if (host.empty())
    std::stable_sort(order.begin(), order.end(),
                     [](addrinfo* a, addrinfo* b) { return a->ai_family == AF_INET6 && b->ai_family != AF_INET6; });
  std::string error = "no address to listen on";
  for (addrinfo* a : order) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int on = 1, off = 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    if (a->ai_family == AF_INET6 && host.empty()) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof(off));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 512) == 0) {
      listen_fd_ = fd;
      break;
    }
    error = std::string(std::strerror(errno));
    close(fd);
  }
  freeaddrinfo(found);
  if (listen_fd_ < 0)
    throw std::runtime_error("cannot listen on " + (host.empty() ? std::string("every interface") : host) + " port " +
                             service + ": " + error);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  port_ = ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in&>(bound).sin_port
                                           : reinterpret_cast<sockaddr_in6&>(bound).sin6_port);
  if (pipe2(wake_, O_CLOEXEC) != 0) {
    close(listen_fd_);
    throw std::runtime_error(std::string("pipe2 failed: ") + std::strerror(errno));
  }
  acceptor_ = std::thread([this] { accept_loop(); });
}

StoreServer::~StoreServer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  changed_.notify_all();
  const char stop = 1;
  (void)!write(wake_[1], &stop, 1);
  acceptor_.join();
  std::list<Connection> all;
  {
    std::lock_guard<std::mutex> lock(connections_mu_);
    for (auto& c : connections_) shutdown(c.fd, SHUT_RDWR);
    all.splice(all.end(), connections_);
  }
  for (auto& c : all) {
    c.thread.join();
    close(c.fd);
  }
  close(listen_fd_);
  close(wake_[0]);
  close(wake_[1]);
}

void StoreServer::accept_loop() {
  for (;;) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (poll(p, 2, -1) < 0 && errno != EINTR) return;
    if (p[1].revents != 0) return;
    if ((p[0].revents & POLLIN) == 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    std::lock_guard<std::mutex> lock(connections_mu_);
    for (auto it = connections_.begin(); it != connections_.end();) {  // reap the finished
      if (!it->done) {
        ++it;
        continue;
      }
      it->thread.join();
      close(it->fd);
      it = connections_.erase(it);
    }
    if (unauthenticated_ >= kMaxUnauthenticated) {
      close(fd);
      report_refusal(": " + std::to_string(kMaxUnauthenticated) + " others are still authenticating");
      continue;
    }
    wire::set_no_delay(fd);
    Connection& c = connections_.emplace_back();
    c.fd = fd;
    try {
      c.thread = std::thread([this, &c] { serve(&c); });
      ++unauthenticated_;
    } catch (const std::system_error&) {  // no thread to be had: this connection is refused
      close(fd);
      connections_.pop_back();
      report_refusal(": no thread left to serve it");
    }
  }
}

void StoreServer::refused(const std::string& why) {
  std::lock_guard<std::mutex> lock(connections_mu_);
  report_refusal(" " + why);
}

void StoreServer::report_refusal(const std::string& why) {
  if (refusals_reported_ < 5) std::fprintf(stderr, "[fsdp] %s refused a connection%s\n", owner_.c_str(), why.c_str());
  if (++refusals_reported_ == 5)
    std::fprintf(stderr, "[fsdp] %s: (further refusals are not reported)\n", owner_.c_str());
}

bool StoreServer::authenticate(int fd, std::string& why) {
  std::string peer;
  const std::optional<bool> same_user = loopback_peer_is_same_user(fd, peer);
  if (same_user == false) {
    why = "from " + peer + ": on this host, only this user's processes may connect";
    return false;
  }
  const std::string server_nonce = random_bytes(wire::kNonceBytes);
  if (!wire::send_frame(fd, wire::kGreeting + server_nonce)) return false;
  std::string answer;
  const wire::ReadStatus s =
      wire::read_frame(fd, answer, wire::kMaxHandshakeFrame, wire::Clock::now() + handshake_timeout_);
  if (s != wire::ReadStatus::kOk || answer.size() != wire::kNonceBytes + sizeof(Digest)) {
    why = "from " + peer + ": " +
          (s == wire::ReadStatus::kTimeout ? "it did not authenticate in time"
                                           : "it does not speak the store's protocol");
    return false;
  }
  const std::string client_nonce = answer.substr(0, wire::kNonceBytes);
  Digest proof;
  std::memcpy(proof.data(), answer.data() + wire::kNonceBytes, proof.size());
  if (!digests_equal(proof, wire::client_proof(token_, server_nonce, client_nonce))) {
    wire::send_frame(fd, wire::Writer().u8(0).bytes("wrong job token").str());
    why = "from " + peer + ": wrong job token (FSDP_JOB_TOKEN)";
    return false;
  }
  const Digest mine = wire::server_proof(token_, server_nonce, client_nonce);
  return wire::send_frame(fd, wire::Writer().u8(1).bytes(std::string(mine.begin(), mine.end())).str());
}

void StoreServer::serve(Connection* c) {
  // Nothing may escape a connection's thread: a failure ends this connection only.
  std::string why;
  bool authenticated = false;
  try {
    authenticated = authenticate(c->fd, why);
  } catch (const std::exception& e) {
    why = std::string("during authentication: ") + e.what();
  }
  {
    std::lock_guard<std::mutex> lock(connections_mu_);
    --unauthenticated_;
  }
  if (authenticated) {
    std::string request;
    try {
      while (wire::read_frame(c->fd, request, wire::kMaxFrame, wire::Clock::time_point::max()) == wire::ReadStatus::kOk)
        if (!wire::send_frame(c->fd, handle(request))) break;
    } catch (const std::exception&) {  // a malformed request, or no memory for a reply
    }
  } else if (!why.empty()) {
    refused(why);
  }
  shutdown(c->fd, SHUT_RDWR);
  std::lock_guard<std::mutex> lock(connections_mu_);
  c->done = true;
}

std::string StoreServer::handle(const std::string& request) {
  wire::Reader in(request);
  wire::Writer out;
  std::unique_lock<std::mutex> lock(mu_);
  const uint8_t op = in.u8();
  if (op == wire::kSet) {
    std::string key = in.bytes();
    data_[std::move(key)] = in.bytes();
    changed_.notify_all();
    out.u8(1);
  } else if (op == wire::kGet) {
    const auto it = data_.find(in.bytes());
    out.u8(it != data_.end());
    if (it != data_.end()) out.bytes(it->second);
  } else if (op == wire::kAdd) {
    const std::string key = in.bytes();
    const int64_t delta = in.i64();
    const auto it = data_.find(key);
    const int64_t value = (it == data_.end() ? 0 : std::strtoll(it->second.c_str(), nullptr, 10)) + delta;
    data_[key] = std::to_string(value);
    changed_.notify_all();
    out.u8(1).i64(value);
  } else if (op == wire::kCompareSet) {
    const std::string key = in.bytes(), expected = in.bytes(), desired = in.bytes();
    const auto it = data_.find(key);
    if (it == data_.end()) {  // as c10d: an absent key counts as an empty expected value
      if (expected.empty()) data_[key] = desired;
      out.u8(1).bytes(expected.empty() ? desired : expected);
    } else if (it->second == expected) {
      it->second = desired;
      out.u8(1).bytes(desired);
    } else {
      out.u8(1).bytes(it->second);
    }
    changed_.notify_all();
  } else if (op == wire::kDelete) {
    out.u8(data_.erase(in.bytes()) > 0);
  } else if (op == wire::kCheck || op == wire::kWait) {
    const std::vector<std::string> keys = in.keys();
    auto all_present = [&] {
      for (const auto& k : keys)
        if (!data_.count(k)) return false;
      return true;
    };
    if (op == wire::kWait) {
      const auto deadline = wire::Clock::now() + std::chrono::milliseconds(std::max<int64_t>(0, in.i64()));
      changed_.wait_until(lock, deadline, [&] { return stopping_ || all_present(); });
    }
    out.u8(all_present());
  } else if (op == wire::kNumKeys) {
    out.u8(1).i64(static_cast<int64_t>(data_.size()));
  } else {
    throw wire::Reader::Malformed();
  }
  if (!in.at_end()) throw wire::Reader::Malformed();
  return out.str();
}

}  // namespace fsdp
