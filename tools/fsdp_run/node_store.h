#pragma once
// NodeStore: fsdp-run's client of the rendezvous store (src/store_server.h) that the elastic job's
// node 0 hosts; one authenticated connection, calls serialized.
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdp_run {

// The connection to the store broke: its node is gone.
struct StoreLost : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class NodeStore {
 public:
  // Connects to `host`:`port` within `timeout` and authenticates with `token`; throws
  // std::runtime_error (fsdp::StoreAuthError for a token mismatch) when it cannot.
  NodeStore(const std::string& host, int port, const std::string& token, std::chrono::milliseconds timeout);
  ~NodeStore();
  NodeStore(const NodeStore&) = delete;
  NodeStore& operator=(const NodeStore&) = delete;

  void set(const std::string& key, const std::string& value);
  // The value of `key`, or nothing when it is absent; does not wait.
  std::optional<std::string> get(const std::string& key);
  // Adds `delta` to the integer at `key` (absent: 0) and returns the sum.
  int64_t add(const std::string& key, int64_t delta);
  // Sets `key` to `desired` if it holds `expected` (absent matches ""); returns the value it holds after.
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired);
  // Whether all `keys` are present within `timeout`.
  bool wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);

  const std::string& where() const { return where_; }

 private:
  std::string call(const std::string& request, std::chrono::milliseconds timeout);

  std::string where_;  // host:port, for messages
  int fd_ = -1;
  std::mutex mu_;
};

}  // namespace fsdp_run
