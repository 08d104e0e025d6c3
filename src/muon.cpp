#include "fsdp/muon.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "fsdp/check.h"
#include "internal_op_guard.h"
#include "optimizer_state_key.h"

namespace fsdp {

at::Tensor Muon::orthogonalize(const at::Tensor& g, int steps) {
  const double a = 3.4445, b = -4.7750, c = 2.0315;
  const bool tall = g.size(0) > g.size(1);
  at::Tensor x = tall ? g.t() : g;
  x = x / (x.norm() + 1e-7);
  for (int k = 0; k < steps; ++k) {
    const at::Tensor gram = at::matmul(x, x.t());
    const at::Tensor poly = at::addmm(gram, gram, gram, /*beta=*/b, /*alpha=*/c);
    x = at::addmm(x, poly, x, /*beta=*/a);
  }
  return tall ? x.t() : x;
}

Muon::Muon(FullyShardedModule& module, std::vector<torch::optim::OptimizerParamGroup> groups,
           const MuonOptions& defaults)
    : WholeParamOptimizer(module, std::move(groups), std::make_unique<MuonOptions>(defaults)) {
  // Which parameters are Muon's matrices: a holder of a piece knows its group; the shard group
  // agrees through one reduction, so that every member lays the step's buffers out alike.
  const auto& params = reduction_.params();
  // Its owner may hold no piece of a matrix: the holders' group also tells it the iterations.
  std::vector<int> ids;
  for (const WholeParam& p : params) {
    const int g = group_of(p);
    const auto* o = g >= 0 ? &static_cast<const MuonOptions&>(param_groups_[g].options()) : nullptr;
    const bool mine = o && p.shape.size() == 2 && o->use_muon();
    ids.push_back(
        reduction_.add(at::tensor({mine ? 1.0 : 0.0, mine ? double(o->ns_steps()) : 0.0}, at::kDouble), Combine::kMax));
  }
  reduction_.run();
  std::vector<int64_t> cost;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor agreed = reduction_.result(ids[i]);
    is_muon_.push_back(params[i].trainable && agreed[0].item<double>() > 0);
    if (!is_muon_.back()) continue;
    Matrix m;
    m.param = i;
    m.ns_steps = static_cast<int>(agreed[1].item<double>());
    matrices_.push_back(m);
    const auto& s = params[i].shape;
    cost.push_back(s[0] * s[1] * std::min(s[0], s[1]));
  }
  // Owners: the costliest matrix first, each to the least-loaded rank (the lowest on a tie).
  const CommunicatorPtr& comm = reduction_.communicator();
  const int members = comm ? comm->size() : 1;
  std::vector<size_t> order(matrices_.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return cost[x] > cost[y]; });
  std::vector<int64_t> load(members, 0), filled(members, 0);
  for (size_t i : order) {
    const int owner = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    matrices_[i].owner = owner;
    load[owner] += cost[i];
  }
  for (Matrix& m : matrices_) {  // each owner's segment in parameter order
    m.offset = filled[m.owner];
    filled[m.owner] += params[m.param].numel;
  }
  const int64_t segment = matrices_.empty() ? 0 : *std::max_element(filled.begin(), filled.end());
  int64_t total = 0, dtype_size = 0;
  for (const Matrix& m : matrices_) {
    total += params[m.param].numel;
    dtype_size = static_cast<int64_t>(c10::elementSize(params[m.param].dtype));
    FSDP_CHECK(params[m.param].dtype == params[matrices_.front().param].dtype,
               "Muon: its matrices must share one dtype; '", params[m.param].name, "' is ", params[m.param].dtype);
  }
  stats_.matrices = static_cast<int64_t>(matrices_.size());
  stats_.owned = 0;
  for (const Matrix& m : matrices_) stats_.owned += (comm ? m.owner == comm->rank() : true) ? 1 : 0;
  stats_.segment_numel = segment;
  if (comm) {
    stats_.bytes_sent = 2 * (members - 1) * segment * dtype_size;
    stats_.naive_bytes_sent = (members - 1) * ((total + members - 1) / members) * dtype_size;
  }
}

at::Tensor Muon::momentum_update(const WholeParam& p) {
  const auto& o = static_cast<const MuonOptions&>(param_groups_[group_of(p)].options());
  auto& s = static_cast<MuonParamState&>(*state_.at(detail::optimizer_state_key(p.piece)));
  const at::Tensor& g = p.piece.grad();
  s.step(s.step() + 1);
  s.momentum_buffer().lerp_(g, 1 - o.momentum());
  return o.nesterov() ? g.lerp(s.momentum_buffer(), o.momentum()) : s.momentum_buffer().clone();
}

