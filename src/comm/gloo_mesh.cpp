#include "comm/gloo_mesh.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <gloo/common/common.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <vector>

#include "fsdp/check.h"
#include "job_token.h"

namespace fsdp {
namespace {

constexpr uint8_t kProofSlotPrefix = 0x7e;

std::string text_of(const std::exception& e) {
  std::string s = e.what();
  if (auto nl = s.find('\n'); nl != std::string::npos) s.resize(nl);
  return s;
}

// What member `from` sends member `to` over their pair: only a holder of the job token knows it.
Digest pair_proof(const std::string& token, const std::string& id, int attempt, int from, int to) {
  return hmac_sha256(token, "gloo-pair " + id + " attempt " + std::to_string(attempt) + " from " +
                                std::to_string(from) + " to " + std::to_string(to));
}

// Sends every other member its proof and checks theirs; "" or what failed.
std::string prove_pairs(gloo::Context& ctx, const std::string& token, const std::string& id, int attempt,
                        std::chrono::milliseconds timeout) {
  const int W = ctx.size, r = ctx.rank;
  std::vector<Digest> mine(W), got(W);
  for (int p = 0; p < W; ++p) mine[p] = pair_proof(token, id, attempt, r, p);
  try {
    auto send_buf = ctx.createUnboundBuffer(mine.data(), sizeof(Digest) * W);
    auto recv_buf = ctx.createUnboundBuffer(got.data(), sizeof(Digest) * W);
    const uint64_t slot = gloo::Slot::build(kProofSlotPrefix, 0);
    for (int p = 0; p < W; ++p) {
      if (p == r) continue;
      recv_buf->recv(p, slot, sizeof(Digest) * p, sizeof(Digest));
      send_buf->send(p, slot, sizeof(Digest) * p, sizeof(Digest));
    }
    for (int i = 0; i < W - 1; ++i)
      if (!recv_buf->waitRecv(timeout)) return "a proof receive was aborted";
    for (int i = 0; i < W - 1; ++i)
      if (!send_buf->waitSend(timeout)) return "a proof send was aborted";
  } catch (const std::exception& e) {
    return text_of(e);
  }
  for (int p = 0; p < W; ++p)
    if (p != r && !digests_equal(got[p], pair_proof(token, id, attempt, p, r)))
      return "the pair to member " + std::to_string(p) + " delivered a wrong proof (it does not reach that rank)";
  return "";
}

// Publishes this member's outcome of `phase` and reads everyone's: "" when all succeeded, else
// the first failure, naming its member.
std::string agree(c10d::Store& store, const std::string& phase, int my_index, int size, const std::string& mine,
                  std::chrono::milliseconds timeout) {
  const std::string outcome = mine.empty() ? "ok" : "failed: " + mine;
  store.set(phase + "/" + std::to_string(my_index), std::vector<uint8_t>(outcome.begin(), outcome.end()));
  std::vector<std::string> keys;
  for (int i = 0; i < size; ++i) keys.push_back(phase + "/" + std::to_string(i));
  store.wait(keys, timeout);
  for (int i = 0; i < size; ++i) {
    const auto v = store.get(keys[i]);
    const std::string s(v.begin(), v.end());
    if (s != "ok") return "member " + std::to_string(i) + " " + s;
  }
  return "";
}

}  // namespace

std::shared_ptr<gloo::Context> connect_verified_mesh(const c10::intrusive_ptr<c10d::Store>& store, int my_index,
                                                     int size, const std::string& id,
                                                     const GlooMeshSettings& settings) {
  const std::string token = job_token();
  // The exchange of proofs follows a barrier, so it waits only on the network, not on late ranks.
  const auto proof_timeout = std::min(settings.timeout, std::chrono::milliseconds(std::chrono::seconds(15)));
  std::string failure;
  for (int attempt = 0; attempt < settings.attempts; ++attempt) {
    auto scoped = c10::make_intrusive<c10d::PrefixStore>("mesh" + std::to_string(attempt), store);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(my_index, size);
    ctx->setTimeout(settings.timeout);
    // One transport device per communicator, as c10d does per process group: contexts that share
    // a device can deadlock when two of them run collectives at once.
    gloo::transport::tcp::attr attr;
    attr.iface = settings.iface;
    attr.hostname = settings.hostname;
    std::shared_ptr<gloo::transport::Device> device;
    try {
      device = gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception& e) {
      FSDP_FAIL("member ", my_index, " of ", id, " cannot listen for Gloo pairs: ", text_of(e),
                ". Set FSDP_BIND_ADDR or GLOO_SOCKET_IFNAME to an address or interface of this host");
    }
    std::string mine;
    try {
      c10d::ProcessGroupGloo::GlooStore gloo_store(scoped);
      ctx->connectFullMesh(gloo_store, device);
    } catch (const std::exception& e) {
      mine = text_of(e);
    }
    failure = agree(*scoped, "connected", my_index, size, mine, settings.timeout);
    // A peer that does not answer in time is not a stranger's doing: connecting again would wait as long.
    if (failure.find("imed out") != std::string::npos) break;
    if (failure.empty()) {
      mine = prove_pairs(*ctx, token, id, attempt, proof_timeout);
      failure = agree(*scoped, "proved", my_index, size, mine, settings.timeout);
    }
    if (failure.empty()) return ctx;
    if (my_index == 0 && attempt + 1 < settings.attempts)
      std::fprintf(stderr,
                   "[fsdp] %s: setting up its Gloo pairs failed (attempt %d of %d: %s); a connection that is not a "
                   "rank of this job may have reached their ports (docs/security.md). Connecting again on fresh "
                   "ports\n",
                   id.c_str(), attempt + 1, settings.attempts, failure.c_str());
  }
  FSDP_FAIL("member ", my_index, " of ", id, " could not set up its Gloo pairs: ", failure,
            ". Check that every member rank is alive and that their addresses are reachable (set FSDP_BIND_ADDR or "
            "GLOO_SOCKET_IFNAME to choose the interface); if connections that are not ranks of this job reach the "
            "job's ports, keep the job on a network only its hosts can reach (docs/security.md)");
}

}  // namespace fsdp
