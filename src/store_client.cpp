#include "store_client.h"

#include <unistd.h>

namespace fsdp {

namespace wire = store_wire;

StoreClient::StoreClient(const std::string& host, int port, const std::string& token, std::chrono::milliseconds timeout,
                         std::unique_ptr<StoreServer> server)
    : c10d::Store(timeout),
      host_(host),
      port_(port),
      token_(token),
      where_(host + ":" + std::to_string(port)),
      fd_(connect_to_store(host, port, token, timeout, "rank 0")),
      server_(std::move(server)) {}

StoreClient::~StoreClient() {
  if (fd_ >= 0) close(fd_);
  server_.reset();
}

c10::intrusive_ptr<c10d::Store> StoreClient::clone() {
  return c10::make_intrusive<StoreClient>(host_, port_, token_, timeout_);
}

std::string StoreClient::call(const std::string& request, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string reply;
  if (!wire::send_frame(fd_, request))
    throw std::runtime_error("lost the connection to the rendezvous store at " + where_ + " (rank 0 is gone)");
  const wire::ReadStatus s = wire::read_frame(fd_, reply, wire::kMaxFrame, wire::Clock::now() + timeout);
  if (s == wire::ReadStatus::kTimeout)
    throw std::runtime_error("the rendezvous store at " + where_ + " did not answer within " +
                             store_seconds_text(timeout));
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
                             store_seconds_text(timeout_));
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
                             ") timed out after " + store_seconds_text(timeout));
}

}  // namespace fsdp
