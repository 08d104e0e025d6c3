#pragma once
// StoreServer: the job's rendezvous store as rank 0 hosts it: a key-value map served over TCP on
// one address (loopback for a single-host job), to clients that prove they hold the job token
// (store_wire.h). See Note [Rendezvous store] in docs/design.md.
#include <chrono>
#include <condition_variable>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace fsdp {

class StoreServer {
 public:
  // Listens on `host` ("" for every interface) at `port` (0: any free one). A client has
  // `handshake_timeout` to authenticate with `token`. Throws std::runtime_error when it cannot listen.
  // `owner` names the store in the refusals it reports.
  StoreServer(const std::string& host, int port, std::string token, std::chrono::milliseconds handshake_timeout,
              std::string owner = "rank 0: the rendezvous store");
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;
  int port() const { return port_; }

 private:
  struct Connection {
    int fd = -1;
    std::thread thread;
    bool done = false;  // guarded by connections_mu_
  };
  void accept_loop();
  void serve(Connection* c);
  // Whether the client on `fd` proves it holds the token; says why not in `why`.
  bool authenticate(int fd, std::string& why);
  // The reply to one request; a malformed request throws.
  std::string handle(const std::string& request);
  void refused(const std::string& why);
  // Prints the first few refusals; connections_mu_ is held.
  void report_refusal(const std::string& why);

  std::string token_;
  std::string owner_;
  std::chrono::milliseconds handshake_timeout_;
  int listen_fd_ = -1, port_ = 0;
  int wake_[2] = {-1, -1};  // a pipe that stops the accept loop
  std::thread acceptor_;

  std::mutex connections_mu_;  // guards what follows
  std::list<Connection> connections_;
  int unauthenticated_ = 0;  // connections still in their handshake
  int refusals_reported_ = 0;

  std::mutex mu_;  // guards what follows
  std::condition_variable changed_;
  std::map<std::string, std::string> data_;
  bool stopping_ = false;
};

}  // namespace fsdp
