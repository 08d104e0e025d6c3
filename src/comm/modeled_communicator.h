#pragma once
// The network-model decorator (see include/fsdp/network_model.h for the model itself).
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "fsdp/comm.h"
#include "fsdp/network_model.h"

namespace fsdp {

class ModeledCommunicator : public Communicator {
 public:
  using Clock = std::chrono::steady_clock;

  ModeledCommunicator(CommunicatorPtr inner, std::string link_name, Link link);

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string name() const override;

  WorkPtr all_gather_into(at::Tensor out, at::Tensor in, CollectiveOptions opts = {}) override;
  WorkPtr reduce_scatter(at::Tensor out, at::Tensor in, CollectiveOptions opts = {}) override;
  WorkPtr all_reduce(at::Tensor t, CollectiveOptions opts = {}) override;
  WorkPtr all_to_all_into(at::Tensor out, at::Tensor in, CollectiveOptions opts = {}) override;
  bool has_all_to_all() const override { return inner_->has_all_to_all(); }
  WorkPtr broadcast(at::Tensor t, int root, CollectiveOptions opts = {}) override;
  void barrier() override;
  WorkPtr shutdown() override { return inner_->shutdown(); }
  int64_t scratch_bytes() const override { return inner_->scratch_bytes(); }
  int64_t shared_memory_bytes() const override { return inner_->shared_memory_bytes(); }
  c10::Device device() const override { return inner_->device(); }
  std::string transport() const override { return inner_->transport(); }

  ModeledLinkStats stats() const;
  const CommunicatorPtr& inner() const { return inner_; }

 private:
  static Clock::time_point issue_time(const CollectiveOptions& opts);
  // Books the link for one collective issued at `issued`; returns its modeled start and completion.
  std::pair<Clock::time_point, Clock::time_point> schedule(Collective c, int64_t bytes, Clock::time_point issued);
  WorkPtr wrap(Collective c, int64_t bytes, Clock::time_point issued, WorkPtr real);

  CommunicatorPtr inner_;
  std::string link_name_;
  Link link_;
  mutable std::mutex mu_;
  Clock::time_point link_free_{};  // modeled completion of the last collective issued
  ModeledLinkStats stats_;
  // Shared with the Work handles, which may outlive the communicator.
  std::shared_ptr<std::atomic<int64_t>> real_exceeded_;
};

}  // namespace fsdp
