#include "fsdp/process_group.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/version.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef FSDP_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>
#endif

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "comm/self_communicator.h"
#include "comm/shm_communicator.h"
#ifdef FSDP_WITH_GLOO
#include "comm/gloo_communicator.h"
#endif
#ifdef FSDP_WITH_NCCL
#include "comm/host_staged_communicator.h"
#include "comm/nccl_communicator.h"
#endif
#include "fsdp/check.h"

namespace fsdp {
namespace {

const char* env_or_null(const char* name) {
  const char* v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

int parse_int(const char* name, const char* value, int lo, int hi) {
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(value, &end, 10);
  FSDP_CHECK(errno == 0 && end && *end == '\0' && end != value, "environment variable ", name, "='", value,
             "' is not an integer; the launcher (fsdp-run, torchrun, mpirun, srun) sets it to one");
  FSDP_CHECK(v >= lo && v <= hi, "environment variable ", name, "=", v, " is out of range [", lo, ", ", hi, "]");
  return static_cast<int>(v);
}

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

// Slurm's per-node task counts, compressed as in "2(x3),1" (three nodes with 2 tasks, then one
// with 1): the count on node `node`, or -1 if `spec` does not have that form or is too short.
int slurm_tasks_on_node(const std::string& spec, int node) {
  std::istringstream entries(spec);
  std::string entry;
  int first_node = 0;
  while (std::getline(entries, entry, ',')) {
    int tasks = 0, repeat = 1;
    char tail = 0;
    const bool repeated = std::sscanf(entry.c_str(), "%d(x%d%c", &tasks, &repeat, &tail) == 3 && tail == ')';
    if (!repeated) {
      repeat = 1;
      if (std::sscanf(entry.c_str(), "%d%c", &tasks, &tail) != 1) return -1;  // one number, nothing after
    }
    if (tasks < 1 || repeat < 1) return -1;
    if (node < first_node + repeat) return tasks;
    first_node += repeat;
  }
  return -1;
}

}  // namespace

RankEnv RankEnv::from_env() {
  RankEnv e;
  const char *rank = nullptr, *world = nullptr, *local_rank = nullptr, *local_world = nullptr;
  const char *rank_name = "RANK", *world_name = "WORLD_SIZE", *lr_name = "LOCAL_RANK", *lw_name = "LOCAL_WORLD_SIZE";
  if (env_or_null("RANK") || env_or_null("WORLD_SIZE")) {
    e.source = "torchrun";
  } else if (env_or_null("OMPI_COMM_WORLD_RANK")) {
    e.source = "mpirun";
    rank_name = "OMPI_COMM_WORLD_RANK", world_name = "OMPI_COMM_WORLD_SIZE";
    lr_name = "OMPI_COMM_WORLD_LOCAL_RANK", lw_name = "OMPI_COMM_WORLD_LOCAL_SIZE";
  } else if (env_or_null("SLURM_PROCID")) {
    e.source = "srun";
    rank_name = "SLURM_PROCID", world_name = "SLURM_NTASKS";
    lr_name = "SLURM_LOCALID", lw_name = "SLURM_NTASKS_PER_NODE";
  } else {
    e.source = "single process";  // no launcher: a world of one
    return e;
  }
  rank = env_or_null(rank_name);
  world = env_or_null(world_name);
  FSDP_CHECK(rank, world_name, " is set but ", rank_name,
             " is not; launch every rank with fsdp-run (or torchrun/"
             "mpirun/srun), which sets both");
  FSDP_CHECK(world, rank_name, " is set but ", world_name,
             " is not; launch every rank with fsdp-run (or torchrun/"
             "mpirun/srun), which sets both");
  e.world_size = parse_int(world_name, world, 1, 1 << 20);
  e.rank = parse_int(rank_name, rank, 0, 1 << 20);
  FSDP_CHECK(e.rank < e.world_size, rank_name, "=", e.rank, " is not below ", world_name, "=", e.world_size,
             "; ranks are numbered 0..", world_name, "-1");
  local_rank = env_or_null(lr_name);
  local_world = env_or_null(lw_name);
  // srun sets SLURM_NTASKS_PER_NODE only when --ntasks-per-node was given; the step's task count
  // on each node is always in SLURM_STEP_TASKS_PER_NODE, indexed by SLURM_NODEID.
  std::string slurm_local_world;
  if (e.source == "srun" && !local_world) {
    const char* spec = env_or_null("SLURM_STEP_TASKS_PER_NODE");
    const char* node = env_or_null("SLURM_NODEID");
    if (spec && node) {
      const int tasks = slurm_tasks_on_node(spec, parse_int("SLURM_NODEID", node, 0, 1 << 20));
      FSDP_CHECK(tasks > 0, "cannot read this node's task count from SLURM_STEP_TASKS_PER_NODE='", spec,
                 "' (SLURM_NODEID=", node, "); export SLURM_NTASKS_PER_NODE to give it");
      slurm_local_world = std::to_string(tasks);
      local_world = slurm_local_world.c_str();
      lw_name = "SLURM_STEP_TASKS_PER_NODE";
    }
  }
  e.local_world_size = local_world ? parse_int(lw_name, local_world, 1, e.world_size) : e.world_size;
  e.local_rank = local_rank ? parse_int(lr_name, local_rank, 0, 1 << 20) : e.rank % e.local_world_size;
  FSDP_CHECK(e.local_rank < e.local_world_size, lr_name, "=", e.local_rank, " is not below ", lw_name, "=",
             e.local_world_size);
  if (const char* addr = env_or_null("MASTER_ADDR")) {
    e.master_addr = addr;
  } else {
    FSDP_CHECK(e.local_world_size == e.world_size, "MASTER_ADDR is not set and the job spans several hosts (",
               world_name, "=", e.world_size, ", ", lw_name, "=", e.local_world_size,
               "); export MASTER_ADDR=<address of rank 0's host>");
  }
  if (const char* port = env_or_null("MASTER_PORT")) e.master_port = parse_int("MASTER_PORT", port, 1, 65535);
  return e;
}

Transport parse_transport(const std::string& name, const char* source) {
  if (name == "auto") return Transport::kAuto;
  if (name == "tcp") return Transport::kTcp;
  if (name == "shm") return Transport::kSharedMemory;
  FSDP_FAIL(source, "=", name,
            " is not a transport; use auto (shared memory within a host, TCP across hosts), "
            "tcp (Gloo over TCP) or shm (shared memory)");
}

const char* to_string(Transport transport) {
  switch (transport) {
    case Transport::kAuto: return "auto";
    case Transport::kTcp: return "tcp";
    case Transport::kSharedMemory: return "shm";
  }
  return "?";
}

bool built_with_nccl() {
#ifdef FSDP_WITH_NCCL
  return true;
#else
  return false;
#endif
}

bool built_with_gloo() {
#ifdef FSDP_WITH_GLOO
  return true;
#else
  return false;
#endif
}

namespace {

std::string arrived_key(int rank) { return "fsdp/arrived/" + std::to_string(rank); }

// Note [SIGPIPE]: a write to a socket whose peer died raises SIGPIPE, whose default action ends
// the process silently (exit 141) before Gloo or the store can report the dead peer. Ignored, the
// write fails with EPIPE and the rank fails with a message. A handler the program set is kept.
void ignore_sigpipe() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL && !(current.sa_flags & SA_SIGINFO))
    signal(SIGPIPE, SIG_IGN);
}

// A process's start time (clock ticks after boot) and state letter from /proc/<pid>/stat.
bool read_proc_stat(const std::string& pid, std::string& start_time, char& state) {
  std::ifstream in("/proc/" + pid + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return false;
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return false;
  std::istringstream fields(stat.substr(paren + 2));
  std::string field;
  fields >> state;  // field 3; the start time is field 22
  for (int i = 4; i <= 22 && fields >> field; ++i) start_time = field;
  return true;
}

// Whether the process `pid` that started at `start_time` (clock ticks after boot) has ended: it
// is gone, a zombie, or the pid now names a later process. A /proc entry that cannot be read (no
// file descriptor left, say) proves nothing: then only the kernel's "no such process" counts.
bool process_gone(const std::string& pid, const std::string& start_time) {
  std::string start;
  char state = '?';
  if (!read_proc_stat(pid, start, state))
    return ::kill(static_cast<pid_t>(std::strtol(pid.c_str(), nullptr, 10)), 0) != 0 && errno == ESRCH;
  return state == 'Z' || state == 'X' || start != start_time;
}

// What names this process among all of a job's: kernel boot, pid namespace, pid, start time.
std::string process_identity() {
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  std::getline(boot, boot_id);
  char ns[128] = {0};
  const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  std::string start;
  char state = '?';
  const std::string pid = std::to_string(getpid());
  read_proc_stat(pid, start, state);
  return boot_id + " " + std::string(ns, n > 0 ? static_cast<size_t>(n) : 0) + " " + pid + " " + start;
}

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
      store->set(arrived_key(rank), std::vector<uint8_t>(id.begin(), id.end()));
      store->check({arrived_key(rank)});  // a request with a reply (set is not): the store answers
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
  for (int r = 0; r < env.world_size; ++r) keys.push_back(arrived_key(r));
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

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  std::mutex mu;
  std::map<int, std::vector<std::string>> identities;  // rank -> process_identity() fields
#ifdef FSDP_WITH_GLOO
  gloo::transport::tcp::attr attr;  // where each communicator's own transport device binds
#endif
};

std::shared_ptr<ProcessGroup> ProcessGroup::from_env(const ProcessGroupOptions& options) {
  return create(RankEnv::from_env(), options);
}

std::shared_ptr<ProcessGroup> ProcessGroup::create(const RankEnv& env, const ProcessGroupOptions& options) {
  FSDP_CHECK(env.world_size >= 1 && env.rank >= 0 && env.rank < env.world_size, "invalid rank ", env.rank,
             " for world size ", env.world_size);
  std::shared_ptr<ProcessGroup> pg(new ProcessGroup());
  pg->env_ = env;
  pg->options_ = options;
  if (const char* t = env_or_null("FSDP_TIMEOUT_S"))
    pg->options_.timeout = std::chrono::milliseconds(int64_t(1000) * parse_int("FSDP_TIMEOUT_S", t, 1, 1 << 24));
  if (const char* c = env_or_null("FSDP_CHECK_COLLECTIVES"))
    pg->options_.check_collectives = parse_int("FSDP_CHECK_COLLECTIVES", c, 0, 1) == 1;
  if (!pg->options_.network_model) pg->options_.network_model = NetworkModel::from_env();
  if (pg->options_.transport == Transport::kAuto)
    if (const char* t = env_or_null("FSDP_TRANSPORT")) pg->options_.transport = parse_transport(t, "FSDP_TRANSPORT");
  if (pg->options_.device.is_cpu()) {
    if (const char* d = env_or_null("FSDP_DEVICE")) {
      const std::string dev = d;
      if (dev == "cuda") {
        pg->options_.device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
      } else {
        try {
          pg->options_.device = c10::Device(dev);
        } catch (const std::exception&) {
          FSDP_FAIL("FSDP_DEVICE=", dev, " is not a device; use cpu, cuda (cuda:LOCAL_RANK) or cuda:<index>");
        }
      }
    }
  }
  if (pg->options_.device.is_cuda()) {
    FSDP_CHECK(built_with_nccl(), "the process group's device is ", pg->options_.device,
               " but this build of libfsdp has no NCCL communicator; build it against a CUDA LibTorch "
               "(cmake -DCMAKE_PREFIX_PATH=<LibTorch with CUDA>) or use the CPU");
    if (!pg->options_.device.has_index())
      pg->options_.device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
  } else {
    FSDP_CHECK(pg->options_.device.is_cpu(), "the process group's device ", pg->options_.device,
               " is not supported; communicators move CPU tensors (shared memory, Gloo) or CUDA tensors (NCCL)");
  }
  if (auto& model = pg->options_.network_model) {
    if (model->ranks_per_host() == 0) model->ranks_per_host(env.local_world_size);
    model->validate();
  }
  pg->impl_ = std::make_shared<Impl>();
  ignore_sigpipe();

  c10d::TCPStoreOptions so;
  // A world of one needs no rendezvous port: take any free one, so that a single process does not
  // fail when another job holds MASTER_PORT (29500 by default).
  so.port = env.world_size == 1 ? 0 : static_cast<uint16_t>(env.master_port);
  so.isServer = env.rank == 0;
  so.numWorkers = env.world_size;
  so.waitWorkers = false;  // wait_for_all_ranks names the ranks that never came
  so.timeout = pg->options_.timeout;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  // LibTorch 2.4 defaults to the libuv server backend, which a LibTorch built without libuv
  // (Debian's) refuses; the classic backend is in every build. USE_LIBUV=1 asks for libuv, as in
  // PyTorch's Python.
  const char* use_libuv = std::getenv("USE_LIBUV");
  so.useLibUV = use_libuv != nullptr && std::string(use_libuv) == "1";
#endif
  try {
    pg->impl_->store = connect_store(env, so);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    FSDP_FAIL("rank ", env.rank, " could not rendezvous at MASTER_ADDR=", env.master_addr,
              " MASTER_PORT=", env.master_port, " (", e.what(),
              "). Check that rank 0 is running, the address is reachable, the port "
              "is free, and every rank got the same WORLD_SIZE=",
              env.world_size);
  }
  wait_for_all_ranks(*pg->impl_->store, env, pg->options_.timeout);

#ifdef FSDP_WITH_GLOO
  gloo::transport::tcp::attr attr;
  std::string bind = options.bind_addr;
  if (bind.empty()) {
    if (const char* a = env_or_null("FSDP_BIND_ADDR")) bind = a;
  }
  if (const char* ifname = env_or_null("GLOO_SOCKET_IFNAME"); bind.empty() && ifname) {
    attr.iface = ifname;
  } else {
    if (bind.empty()) bind = local_address_towards(env.master_addr, env.master_port);
    attr.hostname = bind.empty() ? env.master_addr : bind;
  }
  pg->impl_->attr = attr;
#endif
  pg->world_ = pg->new_group(
      [&] {
        std::vector<int> all(env.world_size);
        for (int i = 0; i < env.world_size; ++i) all[i] = i;
        return all;
      }(),
      "world");
  return pg;
}

ProcessGroup::~ProcessGroup() {
  if (std::uncaught_exceptions() > 0) return;
  try {
    shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "[fsdp] rank %d: %s\n[fsdp] exiting with status 1: this rank must not finish out of step "
                 "with its peers\n",
                 rank(), e.what());
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(1);
  }
}

