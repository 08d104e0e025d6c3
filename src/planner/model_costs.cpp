// The planner's shape pass (model_costs.h).
#include "planner/model_costs.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/activation_checkpoint.h"
#include "fsdp/check.h"
#include "planner/op_trace.h"
#include "planner/parameter_elements.h"

namespace fsdp::planner {
namespace {

struct OwnCost {
  double flops = 0;
  double values = 0;
  double input = 0;  // values per token of the module's input (0: unknown)
};

// The rules: a Linear keeps its input and multiplies it by its weight; an Embedding looks up rows
// (indices kept, no products); a LayerNorm keeps its input and two statistics; any other module's
// matrix (a parameter of 2 or more dimensions) multiplies every token by it and keeps that input.
OwnCost own_cost(const torch::nn::Module& m) {
  OwnCost c;
  if (const auto* linear = dynamic_cast<const torch::nn::LinearImpl*>(&m)) {
    const double in = static_cast<double>(linear->options.in_features());
    c.flops = 2.0 * in * static_cast<double>(linear->options.out_features());
    c.values = c.input = in;
    return c;
  }
  if (dynamic_cast<const torch::nn::EmbeddingImpl*>(&m) != nullptr) return c;
  if (const auto* norm = dynamic_cast<const torch::nn::LayerNormImpl*>(&m)) {
    double n = 1;
    for (const int64_t d : norm->options.normalized_shape()) n *= static_cast<double>(d);
    c.values = n + 2;
    c.input = n;
    return c;
  }
  for (const auto& p : m.named_parameters(/*recurse=*/false)) {
    const at::Tensor& t = p.value();
    if (t.dim() < 2) continue;
    c.flops += 2.0 * static_cast<double>(t.numel());
    c.values += static_cast<double>(t.size(-1));
    if (c.input == 0) c.input = static_cast<double>(t.size(-1));
  }
  return c;
}

// Whether module_cost counts anything for a module.
bool counts(const ModuleCost& c) { return c.forward_flops != 0 || c.activation_values != 0 || c.activation_bytes != 0; }

// Whether the rules above miscount `m`: a LibTorch module whose products run over more than one
// position per token (convolutions), over time steps (recurrent layers) or between tokens
// (attention), or that keeps values without a matrix (batch, instance and group normalization); or
// any module with a parameter of more than two dimensions, which no plain matrix product uses.
bool rules_miscount(const torch::nn::Module& m) {
  namespace nn = torch::nn;
  const bool known = dynamic_cast<const nn::Conv1dImpl*>(&m) || dynamic_cast<const nn::Conv2dImpl*>(&m) ||
                     dynamic_cast<const nn::Conv3dImpl*>(&m) || dynamic_cast<const nn::ConvTranspose1dImpl*>(&m) ||
                     dynamic_cast<const nn::ConvTranspose2dImpl*>(&m) ||
                     dynamic_cast<const nn::ConvTranspose3dImpl*>(&m) || dynamic_cast<const nn::RNNImpl*>(&m) ||
                     dynamic_cast<const nn::LSTMImpl*>(&m) || dynamic_cast<const nn::GRUImpl*>(&m) ||
                     dynamic_cast<const nn::RNNCellImpl*>(&m) || dynamic_cast<const nn::LSTMCellImpl*>(&m) ||
                     dynamic_cast<const nn::GRUCellImpl*>(&m) || dynamic_cast<const nn::MultiheadAttentionImpl*>(&m) ||
                     dynamic_cast<const nn::BatchNorm1dImpl*>(&m) || dynamic_cast<const nn::BatchNorm2dImpl*>(&m) ||
                     dynamic_cast<const nn::BatchNorm3dImpl*>(&m) || dynamic_cast<const nn::InstanceNorm1dImpl*>(&m) ||
                     dynamic_cast<const nn::InstanceNorm2dImpl*>(&m) ||
                     dynamic_cast<const nn::InstanceNorm3dImpl*>(&m) || dynamic_cast<const nn::GroupNormImpl*>(&m) ||
                     dynamic_cast<const nn::BilinearImpl*>(&m);
  if (known) return true;
  for (const auto& p : m.named_parameters(/*recurse=*/false))
    if (p.value().dim() > 2) return true;
  return false;
}

// The unit a module's own tensors belong to: the nearest enclosing unit by qualified name.
int unit_of(const std::string& name, const std::map<std::string, int>& unit_by_name) {
  std::string n = name;
  while (true) {
    auto it = unit_by_name.find(n);
    if (it != unit_by_name.end()) return it->second;
    const auto dot = n.rfind('.');
    if (dot == std::string::npos) return 0;
    n = n.substr(0, dot);
  }
}

// Whether `name` is `scope` or lies inside it.
bool within(const std::string& name, const std::string& scope) {
  return name == scope || scope.empty() ||
         (name.size() > scope.size() && name.compare(0, scope.size(), scope) == 0 && name[scope.size()] == '.');
}

// Accumulates module costs in forward order into per-unit figures and segments.
class CostBuilder {
 public:
  CostBuilder(torch::nn::Module& root, const UnitPlan& units) : units_(units) {
    for (size_t u = 0; u < units.units.size(); ++u) {
      unit_by_name_[units.units[u].name] = static_cast<int>(u);
      const auto& flats = units.units[u].flat_params;
      for (size_t k = 0; k < flats.size(); ++k)
        for (const int p : units.flat_params[flats[k]].params)
          flat_of_.emplace(storage_key(units.params[p].param), std::pair{static_cast<int>(u), static_cast<int>(k)});
    }
    costs_.unit_activation_values.assign(units.units.size(), 0.0);
    costs_.unit_activation_fixed_bytes.assign(units.units.size(), 0.0);
    costs_.unit_input_values.assign(units.units.size(), 0.0);
    for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/true))
      if (dynamic_cast<const CheckpointedBase*>(item.value().get()) != nullptr) checkpointed_.push_back(item.key());
  }

