#include "fsdp/muon.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>

#include "fsdp/check.h"
#include "internal_op_guard.h"
#include "optimizer_state_key.h"

namespace fsdp {

at::Tensor Muon::orthogonalize(const at::Tensor& g, int steps) {
  const double a = 3.4445, b = -4.7750, c = 2.0315;
  const bool tall = g.size(0) > g.size(1);
  at::Tensor x = tall ? g.t() : g;
  x = x / (x.norm() + 1e-7);
  const bool unfused = g.scalar_type() == at::kBFloat16;
  for (int k = 0; k < steps; ++k) {
    const at::Tensor gram = at::matmul(x, x.t());
    const at::Tensor poly = unfused ? b * gram + c * at::matmul(gram, gram) : at::addmm(gram, gram, gram, b, c);
    x = unfused ? a * x + at::matmul(poly, x) : at::addmm(x, poly, x, /*beta=*/a);
  }
  return tall ? x.t() : x;
}

Muon::Muon(FullyShardedModule& module, std::vector<torch::optim::OptimizerParamGroup> groups,
           const MuonOptions& defaults, MuonExchange exchange)
    : WholeParamOptimizer(module, std::move(groups), std::make_unique<MuonOptions>(defaults)), requested_(exchange) {
  plan();
}

void Muon::after_load() { plan(); }

void Muon::plan() {
  // Which parameters are Muon's matrices, their iterations, and where every rank's piece of each
  // lies: a holder of a piece knows its group, and an owner may hold no piece of its matrix; the
  // shard group agrees through one reduction, so that every member plans the exchanges alike.
  const auto& params = reduction_.params();
  const CommunicatorPtr& comm = reduction_.communicator();
  const int members = comm ? comm->size() : 1, rank = comm ? comm->rank() : 0;
  matrices_.clear();
  outgoing_.clear();
  incoming_.clear();
  is_muon_.clear();
  stats_ = {};
  exchange_dtype_ = at::kFloat;
  std::vector<int> ids;
  for (const WholeParam& p : params) {
    const int g = group_of(p);
    const auto* o = g >= 0 ? &static_cast<const MuonOptions&>(param_groups_[g].options()) : nullptr;
    at::Tensor part = at::zeros({3 + 2 * members}, at::kDouble);
    auto* v = part.data_ptr<double>();
    if (o && p.shape.size() == 2 && o->use_muon()) {
      v[0] = 1;
      v[1] = o->ns_steps();
      v[2] = o->ns_bfloat16() ? 1 : 0;
    }
    if (p.piece.defined()) {
      v[3 + 2 * rank] = double(p.begin);
      v[4 + 2 * rank] = double(p.piece.numel());
    }
    ids.push_back(reduction_.add(part, Combine::kMax));
  }
  reduction_.run();
  std::vector<int64_t> cost;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor agreed = reduction_.result(ids[i]);
    const double* v = agreed.data_ptr<double>();
    is_muon_.push_back(params[i].trainable && v[0] > 0);
    if (!is_muon_.back()) continue;
    Matrix m;
    m.param = i;
    m.ns_steps = static_cast<int>(v[1]);
    m.ns_bfloat16 = v[2] > 0;
    for (int r = 0; r < members; ++r) {
      m.begin.push_back(static_cast<int64_t>(v[3 + 2 * r]));
      m.count.push_back(static_cast<int64_t>(v[4 + 2 * r]));
    }
    matrices_.push_back(std::move(m));
    const auto& s = params[i].shape;
    cost.push_back(s[0] * s[1] * std::min(s[0], s[1]));
    stats_.total_cost += cost.back();
  }
  // The exchange (Note [Muon's owner ranks]): the owners' way the transport has, or the all-gather
  // where that moves fewer elements; every rank counts both from the agreed layout alike.
  const bool has_all_to_all = comm && comm->has_all_to_all();
  FSDP_CHECK(requested_ != MuonExchange::kAllToAll || !comm || has_all_to_all, "Muon: MuonExchange::kAllToAll needs ",
             "a transport with an all-to-all, and ", comm ? comm->transport() : std::string(), " has none; use kAuto");
  const bool all_to_all =
      requested_ == MuonExchange::kAllToAll || (requested_ == MuonExchange::kAuto && has_all_to_all);
  assign_owners(cost, members, all_to_all);
  if (comm) {
    stats_.exchange = requested_ == MuonExchange::kAllGather ? MuonExchange::kAllGather
                      : all_to_all                           ? MuonExchange::kAllToAll
                                                             : MuonExchange::kReduceScatterAllGather;
    plan_exchanges(members, rank);
    const bool chosen = requested_ == MuonExchange::kAuto || requested_ == MuonExchange::kAutoWithoutAllToAll;
    if (chosen && 2 * stats_.exchange_numel > straddling_numel(members)) {
      stats_.exchange = MuonExchange::kAllGather;
      outgoing_.clear();
      incoming_.clear();
      stats_.moved_numel = 0;
      plan_exchanges(members, rank);
    }
  }
  // The matrices travel in bfloat16 where every one runs Newton-Schulz in it: its input and output
  // are the same values in either dtype.
  int64_t total = 0;
  bool all_bfloat16 = true;
  for (size_t i = 0; i < matrices_.size(); ++i) {
    const WholeParam& p = params[matrices_[i].param];
    total += p.numel;
    all_bfloat16 = all_bfloat16 && matrices_[i].ns_bfloat16;
    exchange_dtype_ = all_bfloat16 ? at::kBFloat16 : p.dtype;
    FSDP_CHECK(p.dtype == params[matrices_.front().param].dtype, "Muon: its matrices must share one dtype; '", p.name,
               "' is ", p.dtype);
    if (orthogonalizes(matrices_[i], rank)) {
      stats_.owned += 1;
      stats_.owned_cost += cost[i];
    }
  }
  stats_.matrices = static_cast<int64_t>(matrices_.size());
  stats_.matrices_numel = total;
  if (!comm) return;
  const auto dtype_size = static_cast<int64_t>(c10::elementSize(exchange_dtype_));
  const int64_t exchanges = stats_.exchange == MuonExchange::kAllGather ? 1 : 2;
  stats_.bytes_sent = exchanges * (members - 1) * stats_.exchange_numel * dtype_size;
  std::vector<int64_t> held(members, 0);  // elements of the matrices per rank
  for (const Matrix& m : matrices_)
    for (int r = 0; r < members; ++r) held[r] += m.count[r];
  stats_.naive_bytes_sent = (members - 1) * *std::max_element(held.begin(), held.end()) * dtype_size;
}

