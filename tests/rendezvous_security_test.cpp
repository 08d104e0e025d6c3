// The rendezvous store's security (docs/security.md): a single-host job listens on loopback only;
// strangers who connect to the store (garbage, c10d's TCPStore client, a wrong job token) change
// nothing, and training gives the losses of an undisturbed run; a rank with the wrong token fails
// at once, naming FSDP_JOB_TOKEN; a shared-memory segment is mapped only when this user owns it,
// no one else may open it, and it carries the job's tag.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "comm/shm_segment.h"
#include "harness.h"
#include "listening_sockets.h"
#include "models.h"
#include "store_client.h"

namespace fsdp_test {
namespace {

const std::string kToken = "0123456789abcdef0123456789abcdef";

bool is_loopback_text(const std::string& a) {
  return a.rfind("127.", 0) == 0 || a.rfind("::1 ", 0) == 0 || a.rfind("::ffff:127.", 0) == 0;
}

// Trains a small MLP for a few steps and prints each loss with every digit; then checks that this
// process listens on loopback only and, with args[0] a segment name, that it never mapped it. With
// that argument, rank 1 arrives 1.5 s late: strangers have the store to themselves meanwhile.
FSDP_WORKER(secure_training_worker) {
  torch::manual_seed(0);
  if (!ctx.args.empty() && ctx.rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, 10, 3, 2);
  auto sharded =
      fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  torch::optim::SGD opt(sharded->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 5; ++step) {
    torch::manual_seed(100 + step * ctx.world + ctx.rank);
    opt.zero_grad();
    const at::Tensor loss = model->forward(torch::randn({4, 6})).pow(2).mean();
    loss.backward();
    opt.step();
    std::printf("loss %d %.17g\n", step, fsdp::mean_across_ranks(*pg, loss.item<double>()));
  }
  for (const ListeningSocket& s : listening_sockets(getpid())) {
    const std::string a = s.address + " port " + std::to_string(s.port);
    std::printf("listening on %s\n", a.c_str());
    WORKER_CHECK(is_loopback_text(a), "rank ", ctx.rank, " listens beyond loopback: ", a);
  }
  if (!ctx.args.empty()) {
    std::ifstream maps("/proc/self/maps");
    const std::string all((std::istreambuf_iterator<char>(maps)), std::istreambuf_iterator<char>());
    WORKER_CHECK(!contains(all, ctx.args[0]), "rank ", ctx.rank, " mapped the foreign segment ", ctx.args[0]);
  }
  pg->world()->barrier();
  std::fflush(stdout);
}

TEST(RendezvousSecurity, ASingleHostJobListensOnLoopbackOnly) {
  for (const std::string transport : {"tcp", "shm"}) {
    auto r = launch("secure_training_worker", 2, {}, 120, {"FSDP_TRANSPORT=" + transport, "FSDP_JOB_TOKEN=" + kToken});
    ASSERT_TRUE(r.all_ok()) << r.report();
    EXPECT_TRUE(contains(r.ranks[0].output, "listening on 127.0.0.1 port ")) << r.report();  // the store
  }
}

// A stranger's segment, announced as if it were the group's: the ranks must not map it.
struct ForeignSegment {
  explicit ForeignSegment(const std::string& n) : name(n) {
    const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
    if (fd >= 0) {
      (void)!ftruncate(fd, 64 << 20);
      close(fd);
    }
  }
  ~ForeignSegment() { shm_unlink(name.c_str()); }
  std::string name;
};

// Until `stop`: connects to the store at 127.0.0.1:`port` as strangers do, counting what happened.
struct Stranger {
  std::atomic<bool> stop{false};
  std::string c10d_error;  // the first error c10d's client met
  std::atomic<int> garbage_sent{0}, c10d_attempts{0}, c10d_reads{0}, refused_tokens{0}, accepted_tokens{0};
  // c10d's client runs a listener thread that may end its process when the store resets the
  // connection, so each attempt runs in a child; its exit code says whether it read a key.
  void c10d_attempt(int port, const std::vector<std::string>& keys, const std::string& forged) {
    int pipe_fds[2];
    if (pipe(pipe_fds) != 0) return;
    const pid_t child = fork();
    if (child == 0) {
      close(pipe_fds[0]);
      int code = 1;
      try {
        c10d::TCPStoreOptions o;
        o.port = static_cast<uint16_t>(port);
        o.isServer = false;
        o.waitWorkers = false;
        o.timeout = std::chrono::seconds(2);
        c10d::TCPStore store("127.0.0.1", o);
        for (const auto& k : keys) store.set(k, std::vector<uint8_t>(forged.begin(), forged.end()));
        store.get(keys[0]);
        code = 0;
      } catch (const std::exception& e) {
        (void)!write(pipe_fds[1], e.what(), std::strlen(e.what()));
      }
      _exit(code);
    }
    close(pipe_fds[1]);
    if (child < 0) {
      close(pipe_fds[0]);
      return;
    }
    std::string error;
    char buf[256];
    for (ssize_t n; (n = read(pipe_fds[0], buf, sizeof(buf))) > 0;) error.append(buf, static_cast<size_t>(n));
    close(pipe_fds[0]);
    int status = 0;
    waitpid(child, &status, 0);
    ++c10d_attempts;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) ++c10d_reads;
    if (c10d_error.empty() && !error.empty()) c10d_error = error;
  }
  void run(int port, const std::string& segment) {
    const std::vector<std::string> keys = {"fsdp/arrived/1",
                                           "fsdp/agree/0/0",
                                           "fsdp/agree/0/read/1",
                                           "fsdp/agree/0/failed/1",
                                           "fsdp/world[0,1]/shm/segment0",
                                           "fsdp/world[0,1]/shm/status/1",
                                           "fsdp/world[0,1]/shm/ready/1"};
    const std::string forged = segment + " 1";
    for (int round = 0; !stop; ++round) {
      const int fd = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(static_cast<uint16_t>(port));
      const bool listening = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
      if (listening) {
        std::string junk(1 + round % 300, static_cast<char>(round));
        if (send(fd, junk.data(), junk.size(), MSG_NOSIGNAL) > 0) ++garbage_sent;
      }
      close(fd);
      if (!listening) {  // not yet, or no more: c10d's client would only log its retries
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;
      }
      c10d_attempt(port, keys, forged);
      try {
        fsdp::StoreClient store("127.0.0.1", port, "a-token-of-another-job-entirely", std::chrono::milliseconds(500));
        ++accepted_tokens;
        for (const auto& k : keys) store.set(k, std::vector<uint8_t>(forged.begin(), forged.end()));
      } catch (const fsdp::StoreAuthError&) {
        ++refused_tokens;
      } catch (...) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
};

TEST(RendezvousSecurity, StrangersWritingStartUpKeysChangeNothing) {
  const std::string token_env = "FSDP_JOB_TOKEN=" + kToken;
  auto quiet = launch("secure_training_worker", 2, {}, 120, {token_env});
  ASSERT_TRUE(quiet.all_ok()) << quiet.report();
  const std::string expected = lines_starting_with("loss ", quiet.ranks[0].output);
  ASSERT_FALSE(expected.empty()) << quiet.report();

  ForeignSegment segment("/fsdp-stranger-" + std::to_string(getpid()));
  const LoopbackPort held;  // kept off other launches until this test ends
  const int port = held.port();
  Stranger stranger;
  std::thread hammer([&] { stranger.run(port, segment.name); });
  RunningRanks running = start("secure_training_worker", 2, {segment.name},
                               {token_env, "MASTER_PORT=" + std::to_string(port), "FSDP_TRANSPORT=shm"});
  auto r = wait_for(running, 120);
  stranger.stop = true;
  hammer.join();
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_EQ(lines_starting_with("loss ", r.ranks[0].output), expected) << r.report();
  std::printf("stranger: %d garbage sends, %d c10d clients (%s), %d refused tokens\n", stranger.garbage_sent.load(),
              stranger.c10d_attempts.load(), stranger.c10d_error.c_str(), stranger.refused_tokens.load());
  EXPECT_GT(stranger.refused_tokens.load(), 0) << "the stranger never reached the store";
  EXPECT_EQ(stranger.accepted_tokens.load(), 0);
  EXPECT_EQ(stranger.c10d_reads.load(), 0);
  EXPECT_TRUE(contains(r.ranks[0].output, "the rendezvous store refused a connection from 127.0.0.1:")) << r.report();
}

// Rank 1 holds another token: it fails at once naming FSDP_JOB_TOKEN; rank 0 reports the refusal
// and, rank 1 never arriving, fails at the timeout.
FSDP_WORKER(wrong_token_worker) {
  if (ctx.rank == 1) setenv("FSDP_JOB_TOKEN", "fedcba9876543210fedcba9876543210", 1);
  const auto t0 = std::chrono::steady_clock::now();
  expect_error([] { fsdp::ProcessGroup::from_env(); },
               ctx.rank == 1 ? "refused this process's job token" : "1 of 2 ranks never arrived", "rendezvous");
  if (ctx.rank == 1) WORKER_CHECK(seconds_since(t0) < 3, "the wrong token took ", seconds_since(t0), " s to fail");
}

TEST(RendezvousSecurity, ARankWithTheWrongTokenFailsAtOnce) {
  auto r = launch("wrong_token_worker", 2, {}, 60, {"FSDP_JOB_TOKEN=" + kToken, "FSDP_TIMEOUT_S=4"});
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[1].output, "FSDP_JOB_TOKEN")) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "wrong job token (FSDP_JOB_TOKEN)")) << r.report();
}

