#include "model_setup.h"

#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "optimizer.h"

namespace fsdp_gpt {

void resolve_init(TrainConfig& config, int rank) {
  if (config.init == "deferred" && !fsdp::DeferredInit::supported()) {
    if (rank == 0) std::cerr << "fsdp_gpt: this LibTorch cannot defer initialization; building the model eagerly\n";
    config.init = "eager";
  }
}

BuiltModel build_model(const TrainConfig& config) {
  torch::manual_seed(config.seed);
  BuiltModel built;
  built.config.context = config.context;
  built.config.width = config.width;
  built.config.layers = config.layers;
  built.config.heads = config.heads;
  built.config.activation_checkpointing = config.activation_checkpointing;
  built.config.checkpointed_blocks = config.checkpointed_blocks;
  built.config.dropout = config.dropout;
  if (config.init == "deferred") {
    fsdp::DeferredInit deferred;  // no parameter memory until fully_shard materializes each unit
    built.model = gpt::GPT(built.config);
  } else {
    built.model = gpt::GPT(built.config);
  }
  built.parameter_count = gpt::count_parameters(*built.model);
  // Weight decay applies to matrices (weights, embeddings), not to biases or LayerNorm gains. The
  // shard pieces are 1-D, so remember each parameter's original rank by name.
  return built;
}

fsdp::Quantization quantization_flags(const TrainConfig& config, const std::string& dtype) {
  if (dtype == "none") return fsdp::Quantization();
  return fsdp::Quantization().enabled(true).dtype(fsdp::parse_quantized_dtype(dtype)).block_size(config.quantize_block);
}

fsdp::Quantization reduce_quantization_flags(const TrainConfig& config) {
  return quantization_flags(config, config.quantize_reduce)
      .error_feedback(config.quantize_reduce != "none" && config.quantize_error_feedback);
}

fsdp::ReshardPolicy reshard_policy(const TrainConfig& config) {
  if (config.reshard_after_forward == "strategy") return nullptr;
  const std::string choice = config.reshard_after_forward;
  const std::string last = "blocks." + std::to_string(config.layers - 1);
  return [choice, last](const std::string& name, const torch::nn::Module&) {
    return c10::optional<bool>(choice == "true" || (choice == "except-last" && name != last));
  };
}

std::shared_ptr<fsdp::FullyShardedModule> shard_model(BuiltModel& built, const TrainConfig& config,
                                                      fsdp::ProcessGroupPtr pg) {
  const gpt::GPTConfig model_config = built.config;
  auto options = fsdp::Options()
                     .sharding_strategy(fsdp::parse_sharding_strategy(config.strategy))
                     .sharding_factor(config.sharding_factor)
                     .backward_prefetch(fsdp::parse_backward_prefetch(config.backward_prefetch))
                     .forward_prefetch(config.forward_prefetch)
                     .limit_all_gathers(config.all_gather_limit > 0)
                     .all_gather_limit(std::max(1, config.all_gather_limit))
                     .deterministic(config.deterministic)
                     .trace(config.measure_exposed_comm)
                     .param_init_fn([model_config](const std::string& name, torch::nn::Module& module) {
                       gpt::initialize(model_config, name, module);
                     });
  if (config.wrap == "block") options.auto_wrap_policy(fsdp::wrap::by_type<gpt::BlockImpl>());
  if (config.mixed_precision != "none")
    options.mixed_precision(fsdp::MixedPrecision()
                                .param_dtype(config.mixed_precision == "bf16" ? torch::kBFloat16 : torch::kFloat16)
                                .reduce_dtype(torch::kFloat32));
  options.reshard_after_forward_policy(reshard_policy(config));
  options.reshard_after_forward_size(config.reshard_after_forward_size);
  options.all_gather_quantization(quantization_flags(config, config.quantize_all_gather));
  options.reduce_quantization(reduce_quantization_flags(config));
  return fsdp::fully_shard(built.model, std::move(pg), options);
}

std::unique_ptr<torch::optim::Optimizer> build_optimizer(fsdp::FullyShardedModule& sharded, const TrainConfig& config) {
  // The pieces are 1-D; their parameters' shapes decide the weight decay.
  std::vector<std::pair<std::string, torch::Tensor>> pieces;
  std::map<std::string, int64_t> dims;
  for (const auto& p : sharded.shard_pieces()) {
    pieces.emplace_back(p.name, p.piece);
    dims[p.name] = static_cast<int64_t>(p.shape.size());
  }
  if (config.optimizer != "adamw")
    return gpt::make_whole_param_optimizer(config.optimizer, sharded, dims, config.lr, config.weight_decay);
  auto optimizer = gpt::make_adamw(pieces, dims, config.lr, config.weight_decay, config.fused_adamw);
  sharded.check_optimizer(*optimizer);
  return optimizer;
}

}  // namespace fsdp_gpt