void ProcessGroup::shutdown() {
  // All at once, each on its communicator's own thread: members that share several communicators
  // never wait for each other in different orders.
  std::vector<WorkPtr> works;
  for (auto& [key, comm] : raw_groups_) works.push_back(comm->shutdown());
  std::string error;
  for (auto& w : works) {
    try {
      w->wait();
    } catch (const std::exception& e) {
      if (error.empty()) error = e.what();
    }
  }
  FSDP_CHECK(error.empty(), error);
}

void ProcessGroup::set_network_model(std::optional<NetworkModel> model) {
  if (model) {
    if (model->ranks_per_host() == 0) model->ranks_per_host(env_.local_world_size);
    model->validate();
  }
  options_.network_model = std::move(model);
  groups_.clear();  // handed-out communicators keep their model; new requests get the new one
  std::vector<int> all(env_.world_size);
  for (int i = 0; i < env_.world_size; ++i) all[i] = i;
  world_ = new_group(all, "world");
}

c10::intrusive_ptr<c10d::Store> ProcessGroup::store() const { return impl_->store; }

std::optional<std::pair<std::string, std::string>> ProcessGroup::same_host_process(int r) const {
  if (r == rank() || r < 0 || r >= size()) return std::nullopt;
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto& cached = impl_->identities;
  if (!cached.count(rank())) {
    std::istringstream in(process_identity());
    for (std::string f; in >> f;) cached[rank()].push_back(f);
  }
  if (!cached.count(r)) {
    const auto raw = impl_->store->get(arrived_key(r));
    std::istringstream in(std::string(raw.begin(), raw.end()));
    for (std::string f; in >> f;) cached[r].push_back(f);
  }
  const auto& theirs = cached[r];
  const auto& mine = cached[rank()];
  if (theirs.size() != 4 || mine.size() != 4 || theirs[0] != mine[0] || theirs[1] != mine[1]) return std::nullopt;
  return std::make_pair(theirs[2], theirs[3]);
}