FSDP_WORKER(short_token_worker) {
  expect_error([] { fsdp::ProcessGroup::from_env(); }, "FSDP_JOB_TOKEN has 5 characters", "short token");
}

TEST(RendezvousSecurity, ATooShortTokenIsRefused) {
  auto r = launch("short_token_worker", 2, {}, 60, {"FSDP_JOB_TOKEN=short", "FSDP_TIMEOUT_S=10"});
  ASSERT_TRUE(r.all_ok()) << r.report();
}

// The store answers as c10d's stores do, to clients with the token.
TEST(RendezvousSecurity, TheStoreAnswersClientsWithTheToken) {
  using std::chrono::milliseconds;
  auto server = std::make_unique<fsdp::StoreServer>("127.0.0.1", 0, kToken, milliseconds(2000));
  const int port = server->port();
  fsdp::StoreClient a("127.0.0.1", port, kToken, milliseconds(2000), std::move(server));
  fsdp::StoreClient b("127.0.0.1", port, kToken, milliseconds(2000));
  auto bytes = [](const std::string& s) {
    return std::vector<uint8_t>(s.begin(), s.end());
  };
  std::thread later([&] {
    std::this_thread::sleep_for(milliseconds(100));
    a.set("k", bytes("v"));
  });
  EXPECT_EQ(b.get("k"), bytes("v"));  // waits for the key
  later.join();
  EXPECT_EQ(a.add("n", 2), 2);
  EXPECT_EQ(b.add("n", 3), 5);
  EXPECT_EQ(b.compareSet("k", bytes("x"), bytes("y")), bytes("v"));
  EXPECT_EQ(b.compareSet("k", bytes("v"), bytes("w")), bytes("w"));
  EXPECT_EQ(b.compareSet("fresh", {}, bytes("z")), bytes("z"));
  EXPECT_TRUE(a.check({"k", "n", "fresh"}));
  EXPECT_EQ(a.getNumKeys(), 3);
  EXPECT_TRUE(a.deleteKey("fresh"));
  EXPECT_FALSE(a.deleteKey("fresh"));
  EXPECT_FALSE(a.check({"k", "fresh"}));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(b.wait({"never"}, milliseconds(200)), std::runtime_error);
  EXPECT_LT(seconds_since(t0), 2);
  // A clone is its own connection to the same store (newer LibTorch clones a store for other threads).
  const c10::intrusive_ptr<c10d::Store> c = b.clone();
  EXPECT_EQ(c->get("k"), bytes("w"));
  c->set("from-clone", bytes("c"));
  EXPECT_EQ(a.get("from-clone"), bytes("c"));
}

