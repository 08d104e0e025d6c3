#pragma once
// Checkpoints of a sharded model: sharded save / load (each rank writes and reads only its own
// pieces; loads at any world size, strategy and wrap policy), and a full-model safetensors file
// written and read unit by unit. Usage and guarantees: docs/checkpoints.md; the on-disk format:
// Note [Checkpoint format] in docs/design.md.
#include <torch/arg.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>

#include "fsdp/fully_shard.h"

namespace fsdp::checkpoint {

namespace detail {
struct SaveJob;
}

// User state that rides along with a checkpoint (step, data position, RNG states, ...): any bytes.
using Extra = std::map<std::string, std::string>;

struct SaveOptions {
  // Replace an existing checkpoint at `dir` (the old one is removed only after the new one is in
  // place); a `dir` holding anything else is refused. Off: saving to an existing path is an error.
  TORCH_ARG(bool, overwrite) = false;
};

// Collective. Writes `dir` atomically: every rank writes its shard pieces of the parameters and of
// `optimizer`'s state (AdamW, Adam, SGD; null: none) into `dir`.tmp-XXXX, then rank 0 writes the
// manifest last and renames the directory to `dir`. A save killed at any point leaves no `dir`.
void save(const std::string& dir, FullyShardedModule& model, torch::optim::Optimizer* optimizer,
          const Extra& extra = {}, const SaveOptions& options = {});
inline void save(const std::string& dir, FullyShardedModule& model, torch::optim::Optimizer& optimizer,
                 const Extra& extra = {}, const SaveOptions& options = {}) {
  save(dir, model, &optimizer, extra, options);
}

// A save finishing in the background (async_save). Move-only; destroying or reassigning one that
// is still running waits for it and prints (does not throw) its error.
class SaveHandle {
 public:
  SaveHandle() = default;
  explicit SaveHandle(std::shared_ptr<detail::SaveJob> job);
  SaveHandle(SaveHandle&&) noexcept = default;
  SaveHandle& operator=(SaveHandle&& other) noexcept;
  SaveHandle(const SaveHandle&) = delete;
  SaveHandle& operator=(const SaveHandle&) = delete;
  ~SaveHandle();

  // Blocks until the checkpoint is published; rethrows the save's error (the same on every rank).
  void wait();
  // True once wait() will not block (published or failed); also true for an empty handle.
  bool done() const;

 private:
  std::shared_ptr<detail::SaveJob> job_;
};

// Collective. save(), asynchronously: returns once this rank's pieces and optimizer state are
// copied to host memory (the only pause training sees); a background thread writes them and,
// over a communicator of its own, agrees on success and publishes the manifest. Training may
// change the model and optimizer at once. Costs host memory for one copy of this rank's share
// until written. A later save, async_save or load of this model first waits for it.
SaveHandle async_save(const std::string& dir, FullyShardedModule& model, torch::optim::Optimizer* optimizer,
                      const Extra& extra = {}, const SaveOptions& options = {});
inline SaveHandle async_save(const std::string& dir, FullyShardedModule& model, torch::optim::Optimizer& optimizer,
                             const Extra& extra = {}, const SaveOptions& options = {}) {
  return async_save(dir, model, &optimizer, extra, options);
}

// Collective. Loads a checkpoint saved at any world size, strategy and wrap policy: each rank
// reads only the byte ranges its own pieces overlap (and verifies their checksums). `optimizer`
// (null: model only) must be of the saved kind; its state and group options are restored.
// `extra` (optional) receives the saved user state. Throws fsdp::Error on every rank, naming the
// file and the problem, for a missing, incomplete, corrupted or mismatched checkpoint.
void load(const std::string& dir, FullyShardedModule& model, torch::optim::Optimizer* optimizer,
          Extra* extra = nullptr);
inline void load(const std::string& dir, FullyShardedModule& model, torch::optim::Optimizer& optimizer,
                 Extra* extra = nullptr) {
  load(dir, model, &optimizer, extra);
}

// Collective. load() of latest(root), which every rank must find the same; returns its path.
// Throws fsdp::Error on every rank, naming `root`, if it holds no complete checkpoint (to start
// from scratch then, test latest(root).empty() first) or the ranks found different ones.
std::string load_latest(const std::string& root, FullyShardedModule& model, torch::optim::Optimizer* optimizer,
                        Extra* extra = nullptr);
inline std::string load_latest(const std::string& root, FullyShardedModule& model, torch::optim::Optimizer& optimizer,
                               Extra* extra = nullptr) {
  return load_latest(root, model, &optimizer, extra);
}

// True if `dir` holds a complete checkpoint (a readable manifest, every file of the size it names).
bool is_complete(const std::string& dir);
// The extra entries save() was given for the checkpoint `dir`, read from its manifest alone (no
// model, not collective): what a program needs to know before it builds the model it loads into.
Extra read_extra(const std::string& dir);
// The newest complete checkpoint directly under `root` (by the time its manifest was written), or
// "" if there is none (load("") is refused: test for it, or use load_latest). Directories of
// unfinished saves (*.tmp-*) are never picked.
std::string latest(const std::string& root);

// Collective. Rank 0 writes the whole model (parameters under their own names, then buffers) as
// one safetensors file, gathering one unit at a time; other ranks write nothing. A tied
// parameter appears once, under its first name; its other names are listed in the header's
// __metadata__ ("libfsdp.aliases"). Written to `file`.tmp-XXXX and renamed.
void export_full(const std::string& file, FullyShardedModule& model);

// Collective. Rank 0 reads a safetensors file (export_full's, or one written by Python's
// safetensors.torch.save_file) and each FlatParameter's values are broadcast, one at a time, for
// every rank to copy its shard. Every parameter and buffer must be present (under any of its
// names) with its shape; values are converted to the parameter's dtype as Tensor::copy_ does.
void load_full(const std::string& file, FullyShardedModule& model);

}  // namespace fsdp::checkpoint