  void add(const std::string& module, double flops, double values, double input, bool reads_params, bool grads_arrive,
           bool backward_reads, double fixed_bytes, const std::vector<const void*>& arriving) {
    int u = unit_of(module, unit_by_name_);
    // A unit without parameters is never entered by the runtime: its work runs in the enclosing one.
    while (u != 0 && units_.units[u].flat_params.empty()) u = units_.units[u].parent;
    if (costs_.unit_input_values[u] == 0) costs_.unit_input_values[u] = input;
    costs_.unit_activation_values[u] += values;
    costs_.unit_activation_fixed_bytes[u] += fixed_bytes;
    costs_.forward_flops += flops;
    for (const std::string& scope : checkpointed_)
      if (within(module, scope)) {
        costs_.checkpointed_forward_flops += flops;
        break;
      }
    if (costs_.segments.empty() || costs_.segments.back().unit != u) {
      costs_.segments.emplace_back();
      costs_.segments.back().unit = u;
    }
    costs_.segments.back().forward_flops += flops;
    costs_.segments.back().activation_values += values;
    costs_.segments.back().activation_fixed_bytes += fixed_bytes;
    costs_.segments.back().reads_params = costs_.segments.back().reads_params || reads_params;
    costs_.segments.back().grads_arrive = costs_.segments.back().grads_arrive || grads_arrive;
    costs_.segments.back().backward_reads = costs_.segments.back().backward_reads || backward_reads;
    std::vector<int>& flats = costs_.segments.back().arriving_flats;
    for (const void* key : arriving)
      if (const auto it = flat_of_.find(key); it != flat_of_.end() && it->second.first == u &&
                                              units_.units[u].flat_params.size() > 1 &&
                                              std::find(flats.begin(), flats.end(), it->second.second) == flats.end())
        flats.push_back(it->second.second);
  }

  ModelCosts take() {
    std::vector<char> seen(units_.units.size(), 0);
    auto add = [&](int u) {
      if (u != 0 && costs_.unit_input_values[u] > 0 && !seen[u]) costs_.checkpointable_units.push_back(u);
      seen[u] = 1;
    };
    for (const SegmentCost& s : costs_.segments) add(s.unit);
    for (size_t u = 0; u < units_.units.size(); ++u) add(static_cast<int>(u));  // units no stretch enters
    return std::move(costs_);
  }

 private:
  const UnitPlan& units_;
  std::map<std::string, int> unit_by_name_;
  std::map<const void*, std::pair<int, int>> flat_of_;  // parameter storage -> its unit, its FlatParameter there
  std::vector<std::string> checkpointed_;               // the names of the model's checkpointing wrappers
  ModelCosts costs_;
};

}  // namespace