// Root only: a process of another user on this host is refused even with the token.
TEST(RendezvousSecurity, TheStoreRefusesAnotherUsersLoopbackClient) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another user";
  fsdp::StoreServer server("127.0.0.1", 0, kToken, std::chrono::milliseconds(2000));
  const pid_t child = fork();
  if (child == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(3);
    try {
      fsdp::StoreClient client("127.0.0.1", server.port(), kToken, std::chrono::milliseconds(2000));
      _exit(0);  // accepted: wrong
    } catch (const std::exception& e) {
      _exit(contains(e.what(), "closed the connection at once") ? 1 : 2);
    }
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1) << "0: accepted, 2: refused for another reason, 3: setuid failed";
  fsdp::StoreClient mine("127.0.0.1", server.port(), kToken, std::chrono::milliseconds(2000));  // this user: fine
  EXPECT_FALSE(mine.check({"k"}));
}

std::string segment_name(const char* what) {
  return "/fsdp-test-" + std::string(what) + "-" + std::to_string(getpid());
}

TEST(RendezvousSecurity, ASegmentWithoutTheJobsTagIsRefused) {
  const std::string name = segment_name("tag");
  fsdp::ShmSegment created;
  ASSERT_EQ(created.create(name, 7, 2, fsdp::segment_tag("another job's token!", name, 7)), "");
  fsdp::ShmSegment opened;
  const std::string error = opened.open(name, 7, 2, fsdp::segment_tag(kToken, name, 7));
  shm_unlink(name.c_str());
  EXPECT_TRUE(contains(error, "does not carry this job's tag")) << error;
}

TEST(RendezvousSecurity, ASegmentOthersMayOpenIsRefused) {
  const std::string name = segment_name("mode");
  fsdp::ShmSegment created;
  const fsdp::Digest tag = fsdp::segment_tag(kToken, name, 7);
  ASSERT_EQ(created.create(name, 7, 2, tag), "");
  fsdp::ShmSegment fine;
  EXPECT_EQ(fine.open(name, 7, 2, tag), "");
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(fchmod(fd, 0666), 0);
  fsdp::ShmSegment opened;
  std::string error = opened.open(name, 7, 2, tag);
  EXPECT_TRUE(contains(error, "may be opened by other users (mode 666)")) << error;
  if (geteuid() == 0) {  // root may give the segment away: then its owner is another user
    ASSERT_EQ(fchmod(fd, 0600), 0);
    ASSERT_EQ(fchown(fd, 65534, 65534), 0);
    fsdp::ShmSegment foreign;
    error = foreign.open(name, 7, 2, tag);
    EXPECT_TRUE(contains(error, "belongs to uid 65534")) << error;
  }
  close(fd);
  shm_unlink(name.c_str());
  fsdp::ShmSegment bad_name;
  EXPECT_TRUE(contains(bad_name.open("/dev/shm/x", 7, 2, tag), "is not a shared-memory segment name"));
}

}  // namespace
}  // namespace fsdp_test
