#include "comm/modeled_communicator.h"

#include <algorithm>
#include <sstream>
#include <thread>

#include "fsdp/check.h"

namespace fsdp {
namespace {

class ModeledWork : public Work {
 public:
  ModeledWork(WorkPtr real, ModeledCommunicator::Clock::time_point start,
              ModeledCommunicator::Clock::time_point done_at, std::shared_ptr<std::atomic<int64_t>> real_exceeded)
      : real_(std::move(real)), start_(start), done_at_(done_at), real_exceeded_(std::move(real_exceeded)) {}

  ModeledCommunicator::Clock::time_point done_at() const { return done_at_; }
  // The modeled span on the link; it ends later if the real collective did.
  WorkTiming timing() const override { return {start_, std::max(done_at_, real_->timing().end)}; }

  void wait() override {
    using Clock = ModeledCommunicator::Clock;
    // Whether the real work outlasted the modeled time is only counted when it is seen: the
    // real work is still running at (or after) the modeled completion.
    const bool real_done_before = real_->completed();
    real_->wait();  // rethrows the real collective's error without modeling any time
    if (!real_done_before && Clock::now() > done_at_) note_real_exceeded();
    // Sleeping, not spinning: a modeled network must not take CPU from the overlapping compute.
    std::this_thread::sleep_until(done_at_);
  }
  bool completed() const override {
    const bool past_model = ModeledCommunicator::Clock::now() >= done_at_;
    const bool real_done = real_->completed();
    if (past_model && !real_done) note_real_exceeded();
    return real_done && past_model;
  }

 private:
  void note_real_exceeded() const {
    if (!counted_.exchange(true)) real_exceeded_->fetch_add(1);
  }

