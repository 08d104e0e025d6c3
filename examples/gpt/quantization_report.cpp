#include "quantization_report.h"

#include <c10/util/irange.h>

#include <cmath>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "data.h"
#include "evaluation.h"
#include "training_data.h"

namespace fsdp_gpt {

namespace {

// A copy of the trained model whose collectives quantize as `gather` and `reduce` say ("none",
// "int8", "fp8") with `block` values per scale.
struct Copy {
  BuiltModel built;
  std::shared_ptr<fsdp::FullyShardedModule> sharded;
};

Copy make_copy(const TrainConfig& config, const fsdp::ProcessGroupPtr& pg,
               const std::unordered_map<std::string, at::Tensor>& weights, const std::string& gather,
               const std::string& reduce, int block) {
  TrainConfig c = config;
  c.quantize_all_gather = gather;
  c.quantize_reduce = reduce;
  c.quantize_block = block;
  c.quantize_error_feedback = false;
  c.deterministic = false;  // deterministic training excludes quantized communication
  c.measure_exposed_comm = false;
  Copy copy;
  copy.built = build_model(c);
  copy.sharded = shard_model(copy.built, c, pg);
  copy.sharded->load_full_state_dict(weights);
  return copy;
}

// The model's parameters by name, each tensor once (the tied head's weight under its first name).
std::vector<std::pair<std::string, at::Tensor>> distinct_parameters(torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_set<const void*> seen;
  for (const auto& p : model.named_parameters())
    if (seen.insert(p.value().unsafeGetTensorImpl()).second) out.emplace_back(p.key(), p.value());
  return out;
}

// Sums of squares per parameter name: [2 i] of the difference, [2 i + 1] of the reference.
using SquareSums = std::vector<double>;

// The unsharded parameters as the copy's gathers deliver them (values valid until its reshard()).
std::unordered_map<std::string, at::Tensor> gathered(Copy& copy) {
  copy.sharded->unshard().wait();
  std::unordered_map<std::string, at::Tensor> out;
  for (const auto& [name, value] : distinct_parameters(*copy.built.model)) out.emplace(name, value.detach());
  return out;
}

SquareSums gather_error(Copy& quantized, const std::unordered_map<std::string, at::Tensor>& reference,
                        const std::vector<std::string>& names) {
  const auto values = gathered(quantized);
  SquareSums sums(2 * names.size(), 0.0);
  for (const auto i : c10::irange(names.size())) {
    const at::Tensor exact = reference.at(names[i]).to(at::kDouble), got = values.at(names[i]).to(at::kDouble);
    sums[2 * i] = (got - exact).pow(2).sum().item<double>();
    sums[2 * i + 1] = exact.pow(2).sum().item<double>();
  }
  quantized.sharded->reshard();
  return sums;
}

// This rank's gradient pieces after one forward and backward of `batch`, by parameter name.
std::vector<std::pair<std::string, at::Tensor>> gradient_pieces(Copy& copy, const gpt::Batch& batch) {
  next_token_loss(copy.built.model, batch).backward();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& piece : copy.sharded->shard_pieces())
    if (piece.piece.grad().defined()) out.emplace_back(piece.name, piece.piece.grad().to(at::kDouble));
  return out;
}

// Collective: the sums of squares over every rank's pieces.
SquareSums reduce_error(const std::vector<std::pair<std::string, at::Tensor>>& got,
                        const std::vector<std::pair<std::string, at::Tensor>>& exact,
                        const std::vector<std::string>& names, fsdp::ProcessGroup& pg) {
  std::unordered_map<std::string, size_t> index;
  for (const auto i : c10::irange(names.size())) index.emplace(names[i], i);
  auto sums = torch::zeros({static_cast<int64_t>(2 * names.size())}, torch::kDouble);
  auto* s = sums.data_ptr<double>();
  FSDP_CHECK(got.size() == exact.size(), "quantization report: the copies hold different gradient pieces");
  for (const auto k : c10::irange(got.size())) {
    const size_t i = index.at(exact[k].first);
    s[2 * i] += (got[k].second - exact[k].second).pow(2).sum().item<double>();
    s[2 * i + 1] += exact[k].second.pow(2).sum().item<double>();
  }
  if (pg.size() > 1) pg.world()->all_reduce(sums)->wait();
  return SquareSums(s, s + sums.numel());
}

std::string relative(double difference, double reference) {
  if (reference <= 0) return difference > 0 ? "inf" : "0";
  std::ostringstream o;
  o << std::scientific << std::setprecision(2) << std::sqrt(difference / reference);
  return o.str();
}

// One table: a row per parameter, a column per block size, and a row over every quantized one.
void print_table(const std::string& title, const std::vector<std::string>& names, const std::vector<bool>& quantized,
                 const std::vector<int>& blocks, const std::vector<SquareSums>& sums) {
  std::cout << "\n" << title << "\n\n| parameter |";
  for (const int b : blocks) std::cout << " block " << b << " |";
  std::cout << "\n| --- |";
  for (size_t b = 0; b < blocks.size(); ++b) std::cout << " ---: |";
  std::cout << "\n";
  for (const auto i : c10::irange(names.size())) {
    std::cout << "| " << names[i] << " |";
    for (const auto& s : sums)
      std::cout << " " << (quantized[i] ? relative(s[2 * i], s[2 * i + 1]) : "not quantized") << " |";
    std::cout << "\n";
  }
  std::cout << "| all quantized parameters |";
  for (const auto& s : sums) {
    double difference = 0, reference = 0;
    bool any = false;
    for (const auto i : c10::irange(names.size()))
      if (quantized[i]) difference += s[2 * i], reference += s[2 * i + 1], any = true;
    std::cout << " " << (any ? relative(difference, reference) : "none") << " |";
  }
  std::cout << "\n" << std::flush;
}

// Whether each parameter's unit quantizes its all-gathers (`gathers`) or its reductions
// (UnitInfo: NO_SHARD gathers nothing, the trainer leaves the root unquantized).
std::vector<bool> quantized_parameters(const fsdp::FullyShardedModule& sharded, const std::vector<std::string>& names,
                                       bool gathers) {
  std::unordered_map<std::string, bool> quantized_of;
  for (const auto& unit : sharded.units())
    for (const auto& p : unit.parameters)
      quantized_of[p] = gathers ? unit.quantized_gathers : unit.quantized_reductions;
  std::vector<bool> out;
  for (const auto& name : names) {
    const auto it = quantized_of.find(name);
    out.push_back(it != quantized_of.end() && it->second);
  }
  return out;
}

}  // namespace

