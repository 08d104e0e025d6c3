#include "communicator_factory.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>

#include "comm/self_communicator.h"
#include "comm/shm_communicator.h"
#ifdef FSDP_WITH_GLOO
#include "comm/gloo_communicator.h"
#include "comm/gloo_mesh.h"
#endif
#ifdef FSDP_WITH_NCCL
#include "comm/host_staged_communicator.h"
#include "comm/nccl_communicator.h"
#endif
#include "env_var.h"
#include "fsdp/check.h"

namespace fsdp {

namespace {

#ifdef FSDP_WITH_GLOO
bool is_loopback(const std::string& addr) { return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1"; }

// The local address this host uses to reach `peer` (an address or a host name): connecting a
// UDP socket sends nothing but makes the kernel pick the route, and getsockname() tells the
// source address. "" if no address of `peer` is routable from here.
std::string local_address_towards(const std::string& peer, int port) {
  if (is_loopback(peer)) return "127.0.0.1";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(peer.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return "";
  std::string result;
  for (addrinfo* a = found; a && result.empty(); a = a->ai_next) {
    if (a->ai_family != AF_INET && a->ai_family != AF_INET6) continue;
    const int fd = socket(a->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    sockaddr_storage self{};
    socklen_t len = sizeof(self);
    char buf[INET6_ADDRSTRLEN] = {0};
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 && getsockname(fd, reinterpret_cast<sockaddr*>(&self), &len) == 0) {
      const void* addr = self.ss_family == AF_INET
                             ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&self)->sin_addr)
                             : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&self)->sin6_addr);
      if (inet_ntop(self.ss_family, addr, buf, sizeof(buf))) result = buf;
    }
    close(fd);
  }
  freeaddrinfo(found);
  return result;
}
#endif  // FSDP_WITH_GLOO

}  // namespace

CommunicatorFactory::CommunicatorFactory(const RankEnv& env, const ProcessGroupOptions& options,
                                         const MemberWatch* members)
    : env_(env), options_(options), members_(members) {
#ifdef FSDP_WITH_GLOO
  std::string bind = options.bind_addr;
  if (bind.empty()) {
    if (const char* a = env_or_null("FSDP_BIND_ADDR")) bind = a;
  }
  if (const char* ifname = env_or_null("GLOO_SOCKET_IFNAME"); bind.empty() && ifname) {
    gloo_iface_ = ifname;
  } else {
    if (bind.empty()) bind = local_address_towards(env.master_addr, env.master_port);
    gloo_hostname_ = bind.empty() ? env.master_addr : bind;
  }
#endif
}

CommunicatorPtr CommunicatorFactory::connect(const c10::intrusive_ptr<c10d::Store>& store,
                                             const std::vector<int>& ranks, int my_index, const std::string& id) const {
  CommunicatorPtr comm;
  auto host_comm = [&] {
    CommunicatorPtr c;
    if (ranks.size() > 1 && options_.transport != Transport::kTcp)
      c = make_shm_communicator(store, my_index, static_cast<int>(ranks.size()), id, options_.timeout,
                                options_.transport == Transport::kSharedMemory);
    return c ? c : connect_gloo(store, ranks, my_index, id);
  };
  if (options_.device.is_cuda()) {
#ifdef FSDP_WITH_NCCL
    // CUDA tensors: NCCL, unless a CPU transport was named (ranks sharing one GPU, which NCCL
    // refuses): then staged through host memory over it (Note [Host-staged collectives]).
    if (options_.transport == Transport::kAuto)
      comm = make_nccl_communicator(store, my_index, static_cast<int>(ranks.size()), id, options_.timeout,
                                    options_.device);
    else
      comm = make_host_staged_communicator(host_comm(), options_.device, options_.timeout);
#endif
  } else {
    comm = host_comm();
  }
  return comm;
}

CommunicatorPtr CommunicatorFactory::connect_gloo(const c10::intrusive_ptr<c10d::Store>& store,
                                                  const std::vector<int>& ranks, int my_index,
                                                  const std::string& id) const {
  const int size = static_cast<int>(ranks.size());
#ifndef FSDP_WITH_GLOO
  if (size == 1) return make_self_communicator(id);
  FSDP_FAIL("rank ", env_.rank, " cannot connect ", id,
            " over TCP: this build of libfsdp has no Gloo (PyTorch's own "
            "LibTorch ships no Gloo headers). Within one host use the shared-memory transport (FSDP_TRANSPORT=shm), "
            "or build against a LibTorch with Gloo (Debian's libtorch-dev + libgloo-dev)");
#else
  GlooMeshSettings mesh;
  mesh.iface = gloo_iface_;
  mesh.hostname = gloo_hostname_;
  mesh.timeout = options_.timeout;
  auto ctx = connect_verified_mesh(store, my_index, size, id, mesh);
  return make_gloo_communicator(std::move(ctx), id, options_.timeout, options_.check_collectives,
                                members_->exit_watch(ranks), store);
#endif
}

}  // namespace fsdp
