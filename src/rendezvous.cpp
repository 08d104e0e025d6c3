#include "rendezvous.h"

#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdio>
#include <future>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/check.h"
#include "job_token.h"
#include "member_watch.h"
#include "store_client.h"

namespace fsdp {

namespace {

bool is_loopback_name(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

// Where rank 0's store listens (Note [Rendezvous store] in docs/design.md): loopback for a world of
// one or a loopback MASTER_ADDR; MASTER_ADDR's own address for a job on one host; every interface
// ("") only for a job across hosts, where MASTER_ADDR may name this host by an address it does not
// have (NAT) or a name that resolves to loopback here.
std::string listen_host(const RankEnv& env) {
  if (env.world_size == 1) return "127.0.0.1";
  if (is_loopback_name(env.master_addr) || env.local_world_size == env.world_size) return env.master_addr;
  return "";
}

// The store, connected, authenticated and answered once (this rank's arrival is recorded) on a
// helper thread: a peer that accepts the connection but never answers (another program listening
// on MASTER_PORT) fails after the timeout instead of hanging.
c10::intrusive_ptr<c10d::Store> connect_store(const RankEnv& env, std::chrono::milliseconds timeout) {
  // A name that does not resolve would otherwise be retried until the timeout.
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(env.master_addr.c_str(), nullptr, &hints, &found);
  if (found != nullptr) freeaddrinfo(found);
  FSDP_CHECK(rc == 0, "rank ", env.rank, ": MASTER_ADDR '", env.master_addr, "' does not resolve (", gai_strerror(rc),
             "); set MASTER_ADDR to rank 0's host name or IP address");
  const std::string token = job_token();
  if (token.empty() && env.rank == 0 && env.local_world_size != env.world_size)
    std::fprintf(stderr,
                 "[fsdp] warning: FSDP_JOB_TOKEN is not set for a job across hosts: the rendezvous store at %s:%d "
                 "accepts any client that reaches it. Set the same FSDP_JOB_TOKEN (at least %zu random characters, "
                 "e.g. $(openssl rand -hex 32)) for every rank; see docs/security.md\n",
                 env.master_addr.c_str(), env.master_port, kMinJobTokenLength);
  auto result = std::make_shared<std::promise<c10::intrusive_ptr<c10d::Store>>>();
  auto done = result->get_future();
  std::thread([result, env, token, timeout, id = process_identity()] {
    try {
      std::unique_ptr<StoreServer> server;
      std::string host = env.master_addr;
      int port = env.master_port;
      if (env.rank == 0) {
        // A world of one needs no rendezvous port: any free one, so that a single process does not
        // fail when another job holds MASTER_PORT (29500 by default).
        server = std::make_unique<StoreServer>(listen_host(env), env.world_size == 1 ? 0 : env.master_port, token,
                                               std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(10)));
        if (env.world_size == 1) host = "127.0.0.1", port = server->port();
      }
      auto store = c10::make_intrusive<StoreClient>(host, port, token, timeout, std::move(server));
      store->set(arrival_key(env.rank), std::vector<uint8_t>(id.begin(), id.end()));
      result->set_value(store);
    } catch (...) {
      result->set_exception(std::current_exception());
    }
  }).detach();
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(timeout).count();
  FSDP_CHECK(done.wait_for(timeout + std::chrono::seconds(2)) == std::future_status::ready, "rank ", env.rank,
             " could not rendezvous at MASTER_ADDR=", env.master_addr, " MASTER_PORT=", env.master_port,
             ": something accepted the connection but did not answer as libfsdp's rendezvous store within ", seconds,
             " s. If rank 0 failed, see its error; if another program listens on that port, choose a free "
             "MASTER_PORT (fsdp-run --master-port)");
  try {
    return done.get();
  } catch (const StoreAuthError& e) {
    FSDP_FAIL("rank ", env.rank, ": ", e.what(), " (MASTER_ADDR=", env.master_addr, " MASTER_PORT=", env.master_port,
              ")");
  }
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
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = connect_store(env, timeout);
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
