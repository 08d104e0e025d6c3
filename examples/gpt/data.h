#pragma once
// Text data for the GPT example: the corpus, byte-level tokens, the train/validation split, and
// batches that are the same on every rank for a given (seed, step).
#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace gpt {

// Where Debian's `fortunes` packages install their text files.
inline constexpr const char* kFortunesDir = "/usr/share/games/fortunes";

struct Corpus {
  std::string text;
  std::string description;  // for the configuration table, e.g. "fortunes: 43 files in /usr/..."
};

// Every fortune file in `dir` (sorted by name, each file once even where a symlink such as
// "art.u8" points at it; *.dat index files and subdirectories such as off/ skipped), with the
// '%' lines that separate fortunes removed. Throws std::runtime_error if there are none.
Corpus load_fortunes(const std::string& dir = kFortunesDir);
// A user's text file, as bytes.
Corpus load_text_file(const std::string& path);

// Byte-level tokens: one token per byte, vocabulary 256.
torch::Tensor encode(const std::string& text);  // -> 1-D int64
std::string decode(const torch::Tensor& tokens);

struct TokenSplits {
  torch::Tensor train;       // 1-D int64
  torch::Tensor validation;  // 1-D int64
};
// Holds out `validation_fraction` of the tokens. The text is cut into equal contiguous pieces and
// every tenth piece is held out, so validation covers the whole corpus (the fortune collections
// differ in style; a plain tail split would validate on the last few files only).
TokenSplits split_train_validation(const torch::Tensor& tokens, double validation_fraction = 0.1);

struct Batch {
  torch::Tensor inputs;   // [rows, context] int64
  torch::Tensor targets;  // [rows, context] int64: inputs shifted left by one token
};

// Mixes (seed, stream, index) into one generator seed, so e.g. step 7 of seed 1 always draws the
// same windows whatever the world size.
uint64_t batch_key(uint64_t seed, uint64_t stream, uint64_t index);

// Draws `total_rows` random windows of context + 1 tokens with a generator seeded by `key` and
// returns rows [first_row, first_row + rows) of them. Every rank draws the whole (global) batch
// and keeps its own slice, so the global batch does not depend on how it is divided.
Batch sample_batch(const torch::Tensor& tokens, int64_t context, uint64_t key, int64_t total_rows, int64_t first_row,
                   int64_t rows);

}  // namespace gpt
