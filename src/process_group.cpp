#include "fsdp/process_group.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <sstream>

#include "communicator_factory.h"
#include "env_var.h"
#include "fsdp/check.h"
#include "member_watch.h"
#include "rendezvous.h"

namespace fsdp {

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

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  std::unique_ptr<MemberWatch> members;
  std::unique_ptr<CommunicatorFactory> factory;
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
    pg->options_.timeout = std::chrono::milliseconds(int64_t(1000) * parse_env_int("FSDP_TIMEOUT_S", t, 1, 1 << 24));
  if (const char* c = env_or_null("FSDP_CHECK_COLLECTIVES"))
    pg->options_.check_collectives = parse_env_int("FSDP_CHECK_COLLECTIVES", c, 0, 1) == 1;
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

  pg->impl_->store = rendezvous(env, pg->options_.timeout);
  pg->impl_->members = std::make_unique<MemberWatch>(pg->impl_->store, env.rank, env.world_size);
  pg->impl_->factory = std::make_unique<CommunicatorFactory>(env, pg->options_, pg->impl_->members.get());

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
  options_.network_model = model;
  groups_.clear();  // handed-out communicators keep their model; new requests get the new one
  std::vector<int> all(env_.world_size);
  for (int i = 0; i < env_.world_size; ++i) all[i] = i;
  world_ = new_group(all, "world");
}

c10::intrusive_ptr<c10d::Store> ProcessGroup::store() const { return impl_->store; }

bool ProcessGroup::rank_exited(int r) const { return impl_->members->exited(r); }

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
  CommunicatorPtr comm = impl_->factory->connect(prefixed, ranks, my_index, id.str());
  raw_groups_[id.str()] = comm;
  if (options_.network_model) comm = with_network_model(std::move(comm), ranks, *options_.network_model);
  groups_[id.str()] = comm;
  return comm;
}

std::vector<std::pair<std::string, ModeledLinkStats>> ProcessGroup::modeled_links() const {
  std::vector<std::pair<std::string, ModeledLinkStats>> links;
  for (const auto& [id, comm] : groups_)
    if (auto stats = modeled_link_stats(*comm)) links.emplace_back(id, *stats);
  return links;
}

double mean_across_ranks(const ProcessGroup& pg, double value) {
  return mean_across_ranks(pg, at::tensor({value}, at::kDouble)).item<double>();
}

at::Tensor mean_across_ranks(const ProcessGroup& pg, const at::Tensor& value) {
  FSDP_CHECK(value.defined(), "mean_across_ranks: the tensor is undefined");
  const CommunicatorPtr world = pg.world();
  at::Tensor sum =
      value.detach().to(world->device(), value.scalar_type(), /*non_blocking=*/false, /*copy=*/true).contiguous();
  if (pg.size() > 1) world->all_reduce(sum)->wait();
  return (sum / pg.size()).to(value.device());
}

}  // namespace fsdp
