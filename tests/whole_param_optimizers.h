#pragma once
// A sharded whole-parameter optimizer (fsdp::Lamb, fsdp::Adafactor, fsdp::Muon) paired with the
// same optimizer's single-process step (tests/whole_param_reference.h), with the settings the
// tests share (tests/whole_param_optim_test.cpp, tests/gpu/gpu_whole_param_test.cpp).
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/adafactor.h"
#include "fsdp/lamb.h"
#include "fsdp/muon.h"
#include "whole_param_reference.h"

namespace fsdp_test {

using StepFn = std::function<void(const std::vector<at::Tensor>&)>;

inline fsdp::MuonExchange muon_exchange(const std::string& kind) {
  if (kind == "muon_rs") return fsdp::MuonExchange::kReduceScatterAllGather;
  if (kind == "muon_ag") return fsdp::MuonExchange::kAllGather;
  if (kind == "muon_cuda") return fsdp::MuonExchange::kAutoWithoutAllToAll;
  return fsdp::MuonExchange::kAuto;
}

// The sharded optimizer `kind` over `sharded`, and the same optimizer's single-process step.
inline std::pair<std::unique_ptr<fsdp::WholeParamOptimizer>, StepFn> optimizers(const std::string& kind,
                                                                                fsdp::FullyShardedModule& sharded) {
  if (kind == "lamb") {
    auto ref = std::make_shared<ReferenceLamb>(ReferenceLamb{2e-2, 0.9, 0.99, 1e-6, 0.01, {}});
    return {
        std::make_unique<fsdp::Lamb>(sharded, fsdp::LambOptions(2e-2).betas({0.9, 0.99}).eps(1e-6).weight_decay(0.01)),
        [ref](const std::vector<at::Tensor>& ps) {
          ref->step(ps);
        }};
  }
  if (kind == "adafactor") {
    auto ref = std::make_shared<ReferenceAdafactor>();
    ref->beta1 = 0.9;
    ref->weight_decay = 0.01;
    return {std::make_unique<fsdp::Adafactor>(sharded, fsdp::AdafactorOptions().beta1(0.9).weight_decay(0.01)),
            [ref](const std::vector<at::Tensor>& ps) {
              ref->step(ps);
            }};
  }
  // muon_bf16: Newton-Schulz in bfloat16 on both sides; muon_rs: exchanges by reduce-scatter and
  // all-gather; muon_ag: by one all-gather of the straddling matrices; muon_cuda: kAuto's choice on a
  // transport without an all-to-all.
  auto ref = std::make_shared<ReferenceMuon>(ReferenceMuon{2e-2, 0.95, 0.01, 1e-2, 0.9, 0.99, 1e-8, 0.01, {}, {}});
  ref->bfloat16 = kind == "muon_bf16";
  return {
      std::make_unique<fsdp::Muon>(sharded,
                                   fsdp::MuonOptions(2e-2)
                                       .momentum(0.95)
                                       .weight_decay(0.01)
                                       .ns_bfloat16(ref->bfloat16)
                                       .adamw(fsdp::MuonAdamW(1e-2).betas({0.9, 0.99}).eps(1e-8).weight_decay(0.01)),
                                   muon_exchange(kind)),
      [ref](const std::vector<at::Tensor>& ps) {
        if (ref->muon.empty())
          for (const auto& p : ps) ref->muon.push_back(p.dim() == 2);
        ref->step(ps);
      }};
}

}  // namespace fsdp_test
