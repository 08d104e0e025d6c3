#include "checkpoint/data_file.h"

#include <algorithm>
#include <cstring>

#include "fsdp/check.h"

namespace fsdp::checkpoint::detail {

namespace {
constexpr uint64_t kAlign = 64;
constexpr uint64_t kMaxRunChunks = 16;  // one positioned read covers at most this many chunks
}  // namespace

DataWriter::DataWriter(const std::string& path, std::string name) : file_(File::create(path)), name_(std::move(name)) {}

void DataWriter::write(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  size_t left = bytes;
  while (left > 0) {
    const size_t take = std::min<uint64_t>(left, kChunkBytes - in_chunk_);
    hash_.update(p, take);
    in_chunk_ += take;
    p += take;
    left -= take;
    if (in_chunk_ == kChunkBytes) {
      chunk_hashes_.push_back(hash_.digest());
      hash_ = Hash64();
      in_chunk_ = 0;
    }
  }
  file_.write_all(data, bytes);
  offset_ += bytes;
}

uint64_t DataWriter::append(const at::Tensor& t) {
  static const char zeros[kAlign] = {};
  if (offset_ % kAlign) write(zeros, kAlign - offset_ % kAlign);
  const uint64_t at_offset = offset_;
  at::Tensor c = t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
  write(c.data_ptr(), c.nbytes());
  return at_offset;
}

FileEntry DataWriter::finish() {
  if (in_chunk_ > 0) chunk_hashes_.push_back(hash_.digest());
  file_.sync();
  file_.close();
  FileEntry e;
  e.name = name_;
  e.bytes = offset_;
  e.chunk_hashes = chunk_hashes_;
  return e;
}

DataReader::DataReader(const std::string& path, const FileEntry& entry, uint64_t chunk_bytes)
    : file_(File::open_read(path)), entry_(entry), chunk_bytes_(chunk_bytes) {
  const uint64_t size = file_.size();
  FSDP_CHECK(size == entry.bytes, "'", path, "' has ", size, " bytes but the manifest says ", entry.bytes,
             ": the file is truncated or was replaced; the checkpoint is damaged, use another one");
}

void DataReader::read(std::vector<ReadRequest> requests) {
  requests.erase(std::remove_if(requests.begin(), requests.end(), [](const ReadRequest& r) { return r.bytes == 0; }),
                 requests.end());
  if (requests.empty()) return;
  std::sort(requests.begin(), requests.end(),
            [](const ReadRequest& a, const ReadRequest& b) { return a.offset < b.offset; });
  // Runs of consecutive chunks that some request touches.
  std::vector<std::pair<uint64_t, uint64_t>> runs;  // [first chunk, last chunk]
  for (const auto& r : requests) {
    FSDP_CHECK(r.offset <= entry_.bytes && r.bytes <= entry_.bytes - r.offset, "internal: read beyond '", file_.path(),
               "'");
    const uint64_t c0 = r.offset / chunk_bytes_, c1 = (r.offset + r.bytes - 1) / chunk_bytes_;
    if (!runs.empty() && c0 <= runs.back().second + 1)
      runs.back().second = std::max(runs.back().second, c1);
    else
      runs.emplace_back(c0, c1);
  }
  size_t first = 0;
  for (const auto& run : runs) {
    for (uint64_t c = run.first; c <= run.second; c += kMaxRunChunks) {
      const uint64_t last = std::min(run.second, c + kMaxRunChunks - 1);
      const uint64_t begin = c * chunk_bytes_, end = std::min(entry_.bytes, (last + 1) * chunk_bytes_);
      buffer_.resize(static_cast<size_t>(end - begin));
      file_.pread_all(buffer_.data(), buffer_.size(), begin);
      for (uint64_t k = c; k <= last; ++k) {
        const uint64_t kb = k * chunk_bytes_, ke = std::min(entry_.bytes, kb + chunk_bytes_);
        FSDP_CHECK(hash64(buffer_.data() + (kb - begin), static_cast<size_t>(ke - kb)) == entry_.chunk_hashes[k], "'",
                   file_.path(), "' is corrupted: bytes [", kb, ", ", ke,
                   ") do not match their checksum in the manifest; the checkpoint is damaged, use another one");
      }
      for (size_t i = first; i < requests.size() && requests[i].offset < end; ++i) {
        const auto& r = requests[i];
        const uint64_t b = std::max(begin, r.offset), e = std::min(end, r.offset + r.bytes);
        if (b < e) std::memcpy(r.dest + (b - r.offset), buffer_.data() + (b - begin), static_cast<size_t>(e - b));
      }
      while (first < requests.size() && requests[first].offset + requests[first].bytes <= end) ++first;
    }
  }
}

}  // namespace fsdp::checkpoint::detail
