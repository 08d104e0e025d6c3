#pragma once
// StoreClient: a c10d::Store backed by the job's rendezvous store (store_server.h), over one
// authenticated connection. Rank 0's client also owns the server. See Note [Rendezvous store] in
// docs/design.md.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "store_server.h"
#include "store_wire.h"

namespace fsdp {

class StoreClient : public c10d::Store {
 public:
  // Connects to `host`:`port` (retrying while nothing listens there, until `timeout`) and proves
  // that it holds `token`, as the server must too. Throws StoreAuthError when either proof fails,
  // std::runtime_error for anything else. `server`, if given, lives as long as the client.
  StoreClient(const std::string& host, int port, const std::string& token, std::chrono::milliseconds timeout,
              std::unique_ptr<StoreServer> server = nullptr);
  ~StoreClient() override;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;
  // Another connection to the same store, proving the same token; it does not own the server.
  // Overrides c10d::Store::clone() in LibTorch versions that declare it (no `override`: older
  // ones do not).
  c10::intrusive_ptr<c10d::Store> clone();  // NOLINT(modernize-use-override)

 private:
  // Sends `request` and returns the reply, which must come within `timeout`.
  std::string call(const std::string& request, std::chrono::milliseconds timeout);
  bool wait_for(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);

  std::string host_;
  int port_;
  std::string token_;
  std::string where_;  // host:port, for messages
  int fd_ = -1;
  std::mutex mu_;
  std::unique_ptr<StoreServer> server_;
};

}  // namespace fsdp
