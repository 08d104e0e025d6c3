#include "checkpoint/optimizer_state.h"

#include <c10/util/string_utils.h>
#include <torch/version.h>

#include "fsdp/adafactor.h"
#include "fsdp/check.h"
#include "fsdp/lamb.h"
#include "fsdp/lbfgs.h"
#include "fsdp/muon.h"
#include "optimizer_state_key.h"

namespace fsdp::checkpoint::detail {

using nlohmann::json;
namespace optim = torch::optim;

namespace {

using StateKey = fsdp::detail::OptimizerStateKey;
StateKey key_of(const at::Tensor& param) { return fsdp::detail::optimizer_state_key(param); }

PieceState muon_state(const MuonParamState& s) {
  PieceState out;
  out.present = true;
  out.step = s.step();
  if (s.momentum_buffer().defined()) out.tensors["momentum_buffer"] = s.momentum_buffer();
  if (s.exp_avg().defined()) out.tensors["exp_avg"] = s.exp_avg();
  if (s.exp_avg_sq().defined()) out.tensors["exp_avg_sq"] = s.exp_avg_sq();
  return out;
}

std::unique_ptr<optim::OptimizerParamState> make_muon_state(const PieceState& in) {
  auto s = std::make_unique<MuonParamState>();
  s->step(in.step);
  for (const auto& [name, t] : in.tensors) {
    if (name == "momentum_buffer")
      s->momentum_buffer(t);
    else if (name == "exp_avg")
      s->exp_avg(t);
    else if (name == "exp_avg_sq")
      s->exp_avg_sq(t);
    else
      FSDP_FAIL("checkpoint: state tensor '", name, "' does not belong to Muon");
  }
  FSDP_CHECK(s->momentum_buffer().defined() || (s->exp_avg().defined() && s->exp_avg_sq().defined()),
             "checkpoint: Muon state without momentum_buffer or exp_avg / exp_avg_sq; the checkpoint is damaged");
  return s;
}

template <class State>
PieceState adam_state(const State& s) {
  PieceState out;
  out.present = true;
  out.step = s.step();
  if (s.exp_avg().defined()) out.tensors["exp_avg"] = s.exp_avg();
  if (s.exp_avg_sq().defined()) out.tensors["exp_avg_sq"] = s.exp_avg_sq();
  if (s.max_exp_avg_sq().defined()) out.tensors["max_exp_avg_sq"] = s.max_exp_avg_sq();
  return out;
}

template <class State>
std::unique_ptr<optim::OptimizerParamState> make_adam_state(const PieceState& in) {
  auto s = std::make_unique<State>();
  s->step(in.step);
  for (const auto& [name, t] : in.tensors) {
    if (name == "exp_avg")
      s->exp_avg(t);
    else if (name == "exp_avg_sq")
      s->exp_avg_sq(t);
    else if (name == "max_exp_avg_sq")
      s->max_exp_avg_sq(t);
    else
      FSDP_FAIL("checkpoint: state tensor '", name, "' does not belong to an Adam-type optimizer");
  }
  FSDP_CHECK(s->exp_avg().defined() && s->exp_avg_sq().defined(),
             "checkpoint: Adam-type state without exp_avg / exp_avg_sq; the checkpoint is damaged");
  return s;
}

}  // namespace

OptimizerKind optimizer_kind(const optim::Optimizer* optimizer) {
  if (!optimizer) return OptimizerKind::kNone;
  if (dynamic_cast<const Lamb*>(optimizer)) return OptimizerKind::kLamb;
  if (dynamic_cast<const Muon*>(optimizer)) return OptimizerKind::kMuon;
  if (dynamic_cast<const Adafactor*>(optimizer)) return OptimizerKind::kAdafactor;
  if (dynamic_cast<const LBFGS*>(optimizer)) return OptimizerKind::kLbfgs;
  if (dynamic_cast<const optim::AdamW*>(optimizer)) return OptimizerKind::kAdamW;
  if (dynamic_cast<const optim::Adam*>(optimizer)) return OptimizerKind::kAdam;
  if (dynamic_cast<const optim::SGD*>(optimizer)) return OptimizerKind::kSgd;
  if (dynamic_cast<const optim::Adagrad*>(optimizer)) return OptimizerKind::kAdagrad;
  if (dynamic_cast<const optim::RMSprop*>(optimizer)) return OptimizerKind::kRmsprop;
  FSDP_FAIL("checkpoints carry the state of torch::optim::AdamW (and fsdp::FusedAdamW), Adam, SGD, Adagrad, "
            "RMSprop, fsdp::Lamb, fsdp::Muon, fsdp::Adafactor and fsdp::LBFGS only; save this optimizer's state "
            "yourself, or pass no optimizer to save the model alone");
}

std::string to_string(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kNone: return "none";
    case OptimizerKind::kAdamW: return "adamw";
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kSgd: return "sgd";
    case OptimizerKind::kAdagrad: return "adagrad";
    case OptimizerKind::kRmsprop: return "rmsprop";
    case OptimizerKind::kLamb: return "lamb";
    case OptimizerKind::kMuon: return "muon";
    case OptimizerKind::kAdafactor: return "adafactor";
    case OptimizerKind::kLbfgs: return "lbfgs";
  }
  return "none";
}