bool ProcessGroup::rank_exited(int r) const {
  const auto process = same_host_process(r);
  return process && process_gone(process->first, process->second);
}

std::function<std::string()> ProcessGroup::exit_watch(const std::vector<int>& ranks) const {
  struct Member {
    int rank;
    std::string pid, start;
  };
  std::vector<Member> members;
  try {
    // Only members seen alive now. One whose /proc entry cannot be read from here (another user's,
    // under hidepid) is alive to process_gone until kill(pid, 0) answers ESRCH.
    for (int r : ranks)
      if (const auto process = same_host_process(r); process && !process_gone(process->first, process->second))
        members.push_back({r, process->first, process->second});
  } catch (const std::exception&) {
    return {};  // the store did not answer: no watch, Gloo's own detection remains
  }
  if (members.empty()) return {};
  return [members] {
    for (const auto& m : members)
      if (process_gone(m.pid, m.start)) return detail::compose("rank ", m.rank, " (pid ", m.pid, ") died");
    return std::string();
  };
}

CommunicatorPtr ProcessGroup::new_group(const std::vector<int>& ranks, const std::string& key) {
  FSDP_CHECK(!ranks.empty(), "new_group: the rank list is empty");
  int my_index = -1;
  std::ostringstream id;
  id << key << "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    FSDP_CHECK(ranks[i] >= 0 && ranks[i] < size(), "new_group: rank ", ranks[i], " is outside the world of ", size());
    FSDP_CHECK(i == 0 || ranks[i] > ranks[i - 1], "new_group: ranks must be sorted and distinct");
    if (ranks[i] == rank()) my_index = static_cast<int>(i);
    id << (i ? "," : "") << ranks[i];
  }
  id << "]";
  FSDP_CHECK(my_index >= 0, "new_group: this rank (", rank(), ") is not a member of ", id.str());
  if (auto it = groups_.find(id.str()); it != groups_.end()) return it->second;
  if (auto it = raw_groups_.find(id.str()); it != raw_groups_.end()) {  // created before the model changed
    auto comm = options_.network_model ? with_network_model(it->second, ranks, *options_.network_model) : it->second;
    groups_[id.str()] = comm;
    return comm;
  }
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("fsdp/" + id.str(), impl_->store);
  CommunicatorPtr comm;
  auto host_comm = [&] {
    CommunicatorPtr c;
    if (ranks.size() > 1 && options_.transport != Transport::kTcp)
      c = make_shm_communicator(prefixed, my_index, static_cast<int>(ranks.size()), id.str(), options_.timeout,
                                options_.transport == Transport::kSharedMemory);
    return c ? c : connect_gloo(prefixed, ranks, my_index, id.str());
  };
  if (options_.device.is_cuda()) {
#ifdef FSDP_WITH_NCCL
    // CUDA tensors: NCCL, unless a CPU transport was named (ranks sharing one GPU, which NCCL
    // refuses): then staged through host memory over it (Note [Host-staged collectives]).
    if (options_.transport == Transport::kAuto)
      comm = make_nccl_communicator(prefixed, my_index, static_cast<int>(ranks.size()), id.str(), options_.timeout,
                                    options_.device);
    else
      comm = make_host_staged_communicator(host_comm(), options_.device, options_.timeout);
#endif
  } else {
    comm = host_comm();
  }
  raw_groups_[id.str()] = comm;
  if (options_.network_model) comm = with_network_model(std::move(comm), ranks, *options_.network_model);
  groups_[id.str()] = comm;
  return comm;
}

