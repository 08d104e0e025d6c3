#pragma once
// What a sharded checkpoint save writes: each rank's plan of its data file (its shard pieces, their
// optimizer state, rank 0's buffers), and rank 0's manifest, built from every rank's report and
// published last, by rename. See Note [Checkpoint format] in docs/design.md.
#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/manifest.h"
#include "checkpoint/optimizer_state.h"
#include "runtime/fsdp_state.h"

namespace fsdp::checkpoint::detail {

// What one rank writes: its tensors in file order, each with the place in `report` (the JSON the
// manifest needs from this rank) that receives its offset in the file.
struct RankPlan {
  std::string file_name;
  nlohmann::json report;
  std::vector<std::pair<at::Tensor, nlohmann::json::json_pointer>> tensors;
};

// This rank's plan. snapshot: the tensors are host copies (training may go on), else views.
RankPlan plan_rank_file(FsdpState& state, torch::optim::Optimizer* optimizer, OptimizerKind kind, int rank,
                        bool snapshot);
// Writes the plan's data file into `tmp` (each host copy released once written); its report.
std::string write_rank_file(RankPlan& plan, const std::string& tmp);
// Rank 0: the manifest's model, optimizer and user parts (no files or pieces yet).
Manifest manifest_skeleton(FsdpState& state, torch::optim::Optimizer* optimizer, OptimizerKind kind,
                           const std::map<std::string, std::string>& extra);
// Rank 0: every rank's file and pieces into the manifest, from their reports.
void add_reports(Manifest& m, const std::vector<std::string>& reports);
// Rank 0: writes the manifest into `tmp` last, makes it durable and renames `tmp` to `dir`.
void publish(const Manifest& m, const std::string& tmp, const std::string& dir, bool overwrite, uint64_t random);

}  // namespace fsdp::checkpoint::detail
