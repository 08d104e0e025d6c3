#pragma once
// An authenticated connection to the job's rendezvous store (store_server.h): connect, then the
// mutual challenge-response of store_wire.h. Free of LibTorch, so that fsdp-run uses it too. See
// Note [Rendezvous store] in docs/design.md.
#include <chrono>
#include <stdexcept>
#include <string>

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