PieceState get_piece_state(OptimizerKind kind, optim::Optimizer& optimizer, const at::Tensor& param) {
  if (kind == OptimizerKind::kLbfgs) {
    const auto& lbfgs = static_cast<const LBFGS&>(optimizer);
    PieceState out;
    out.tensors = lbfgs.piece_state(param);
    out.present = !out.tensors.empty();
    out.step = lbfgs.iterations();
    return out;
  }
  auto& states = optimizer.state();
  auto it = states.find(key_of(param));
  if (it == states.end() || !it->second) return {};
  switch (kind) {
    case OptimizerKind::kAdamW: return adam_state(static_cast<const optim::AdamWParamState&>(*it->second));
    case OptimizerKind::kAdam: return adam_state(static_cast<const optim::AdamParamState&>(*it->second));
    case OptimizerKind::kLamb: return adam_state(static_cast<const LambParamState&>(*it->second));
    case OptimizerKind::kMuon: return muon_state(static_cast<const MuonParamState&>(*it->second));
    case OptimizerKind::kAdafactor: {
      const auto s = static_cast<const Adafactor&>(optimizer).spread_state(param);
      PieceState out;
      out.present = true;
      out.step = s->step();
      for (const auto& [name, t] : {std::pair<const char*, at::Tensor>{"exp_avg_sq_row", s->exp_avg_sq_row()},
                                    {"exp_avg_sq_col", s->exp_avg_sq_col()},
                                    {"exp_avg_sq", s->exp_avg_sq()},
                                    {"exp_avg", s->exp_avg()}})
        if (t.defined()) out.tensors[name] = t;
      return out;
    }
    case OptimizerKind::kAdagrad: {
      const auto& st = static_cast<const optim::AdagradParamState&>(*it->second);
      PieceState out;
      out.present = true;
      out.step = st.step();
      if (st.sum().defined()) out.tensors["sum"] = st.sum();
      return out;
    }
    case OptimizerKind::kRmsprop: {
      const auto& st = static_cast<const optim::RMSpropParamState&>(*it->second);
      PieceState out;
      out.present = true;
      out.step = st.step();
      for (const auto& [name, t] : {std::pair<const char*, at::Tensor>{"square_avg", st.square_avg()},
                                    {"momentum_buffer", st.momentum_buffer()},
                                    {"grad_avg", st.grad_avg()}})
        if (t.defined()) out.tensors[name] = t;
      return out;
    }
    case OptimizerKind::kSgd: {
      // LibTorch's SGD keeps state only for momentum, and steps on a state without a buffer would fail.
      const auto& s = static_cast<const optim::SGDParamState&>(*it->second);
      if (!s.momentum_buffer().defined()) return {};
      PieceState out;
      out.present = true;
      out.tensors["momentum_buffer"] = s.momentum_buffer();
      return out;
    }
    case OptimizerKind::kLbfgs:
    case OptimizerKind::kNone: break;
  }
  return {};
}