ModelCosts model_costs(torch::nn::Module& root, const UnitPlan& units, const ModuleCostFn& extra, int64_t seq_len) {
  CostBuilder builder(root, units);
  std::set<const void*> seen;
  std::set<const void*> managed;  // the parameters units hold
  for (const UnitPlan::Param& p : units.params) managed.insert(p.param.unsafeGetTensorImpl());
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    const torch::nn::Module& m = *item.value();
    OwnCost c = own_cost(m);
    double fixed_bytes = 0;
    if (extra) {
      const ModuleCost more = extra(item.key(), m, seq_len);
      FSDP_CHECK(more.forward_flops >= 0 && more.activation_values >= 0 && more.activation_bytes >= 0,
                 "PlanRequest::module_cost gave a negative cost for ", item.key().empty() ? "the root" : item.key(),
                 "; give 0 or more FLOPs, values and bytes");
      if (counts(more) && rules_miscount(m)) {
        c.flops = c.values = 0;  // module_cost counts what the rules would miscount
      }
      c.flops += more.forward_flops;
      c.values += more.activation_values;
      fixed_bytes = more.activation_bytes;
    }
    // A module with parameters marks where its unit runs even when it costs nothing by the rules.
    if (c.flops == 0 && c.values == 0 && fixed_bytes == 0 && m.named_parameters(/*recurse=*/false).is_empty()) continue;
    // Its backward reads its unit's parameters but biases (which only receive the gradient's sums)
    // and an embedding's table (whose gradient is scattered from the indices).
    const bool embedding = dynamic_cast<const torch::nn::EmbeddingImpl*>(&m) != nullptr ||
                           dynamic_cast<const torch::nn::EmbeddingBagImpl*>(&m) != nullptr;
    bool arrive = false;  // a parameter requiring grad that no earlier module holds (a tied one's first use)
    bool reads = false, backward_reads = false;
    std::vector<const void*> arriving;
    for (const auto& p : m.named_parameters(/*recurse=*/false)) {
      if (managed.count(p.value().unsafeGetTensorImpl()) == 0) continue;  // ignored: no unit's
      reads = true;
      const std::string& name = p.key();
      const bool bias = name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0;
      backward_reads = backward_reads || (!bias && !embedding);
      if (p.value().requires_grad() && seen.insert(p.value().unsafeGetTensorImpl()).second) {
        arrive = true;
        arriving.push_back(storage_key(p.value()));
      }
    }
    builder.add(item.key(), c.flops, c.values, c.input, reads, arrive, backward_reads, fixed_bytes, arriving);
  }
  return builder.take();
}

std::vector<std::string> miscounted_modules(torch::nn::Module& root, const ModuleCostFn& extra, int64_t seq_len) {
  std::vector<std::string> out;
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    const torch::nn::Module& m = *item.value();
    if (!rules_miscount(m)) continue;
    if (extra) {
      const ModuleCost more = extra(item.key(), m, seq_len);
      if (counts(more)) continue;
    }
    out.push_back((item.key().empty() ? std::string("the root") : item.key()) + " (" + m.name() + ")");
  }
  return out;
}

RepeatedBlock repeated_block(torch::nn::Module& root) {
  auto numel = [](const torch::nn::Module& m) {  // a tied parameter once
    return static_cast<double>(parameter_elements(m));
  };
  const double total = numel(root);
  std::map<std::string, RepeatedBlock> by_type;
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    std::string type = item.value()->name();  // LibTorch's own modules name their holder, not the class
    if (type.rfind("torch::nn::", 0) == 0 && (type.size() < 4 || type.compare(type.size() - 4, 4, "Impl") != 0))
      type += "Impl";
    RepeatedBlock& b = by_type[type];
    b.type = type;
    ++b.count;
    b.share += total > 0 ? numel(*item.value()) / total : 0;
  }
  RepeatedBlock best;
  for (const auto& [type, b] : by_type) {
    if (b.count < 2 || b.share < 0.5) continue;
    if (best.count == 0 || b.count < best.count || (b.count == best.count && b.share > best.share)) best = b;
  }
  return best;
}

ModelCosts model_costs(torch::nn::Module& root, const UnitPlan& units, const std::vector<TracedSegment>& traced) {
  CostBuilder builder(root, units);
  for (const TracedSegment& s : traced)
    builder.add(s.module, s.forward_flops, s.activation_values, s.input_values, s.reads_params, s.grads_arrive,
                s.backward_reads, s.activation_fixed_bytes, s.arriving);
  return builder.take();
}

}  // namespace fsdp::planner