int64_t Muon::straddling_numel(int members) const {
  std::vector<int64_t> held(members, 0);
  for (const Matrix& m : matrices_) {
    const int64_t numel = reduction_.params()[m.param].numel;
    for (int r = 0; r < members; ++r)
      if (m.count[r] < numel) held[r] += m.count[r];  // 0 < count < numel: another rank holds the rest
  }
  return *std::max_element(held.begin(), held.end());
}

bool Muon::orthogonalizes(const Matrix& m, int rank) const {
  return stats_.exchange == MuonExchange::kAllGather ? m.count[rank] > 0 : m.owner == rank;
}

void Muon::assign_owners(const std::vector<int64_t>& cost, int members, bool all_to_all) {
  // Owners (Note [Muon's owner ranks]): the costliest matrix first, each to a rank whose load stays
  // within the cap: the one that keeps the exchange smallest (the largest pair for an all-to-all,
  // the largest owner's segment otherwise), then holds most of it, then the lowest; where none
  // fits, the least-loaded rank.
  const int64_t mean = stats_.total_cost / members, cap = mean + mean / 8;
  std::vector<size_t> order(matrices_.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return cost[x] > cost[y]; });
  std::vector<int64_t> load(members, 0), segment(members, 0);
  std::vector<std::vector<int64_t>> pair(members, std::vector<int64_t>(members, 0));
  int64_t exchange = 0;
  for (size_t i : order) {
    Matrix& m = matrices_[i];
    const int64_t numel = reduction_.params()[m.param].numel;
    std::tuple<int64_t, int64_t, int> best{0, 0, -1};
    for (int o = 0; o < members; ++o) {
      if (load[o] + cost[i] > cap) continue;
      int64_t x = std::max(exchange, segment[o] + numel - m.count[o]);
      if (all_to_all) {
        x = exchange;
        for (int r = 0; r < members; ++r)
          if (r != o) x = std::max(x, pair[r][o] + m.count[r]);
      }
      const std::tuple<int64_t, int64_t, int> key{x, -m.count[o], o};
      if (std::get<2>(best) < 0 || key < best) best = key;
    }
    m.owner = std::get<2>(best) >= 0 ? std::get<2>(best)
                                     : static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[m.owner] += cost[i];
    segment[m.owner] += numel - m.count[m.owner];
    exchange = std::max(exchange, all_to_all ? 0 : segment[m.owner]);
    for (int r = 0; r < members; ++r) {
      if (r == m.owner) continue;
      pair[r][m.owner] += m.count[r];
      if (all_to_all) exchange = std::max(exchange, pair[r][m.owner]);
    }
  }
}

