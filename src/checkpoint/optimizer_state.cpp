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

template <class Options>
json adam_options(const Options& o) {
  return {{"lr", o.lr()},
          {"betas", {std::get<0>(o.betas()), std::get<1>(o.betas())}},
          {"eps", o.eps()},
          {"weight_decay", o.weight_decay()},
          {"amsgrad", o.amsgrad()}};
}

double number(const json& saved, const char* key, const std::string& where) {
  auto it = saved.find(key);
  FSDP_CHECK(it != saved.end() && it->is_number(), "checkpoint '", where, "': optimizer option '", key,
             "' is missing or not a number; the manifest is damaged");
  return it->get<double>();
}

bool flag(const json& saved, const char* key, const std::string& where) {
  auto it = saved.find(key);
  FSDP_CHECK(it != saved.end() && it->is_boolean(), "checkpoint '", where, "': optimizer option '", key,
             "' is missing or not a boolean; the manifest is damaged");
  return it->get<bool>();
}

template <class Options>
void restore_adam(const json& saved, Options& o, const std::string& where) {
  auto betas = saved.find("betas");
  FSDP_CHECK(betas != saved.end() && betas->is_array() && betas->size() == 2 && (*betas)[0].is_number() &&
                 (*betas)[1].is_number(),
             "checkpoint '", where,
             "': optimizer option 'betas' is missing or not two numbers; the manifest is damaged");
  o.lr(number(saved, "lr", where));
  o.betas(std::make_tuple((*betas)[0].get<double>(), (*betas)[1].get<double>()));
  o.eps(number(saved, "eps", where));
  o.weight_decay(number(saved, "weight_decay", where));
  o.amsgrad(flag(saved, "amsgrad", where));
}

json muon_options(const MuonOptions& o) {
  const MuonAdamW& a = o.adamw();
  return {{"lr", o.lr()},
          {"momentum", o.momentum()},
          {"nesterov", o.nesterov()},
          {"ns_steps", o.ns_steps()},
          {"ns_bfloat16", o.ns_bfloat16()},
          {"weight_decay", o.weight_decay()},
          {"use_muon", o.use_muon()},
          {"adamw_lr", a.lr()},
          {"adamw_betas", {std::get<0>(a.betas()), std::get<1>(a.betas())}},
          {"adamw_eps", a.eps()},
          {"adamw_weight_decay", a.weight_decay()}};
}

std::tuple<double, double> betas_of(const json& saved, const std::string& where, const char* key = "betas") {
  auto betas = saved.find(key);
  FSDP_CHECK(betas != saved.end() && betas->is_array() && betas->size() == 2 && (*betas)[0].is_number() &&
                 (*betas)[1].is_number(),
             "checkpoint '", where, "': optimizer option '", key,
             "' is missing or not two numbers; the manifest is damaged");
  return std::make_tuple((*betas)[0].get<double>(), (*betas)[1].get<double>());
}

// Which parameters are Muon's matrices is the optimizer's structure, fixed when it was built (their
// state differs): it must match the saved one; the rest is restored, and Muon plans again from it
// (Muon::after_load). A checkpoint without ns_bfloat16 leaves the built value.
void restore_muon(const json& saved, MuonOptions& o, const std::string& where) {
  FSDP_CHECK(flag(saved, "use_muon", where) == o.use_muon(), "checkpoint '", where,
             "': a Muon group was saved with use_muon ", flag(saved, "use_muon", where),
             ", but is built with use_muon ", o.use_muon(), "; build the optimizer's groups as when it was saved");
  o.ns_steps(static_cast<int>(number(saved, "ns_steps", where)));
  if (saved.contains("ns_bfloat16")) o.ns_bfloat16(flag(saved, "ns_bfloat16", where));
  o.lr(number(saved, "lr", where));
  o.momentum(number(saved, "momentum", where));
  o.nesterov(flag(saved, "nesterov", where));
  o.weight_decay(number(saved, "weight_decay", where));
  o.adamw(MuonAdamW(number(saved, "adamw_lr", where))
              .betas(betas_of(saved, where, "adamw_betas"))
              .eps(number(saved, "adamw_eps", where))
              .weight_decay(number(saved, "adamw_weight_decay", where)));
}

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
  FSDP_FAIL("checkpoints carry the state of torch::optim::AdamW (and fsdp::FusedAdamW), Adam, SGD, fsdp::Lamb, "
            "fsdp::Muon, fsdp::Adafactor and fsdp::LBFGS only; save this optimizer's state yourself, or pass no "
            "optimizer to save the model alone");
}

std::string to_string(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kNone: return "none";
    case OptimizerKind::kAdamW: return "adamw";
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kSgd: return "sgd";
    case OptimizerKind::kLamb: return "lamb";
    case OptimizerKind::kMuon: return "muon";
    case OptimizerKind::kAdafactor: return "adafactor";
    case OptimizerKind::kLbfgs: return "lbfgs";
  }
  return "none";
}

