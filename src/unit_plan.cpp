#include "unit_plan.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "fsdp/check.h"
#include "fsdp/explicit_unit.h"

namespace fsdp {

namespace {

// One module of the tree, in pre-order.
struct Node {
  torch::nn::Module* module;
  std::string name;
  int parent;
  std::vector<int> children;
};

// The module tree in pre-order; a module registered twice is visited once.
std::vector<Node> module_tree(torch::nn::Module& root) {
  std::vector<Node> nodes;
  std::set<torch::nn::Module*> seen;
  std::function<void(torch::nn::Module&, const std::string&, int)> walk = [&](torch::nn::Module& m,
                                                                              const std::string& name, int parent) {
    const int i = static_cast<int>(nodes.size());
    seen.insert(&m);
    nodes.push_back({&m, name, parent, {}});
    if (parent >= 0) nodes[parent].children.push_back(i);
    for (const auto& kv : m.named_children()) {
      if (seen.count(kv.value().get())) continue;
      walk(*kv.value(), name.empty() ? kv.key() : name + "." + kv.key(), i);
    }
  };
  walk(root, "", -1);
  return nodes;
}

// Bottom-up: a module becomes a unit if annotated, an explicit unit, or the policy says so given
// the parameter elements of its subtree that no nested unit took (`counts`, where given, per node).
// The root always is one.
std::vector<char> choose_units(const std::vector<Node>& nodes, const std::vector<char>& ignored, const Options& options,
                               std::vector<int64_t>* counts = nullptr) {
  std::set<torch::nn::Module*> annotated;
  for (const auto& m : options.wrap_modules()) {
    const bool in_model =
        m && std::any_of(nodes.begin(), nodes.end(), [&](const Node& n) { return n.module == m.get(); });
    FSDP_CHECK(in_model, "Options::wrap_modules lists a module that is not part of the model");
    annotated.insert(m.get());
  }
  std::vector<char> is_unit(nodes.size(), 0);
  std::set<const c10::TensorImpl*> counted;
  std::function<int64_t(int)> decide = [&](int i) -> int64_t {
    if (ignored[i]) return 0;  // neither a unit nor counted by the policy
    int64_t unwrapped = 0;
    for (int c : nodes[i].children) unwrapped += decide(c);
    for (const auto& kv : nodes[i].module->named_parameters(/*recurse=*/false))
      if (counted.insert(kv.value().unsafeGetTensorImpl()).second) unwrapped += kv.value().numel();
    if (counts) (*counts)[i] = unwrapped;
    if (i == 0) {
      is_unit[i] = 1;
      return 0;
    }
    const bool policy =
        options.auto_wrap_policy() && options.auto_wrap_policy()(nodes[i].name, *nodes[i].module, unwrapped);
    const bool explicit_unit = dynamic_cast<const ExplicitUnit*>(nodes[i].module) != nullptr;
    if (policy || explicit_unit || annotated.count(nodes[i].module)) {
      is_unit[i] = 1;
      return 0;
    }
    return unwrapped;
  };
  decide(0);
  return is_unit;
}

}  // namespace

std::map<const torch::nn::Module*, int64_t> unwrapped_counts(torch::nn::Module& root, const WrapPolicy& policy) {
  const std::vector<Node> nodes = module_tree(root);
  std::vector<int64_t> counts(nodes.size(), 0);
  choose_units(nodes, std::vector<char>(nodes.size(), 0), Options().auto_wrap_policy(policy), &counts);
  std::map<const torch::nn::Module*, int64_t> out;
  for (size_t i = 0; i < nodes.size(); ++i) out[nodes[i].module] = counts[i];
  return out;
}

namespace {

std::string quoted(const std::string& name) { return name.empty() ? "the root module" : "'" + name + "'"; }

// Per node, whether it lies in an ignored module's subtree (Options::ignored_modules). Refuses an
// ignored module that is not in the model, the root, or one that is also made a unit.
std::vector<char> ignored_nodes(const std::vector<Node>& nodes, const Options& options) {
  std::vector<char> ignored(nodes.size(), 0);
  if (options.ignored_modules().empty()) return ignored;
  FSDP_CHECK(options.ignored_parameters().empty(),
             "Options: set ignored_modules or ignored_parameters, not both; list the modules' parameters in "
             "ignored_parameters instead");
  std::set<const torch::nn::Module*> annotated;
  for (const auto& m : options.wrap_modules()) annotated.insert(m.get());
  for (const auto& m : options.ignored_modules()) {
    FSDP_CHECK(m != nullptr, "Options::ignored_modules lists a null module");
    auto it = std::find_if(nodes.begin(), nodes.end(), [&](const Node& n) { return n.module == m.get(); });
    if (it == nodes.end()) {
      for (const Node& n : nodes) {
        const auto* unit = dynamic_cast<const ExplicitUnit*>(n.module);
        FSDP_CHECK(!unit || const_cast<ExplicitUnit*>(unit)->wrapped_module() != m.get(),
                   "Options::ignored_modules lists the module wrapped in fsdp::Sharded at ", quoted(n.name),
                   ", which makes it a unit; ignore it or make it a unit, not both (unwrap it to ignore it)");
      }
      FSDP_FAIL("Options::ignored_modules lists a module that is not part of the model");
    }
    const int i = static_cast<int>(it - nodes.begin());
    FSDP_CHECK(i != 0, "Options::ignored_modules lists the root module; FSDP needs the root (leave it out, or do not "
                       "call fully_shard)");
    FSDP_CHECK(!annotated.count(m.get()), "module ", quoted(nodes[i].name),
               " is in both Options::ignored_modules and Options::wrap_modules; ignore it or make it a unit, not both");
    std::function<void(int)> mark = [&](int k) {
      ignored[k] = 1;
      FSDP_CHECK(dynamic_cast<const ExplicitUnit*>(nodes[k].module) == nullptr, "module ", quoted(nodes[k].name),
                 " is an fsdp::Sharded unit inside ignored module ", quoted(nodes[i].name),
                 "; ignore it or make it a unit, not both");
      FSDP_CHECK(k == i || !annotated.count(nodes[k].module), "module ", quoted(nodes[k].name),
                 " is in Options::wrap_modules inside ignored module ", quoted(nodes[i].name),
                 "; ignore it or make it a unit, not both");
      for (int c : nodes[k].children) mark(c);
    };
    mark(i);
  }
  return ignored;
}

void check_parameter(const std::string& name, const at::Tensor& p, c10::Device device) {
  FSDP_CHECK(p.layout() == at::kStrided && !p.is_quantized(), "parameter '", name,
             "' is not a dense tensor; FSDP shards dense parameters only");
  FSDP_CHECK(!p.requires_grad() || p.is_floating_point() || p.is_complex(), "parameter '", name,
             "' requires grad but has dtype ", p.scalar_type());
  FSDP_CHECK(p.device() == device || p.is_meta(), "parameter '", name, "' is on ", p.device(),
             " but the process group's communicators move tensors of ", device,
             device.is_cpu() ? "; move the model to the CPU before fully_shard, or create the process group "
                               "with ProcessGroupOptions::device set to the model's CUDA device"
                             : "; move the model to that device (module->to(device)) before fully_shard");
}

}  // namespace

UnitPlan plan_units(torch::nn::Module& root, const Options& options, c10::Device device) {
  const std::vector<Node> nodes = module_tree(root);
  const std::vector<char> ignored = ignored_nodes(nodes, options);
  const std::vector<char> is_unit = choose_units(nodes, ignored, options);
  std::set<const c10::TensorImpl*> ignored_tensors;
  for (const auto& p : options.ignored_parameters()) {
    FSDP_CHECK(p.defined(), "Options::ignored_parameters lists an undefined tensor");
    ignored_tensors.insert(p.unsafeGetTensorImpl());
  }

  // Owning unit of every module: its nearest unit ancestor-or-self.
  std::vector<int> owner(nodes.size());
  std::vector<int> unit_node, unit_parent;  // per candidate unit
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (is_unit[i]) {
      owner[i] = static_cast<int>(unit_node.size());
      unit_parent.push_back(i == 0 ? -1 : owner[nodes[i].parent]);
      unit_node.push_back(static_cast<int>(i));
    } else {
      owner[i] = owner[nodes[i].parent];
    }
  }
  auto ancestors_or_self = [&](int u) {
    std::vector<int> chain;
    for (int v = u; v >= 0; v = unit_parent[v]) chain.push_back(v);
    return chain;
  };