void Muon::plan_exchanges(int members, int rank) {
  if (stats_.exchange == MuonExchange::kAllGather) {
    // Rank r's pieces of the matrices that straddle ranks, in matrix order, at r * X.
    const int64_t X = straddling_numel(members);
    stats_.exchange_numel = X;
    std::vector<int64_t> cursor(members, 0);
    for (size_t i = 0; i < matrices_.size(); ++i) {
      const Matrix& m = matrices_[i];
      const int64_t numel = reduction_.params()[m.param].numel;
      for (int r = 0; r < members; ++r) {
        if (m.count[r] == 0 || m.count[r] == numel) continue;  // the matrix lies whole on one rank
        if (r == rank) outgoing_.push_back({i, m.begin[r], m.count[r], cursor[r]});
        if (r != rank && m.count[rank] > 0) incoming_.push_back({i, m.begin[r], m.count[r], r * X + cursor[r]});
        stats_.moved_numel += m.count[r];
        cursor[r] += m.count[r];
      }
    }
    return;
  }
  // The pieces rank r holds of owner o's matrices travel together, in matrix order, as pair (r, o).
  std::vector<std::vector<int64_t>> pair(members, std::vector<int64_t>(members, 0));
  for (const Matrix& m : matrices_)
    for (int r = 0; r < members; ++r)
      if (r != m.owner) pair[r][m.owner] += m.count[r];
  int64_t largest_pair = 0, largest_segment = 0;
  std::vector<std::vector<int64_t>> offset(members, std::vector<int64_t>(members, 0));  // of (r, o) in o's segment
  for (int o = 0; o < members; ++o) {
    int64_t segment = 0;
    for (int r = 0; r < members; ++r) {
      offset[r][o] = segment;
      segment += pair[r][o];
      largest_pair = std::max(largest_pair, pair[r][o]);
      stats_.moved_numel += pair[r][o];
    }
    largest_segment = std::max(largest_segment, segment);
  }
  // An all-to-all pads every pair to the largest; a reduce-scatter and an all-gather carry each
  // owner's pairs together as its segment, padded to the largest segment.
  const bool all_to_all = stats_.exchange == MuonExchange::kAllToAll;
  const int64_t X = all_to_all ? largest_pair : largest_segment;
  stats_.exchange_numel = X;
  std::vector<std::vector<int64_t>> cursor(members, std::vector<int64_t>(members, 0));
  for (size_t i = 0; i < matrices_.size(); ++i) {
    const Matrix& m = matrices_[i];
    const int o = m.owner;
    for (int r = 0; r < members; ++r) {
      if (r == o || m.count[r] == 0) continue;
      const int64_t c = cursor[r][o];
      cursor[r][o] += m.count[r];
      if (r == rank)
        outgoing_.push_back({i, m.begin[r], m.count[r], all_to_all ? o * X + c : o * X + offset[r][o] + c});
      if (o == rank) incoming_.push_back({i, m.begin[r], m.count[r], all_to_all ? r * X + c : offset[r][o] + c});
    }
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

  // Each matrix piece's direction (momentum_update advances its state once), and its
  // orthogonalized update, by index in matrices_.
  std::vector<at::Tensor> direction(matrices_.size()), updates(matrices_.size());
  for (size_t i = 0; i < matrices_.size(); ++i)
    if (steps(params[matrices_[i].param])) direction[i] = momentum_update(params[matrices_[i].param]);
  auto finish = [&](const Matrix& m, const at::Tensor& whole) {  // whole: the (R, C) direction
    const at::Tensor x = orthogonalize(m.ns_bfloat16 ? whole.to(at::kBFloat16) : whole, m.ns_steps);
    return x.to(exchange_dtype_).reshape({-1});
  };
  const CommunicatorPtr& comm = reduction_.communicator();
  if (!comm) {  // every rank holds whole matrices
    for (size_t i = 0; i < matrices_.size(); ++i)
      if (direction[i].defined())
        updates[i] = finish(matrices_[i], direction[i].view(params[matrices_[i].param].shape));
  } else {
    // Each rank sends the pieces it holds of other owners' matrices; each owner completes its
    // matrices with its own pieces, orthogonalizes them, and returns each piece its part of the
    // result at the place it came from. By kAllGather every rank gets every piece of the matrices
    // that straddle ranks, and orthogonalizes those it holds a piece of (Note [Muon's owner ranks]).
    const int members = comm->size(), rank = comm->rank();
    const int64_t X = stats_.exchange_numel;
    const bool all_to_all = stats_.exchange == MuonExchange::kAllToAll;
    const bool all_gather = stats_.exchange == MuonExchange::kAllGather;
    const auto opts = at::TensorOptions().dtype(exchange_dtype_).device(comm->device());
    at::Tensor spread, gathered;
    if (X > 0) {
      spread = at::zeros({all_gather ? X : members * X}, opts);
      for (const Slice& s : outgoing_)
        if (direction[s.matrix].defined()) spread.narrow(0, s.at, s.numel).copy_(direction[s.matrix]);
      gathered = at::empty({all_to_all || all_gather ? members * X : X}, opts);
      if (all_to_all)
        comm->all_to_all_into(gathered, spread, CollectiveOptions::labeled("Muon: pieces to their matrices' owners"))
            ->wait();
      else if (all_gather)
        comm->all_gather_into(gathered, spread, CollectiveOptions::labeled("Muon: straddling matrices' pieces"))
            ->wait();
      else
        comm->reduce_scatter(gathered, spread, CollectiveOptions::labeled("Muon: pieces to their matrices' owners"))
            ->wait();
    }
    size_t k = 0;  // incoming_ lists the slices of this rank's matrices in matrix order
    for (size_t i = 0; i < matrices_.size(); ++i) {
      const Matrix& m = matrices_[i];
      if (!orthogonalizes(m, rank)) continue;
      const WholeParam& p = params[m.param];
      at::Tensor whole = at::zeros({p.numel}, opts);
      if (direction[i].defined()) whole.narrow(0, m.begin[rank], m.count[rank]).copy_(direction[i]);
      const size_t first = k;
      for (; k < incoming_.size() && incoming_[k].matrix == i; ++k)
        whole.narrow(0, incoming_[k].from, incoming_[k].numel)
            .copy_(gathered.narrow(0, incoming_[k].at, incoming_[k].numel));
      const at::Tensor result = finish(m, whole.view(p.shape));
      for (size_t j = first; j < k && !all_gather; ++j)
        gathered.narrow(0, incoming_[j].at, incoming_[j].numel)
            .copy_(result.narrow(0, incoming_[j].from, incoming_[j].numel));
      if (direction[i].defined()) updates[i] = result.narrow(0, m.begin[rank], m.count[rank]);
    }
    if (X > 0 && !all_gather) {
      spread = at::empty({members * X}, opts);
      const auto label = CollectiveOptions::labeled("Muon: orthogonalized parts to the pieces");
      if (all_to_all)
        comm->all_to_all_into(spread, gathered, label)->wait();
      else
        comm->all_gather_into(spread, gathered, label)->wait();
      for (const Slice& s : outgoing_)
        if (direction[s.matrix].defined()) updates[s.matrix] = spread.narrow(0, s.at, s.numel);
    }
  }
  for (size_t i = 0; i < matrices_.size(); ++i) {
    if (!updates[i].defined()) continue;
    const WholeParam& p = params[matrices_[i].param];
    const auto& o = static_cast<const MuonOptions&>(param_groups_[group_of(p)].options());
    const double scale = std::sqrt(std::max(1.0, static_cast<double>(p.shape[0]) / static_cast<double>(p.shape[1])));
    p.piece.mul_(1 - o.lr() * o.weight_decay());
    p.piece.add_(updates[i].to(p.piece.device(), p.piece.scalar_type()) * scale, -o.lr());
  }
  return loss;
}

}  // namespace fsdp