void Muon::step_adamw(const WholeParam& p) {
  const MuonAdamW& o = static_cast<const MuonOptions&>(param_groups_[group_of(p)].options()).adamw();
  auto& s = static_cast<MuonParamState&>(*state_.at(detail::optimizer_state_key(p.piece)));
  const at::Tensor& g = p.piece.grad();
  s.step(s.step() + 1);
  const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
  const double bc1 = 1 - std::pow(b1, static_cast<double>(s.step()));
  const double bc2 = 1 - std::pow(b2, static_cast<double>(s.step()));
  p.piece.mul_(1 - o.lr() * o.weight_decay());
  s.exp_avg().lerp_(g, 1 - b1);
  s.exp_avg_sq().mul_(b2).addcmul_(g, g, 1 - b2);
  const at::Tensor denom = (s.exp_avg_sq().sqrt() / std::sqrt(bc2)).add_(o.eps());
  p.piece.addcdiv_(s.exp_avg(), denom, -o.lr() / bc1);
}

torch::Tensor Muon::step(LossClosure closure) {
  torch::Tensor loss = begin_step("Muon::step", closure);
  at::NoGradGuard no_grad;
  InternalOpGuard internal;
  const auto& params = reduction_.params();
  for (size_t i = 0; i < params.size(); ++i) {  // states on first use
    const WholeParam& p = params[i];
    if (!steps(p)) continue;
    auto& slot = state_[detail::optimizer_state_key(p.piece)];
    if (slot) continue;
    auto fresh = std::make_unique<MuonParamState>();
    if (is_muon_[i]) {
      fresh->momentum_buffer(at::zeros_like(p.piece, at::MemoryFormat::Preserve));
    } else {
      fresh->exp_avg(at::zeros_like(p.piece, at::MemoryFormat::Preserve));
      fresh->exp_avg_sq(at::zeros_like(p.piece, at::MemoryFormat::Preserve));
    }
    slot = std::move(fresh);
  }
  for (size_t i = 0; i < params.size(); ++i)
    if (!is_muon_[i] && steps(params[i])) step_adamw(params[i]);
  if (matrices_.empty()) return loss;

  // Orthogonalized updates of the matrices this rank holds pieces of, by parameter index.
  std::vector<at::Tensor> updates(params.size());
  const CommunicatorPtr& comm = reduction_.communicator();
  auto finish = [&](const Matrix& m, const at::Tensor& whole) {  // whole: the (R, C) direction
    const WholeParam& p = params[m.param];
    const double scale = std::sqrt(std::max(1.0, static_cast<double>(p.shape[0]) / static_cast<double>(p.shape[1])));
    return orthogonalize(whole, m.ns_steps).mul_(scale);
  };
  if (!comm) {  // every rank holds whole matrices
    for (const Matrix& m : matrices_) {
      const WholeParam& p = params[m.param];
      if (steps(p)) updates[m.param] = finish(m, momentum_update(p).view(p.shape)).reshape({-1});
    }
  } else {
    // Each owner's matrices are one segment of S elements: every rank writes its pieces' directions
    // into the owners' segments (zeros elsewhere) and a reduce-scatter hands each owner its
    // matrices whole; the owner orthogonalizes them in place and an all-gather returns every
    // segment to every rank (Note [Muon's owner ranks]).
    const int members = comm->size();
    const int64_t S = stats_.segment_numel;
    const auto opts = at::TensorOptions().dtype(params[matrices_.front().param].dtype).device(comm->device());
    at::Tensor send = at::zeros({members * S}, opts);
    for (const Matrix& m : matrices_) {
      const WholeParam& p = params[m.param];
      if (!steps(p)) continue;
      send.narrow(0, m.owner * S + m.offset + p.begin, p.piece.numel()).copy_(momentum_update(p));
    }
    at::Tensor mine = at::empty({S}, opts);
    comm->reduce_scatter(mine, send, CollectiveOptions::labeled("Muon: matrices to their owners"))->wait();
    for (const Matrix& m : matrices_) {
      if (m.owner != comm->rank()) continue;
      const WholeParam& p = params[m.param];
      at::Tensor whole = mine.narrow(0, m.offset, p.numel).view(p.shape);
      whole.copy_(finish(m, whole.clone()));
    }
    at::Tensor all = at::empty({members * S}, opts);
    comm->all_gather_into(all, mine, CollectiveOptions::labeled("Muon: orthogonalized matrices to the pieces"))->wait();
    for (const Matrix& m : matrices_) {
      const WholeParam& p = params[m.param];
      if (steps(p)) updates[m.param] = all.narrow(0, m.owner * S + m.offset + p.begin, p.piece.numel());
    }
  }
  for (const Matrix& m : matrices_) {
    const WholeParam& p = params[m.param];
    if (!updates[m.param].defined()) continue;
    const auto& o = static_cast<const MuonOptions&>(param_groups_[group_of(p)].options());
    p.piece.mul_(1 - o.lr() * o.weight_decay());
    p.piece.add_(updates[m.param].to(p.piece.device()), -o.lr());
  }
  return loss;
}

}  // namespace fsdp
