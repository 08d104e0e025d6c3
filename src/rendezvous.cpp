#include "rendezvous.h"

#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>

#include <torch/version.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cstdlib>
#include <future>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/check.h"
#include "member_watch.h"

namespace fsdp {

namespace {

// The TCPStore, built and answered once (this rank's arrival is recorded) on a helper thread: a
// peer that accepts the connection but never answers (another program listening on MASTER_PORT)
// fails after the timeout instead of hanging.
c10::intrusive_ptr<c10d::Store> connect_store(const RankEnv& env, const c10d::TCPStoreOptions& so) {
  // A name that does not resolve would otherwise be retried until the timeout.
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(env.master_addr.c_str(), nullptr, &hints, &found);
  if (found != nullptr) freeaddrinfo(found);
  FSDP_CHECK(rc == 0, "rank ", env.rank, ": MASTER_ADDR '", env.master_addr, "' does not resolve (", gai_strerror(rc),
             "); set MASTER_ADDR to rank 0's host name or IP address");
  auto result = std::make_shared<std::promise<c10::intrusive_ptr<c10d::Store>>>();
  auto done = result->get_future();
  std::thread([result, addr = env.master_addr, so, rank = env.rank, id = process_identity()] {
    try {
      auto store = c10::make_intrusive<c10d::TCPStore>(addr, so);
      store->set(arrival_key(rank), std::vector<uint8_t>(id.begin(), id.end()));
      store->check({arrival_key(rank)});  // a request with a reply (set is not): the store answers
      result->set_value(store);
    } catch (...) {
      result->set_exception(std::current_exception());
    }
  }).detach();
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(so.timeout).count();
  FSDP_CHECK(done.wait_for(so.timeout + std::chrono::seconds(2)) == std::future_status::ready, "rank ", env.rank,
             " could not rendezvous at MASTER_ADDR=", env.master_addr, " MASTER_PORT=", env.master_port,
             ": something accepted the connection but did not answer as a c10d TCPStore within ", seconds,
             " s. If rank 0 failed, see its error; if another program listens on that port, choose a free "
             "MASTER_PORT (fsdp-run --master-port)");
  return done.get();
}

// Every rank (announced by connect_store) waits for all the others, so that a rank that never
// started is named (the store itself only counts arrivals).
void wait_for_all_ranks(c10d::Store& store, const RankEnv& env, std::chrono::milliseconds timeout) {
  std::vector<std::string> keys;
  for (int r = 0; r < env.world_size; ++r) keys.push_back(arrival_key(r));
  // Rank 0 hosts the store: it gives up a little later, so that the others can still name the
  // missing ranks when they give up.
  const auto deadline = std::chrono::steady_clock::now() + timeout + std::chrono::seconds(env.rank == 0 ? 2 : 0);
  auto pause = std::chrono::milliseconds(1);
  auto all_arrived = [&] {
    try {
      return store.check(keys);
    } catch (const std::exception& e) {
      FSDP_FAIL("rank ", env.rank, " lost the rendezvous store at MASTER_ADDR=", env.master_addr,
                " MASTER_PORT=", env.master_port, " (rank 0's) while waiting for all ranks to arrive: ", e.what(),
                ". See rank 0's error");
    }
  };
  while (!all_arrived()) {
    if (std::chrono::steady_clock::now() >= deadline) {
      std::ostringstream missing;
      int count = 0;
      for (int r = 0; r < env.world_size; ++r)
        if (!store.check({keys[r]})) missing << (count++ ? ", " : "") << r;
      FSDP_FAIL("rank ", env.rank, ": ", count, " of ", env.world_size, " ranks never arrived at the rendezvous (",
                "MASTER_ADDR=", env.master_addr, " MASTER_PORT=", env.master_port, ") within ",
                std::chrono::duration_cast<std::chrono::seconds>(timeout).count(), " s: rank", count > 1 ? "s " : " ",
                missing.str(), ". Check that they were started with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
}

}  // namespace

void ignore_sigpipe() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL && !(current.sa_flags & SA_SIGINFO))
    signal(SIGPIPE, SIG_IGN);
}

c10::intrusive_ptr<c10d::Store> rendezvous(const RankEnv& env, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions so;
  // A world of one needs no rendezvous port: take any free one, so that a single process does not
  // fail when another job holds MASTER_PORT (29500 by default).
  so.port = env.world_size == 1 ? 0 : static_cast<uint16_t>(env.master_port);
  so.isServer = env.rank == 0;
  so.numWorkers = env.world_size;
  so.waitWorkers = false;  // wait_for_all_ranks names the ranks that never came
  so.timeout = timeout;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  // LibTorch 2.4 defaults to the libuv server backend, which a LibTorch built without libuv
  // (Debian's) refuses; the classic backend is in every build. USE_LIBUV=1 asks for libuv, as in
  // PyTorch's Python.
  const char* use_libuv = std::getenv("USE_LIBUV");
  so.useLibUV = use_libuv != nullptr && std::string(use_libuv) == "1";
#endif
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = connect_store(env, so);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    FSDP_FAIL("rank ", env.rank, " could not rendezvous at MASTER_ADDR=", env.master_addr,
              " MASTER_PORT=", env.master_port, " (", e.what(),
              "). Check that rank 0 is running, the address is reachable, the port "
              "is free, and every rank got the same WORLD_SIZE=",
              env.world_size);
  }
  wait_for_all_ranks(*store, env, timeout);
  return store;
}

}  // namespace fsdp
