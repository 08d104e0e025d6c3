#include "fsdp/lbfgs.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "fsdp/check.h"
#include "state_access.h"

namespace fsdp {
namespace {

using torch::optim::LBFGSOptions;

// The line search's constants, as LibTorch's: sufficient decrease, curvature, evaluations, and the
// bracket width (times max |d|) below which it stops.
constexpr double kSufficientDecrease = 1e-4;
constexpr double kCurvature = 0.9;
constexpr int kMaxSearchEvaluations = 25;
constexpr double kBracketTolerance = 1e-9;
// A new (s, y) pair enters the history only with s . y above this.
constexpr double kMinCurvature = 1e-10;

LBFGSOptions checked(LBFGSOptions o) {
  FSDP_CHECK(o.history_size() >= 1, "fsdp::LBFGS: history_size must be at least 1, got ", o.history_size());
  FSDP_CHECK(o.max_iter() >= 1, "fsdp::LBFGS: max_iter must be at least 1, got ", o.max_iter());
  FSDP_CHECK(!o.line_search_fn().has_value() || *o.line_search_fn() == "strong_wolfe",
             "fsdp::LBFGS: line_search_fn must be unset or \"strong_wolfe\", got \"", *o.line_search_fn(), "\"");
  if (!o.max_eval().has_value()) o.max_eval(o.max_iter() * 5 / 4);
  return o;
}

// The minimum of the cubic through (x1, f1) and (x2, f2) with slopes g1 and g2, kept in [lo, hi];
// the middle of [lo, hi] when the cubic has no minimum.
double cubic_minimum(double x1, double f1, double g1, double x2, double f2, double g2, double lo, double hi) {
  const double d1 = g1 + g2 - 3 * (f1 - f2) / (x1 - x2);
  const double disc = d1 * d1 - g1 * g2;
  if (disc < 0) return (lo + hi) / 2;
  const double d2 = std::sqrt(disc);
  const double at = x1 <= x2 ? x2 - (x2 - x1) * ((g2 + d2 - d1) / (g2 - g1 + 2 * d2))
                             : x1 - (x1 - x2) * ((g1 + d2 - d1) / (g1 - g2 + 2 * d2));
  return std::min(std::max(at, lo), hi);
}

}  // namespace

LBFGS::LBFGS(FullyShardedModule& module, const LBFGSOptions& options)
    : WholeParamOptimizer(module, {}, std::make_unique<LBFGSOptions>(checked(options))),
      pg_(&detail::StateAccess::of(module).process_group()) {}

at::Tensor LBFGS::flat_grad() const {
  std::vector<at::Tensor> parts;
  for (const auto& p : param_groups_.at(0).params())
    parts.push_back(p.grad().defined() ? p.grad().reshape({-1}) : at::zeros({p.numel()}, p.options()));
  return parts.empty() ? at::empty({0}) : at::cat(parts);
}

void LBFGS::add_to_pieces(double step, const at::Tensor& direction) {
  int64_t offset = 0;
  for (auto& p : param_groups_.at(0).params()) {
    p.add_(direction.narrow(0, offset, p.numel()).view_as(p), step);
    offset += p.numel();
  }
}

void LBFGS::set_pieces(const std::vector<at::Tensor>& values) {
  const auto& pieces = param_groups_.at(0).params();
  for (size_t i = 0; i < pieces.size(); ++i) pieces[i].copy_(values[i]);
}

std::vector<double> LBFGS::dots(const std::vector<std::pair<at::Tensor, at::Tensor>>& pairs,
                                const std::vector<at::Tensor>& abs_max) {
  std::vector<at::Tensor> sums, maxima;
  for (const auto& [a, b] : pairs)
    sums.push_back(a.numel() ? a.dot(b).to(at::kDouble) : at::zeros({}, a.options().dtype(at::kDouble)));
  for (const auto& a : abs_max)
    maxima.push_back(a.numel() ? a.abs().max().to(at::kDouble) : at::zeros({}, a.options().dtype(at::kDouble)));
  const int sum_id = sums.empty() ? -1 : reduction_.add(at::stack(sums), Combine::kSum);
  const int max_id = maxima.empty() ? -1 : reduction_.add(at::stack(maxima), Combine::kMax);
  reduction_.run();
  std::vector<double> out;
  for (int id : {sum_id, max_id}) {
    if (id < 0) continue;
    const at::Tensor& r = reduction_.result(id);
    const double* v = r.data_ptr<double>();
    out.insert(out.end(), v, v + r.numel());
  }
  return out;
}

LBFGS::Evaluation LBFGS::evaluate(const LossClosure& closure) {
  at::Tensor loss;
  {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  return evaluated(loss);
}

LBFGS::Evaluation LBFGS::evaluated(const at::Tensor& loss) {
  FSDP_CHECK(loss.defined() && loss.numel() == 1,
             "fsdp::LBFGS::step: the closure must return the loss, one value; it returned ",
             loss.defined() ? "a tensor of shape " + c10::str(loss.sizes()) : std::string("an undefined tensor"));
  Evaluation e;
  e.loss = mean_across_ranks(*pg_, loss.item<double>());  // the same on every rank, so all decide alike
  e.grad = flat_grad();
  return e;
}

LBFGS::Evaluation LBFGS::probe(const LossClosure& closure, const std::vector<at::Tensor>& x, double t,
                               const at::Tensor& d) {
  add_to_pieces(t, d);
  Evaluation e = evaluate(closure);
  set_pieces(x);
  return e;
}

at::Tensor LBFGS::direction(const at::Tensor& g, const at::Tensor& y, const at::Tensor& s) {
  const auto& o = static_cast<const LBFGSOptions&>(param_groups_.at(0).options());
  const size_t m = s_.size();
  // One collective: the new pair's inner products with itself and the history, and the gradient's
  // with every pair (Note [L-BFGS over shards]).
  std::vector<std::pair<at::Tensor, at::Tensor>> pairs{{y, s}, {y, y}, {s, g}, {y, g}};
  for (size_t j = 0; j < m; ++j) {
    pairs.push_back({s_[j], y});
    pairs.push_back({y, y_[j]});
    pairs.push_back({s_[j], g});
    pairs.push_back({y_[j], g});
  }
  const std::vector<double> v = dots(pairs);
  auto of_pair = [&](size_t j, int k) {
    return v[4 + 4 * j + k];
  };  // k: s_j.y, y.y_j, s_j.g, y_j.g
  std::deque<double> sg, yg;
  for (size_t j = 0; j < m; ++j) {
    sg.push_back(of_pair(j, 2));
    yg.push_back(of_pair(j, 3));
  }
  const double ys = v[0], yy = v[1];
  if (ys > kMinCurvature) {
    // A full history drops its oldest pair: the pairs from `first` on stay.
    const size_t first = static_cast<int64_t>(m) == o.history_size() ? 1 : 0;
    if (first) {
      s_.pop_front(), y_.pop_front(), ro_.pop_front(), sy_.pop_front(), yy_.pop_front();
      sg.pop_front(), yg.pop_front();
      for (auto& row : yy_) row.pop_front();
    }
    std::deque<double> yy_row;
    for (size_t j = first; j < m; ++j) {
      sy_[j - first].push_back(of_pair(j, 0));
      yy_[j - first].push_back(of_pair(j, 1));
      yy_row.push_back(of_pair(j, 1));
    }
    yy_row.push_back(yy);
    sy_.push_back({ys});
    yy_.push_back(std::move(yy_row));
    s_.push_back(s);
    y_.push_back(y);
    ro_.push_back(1. / ys);
    sg.push_back(v[2]);
    yg.push_back(v[3]);
    h_diag_ = ys / yy;
  }
  // The two loops on inner products: q = -g - sum_j al_j y_j; r = h q + sum_j (al_j - be_j) s_j.
  const size_t n = s_.size();
  std::vector<double> al(n), be(n);
  for (size_t i = n; i-- > 0;) {
    double sq = -sg[i];
    for (size_t j = i + 1; j < n; ++j) sq -= al[j] * sy_[i][j - i];
    al[i] = ro_[i] * sq;
  }
  for (size_t i = 0; i < n; ++i) {
    double yq = -yg[i];
    for (size_t j = 0; j < n; ++j) yq -= al[j] * yy_[i][j];
    double yr = h_diag_ * yq;
    for (size_t j = 0; j < i; ++j) yr += (al[j] - be[j]) * sy_[j][i - j];
    be[i] = ro_[i] * yr;
  }
  at::Tensor d = g.mul(-h_diag_);
  for (size_t j = 0; j < n; ++j) {
    d.add_(y_[j], -h_diag_ * al[j]);
    d.add_(s_[j], al[j] - be[j]);
  }
  return d;
}

LBFGS::Search LBFGS::strong_wolfe(const LossClosure& closure, double t, const at::Tensor& d, const Evaluation& at0,
                                  double gtd) {
  struct Point {
    double t = 0, f = 0;
    at::Tensor g;
    double gtd = 0, gmax = 0;
  };
  std::vector<at::Tensor> x;
  for (const auto& p : param_groups_.at(0).params()) x.push_back(p.clone());
  const double dmax = dots({}, {d})[0];
  int64_t evaluations = 0;
  auto at_step = [&](double step) {
    Evaluation e = probe(closure, x, step, d);
    const std::vector<double> r = dots({{e.grad, d}}, {e.grad});
    ++evaluations;
    return Point{step, e.loss, e.grad, r[0], r[1]};
  };
  const Point start{0, at0.loss, at0.grad, gtd, 0};
  const double f0 = at0.loss;
  auto armijo_fails = [&](const Point& p) {
    return p.f > f0 + kSufficientDecrease * p.t * gtd;
  };
  auto curvature_holds = [&](const Point& p) {
    return std::abs(p.gtd) <= -kCurvature * gtd;
  };

  // Bracketing: find an interval that holds a point meeting the strong Wolfe conditions.
  Point prev = start, cur = at_step(t);
  std::array<Point, 2> bracket;
  bool done = false;
  int iter = 0;
  for (; iter < kMaxSearchEvaluations; ++iter) {
    if (armijo_fails(cur) || (iter > 1 && cur.f >= prev.f)) {
      bracket = {prev, cur};
      break;
    }
    if (curvature_holds(cur)) {
      bracket = {cur, cur};
      done = true;
      break;
    }
    if (cur.gtd >= 0) {
      bracket = {prev, cur};
      break;
    }
    const double next =
        cubic_minimum(prev.t, prev.f, prev.gtd, cur.t, cur.f, cur.gtd, cur.t + 0.01 * (cur.t - prev.t), cur.t * 10);
    prev = cur;
    cur = at_step(next);
  }
  if (iter == kMaxSearchEvaluations) bracket = {start, cur};

  // Zoom: shrink the bracket until a point meets the conditions.
  bool slow = false;
  int low = bracket[0].f <= bracket[1].f ? 0 : 1;
  while (!done && iter < kMaxSearchEvaluations) {
    const double hi_t = std::max(bracket[0].t, bracket[1].t), lo_t = std::min(bracket[0].t, bracket[1].t);
    double next = cubic_minimum(bracket[0].t, bracket[0].f, bracket[0].gtd, bracket[1].t, bracket[1].f, bracket[1].gtd,
                                lo_t, hi_t);
    const double margin = 0.1 * (hi_t - lo_t);
    if (std::min(hi_t - next, next - lo_t) < margin) {
      // Too close to an end: after a slow step, or at the end itself, step a tenth inside.
      if (slow || next >= hi_t || next <= lo_t) {
        next = std::abs(next - hi_t) < std::abs(next - lo_t) ? hi_t - margin : lo_t + margin;
        slow = false;
      } else {
        slow = true;
      }
    } else {
      slow = false;
    }
    Point p = at_step(next);
    ++iter;
    const int high = 1 - low;
    if (armijo_fails(p) || p.f >= bracket[low].f) {
      bracket[high] = p;
      low = bracket[0].f <= bracket[1].f ? 0 : 1;
    } else {
      if (curvature_holds(p))
        done = true;
      else if (p.gtd * (bracket[high].t - bracket[low].t) >= 0)
        bracket[high] = bracket[low];
      bracket[low] = p;
    }
    if (std::abs(bracket[1].t - bracket[0].t) * dmax < kBracketTolerance) break;
  }
  const Point& best = bracket[low];
  if (best.t == 0) {  // the start point: its gradient's maximum was not needed until now
    Search s{best.f, best.t, best.g, dots({}, {best.g})[0], evaluations};
    return s;
  }
  return Search{best.f, best.t, best.g, best.gmax, evaluations};
}

torch::Tensor LBFGS::step(LossClosure closure) {
  FSDP_CHECK(closure != nullptr,
             "fsdp::LBFGS::step needs a closure that zeroes the gradients, runs forward and backward and returns "
             "the loss");
  begin_step("LBFGS::step", nullptr);
  at::NoGradGuard no_grad;
  const auto& o = static_cast<const LBFGSOptions&>(param_groups_.at(0).options());
  const double tolerance_change = o.tolerance_change(), tolerance_grad = o.tolerance_grad();

  at::Tensor orig_loss;
  {
    at::AutoGradMode enable_grad(true);
    orig_loss = closure();
  }
  Evaluation e = evaluated(orig_loss);
  ++func_evals_;
  int64_t current_evals = 1;
  double grad_max = dots({}, {e.grad})[0];
  if (grad_max <= tolerance_grad) return orig_loss;
  double loss = e.loss;
  at::Tensor g = e.grad;
  bool optimal = false;
  for (int64_t n_iter = 1; n_iter <= o.max_iter(); ++n_iter) {
    ++n_iter_;
    if (n_iter_ == 1) {
      d_ = g.neg();
      h_diag_ = 1;
      s_.clear(), y_.clear(), ro_.clear(), sy_.clear(), yy_.clear();
    } else {
      d_ = direction(g, g.sub(prev_grad_), d_.mul(t_));
    }
    prev_grad_ = g.clone();
    prev_loss_ = loss;
    // The first step is scaled to the gradient's size; then lr.
    const std::vector<double> v =
        n_iter_ == 1 ? dots({{g, d_}, {g.abs(), at::ones_like(g)}}, {d_}) : dots({{g, d_}}, {d_});
    t_ = n_iter_ == 1 ? std::min(1., 1. / v[1]) * o.lr() : o.lr();
    const double gtd = v[0], dmax = v.back();
    if (gtd > -tolerance_change) break;

    int64_t ls_evals = 0;
    if (o.line_search_fn().has_value()) {
      Search s = strong_wolfe(closure, t_, d_, Evaluation{loss, g}, gtd);
      t_ = s.t;
      add_to_pieces(t_, d_);
      loss = s.loss;
      g = s.grad;
      optimal = s.grad_max <= tolerance_grad;
      ls_evals = s.evaluations;
    } else {
      add_to_pieces(t_, d_);
      if (n_iter != o.max_iter()) {
        e = evaluate(closure);
        loss = e.loss;
        g = e.grad;
        optimal = dots({}, {g})[0] <= tolerance_grad;
        ls_evals = 1;
      }
    }
    current_evals += ls_evals;
    func_evals_ += ls_evals;
    if (n_iter == o.max_iter() || current_evals >= *o.max_eval() || optimal) break;
    if (std::abs(t_) * dmax <= tolerance_change) break;  // lack of progress
    if (std::abs(loss - prev_loss_) < tolerance_change) break;
  }
  return orig_loss;
}

LBFGS::History LBFGS::history() const {
  History h;
  h.n_iter = n_iter_;
  h.func_evals = func_evals_;
  h.t = t_;
  h.prev_loss = prev_loss_;
  h.h_diag = h_diag_;
  h.ro.assign(ro_.begin(), ro_.end());
  for (const auto& row : sy_) h.sy.emplace_back(row.begin(), row.end());
  for (const auto& row : yy_) h.yy.emplace_back(row.begin(), row.end());
  return h;
}

std::map<std::string, at::Tensor> LBFGS::piece_state(const at::Tensor& piece) const {
  std::map<std::string, at::Tensor> out;
  if (!d_.defined()) return out;
  int64_t offset = 0;
  for (const auto& p : param_groups_.at(0).params()) {
    if (p.unsafeGetTensorImpl() == piece.unsafeGetTensorImpl()) {
      auto part = [&](const at::Tensor& flat) {
        return flat.narrow(0, offset, p.numel());
      };
      out["d"] = part(d_);
      out["prev_flat_grad"] = part(prev_grad_);
      for (size_t i = 0; i < s_.size(); ++i) {
        out["s." + std::to_string(i)] = part(s_[i]);
        out["y." + std::to_string(i)] = part(y_[i]);
      }
      return out;
    }
    offset += p.numel();
  }
  return out;
}

void LBFGS::set_history(const History& h) {
  const size_t m = h.ro.size();
  FSDP_CHECK(h.sy.size() == m && h.yy.size() == m, "fsdp::LBFGS: a history of ", m, " pairs with ", h.sy.size(),
             " rows of s . y and ", h.yy.size(), " of y . y; the checkpoint is damaged");
  for (size_t i = 0; i < m; ++i)
    FSDP_CHECK(h.sy[i].size() == m - i && h.yy[i].size() == m,
               "fsdp::LBFGS: the history's inner products do not fit its ", m, " pairs; the checkpoint is damaged");
  n_iter_ = h.n_iter;
  func_evals_ = h.func_evals;
  t_ = h.t;
  prev_loss_ = h.prev_loss;
  h_diag_ = h.h_diag;
  ro_.assign(h.ro.begin(), h.ro.end());
  sy_.clear(), yy_.clear();
  for (const auto& row : h.sy) sy_.emplace_back(row.begin(), row.end());
  for (const auto& row : h.yy) yy_.emplace_back(row.begin(), row.end());
  loaded_.clear();
}

void LBFGS::set_piece_state(const at::Tensor& piece, std::map<std::string, at::Tensor> state) {
  loaded_[piece.unsafeGetTensorImpl()] = std::move(state);
}

void LBFGS::after_load() {
  const auto& pieces = param_groups_.at(0).params();
  std::map<const c10::TensorImpl*, std::map<std::string, at::Tensor>> loaded = std::move(loaded_);
  loaded_.clear();
  s_.clear(), y_.clear();
  d_ = prev_grad_ = at::Tensor();
  if (n_iter_ == 0) return;  // saved before the first step: nothing to assemble
  auto flat = [&](const std::string& name) {
    std::vector<at::Tensor> parts;
    for (const auto& p : pieces) {
      auto it = loaded.find(p.unsafeGetTensorImpl());
      FSDP_CHECK(it != loaded.end() && it->second.count(name), "fsdp::LBFGS: the checkpoint holds no '", name,
                 "' of the L-BFGS history for a piece of this rank (", p.numel(),
                 " elements); it is damaged, or was saved by another optimizer");
      const at::Tensor& t = it->second.at(name);
      FSDP_CHECK(t.numel() == p.numel(), "fsdp::LBFGS: the history's '", name, "' has ", t.numel(),
                 " elements for a piece of ", p.numel());
      parts.push_back(t.reshape({-1}).to(p.device()));
    }
    return parts.empty() ? at::empty({0}) : at::cat(parts);
  };
  d_ = flat("d");
  prev_grad_ = flat("prev_flat_grad");
  for (size_t i = 0; i < ro_.size(); ++i) {
    s_.push_back(flat("s." + std::to_string(i)));
    y_.push_back(flat("y." + std::to_string(i)));
  }
}

}  // namespace fsdp