 private:
  WorkPtr real_;
  ModeledCommunicator::Clock::time_point start_, done_at_;
  std::shared_ptr<std::atomic<int64_t>> real_exceeded_;
  mutable std::atomic<bool> counted_{false};
};

bool same_host(const std::vector<int>& ranks, int ranks_per_host) {
  for (int r : ranks)
    if (r / ranks_per_host != ranks.front() / ranks_per_host) return false;
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// ModeledCommunicator

ModeledCommunicator::ModeledCommunicator(CommunicatorPtr inner, std::string link_name, Link link)
    : inner_(std::move(inner)),
      link_name_(std::move(link_name)),
      link_(link),
      real_exceeded_(std::make_shared<std::atomic<int64_t>>(0)) {
  stats_.link = link_name_;
  stats_.params = link_;
}

std::string ModeledCommunicator::name() const {
  std::ostringstream o;
  o << inner_->name() << " (modeled " << link_name_ << "-host link: " << link_.bandwidth_gbps() << " GB/s, "
    << link_.latency_us() << " us/step)";
  return o.str();
}

std::pair<ModeledCommunicator::Clock::time_point, ModeledCommunicator::Clock::time_point> ModeledCommunicator::schedule(
    Collective c, int64_t bytes, Clock::time_point issued) {
  const double seconds = modeled_seconds(c, bytes, size(), link_);
  const auto duration = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  std::lock_guard<std::mutex> lock(mu_);
  const auto start = std::max(issued, link_free_);
  link_free_ = start + duration;
  stats_.collectives += 1;
  const auto wire = static_cast<int64_t>(modeled_wire_bytes(c, bytes, size()));
  stats_.wire_bytes += wire;
  if (c == Collective::kAllGather) stats_.gather_wire_bytes += wire;
  if (c == Collective::kReduceScatter || c == Collective::kAllToAll) stats_.scatter_wire_bytes += wire;
  stats_.modeled_busy_s += seconds;
  return {start, link_free_};
}

WorkPtr ModeledCommunicator::wrap(Collective c, int64_t bytes, Clock::time_point issued, WorkPtr real) {
  const auto [start, done_at] = schedule(c, bytes, issued);
  return std::make_shared<ModeledWork>(std::move(real), start, done_at, real_exceeded_);
}

// A collective chained after another (CollectiveOptions::after) starts on the link no earlier
// than that one's modeled completion.
ModeledCommunicator::Clock::time_point ModeledCommunicator::issue_time(const CollectiveOptions& opts) {
  auto issued = Clock::now();
  if (const auto* before = dynamic_cast<const ModeledWork*>(opts.after.get()))
    issued = std::max(issued, before->done_at());
  return issued;
}

// The real collective is issued first: if it rejects its arguments, nothing is booked on the link.
WorkPtr ModeledCommunicator::all_gather_into(at::Tensor out, at::Tensor in, CollectiveOptions opts) {
  const auto issued = issue_time(opts);
  auto real = inner_->all_gather_into(out, in, opts);
  return wrap(Collective::kAllGather, static_cast<int64_t>(out.nbytes()), issued, std::move(real));
}

WorkPtr ModeledCommunicator::reduce_scatter(at::Tensor out, at::Tensor in, CollectiveOptions opts) {
  const auto issued = issue_time(opts);
  auto real = inner_->reduce_scatter(out, in, opts);
  return wrap(Collective::kReduceScatter, static_cast<int64_t>(in.nbytes()), issued, std::move(real));
}

WorkPtr ModeledCommunicator::all_reduce(at::Tensor t, CollectiveOptions opts) {
  const auto issued = issue_time(opts);
  auto real = inner_->all_reduce(t, opts);
  return wrap(Collective::kAllReduce, static_cast<int64_t>(t.nbytes()), issued, std::move(real));
}

WorkPtr ModeledCommunicator::all_to_all_into(at::Tensor out, at::Tensor in, CollectiveOptions opts) {
  const auto issued = issue_time(opts);
  auto real = inner_->all_to_all_into(out, in, opts);
  return wrap(Collective::kAllToAll, static_cast<int64_t>(in.nbytes()), issued, std::move(real));
}

WorkPtr ModeledCommunicator::broadcast(at::Tensor t, int root, CollectiveOptions opts) {
  const auto issued = issue_time(opts);
  auto real = inner_->broadcast(t, root, opts);
  return wrap(Collective::kBroadcast, static_cast<int64_t>(t.nbytes()), issued, std::move(real));
}

void ModeledCommunicator::barrier() {
  const auto done_at = schedule(Collective::kBarrier, 0, Clock::now()).second;
  inner_->barrier();
  if (Clock::now() > done_at) real_exceeded_->fetch_add(1);
  std::this_thread::sleep_until(done_at);
}

ModeledLinkStats ModeledCommunicator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  ModeledLinkStats s = stats_;
  s.real_exceeded_model = real_exceeded_->load();
  return s;
}

// ---------------------------------------------------------------------------------------------

CommunicatorPtr with_network_model(CommunicatorPtr inner, const std::vector<int>& global_ranks,
                                   const NetworkModel& model) {
  FSDP_CHECK(inner != nullptr, "with_network_model: the communicator is null");
  FSDP_CHECK(static_cast<int>(global_ranks.size()) == inner->size(), "with_network_model: ", global_ranks.size(),
             " global ranks given for a communicator of ", inner->size(), " ranks (", inner->name(), ")");
  FSDP_CHECK(model.ranks_per_host() >= 1, "with_network_model: ranks_per_host must be resolved to >= 1, got ",
             model.ranks_per_host(), " (ProcessGroup resolves 0 to LOCAL_WORLD_SIZE)");
  model.validate();
  if (same_host(global_ranks, model.ranks_per_host()))
    return std::make_shared<ModeledCommunicator>(std::move(inner), "intra", model.intra());
  const int per_host = fewest_per_host(global_ranks, model.ranks_per_host());
  return std::make_shared<ModeledCommunicator>(std::move(inner), "inter",
                                               spanning_link(model.intra(), model.inter(), per_host));
}

std::optional<ModeledLinkStats> modeled_link_stats(const Communicator& comm) {
  if (auto* m = dynamic_cast<const ModeledCommunicator*>(&comm)) return m->stats();
  return std::nullopt;
}

CommunicatorPtr modeled_inner(const Communicator& comm) {
  if (auto* m = dynamic_cast<const ModeledCommunicator*>(&comm)) return m->inner();
  return nullptr;
}

}  // namespace fsdp
