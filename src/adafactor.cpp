#include "fsdp/adafactor.h"

#include <algorithm>
#include <cmath>

#include "fsdp/check.h"
#include "optimizer_state_key.h"

namespace fsdp {
namespace {

bool factored(const WholeParam& p) { return p.shape.size() == 2; }

// The relative or absolute step size of Hugging Face's Adafactor at `step`, for a parameter of RMS `rms`.
double step_size(const AdafactorOptions& o, int64_t step, double rms) {
  double size = o.lr();
  if (o.relative_step()) {
    const double t = static_cast<double>(step);
    size = std::min(o.warmup_init() ? 1e-6 * t : 1e-2, 1.0 / std::sqrt(t));
  }
  return o.scale_parameter() ? std::max(o.eps2(), rms) * size : size;
}

// p's state on this rank, or null.
template <class States>
AdafactorParamState* state_of(const States& states, const WholeParam& p) {
  if (!p.piece.defined()) return nullptr;
  auto it = states.find(detail::optimizer_state_key(p.piece));
  return it == states.end() ? nullptr : static_cast<AdafactorParamState*>(it->second.get());
}

}  // namespace

Adafactor::Adafactor(FullyShardedModule& module, std::vector<torch::optim::OptimizerParamGroup> groups,
                     const AdafactorOptions& defaults)
    : WholeParamOptimizer(module, std::move(groups), std::make_unique<AdafactorOptions>(defaults)) {}

torch::Tensor Adafactor::step(LossClosure closure) {
  torch::Tensor loss = begin_step("Adafactor::step", closure);
  at::NoGradGuard no_grad;
  struct Pending {
    const WholeParam* p = nullptr;
    AdafactorParamState* s = nullptr;
    const AdafactorOptions* o = nullptr;
    int weight_sq = -1, rows = -1, cols = -1, spread = -1, update_sq = -1;
    double weight_rms = 0;
    at::Tensor row_mean, col_mean, update;
  };
  std::vector<Pending> pending;
  const auto dbl = [](const at::Tensor& t) {
    return t.to(at::kDouble);
  };
  // First collective: each parameter's sum of squares and, for matrices, the row and column sums of
  // its squared gradient; a rank without a gradient of it adds zeros of the same length.
  for (const WholeParam& p : reduction_.params()) {
    if (!p.trainable) continue;
    Pending w;
    w.p = &p;
    at::Tensor wsq = at::zeros({1}, at::kDouble);
    at::Tensor rows, cols;
    if (factored(p)) {
      rows = at::zeros({p.shape[0]}, at::kDouble);
      cols = at::zeros({p.shape[1]}, at::kDouble);
    }
    if (steps(p)) {
      w.o = &static_cast<const AdafactorOptions&>(param_groups_[group_of(p)].options());
      const auto key = detail::optimizer_state_key(p.piece);
      auto it = state_.find(key);
      if (it == state_.end()) {
        auto fresh = std::make_unique<AdafactorParamState>();
        const auto opts = p.piece.options();
        if (factored(p)) {
          fresh->exp_avg_sq_row(at::zeros({p.shape[0]}, opts));
          fresh->exp_avg_sq_col(at::zeros({p.shape[1]}, opts));
        } else {
          fresh->exp_avg_sq(at::zeros_like(p.piece, at::MemoryFormat::Preserve));
        }
        if (w.o->beta1() > 0) fresh->exp_avg(at::zeros_like(p.piece, at::MemoryFormat::Preserve));
        it = state_.emplace(key, std::move(fresh)).first;
      }
      w.s = &static_cast<AdafactorParamState&>(*it->second);
      w.s->step(w.s->step() + 1);
      wsq = dbl(p.piece).square().sum().reshape({1});
      if (factored(p)) {
        const at::Tensor& g = p.piece.grad();
        // In double: a float's square is exact there, so the sums do not depend on how the ranks
        // split the matrix (Note [Whole-parameter reductions]).
        const PieceRows sq = piece_rows(p, dbl(g).square() + w.o->eps1());
        rows.narrow(0, sq.first_row, sq.matrix.size(0)).copy_(sq.matrix.sum(1));
        cols.copy_(sq.matrix.sum(0));
      }
    }
    w.weight_sq = reduction_.add(wsq, Combine::kSum);
    if (factored(p)) {
      w.rows = reduction_.add(rows, Combine::kSum);
      w.cols = reduction_.add(cols, Combine::kSum);
      const AdafactorParamState* s = state_of(state_, p);
      w.spread = reduction_.add(at::full({1}, s && s->spread() ? 1.0 : 0.0, at::kDouble), Combine::kMax);
    }
    pending.push_back(std::move(w));
  }
  reduction_.run();
  bool any_spread = false;
  for (Pending& w : pending) {
    any_spread = any_spread || (w.spread >= 0 && reduction_.result(w.spread).item<double>() > 0);
    if (!w.s) continue;
    const double n = static_cast<double>(std::max<int64_t>(1, w.p->numel));
    w.weight_rms = std::sqrt(reduction_.result(w.weight_sq).item<double>() / n);
    if (factored(*w.p)) {
      w.row_mean = reduction_.result(w.rows) / static_cast<double>(w.p->shape[1]);
      w.col_mean = reduction_.result(w.cols) / static_cast<double>(w.p->shape[0]);
    }
  }
  if (any_spread) gather_spread_moments();
  // The unclipped updates, and the second collective: each update's sum of squares.
  for (Pending& w : pending) {
    const WholeParam& p = *w.p;
    at::Tensor usq = at::zeros({1}, at::kDouble);
    if (w.s) {
      AdafactorParamState& s = *w.s;
      const double beta2t = 1.0 - std::pow(static_cast<double>(s.step()), w.o->decay_rate());
      const at::Tensor& g = p.piece.grad();
      if (factored(p)) {
        const auto opts = s.exp_avg_sq_row().options();
        s.exp_avg_sq_row().mul_(beta2t).add_(w.row_mean.to(opts), 1.0 - beta2t);
        s.exp_avg_sq_col().mul_(beta2t).add_(w.col_mean.to(opts), 1.0 - beta2t);
        const at::Tensor r_factor =
            (s.exp_avg_sq_row() / s.exp_avg_sq_row().mean(-1, /*keepdim=*/true)).rsqrt_().unsqueeze(-1);
        const at::Tensor c_factor = s.exp_avg_sq_col().unsqueeze(-2).rsqrt();
        const PieceRows grows = piece_rows(p, g);
        const at::Tensor approx = r_factor.narrow(0, grows.first_row, grows.matrix.size(0)) * c_factor;
        w.update = piece_of_rows(p, approx.mul_(grows.matrix)).clone();
      } else {
        s.exp_avg_sq().mul_(beta2t).add_(g * g + w.o->eps1(), 1.0 - beta2t);
        w.update = s.exp_avg_sq().rsqrt() * g;
      }
      usq = dbl(w.update).square().sum().reshape({1});
    }
    w.update_sq = reduction_.add(usq, Combine::kSum);
  }
  reduction_.run();
  for (Pending& w : pending) {
    if (!w.s) continue;
    const WholeParam& p = *w.p;
    const AdafactorOptions& o = *w.o;
    const double n = static_cast<double>(std::max<int64_t>(1, p.numel));
    const double update_rms = std::sqrt(reduction_.result(w.update_sq).item<double>() / n);
    const double lr = step_size(o, w.s->step(), w.weight_rms);
    w.update.div_(std::max(1.0, update_rms / o.clip_threshold()));
    w.update.mul_(lr);
    if (o.beta1() > 0) {
      w.s->exp_avg().mul_(o.beta1()).add_(w.update, 1 - o.beta1());
      w.update = w.s->exp_avg();
    }
    if (o.weight_decay() != 0) p.piece.add_(p.piece, -o.weight_decay() * lr);
    p.piece.sub_(w.update);
  }
  return loss;
}

const WholeParam* Adafactor::param_of(const at::Tensor& piece) const {
  for (const WholeParam& p : reduction_.params())
    if (p.piece.defined() && p.piece.is_same(piece)) return &p;
  FSDP_FAIL("Adafactor: the tensor is not a piece of the module it steps");
}

void Adafactor::gather_spread_moments() {
  // Every row and column of a matrix lies in some rank's piece, whose spread state holds its
  // value; the moments are positive, so the maximum over ranks (zeros elsewhere) restores them.
  struct Ids {
    AdafactorParamState* s;
    const WholeParam* p;
    int rows, cols;
  };
  std::vector<Ids> ids;
  for (const WholeParam& p : reduction_.params()) {
    if (!p.trainable || !factored(p)) continue;
    at::Tensor rows = at::zeros({p.shape[0]}, at::kDouble), cols = at::zeros({p.shape[1]}, at::kDouble);
    AdafactorParamState* s = state_of(state_, p);
    if (s && !s->spread()) s = nullptr;
    if (s) {
      const PieceRows r = piece_rows(p, s->exp_avg_sq_row());
      rows.narrow(0, r.first_row, r.matrix.size(0)).copy_(r.matrix.amax(1).to(at::kDouble));
      cols.copy_(piece_rows(p, s->exp_avg_sq_col()).matrix.amax(0).to(at::kDouble));
    }
    ids.push_back({s, &p, reduction_.add(rows, Combine::kMax), reduction_.add(cols, Combine::kMax)});
  }
  reduction_.run();
  for (const Ids& i : ids) {
    if (!i.s) continue;
    const auto opts = i.s->exp_avg_sq_row().options();
    i.s->exp_avg_sq_row(reduction_.result(i.rows).to(opts));
    i.s->exp_avg_sq_col(reduction_.result(i.cols).to(opts));
    i.s->spread(false);
  }
}

std::unique_ptr<AdafactorParamState> Adafactor::spread_state(const at::Tensor& piece) const {
  const WholeParam& p = *param_of(piece);
  const AdafactorParamState* s = state_of(state_, p);
  if (!s) return nullptr;
  auto out = std::make_unique<AdafactorParamState>(*s);
  if (factored(p) && !s->spread()) {
    const int64_t first_row = p.begin / p.shape[1];
    const int64_t rows = (p.begin + p.piece.numel() + p.shape[1] - 1) / p.shape[1] - first_row;
    const at::Tensor by_row = s->exp_avg_sq_row().narrow(0, first_row, rows).unsqueeze(1).expand({rows, p.shape[1]});
    const at::Tensor by_col = s->exp_avg_sq_col().unsqueeze(0).expand({rows, p.shape[1]});
    out->exp_avg_sq_row(piece_of_rows(p, by_row.contiguous()).clone());
    out->exp_avg_sq_col(piece_of_rows(p, by_col.contiguous()).clone());
    out->spread(true);
  }
  return out;
}

void Adafactor::set_spread_state(const at::Tensor& piece, std::unique_ptr<AdafactorParamState> state) {
  const WholeParam& p = *param_of(piece);
  FSDP_CHECK(!factored(p) || state->spread(), "Adafactor: the state of matrix '", p.name,
             "' must be spread over its piece (spread_state)");
  state_[detail::optimizer_state_key(piece)] = std::move(state);
}

}  // namespace fsdp
