// The planner trace's keep table (keep_table.h).
#include "planner/keep_table.h"

#include <torch/version.h>

#include <unordered_map>

namespace fsdp::planner {
namespace {

const std::unordered_map<std::string_view, KeepRule>& keep_rules() {
  static const std::unordered_map<std::string_view, KeepRule> rules = [] {
    std::unordered_map<std::string_view, KeepRule> r;
    for (const char* op : {"convolution",
                           "_convolution",
                           "pow",
                           "gelu",
                           "silu",
                           "mish",
                           "softplus",
                           "leaky_relu",
                           "hardswish",
                           "elu",
                           "sin",
                           "cos",
                           "log",
                           "erf",
                           "avg_pool1d",
                           "avg_pool2d",
                           "avg_pool3d",
                           "_adaptive_avg_pool2d",
                           "_adaptive_avg_pool3d",
                           "upsample_nearest2d",
                           "upsample_bilinear2d",
                           "prelu",
                           "_prelu_kernel",
                           "hardtanh",
                           "threshold",
                           "gather",
                           "clamp",
                           "clamp_min",
                           "clamp_max",
                           "abs",
                           "log1p",
                           "log2",
                           "log10",
                           "atan",
                           "sinh",
                           "cosh",
                           "hardsigmoid",
                           "hardshrink",
                           "softshrink",
                           "glu",
                           "maximum",
                           "minimum",
                           "atan2",
                           "grid_sampler_2d",
                           "reflection_pad2d",
                           "var",
                           "var_mean",
                           "celu",
                           "logit",
                           "renorm",
                           "linalg_cross",
                           "soft_margin_loss",
                           "multi_margin_loss",
                           "mse_loss",
                           "l1_loss",
                           "smooth_l1_loss",
                           "huber_loss",
                           "binary_cross_entropy",
                           "binary_cross_entropy_with_logits",
                           "_trilinear"})
      r[op] = {KeepArgs::kAll, 0, -1};
    for (const char* op : {"mul", "mm", "bmm", "mv", "dot", "vdot"}) r[op] = {KeepArgs::kCrosswise, 0, -1};
    for (const char* op : {"addmm", "baddbmm", "addbmm", "addcmul"}) r[op] = {KeepArgs::kCrosswise, 1, -1};
    r["div"] = {KeepArgs::kDivisor, 0, -1};
    r["masked_fill"] = {KeepArgs::kOne, 1, -1};
    r["where"] = {KeepArgs::kOne, 0, -1};  // the condition
    r["embedding"] = {KeepArgs::kOne, 1, -1};
    r["index_select"] = {KeepArgs::kOne, 2, -1};
    r["nll_loss_forward"] = {KeepArgs::kOne, 1, 1};  // the target; the total weight
    r["nll_loss2d_forward"] = {KeepArgs::kOne, 1, 1};
    for (const char* op :
         {"relu", "sigmoid", "tanh", "tan", "exp", "expm1", "reciprocal", "sqrt", "rsqrt", "_softmax", "_log_softmax"})
      r[op] = {KeepArgs::kNone, 0, 0};
    for (const char* op :
         {"logsumexp", "linalg_vector_norm", "norm", "std", "amax", "cumprod", "prod", "sgn", "logcumsumexp"})
      r[op] = {KeepArgs::kAll, 0, 0};
    for (const char* op : {"scatter", "scatter_add", "index_fill"}) r[op] = {KeepArgs::kOne, 2, -1};  // the index
    for (const char* op : {"index_add", "index_copy", "addcdiv"}) r[op] = {KeepArgs::kAllBut, 0, -1};
    for (const char* op : {"sort", "topk", "kthvalue"}) r[op] = {KeepArgs::kNone, 0, 1};  // the indices
    // Their first result is the output; what follows (statistics, indices) is kept.
    for (const char* op : {"native_layer_norm", "_embedding_bag", "adaptive_max_pool2d", "cummax",
                           "max_pool1d_with_indices", "max_pool2d_with_indices", "max_pool3d_with_indices"})
      r[op] = {KeepArgs::kAll, 0, 1};
    for (const char* op : {"native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update",
                           "_batch_norm_no_update", "native_group_norm"})
      r[op] = {KeepArgs::kAllBut, 2, 1};
    // Fused attention keeps its inputs, its output and the log-sum-exp (and a generator's state).
    for (const char* op : {"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"})
      r[op] = {KeepArgs::kAll, 0, 0};
    r["native_dropout"] = {KeepArgs::kNone, 0, 1};  // the mask
#if TORCH_VERSION_MAJOR < 2
    r["mean"] = {KeepArgs::kOne, 0, -1, 3};  // LibTorch 1.13's mean over dimensions keeps its input
#endif
    return r;
  }();
  return rules;
}

}  // namespace

const KeepRule* keep_rule(std::string_view op) {
  auto rule = keep_rules().find(op);
  if (rule == keep_rules().end() && !op.empty() && op.back() == '_')
    rule = keep_rules().find(op.substr(0, op.size() - 1));
  return rule == keep_rules().end() ? nullptr : &rule->second;
}

}  // namespace fsdp::planner