void set_piece_state(OptimizerKind kind, optim::Optimizer& optimizer, const at::Tensor& param,
                     const PieceState& state) {
  if (kind == OptimizerKind::kLbfgs) {
    if (state.present) static_cast<LBFGS&>(optimizer).set_piece_state(param, state.tensors);
    return;
  }
  auto& states = optimizer.state();
  const StateKey key = key_of(param);
  if (!state.present) {
    states.erase(key);
    return;
  }
  switch (kind) {
    case OptimizerKind::kAdamW: states[key] = make_adam_state<optim::AdamWParamState>(state); break;
    case OptimizerKind::kAdam: states[key] = make_adam_state<optim::AdamParamState>(state); break;
    case OptimizerKind::kLamb: states[key] = make_adam_state<LambParamState>(state); break;
    case OptimizerKind::kMuon: states[key] = make_muon_state(state); break;
    case OptimizerKind::kAdafactor: {
      auto s = std::make_unique<AdafactorParamState>();
      s->step(state.step);
      for (const auto& [name, t] : state.tensors) {
        if (name == "exp_avg_sq_row")
          s->exp_avg_sq_row(t).spread(true);
        else if (name == "exp_avg_sq_col")
          s->exp_avg_sq_col(t);
        else if (name == "exp_avg_sq")
          s->exp_avg_sq(t);
        else if (name == "exp_avg")
          s->exp_avg(t);
        else
          FSDP_FAIL("checkpoint: state tensor '", name, "' does not belong to Adafactor");
      }
      static_cast<Adafactor&>(optimizer).set_spread_state(param, std::move(s));
      break;
    }
    case OptimizerKind::kAdagrad: {
      auto st = std::make_unique<optim::AdagradParamState>();
      st->step(state.step);
      for (const auto& [name, t] : state.tensors) {
        FSDP_CHECK(name == "sum", "checkpoint: state tensor '", name, "' does not belong to Adagrad");
        st->sum(t);
      }
      FSDP_CHECK(st->sum().defined(), "checkpoint: Adagrad state without sum; the checkpoint is damaged");
      states[key] = std::move(st);
      break;
    }
    case OptimizerKind::kRmsprop: {
      auto st = std::make_unique<optim::RMSpropParamState>();
      st->step(state.step);
      for (const auto& [name, t] : state.tensors) {
        if (name == "square_avg")
          st->square_avg(t);
        else if (name == "momentum_buffer")
          st->momentum_buffer(t);
        else if (name == "grad_avg")
          st->grad_avg(t);
        else
          FSDP_FAIL("checkpoint: state tensor '", name, "' does not belong to RMSprop");
      }
      FSDP_CHECK(st->square_avg().defined(), "checkpoint: RMSprop state without square_avg; the checkpoint is damaged");
      states[key] = std::move(st);
      break;
    }
    case OptimizerKind::kSgd: {
      if (state.tensors.empty()) {
        states.erase(key);
        break;
      }
      auto s = std::make_unique<optim::SGDParamState>();
      for (const auto& [name, t] : state.tensors) {
        FSDP_CHECK(name == "momentum_buffer", "checkpoint: state tensor '", name, "' does not belong to SGD");
        s->momentum_buffer(t);
      }
      states[key] = std::move(s);
      break;
    }
    case OptimizerKind::kLbfgs:
    case OptimizerKind::kNone: break;
  }
}

void add_optimizer_scalars(OptimizerKind kind, const optim::Optimizer& optimizer, json& group) {
  if (kind != OptimizerKind::kLbfgs) return;
  const LBFGS::History h = static_cast<const LBFGS&>(optimizer).history();
  group["history"] = {{"n_iter", h.n_iter}, {"func_evals", h.func_evals},
                      {"t", h.t},           {"prev_loss", h.prev_loss},
                      {"h_diag", h.h_diag}, {"ro", h.ro},
                      {"sy", h.sy},         {"yy", h.yy}};
}

void restore_optimizer_scalars(OptimizerKind kind, const json& group, optim::Optimizer& optimizer,
                               const std::string& where) {
  if (kind != OptimizerKind::kLbfgs) return;
  auto it = group.find("history");
  FSDP_CHECK(it != group.end() && it->is_object(), "checkpoint '", where,
             "': the fsdp::LBFGS history is missing; the manifest is damaged");
  const json& saved = *it;
  LBFGS::History h;
  try {
    h.n_iter = saved.at("n_iter").get<int64_t>();
    h.func_evals = saved.at("func_evals").get<int64_t>();
    h.t = saved.at("t").get<double>();
    h.prev_loss = saved.at("prev_loss").get<double>();
    h.h_diag = saved.at("h_diag").get<double>();
    h.ro = saved.at("ro").get<std::vector<double>>();
    h.sy = saved.at("sy").get<std::vector<std::vector<double>>>();
    h.yy = saved.at("yy").get<std::vector<std::vector<double>>>();
  } catch (const json::exception& e) {
    FSDP_FAIL("checkpoint '", where, "': the fsdp::LBFGS history is malformed (", e.what(),
              "); the manifest is damaged");
  }
  static_cast<LBFGS&>(optimizer).set_history(h);
}

std::map<const c10::TensorImpl*, int> groups_by_tensor(const torch::optim::Optimizer* optimizer) {
  std::map<const c10::TensorImpl*, int> out;
  if (!optimizer) return out;
  const auto& groups = optimizer->param_groups();
  for (size_t g = 0; g < groups.size(); ++g)
    for (const auto& p : groups[g].params()) out[p.unsafeGetTensorImpl()] = static_cast<int>(g);
  return out;
}

}  // namespace fsdp::checkpoint::detail