void report_quantization_error(const TrainConfig& config, fsdp::FullyShardedModule& trained,
                               const fsdp::ProcessGroupPtr& pg, const torch::Tensor& train_tokens, bool is_main) {
  const auto weights = trained.full_state_dict();
  Copy plain = make_copy(config, pg, weights, "none", "none", config.quantize_block);
  std::vector<std::string> names;
  for (const auto& p : distinct_parameters(*plain.built.model)) names.push_back(p.first);

  // One micro-batch per rank, drawn after the training's last step.
  const BatchPlan& plan = config.batch;
  const int64_t world = pg->size(), rows = plan.micro;
  const auto batch =
      gpt::sample_batch(train_tokens, config.context, gpt::batch_key(config.seed, kTrainStream, config.steps + 1),
                        world * rows, pg->rank() * rows, rows);
  const auto reference_gradients = gradient_pieces(plain, batch);
  const auto reference_values = gathered(plain);

  std::vector<std::string> dtypes{"int8"};
  if (fsdp::has_float8()) dtypes.emplace_back("fp8");
  for (const auto& dtype : dtypes) {
    std::vector<SquareSums> gathers, reductions;
    std::vector<bool> gathered_quantized, reduced_quantized;
    for (const int block : config.quantization_report) {
      Copy gathering = make_copy(config, pg, weights, dtype, "none", block);
      gathers.push_back(gather_error(gathering, reference_values, names));
      gathered_quantized = quantized_parameters(*gathering.sharded, names, /*gathers=*/true);
      Copy reducing = make_copy(config, pg, weights, "none", dtype, block);
      reductions.push_back(reduce_error(gradient_pieces(reducing, batch), reference_gradients, names, *pg));
      reduced_quantized = quantized_parameters(*reducing.sharded, names, /*gathers=*/false);
    }
    if (!is_main) continue;
    print_table(
        "quantization error, " + dtype + " all-gathers: ||gathered - unquantized|| / ||unquantized|| per parameter",
        names, gathered_quantized, config.quantization_report, gathers);
    print_table("quantization error, " + dtype +
                    " reductions: ||reduced gradient - unquantized|| / ||unquantized|| per "
                    "parameter (one micro-batch of " +
                    std::to_string(rows) + " per rank)",
                names, reduced_quantized, config.quantization_report, reductions);
  }
  plain.sharded->reshard();
}

}  // namespace fsdp_gpt
