#include "data.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace gpt {
namespace fs = std::filesystem;

namespace {

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path.string());
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

// A fortune file is fortunes separated by lines holding just "%".
std::string strip_separator_lines(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line == "%" || line == "%\r") continue;
    out += line;
    out += '\n';
  }
  return out;
}

}  // namespace

Corpus load_fortunes(const std::string& dir) {
  std::error_code error;
  if (!fs::is_directory(dir, error))
    throw std::runtime_error("the default corpus directory " + dir +
                             " does not exist; install Debian's fortune files (apt-get install fortunes) or "
                             "pass --data PATH to train on your own text file");
  std::vector<fs::path> files;
  std::set<fs::path> seen;  // canonical paths: "art.u8" is a symlink to "art"
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;            // skips off/ and other directories (symlinks are followed)
    if (entry.path().extension() == ".dat") continue;  // strfile's binary index
    if (seen.insert(fs::canonical(entry.path())).second) files.push_back(fs::canonical(entry.path()));
  }
  std::sort(files.begin(), files.end());  // directory order is arbitrary; ranks must agree
  if (files.empty())
    throw std::runtime_error("no fortune files in " + dir + "; pass --data PATH to train on your own text file");

  Corpus corpus;
  for (const auto& file : files) corpus.text += strip_separator_lines(read_file(file));
  corpus.description = "fortunes: " + std::to_string(files.size()) + " files in " + dir;
  return corpus;
}

Corpus load_text_file(const std::string& path) {
  Corpus corpus;
  corpus.text = read_file(path);
  corpus.description = path;
  return corpus;
}

torch::Tensor encode(const std::string& text) {
  auto bytes = torch::empty({static_cast<int64_t>(text.size())}, torch::TensorOptions().dtype(torch::kUInt8));
  std::copy(text.begin(), text.end(), reinterpret_cast<char*>(bytes.data_ptr<uint8_t>()));
  return bytes.to(torch::kLong);
}

std::string decode(const torch::Tensor& tokens) {
  auto bytes = tokens.to(torch::kUInt8).contiguous();
  const char* data = reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>());
  return std::string(data, data + bytes.numel());
}

TokenSplits split_train_validation(const torch::Tensor& tokens, double validation_fraction) {
  // 10 * k pieces with k pieces held out gives the fraction in steps of 1 / (10 * k).
  const int64_t pieces_per_group = 10;
  const int64_t held_out_per_group = std::max<int64_t>(1, std::llround(validation_fraction * pieces_per_group));
  const int64_t groups = 10;
  const int64_t pieces = pieces_per_group * groups;
  const int64_t piece_len = tokens.numel() / pieces;
  std::vector<torch::Tensor> train, validation;
  for (int64_t i = 0; i < pieces; ++i) {
    const int64_t begin = i * piece_len;
    const int64_t len = (i == pieces - 1) ? tokens.numel() - begin : piece_len;
    auto piece = tokens.narrow(0, begin, len);
    (i % pieces_per_group >= pieces_per_group - held_out_per_group ? validation : train).push_back(piece);
  }
  return {torch::cat(train), torch::cat(validation)};
}

uint64_t batch_key(uint64_t seed, uint64_t stream, uint64_t index) {
  // splitmix64 finalizer over a combination of the three: nearby inputs give unrelated keys.
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + stream * 0xBF58476D1CE4E5B9ull + index * 0x94D049BB133111EBull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

Batch sample_batch(const torch::Tensor& tokens, int64_t context, uint64_t key, int64_t total_rows, int64_t first_row,
                   int64_t rows) {
  TORCH_CHECK(tokens.numel() > context + 1, "the text has ", tokens.numel(), " tokens, too few for windows of ",
              context + 1);
  TORCH_CHECK(first_row >= 0 && first_row + rows <= total_rows, "rows out of range");
  auto generator = at::make_generator<at::CPUGeneratorImpl>(key);
  auto starts =
      torch::randint(tokens.numel() - context, {total_rows}, generator, torch::TensorOptions().dtype(torch::kLong));
  std::vector<torch::Tensor> windows;
  for (int64_t r = first_row; r < first_row + rows; ++r)
    windows.push_back(tokens.narrow(0, starts[r].item<int64_t>(), context + 1));
  auto stacked = torch::stack(windows);
  return {stacked.narrow(1, 0, context), stacked.narrow(1, 1, context)};
}

}  // namespace gpt
