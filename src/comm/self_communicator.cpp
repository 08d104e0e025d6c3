#include "comm/self_communicator.h"

#include "fsdp/check.h"

namespace fsdp {
namespace {

class DoneWork : public Work {
 public:
  void wait() override {}
  bool completed() const override { return true; }
};

class SelfCommunicator : public Communicator {
 public:
  explicit SelfCommunicator(std::string name) : name_(std::move(name)) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return name_; }
  std::string transport() const override { return "in-process (a group of one)"; }

  WorkPtr all_gather_into(at::Tensor out, at::Tensor in, CollectiveOptions opts) override {
    FSDP_CHECK(out.numel() == in.numel() && out.scalar_type() == in.scalar_type(), name_,
               ": all_gather_into needs an output of size() * input elements of the input's dtype");
    after(opts);
    if (!out.is_same(in)) out.view({-1}).copy_(in.view({-1}));
    return done();
  }
  WorkPtr reduce_scatter(at::Tensor out, at::Tensor in, CollectiveOptions opts) override {
    FSDP_CHECK(out.numel() == in.numel() && out.scalar_type() == in.scalar_type(), name_,
               ": reduce_scatter needs an input of size() * output elements of the output's dtype");
    after(opts);
    if (!out.is_same(in)) out.view({-1}).copy_(in.view({-1}));
    return done();
  }
  bool has_all_to_all() const override { return true; }
  WorkPtr all_to_all_into(at::Tensor out, at::Tensor in, CollectiveOptions opts) override {
    FSDP_CHECK(out.numel() == in.numel() && out.scalar_type() == in.scalar_type(), name_,
               ": all_to_all_into needs an output of the input's numel and dtype");
    after(opts);
    if (!out.is_same(in)) out.view({-1}).copy_(in.view({-1}));
    return done();
  }
  WorkPtr all_reduce(at::Tensor, CollectiveOptions opts) override {
    after(opts);
    return done();
  }
  WorkPtr broadcast(at::Tensor, int root, CollectiveOptions opts) override {
    FSDP_CHECK(root == 0, name_, ": broadcast root ", root, " is outside a group of one");
    after(opts);
    return done();
  }
  void barrier() override {}

 private:
  static void after(const CollectiveOptions& opts) {
    if (opts.after) opts.after->wait();
  }
  static WorkPtr done() { return std::make_shared<DoneWork>(); }
  std::string name_;
};

}  // namespace

CommunicatorPtr make_self_communicator(std::string name) { return std::make_shared<SelfCommunicator>(std::move(name)); }

}  // namespace fsdp
