#pragma once
// Manifest: the JSON file that makes a checkpoint directory complete. It names every data file
// (size, chunk checksums), every parameter (names, shape, dtype) with the pieces that hold it
// (file, byte offset, element range, optimizer state), the buffers, the optimizer's kind and group
// options, and the user's extra state. Parsing validates everything that can be checked without
// the model, so a damaged manifest is an fsdp::Error, never a crash. Torch-free (fuzzed under
// sanitizers on its own). See Note [Checkpoint format] in docs/design.md.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace fsdp::checkpoint::detail {

constexpr const char* kManifestName = "manifest.json";
constexpr const char* kFormatName = "libfsdp-checkpoint";
constexpr int kFormatVersion = 1;
constexpr uint64_t kMaxManifestBytes = uint64_t(1) << 30;

struct FileEntry {
  std::string name;  // relative to the checkpoint directory, no '/'
  uint64_t bytes = 0;
  std::vector<uint64_t> chunk_hashes;  // Hash64 of each chunk_bytes-sized chunk (the last may be shorter)
};

// Elements [begin, end) of a flattened tensor, at `offset` in file `file`; optimizer state tensors
// of the same elements and dtype at their own offsets in the same file.
struct PieceEntry {
  int64_t begin = 0, end = 0;
  int file = 0;
  uint64_t offset = 0;
  bool has_state = false;
  int64_t step = 0;                       // Adam / AdamW step count (0 for SGD)
  std::map<std::string, uint64_t> state;  // state tensor name -> offset
};

struct TensorEntry {
  std::string name;
  std::vector<std::string> aliases;  // further names of a tied parameter
  std::vector<int64_t> shape;
  std::string dtype;  // safetensors' names: F32, F64, BF16, F16, I64, ...
  int64_t numel = 0;
  int group = -1;                  // optimizer parameter group (-1: not in the optimizer)
  std::vector<PieceEntry> pieces;  // sorted, covering [0, numel) exactly once
};

struct Manifest {
  int64_t created_unix_ns = 0;
  int world_size = 1;
  std::string sharding_strategy;
  int sharding_factor = 1;
  uint64_t chunk_bytes = 0;
  std::vector<FileEntry> files;
  std::vector<TensorEntry> parameters;
  std::vector<TensorEntry> buffers;
  std::string optimizer_kind = "none";  // none, adamw, adam, sgd, adagrad, rmsprop, lamb, muon, adafactor, lbfgs
  std::vector<nlohmann::json> optimizer_groups;  // each group's options (an object of numbers / bools)
  std::map<std::string, std::string> extra;
};

std::string to_json(const Manifest& m);
// Throws fsdp::Error naming `where` (the manifest's path) and the first problem found.
Manifest parse_manifest(const std::string& text, const std::string& where);

// The same text with its checksum recomputed (tests and fuzzing: reach the checks behind it).
std::string reseal_manifest(const std::string& text);

// Bytes per element of a dtype name; 0 if unknown.
int64_t dtype_size(const std::string& dtype);
// numel of a shape, or -1 if a dimension is negative or the product overflows 2^62.
int64_t checked_numel(const std::vector<int64_t>& shape);

}  // namespace fsdp::checkpoint::detail