CommunicatorPtr ProcessGroup::connect_gloo(const c10::intrusive_ptr<c10d::Store>& prefixed,
                                           const std::vector<int>& ranks, int my_index, const std::string& id) {
  const int size = static_cast<int>(ranks.size());
#ifndef FSDP_WITH_GLOO
  if (size == 1) return make_self_communicator(id);
  FSDP_FAIL("rank ", rank(), " cannot connect ", id,
            " over TCP: this build of libfsdp has no Gloo (PyTorch's own "
            "LibTorch ships no Gloo headers). Within one host use the shared-memory transport (FSDP_TRANSPORT=shm), "
            "or build against a LibTorch with Gloo (Debian's libtorch-dev + libgloo-dev)");
#else
  c10d::ProcessGroupGloo::GlooStore gloo_store(prefixed);
  auto ctx = std::make_shared<gloo::rendezvous::Context>(my_index, size);
  ctx->setTimeout(options_.timeout);
  try {
    // One transport device per communicator, as c10d does per process group: contexts that share
    // a device were seen to deadlock when two of them run collectives at once.
    auto device = gloo::transport::tcp::CreateDevice(impl_->attr);
    ctx->connectFullMesh(gloo_store, device);
  } catch (const std::exception& e) {
    FSDP_FAIL("rank ", rank(), " could not connect ", id, ": ", e.what(),
              ". Check that every member rank is alive and that their addresses are reachable "
              "(set FSDP_BIND_ADDR or GLOO_SOCKET_IFNAME to choose the interface)");
  }
  return make_gloo_communicator(std::move(ctx), id, options_.timeout, options_.check_collectives, exit_watch(ranks));
#endif
}

}  // namespace fsdp
