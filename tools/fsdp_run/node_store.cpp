#include "node_store.h"

#include <unistd.h>

#include "store_wire.h"

namespace fsdp_run {

namespace {

namespace wire = fsdp::store_wire;

// A reply has this long beyond the request's own wait.
constexpr std::chrono::seconds kReplyTimeout(30);

}  // namespace

NodeStore::NodeStore(const std::string& host, int port, const std::string& token, std::chrono::milliseconds timeout)
    : where_(host + ":" + std::to_string(port)),
      fd_(fsdp::connect_to_store(host, port, token, timeout, "node 0's fsdp-run")) {}

NodeStore::~NodeStore() {
  if (fd_ >= 0) ::close(fd_);
}

std::string NodeStore::call(const std::string& request, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string reply;
  if (wire::send_frame(fd_, request) &&
      wire::read_frame(fd_, reply, wire::kMaxFrame, wire::Clock::now() + timeout) == wire::ReadStatus::kOk)
    return reply;
  throw StoreLost("lost the connection to the rendezvous store at " + where_);
}

void NodeStore::set(const std::string& key, const std::string& value) {
  call(wire::Writer().u8(wire::kSet).bytes(key).bytes(value).str(), kReplyTimeout);
}

std::optional<std::string> NodeStore::get(const std::string& key) {
  const std::string reply = call(wire::Writer().u8(wire::kGet).bytes(key).str(), kReplyTimeout);
  wire::Reader in(reply);
  if (in.u8() != 1) return std::nullopt;
  return in.bytes();
}

int64_t NodeStore::add(const std::string& key, int64_t delta) {
  const std::string reply = call(wire::Writer().u8(wire::kAdd).bytes(key).i64(delta).str(), kReplyTimeout);
  wire::Reader in(reply);
  in.u8();
  return in.i64();
}

std::string NodeStore::compare_set(const std::string& key, const std::string& expected, const std::string& desired) {
  const std::string reply =
      call(wire::Writer().u8(wire::kCompareSet).bytes(key).bytes(expected).bytes(desired).str(), kReplyTimeout);
  wire::Reader in(reply);
  in.u8();
  return in.bytes();
}

bool NodeStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const std::string reply = call(wire::Writer().u8(wire::kWait).keys(keys).i64(timeout.count()).str(),
                                 timeout + std::chrono::duration_cast<std::chrono::milliseconds>(kReplyTimeout));
  return wire::Reader(reply).u8() == 1;
}

}  // namespace fsdp_run
