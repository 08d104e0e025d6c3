#include "checkpoint/optimizer_options.h"

#include "fsdp/adafactor.h"
#include "fsdp/check.h"
#include "fsdp/lamb.h"
#include "fsdp/muon.h"

namespace fsdp::checkpoint::detail {

using nlohmann::json;
namespace optim = torch::optim;

namespace {

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

}  // namespace

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
    case OptimizerKind::kAdagrad: {
      const auto& o = static_cast<const optim::AdagradOptions&>(options);
      return {{"lr", o.lr()},
              {"lr_decay", o.lr_decay()},
              {"weight_decay", o.weight_decay()},
              {"initial_accumulator_value", o.initial_accumulator_value()},
              {"eps", o.eps()}};
    }
    case OptimizerKind::kRmsprop: {
      const auto& o = static_cast<const optim::RMSpropOptions&>(options);
      return {{"lr", o.lr()},
              {"alpha", o.alpha()},
              {"eps", o.eps()},
              {"weight_decay", o.weight_decay()},
              {"momentum", o.momentum()},
              {"centered", o.centered()}};
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
    case OptimizerKind::kAdagrad: {
      auto& o = static_cast<optim::AdagradOptions&>(options);
      o.lr(number(saved, "lr", where));
      o.lr_decay(number(saved, "lr_decay", where));
      o.weight_decay(number(saved, "weight_decay", where));
      o.initial_accumulator_value(number(saved, "initial_accumulator_value", where));
      o.eps(number(saved, "eps", where));
      break;
    }
    case OptimizerKind::kRmsprop: {
      auto& o = static_cast<optim::RMSpropOptions&>(options);
      o.lr(number(saved, "lr", where));
      o.alpha(number(saved, "alpha", where));
      o.eps(number(saved, "eps", where));
      o.weight_decay(number(saved, "weight_decay", where));
      o.momentum(number(saved, "momentum", where));
      o.centered(flag(saved, "centered", where));
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

}  // namespace fsdp::checkpoint::detail
