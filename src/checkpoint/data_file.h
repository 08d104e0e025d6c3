#pragma once
// A checkpoint data file: tensors appended at 64-byte-aligned offsets while a Hash64 of every
// chunk_bytes-sized chunk is computed; and the reader's side: positioned reads of exactly the
// chunks that cover the requested byte ranges, each chunk verified before any byte is used.
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/file_io.h"
#include "checkpoint/hash.h"
#include "checkpoint/manifest.h"

namespace fsdp::checkpoint::detail {

constexpr uint64_t kChunkBytes = uint64_t(1) << 20;

class DataWriter {
 public:
  DataWriter(const std::string& path, std::string name);
  // Appends t's bytes (copied to the CPU first if needed); returns their offset.
  uint64_t append(const at::Tensor& t);
  // fsync + close; the entry the manifest lists.
  FileEntry finish();

 private:
  void write(const void* data, size_t bytes);
  File file_;
  std::string name_;
  uint64_t offset_ = 0;
  uint64_t in_chunk_ = 0;
  Hash64 hash_;
  std::vector<uint64_t> chunk_hashes_;
};

// `bytes` at `offset` of the file, to be copied to `dest` (CPU memory).
struct ReadRequest {
  uint64_t offset = 0, bytes = 0;
  char* dest = nullptr;
};

// Reads requests from one data file, verifying every chunk it touches against the manifest.
// The file's size must be the manifest's (checked when opened).
class DataReader {
 public:
  DataReader(const std::string& path, const FileEntry& entry, uint64_t chunk_bytes);
  void read(std::vector<ReadRequest> requests);

 private:
  File file_;
  const FileEntry& entry_;
  uint64_t chunk_bytes_;
  std::vector<char> buffer_;
};

}  // namespace fsdp::checkpoint::detail