json group_options(OptimizerKind kind, const optim::OptimizerOptions& options) {
  switch (kind) {
    case OptimizerKind::kAdamW: return adam_options(static_cast<const optim::AdamWOptions&>(options));
    case OptimizerKind::kAdam: return adam_options(static_cast<const optim::AdamOptions&>(options));
    case OptimizerKind::kLamb: {
      const auto& o = static_cast<const LambOptions&>(options);
      return {{"lr", o.lr()},
              {"betas", {std::get<0>(o.betas()), std::get<1>(o.betas())}},
              {"eps", o.eps()},
              {"weight_decay", o.weight_decay()}};
    }
    case OptimizerKind::kMuon: return muon_options(static_cast<const MuonOptions&>(options));
    case OptimizerKind::kAdafactor: {
      const auto& o = static_cast<const AdafactorOptions&>(options);
      return {{"lr", o.lr()},
              {"eps1", o.eps1()},
              {"eps2", o.eps2()},
              {"clip_threshold", o.clip_threshold()},
              {"decay_rate", o.decay_rate()},
              {"beta1", o.beta1()},
              {"weight_decay", o.weight_decay()},
              {"scale_parameter", o.scale_parameter()},
              {"relative_step", o.relative_step()},
              {"warmup_init", o.warmup_init()}};
    }
    case OptimizerKind::kLbfgs: {
      const auto& o = static_cast<const optim::LBFGSOptions&>(options);
      json out{{"lr", o.lr()},
               {"max_iter", o.max_iter()},
               {"tolerance_grad", o.tolerance_grad()},
               {"tolerance_change", o.tolerance_change()},
               {"history_size", o.history_size()}};
      if (o.max_eval()) out["max_eval"] = *o.max_eval();
      if (o.line_search_fn()) out["line_search_fn"] = *o.line_search_fn();
      return out;
    }
    case OptimizerKind::kSgd: {
      const auto& o = static_cast<const optim::SGDOptions&>(options);
      return {{"lr", o.lr()},
              {"momentum", o.momentum()},
              {"dampening", o.dampening()},
              {"weight_decay", o.weight_decay()},
              {"nesterov", o.nesterov()}};
    }
    case OptimizerKind::kNone: break;
  }
  return json::object();
}

void restore_group_options(OptimizerKind kind, const json& saved, optim::OptimizerOptions& options,
                           const std::string& where) {
  switch (kind) {
    case OptimizerKind::kAdamW: restore_adam(saved, static_cast<optim::AdamWOptions&>(options), where); break;
    case OptimizerKind::kAdam: restore_adam(saved, static_cast<optim::AdamOptions&>(options), where); break;
    case OptimizerKind::kLamb: {
      auto& o = static_cast<LambOptions&>(options);
      o.lr(number(saved, "lr", where));
      o.betas(betas_of(saved, where));
      o.eps(number(saved, "eps", where));
      o.weight_decay(number(saved, "weight_decay", where));
      break;
    }
    case OptimizerKind::kMuon: restore_muon(saved, static_cast<MuonOptions&>(options), where); break;
    case OptimizerKind::kAdafactor: {
      auto& o = static_cast<AdafactorOptions&>(options);
      o.lr(number(saved, "lr", where));
      o.eps1(number(saved, "eps1", where));
      o.eps2(number(saved, "eps2", where));
      o.clip_threshold(number(saved, "clip_threshold", where));
      o.decay_rate(number(saved, "decay_rate", where));
      o.beta1(number(saved, "beta1", where));
      o.weight_decay(number(saved, "weight_decay", where));
      o.scale_parameter(flag(saved, "scale_parameter", where));
      o.relative_step(flag(saved, "relative_step", where));
      o.warmup_init(flag(saved, "warmup_init", where));
      break;
    }
    case OptimizerKind::kLbfgs: {
      // The history's size is the optimizer's structure: the saved history must fit it.
      auto& o = static_cast<optim::LBFGSOptions&>(options);
      FSDP_CHECK(number(saved, "history_size", where) == static_cast<double>(o.history_size()), "checkpoint '", where,
                 "': fsdp::LBFGS was saved with history_size ", number(saved, "history_size", where),
                 ", but is built with ", o.history_size(), "; build it with the saved history_size");
      o.lr(number(saved, "lr", where));
      o.max_iter(static_cast<int64_t>(number(saved, "max_iter", where)));
      o.tolerance_grad(number(saved, "tolerance_grad", where));
      o.tolerance_change(number(saved, "tolerance_change", where));
      if (saved.contains("max_eval")) o.max_eval(static_cast<int64_t>(number(saved, "max_eval", where)));
      auto fn = saved.find("line_search_fn");
      if (fn == saved.end()) {
        o.line_search_fn(c10::nullopt);
      } else {
        FSDP_CHECK(fn->is_string() && fn->get<std::string>() == "strong_wolfe", "checkpoint '", where,
                   "': optimizer option 'line_search_fn' is not \"strong_wolfe\"; the manifest is damaged");
        o.line_search_fn(fn->get<std::string>());
      }
      break;
    }
    case OptimizerKind::kSgd: {
      auto& o = static_cast<optim::SGDOptions&>(options);
      o.lr(number(saved, "lr", where));
      o.momentum(number(saved, "momentum", where));
      o.dampening(number(saved, "dampening", where));
      o.weight_decay(number(saved, "weight_decay", where));
      o.nesterov(flag(saved, "nesterov", where));
      break;
    }
    case OptimizerKind::kNone: break;
  }
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