  // Every distinct parameter goes to the unit owning the module(s) that register it; a parameter
  // registered in modules of several units goes to their lowest common ancestor unit.
  struct Seen {
    at::Tensor param;
    std::vector<int> units;
    std::vector<std::string> names;
    bool full_precision = false;
  };
  std::vector<Seen> seen;
  std::map<const c10::TensorImpl*, size_t> seen_index;
  UnitPlan plan;
  std::map<const c10::TensorImpl*, size_t> ignored_index;  // into plan.ignored_params
  for (size_t i = 0; i < nodes.size(); ++i) {
    const std::string prefix = nodes[i].name.empty() ? "" : nodes[i].name + ".";
    if (ignored[i])
      for (const auto& kv : nodes[i].module->named_buffers(/*recurse=*/false))
        plan.ignored_buffers.emplace_back(prefix + kv.key(), kv.value());
    for (const auto& kv : nodes[i].module->named_parameters(/*recurse=*/false)) {
      const std::string full = prefix + kv.key();
      const at::Tensor& p = kv.value();
      FSDP_CHECK(p.defined(), "parameter '", full, "' is undefined; register defined tensors only");
      if (ignored[i] || ignored_tensors.count(p.unsafeGetTensorImpl())) {
        auto [it, fresh] = ignored_index.emplace(p.unsafeGetTensorImpl(), plan.ignored_params.size());
        if (fresh)
          plan.ignored_params.push_back({full, {}, p, -1, false});
        else
          plan.ignored_params[it->second].aliases.push_back(full);
        continue;
      }
      auto [it, fresh] = seen_index.emplace(p.unsafeGetTensorImpl(), seen.size());
      if (fresh) seen.push_back({p, {}, {}});
      Seen& s = seen[it->second];
      s.names.push_back(full);
      s.full_precision = s.full_precision || options.mixed_precision().keeps_full_precision(*nodes[i].module);
      if (std::find(s.units.begin(), s.units.end(), owner[i]) == s.units.end()) s.units.push_back(owner[i]);
    }
  }
  for (const auto& t : options.ignored_parameters())
    FSDP_CHECK(ignored_index.count(t.unsafeGetTensorImpl()), "Options::ignored_parameters lists a tensor (shape ",
               t.sizes(), ") that is not a parameter of the model");
  for (const auto& s : seen) {  // a tensor both ignored and managed: tied across the boundary
    auto it = ignored_index.find(s.param.unsafeGetTensorImpl());
    FSDP_CHECK(it == ignored_index.end(), "parameter '", s.names[0], "' is the same tensor as ignored parameter '",
               plan.ignored_params[it->second].name, "' (tied); ignore both or neither");
  }
  for (auto& s : seen) {
    int unit = s.units[0];
    if (s.units.size() > 1) {
      std::ostringstream where;
      for (size_t k = 0; k < s.names.size(); ++k) where << (k ? ", " : "") << "'" << s.names[k] << "'";
      FSDP_CHECK(options.shared_parameters() != SharedParameterPolicy::kError, "parameter ", where.str(),
                 " is shared by modules of different FSDP units; set Options::shared_parameters(",
                 "SharedParameterPolicy::kLowestCommonAncestor) to place it in their common unit, or wrap the "
                 "modules that share it in one unit");
      std::vector<int> common = ancestors_or_self(s.units[0]);
      for (size_t k = 1; k < s.units.size(); ++k) {
        auto chain = ancestors_or_self(s.units[k]);
        common.erase(std::remove_if(common.begin(), common.end(),
                                    [&](int v) { return std::find(chain.begin(), chain.end(), v) == chain.end(); }),
                     common.end());
      }
      unit = common.front();  // nearest first: the lowest common ancestor
    }
    check_parameter(s.names[0], s.param, device);
    plan.params.push_back(
        {s.names[0], std::vector<std::string>(s.names.begin() + 1, s.names.end()), s.param, unit, s.full_precision});
  }

