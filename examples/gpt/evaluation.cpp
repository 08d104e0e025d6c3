#include "evaluation.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "training_data.h"

namespace fsdp_gpt {

namespace {

// Validation batches have a fixed size, so the loss is comparable across world sizes and batch sizes.
constexpr int64_t kValidationRows = 16;

// While alive: the model in evaluation mode (no dropout), as it was afterwards.
class EvalMode {
 public:
  explicit EvalMode(torch::nn::Module& model) : model_(model), training_(model.is_training()) { model_.eval(); }
  ~EvalMode() { model_.train(training_); }
  EvalMode(const EvalMode&) = delete;
  EvalMode& operator=(const EvalMode&) = delete;

 private:
  torch::nn::Module& model_;
  bool training_;
};

}  // namespace

torch::Tensor next_token_loss(gpt::GPT& model, const gpt::Batch& batch) {
  auto logits = model->forward(batch.inputs).to(torch::kFloat);  // the loss in float32 under mixed precision
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), batch.targets.reshape({-1}));
}

double validation_loss(gpt::GPT& model, const torch::Tensor& tokens, const TrainConfig& c) {
  torch::NoGradGuard no_grad;
  const EvalMode eval(*model);
  // A training micro-batch's rows at a time at most: evaluation never holds more than training.
  const int64_t chunk = std::clamp<int64_t>(c.batch.micro, 1, kValidationRows);
  double total = 0.0;
  for (int i = 0; i < c.eval_batches; ++i) {
    const auto batch = gpt::sample_batch(tokens, c.context, gpt::batch_key(c.seed, kValidationStream, i),
                                         kValidationRows, 0, kValidationRows);
    for (int64_t row = 0; row < kValidationRows; row += chunk) {
      const int64_t rows = std::min(chunk, kValidationRows - row);
      const gpt::Batch part{batch.inputs.narrow(0, row, rows), batch.targets.narrow(0, row, rows)};
      total += next_token_loss(model, part).item<double>() * static_cast<double>(rows) / kValidationRows;
    }
  }
  return total / c.eval_batches;
}

std::string generate(gpt::GPT& model, const std::string& prompt, const TrainConfig& c) {
  torch::NoGradGuard no_grad;
  const EvalMode eval(*model);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(gpt::batch_key(c.seed, kSampleStream, 0));
  auto tokens = gpt::encode(prompt);
  for (int i = 0; i < c.sample_bytes; ++i) {
    const int64_t window = std::min<int64_t>(tokens.numel(), c.context);
    auto logits = model->forward(tokens.narrow(0, tokens.numel() - window, window).unsqueeze(0));
    auto last = logits[0][window - 1];
    torch::Tensor next;
    if (c.temperature == 0.0) {
      next = last.argmax().reshape({1});
    } else {
      next = torch::multinomial(torch::softmax(last / c.temperature, -1), 1, false, generator);
    }
    tokens = torch::cat({tokens, next});
  }
  return gpt::decode(tokens);
}

}  // namespace fsdp_gpt
