#pragma once
// Checkpoints of the trainer: --save-dir, --save-every, --async-save, --stop-after, --resume and
// --export, and the progress they carry besides the model and AdamW state.
#include <fsdp/checkpoint.h>
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <string>

#include "train_config.h"

namespace fsdp_gpt {

// What the trainer adds to a checkpoint to continue exactly: the step (batches and the learning
// rate follow from it), the global batch, the unlogged loss window, and the default generator's
// state. See Note [Loss window across a resume] in docs/design.md.
struct Progress {
  int step = 0;
  double window_loss = 0.0;  // this rank's share of the window's loss sum (see the Note)
  int window_steps = 0;      // steps in the window, timed or not
  int global_batch = 0;      // 0: not known (no checkpoint, or one that does not record it)
  std::string dir;           // the checkpoint resumed from ("": none)
};

// A --async-save checkpoint still being written, announced when it is done.
struct PendingSave {
  fsdp::checkpoint::SaveHandle handle;
  std::string dir;
  int step = 0;
  // Waits for it and says so (rank 0); rethrows its error.
  void finish(const fsdp::ProcessGroup& pg);
};

// Saves step-NNNNNNNN under --save-dir; in the background (into `pending`) when `background`.
void save_checkpoint(fsdp::ProcessGroup& pg, const TrainConfig& c, fsdp::FullyShardedModule& sharded,
                     torch::optim::Optimizer& optimizer, const Progress& p, const fsdp::GradScaler* scaler,
                     bool background, PendingSave& pending);

// --resume: loads the newest complete checkpoint under --save-dir; returns where to continue.
Progress resume(fsdp::ProcessGroup& pg, const TrainConfig& c, fsdp::FullyShardedModule& sharded,
                torch::optim::Optimizer& optimizer, fsdp::GradScaler* scaler);

// --save-dir exists (made with its parents) and this process may write into it; otherwise throws
// naming it, before any step trains.
void check_save_dir(const TrainConfig& c);

// --export: writes the whole model as one safetensors file (collective; rank 0 says so).
void export_model(const TrainConfig& config, fsdp::FullyShardedModule& sharded, bool is_main);

}  // namespace fsdp_gpt