  // Units without parameters add nothing; drop them (their children move up), keeping the root.
  std::vector<int> count(unit_node.size(), 0);
  for (const auto& p : plan.params) count[p.unit]++;
  std::vector<int> new_index(unit_node.size(), -1);
  for (size_t u = 0; u < unit_node.size(); ++u) {
    if (u != 0 && count[u] == 0) continue;
    new_index[u] = static_cast<int>(plan.units.size());
    UnitPlan::Unit unit;
    unit.name = nodes[unit_node[u]].name;
    unit.module = nodes[unit_node[u]].module;
    int p = unit_parent[u];
    while (p > 0 && new_index[p] < 0) p = unit_parent[p];
    unit.parent = p < 0 ? -1 : new_index[p];
    plan.units.push_back(unit);
  }
  for (auto& p : plan.params) p.unit = new_index[p.unit];
  for (auto& unit : plan.units)
    for (int v = unit.parent; v >= 0; v = plan.units[v].parent) unit.ancestors.push_back(v);

  // FlatParameters: per unit, one per (dtype, requires_grad, full precision) group, in module order.
  for (size_t u = 0; u < plan.units.size(); ++u) {
    const size_t first = plan.flat_params.size();
    for (size_t i = 0; i < plan.params.size(); ++i) {
      const at::Tensor& p = plan.params[i].param;
      if (plan.params[i].unit != static_cast<int>(u)) continue;
      auto it =
          std::find_if(plan.flat_params.begin() + first, plan.flat_params.end(), [&](const UnitPlan::FlatParam& f) {
            const at::Tensor& q = plan.params[f.params[0]].param;
            return q.scalar_type() == p.scalar_type() && q.requires_grad() == p.requires_grad() &&
                   f.full_precision == plan.params[i].full_precision;
          });
      if (it == plan.flat_params.end()) {
        plan.flat_params.push_back({static_cast<int>(u), {}, plan.params[i].full_precision});
        it = plan.flat_params.end() - 1;
      }
      it->params.push_back(static_cast<int>(i));
    }
    for (size_t id = first; id < plan.flat_params.size(); ++id)
      plan.units[u].flat_params.push_back(static_cast<int>(id));
  }
  return plan;
}

std::string UnitPlan::describe() const {
  std::ostringstream d;
  for (const auto& p : params)
    d << p.name << " " << p.param.sizes() << " " << p.param.scalar_type() << (p.param.requires_grad() ? "" : " frozen")
      << (p.full_precision ? " full precision" : "") << " unit '" << units[p.unit].name << "'\n";
  for (const auto& p : ignored_params)
    d << p.name << " " << p.param.sizes() << " " << p.param.scalar_type() << (p.param.requires_grad() ? "" : " frozen")
      << " ignored\n";
  for (const auto& [name, b] : ignored_buffers) d << name << " " << b.sizes() << " " << b.scalar_type() << " ignored\n";
  return d.str();
}

bool reshards_after_forward(ShardingStrategy strategy) {
  return strategy == ShardingStrategy::kFullShard || strategy == ShardingStrategy::kHybridShard;
}

bool reshards_after_forward(const UnitPlan::Unit& unit, const Options& options) {
  if (unit.parent < 0) return false;
  c10::optional<bool> choice;
  if (options.reshard_after_forward_policy()) choice = options.reshard_after_forward_policy()(unit.name, *unit.module);
  return choice.value_or(reshards_after_forward(options.sharding_strategy()));
}

}  // namespace fsdp
