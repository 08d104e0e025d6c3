#include "data.h"

#include <ATen/CPUGeneratorImpl.h>
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace gpt {

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
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

std::runtime_error system_error(const std::string& what, const std::string& path) {
  return std::runtime_error(what + " " + path + ": " + std::strerror(errno));
}

// The names in `dir` except "." and "..", in directory order.
std::vector<std::string> list_dir(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) throw system_error("cannot open directory", dir);
  std::vector<std::string> names;
  for (;;) {
    errno = 0;
    const dirent* entry = readdir(d);
    if (entry == nullptr) break;
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  const int error = errno;
  closedir(d);
  errno = error;
  if (error != 0) throw system_error("cannot read directory", dir);
  return names;
}

// Whether `path` is a regular file, symlinks followed (a dangling one is none).
bool is_regular_file(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) == 0) return S_ISREG(st.st_mode);
  if (errno == ENOENT || errno == ENOTDIR) return false;
  throw system_error("cannot stat", path);
}

std::string canonical(const std::string& path) {
  char resolved[PATH_MAX];
  if (realpath(path.c_str(), resolved) == nullptr) throw system_error("cannot resolve", path);
  return resolved;
}

int path_byte_rank(char c) { return c == '/' ? 0 : static_cast<unsigned char>(c) + 1; }

// Orders paths component by component: '/' sorts before any other byte.
bool path_less(const std::string& a, const std::string& b) {
  return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end(),
                                      [](char x, char y) { return path_byte_rank(x) < path_byte_rank(y); });
}

}  // namespace

Corpus load_fortunes(const std::string& dir) {
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw std::runtime_error("the default corpus directory " + dir +
                             " does not exist; install Debian's fortune files (apt-get install fortunes) or "
                             "pass --data PATH to train on your own text file");
  std::vector<std::string> files;
  std::set<std::string> seen;  // canonical paths: "art.u8" is a symlink to "art"
  for (const auto& name : list_dir(dir)) {
    const std::string path = dir + "/" + name;
    if (!is_regular_file(path)) continue;  // skips off/ and other directories (symlinks are followed)
    const auto dot = name.rfind('.');
    if (dot != std::string::npos && dot > 0 && name.compare(dot, std::string::npos, ".dat") == 0)
      continue;  // strfile's binary index
    const std::string resolved = canonical(path);
    if (seen.insert(resolved).second) files.push_back(resolved);
  }
  std::sort(files.begin(), files.end(), path_less);  // directory order is arbitrary; ranks must agree
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
