// Fuzzes the checkpoint loaders' parsers (manifest, safetensors header) with random mutations of
// valid inputs: every input must either parse into something whose extents lie inside its files,
// or raise fsdp::Error. Built torch-free with AddressSanitizer and UBSan where available.
//
//   fsdp_checkpoint_fuzz [iterations] [seed]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <random>
#include <string>

#include <nlohmann/json.hpp>

#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "fsdp/check.h"

using namespace fsdp::checkpoint::detail;
using nlohmann::json;

namespace {

Manifest seed_manifest() {
  Manifest m;
  m.created_unix_ns = 1700000000000000000;
  m.world_size = 2;
  m.sharding_strategy = "FULL_SHARD";
  m.sharding_factor = 2;
  m.chunk_bytes = 1024;
  m.files = {{"rank-00000.bin", 3000, {1, 2, 3}}, {"rank-00001.bin", 1500, {4, 5}}};
  TensorEntry w{"fc.weight", {"head.weight"}, {10, 20}, "F32", 200, 0, {}};
  PieceEntry p0{0, 120, 0, 0, true, 7, {{"exp_avg", 512}, {"exp_avg_sq", 1024}}};
  PieceEntry p1{120, 200, 1, 64, true, 7, {{"exp_avg", 448}, {"exp_avg_sq", 832}}};
  w.pieces = {p0, p1};
  TensorEntry b{"fc.bias", {}, {10}, "BF16", 10, -1, {{0, 10, 1, 1200, false, 0, {}}}};
  m.parameters = {w, b};
  m.buffers = {TensorEntry{"bn.running_mean", {}, {10}, "F64", 10, -1, {{0, 10, 0, 2500, false, 0, {}}}}};
  m.optimizer_kind = "adamw";
  m.optimizer_groups = {
      json{{"lr", 0.001}, {"betas", {0.9, 0.99}}, {"eps", 1e-8}, {"weight_decay", 0.1}, {"amsgrad", false}}};
  m.extra = {{"step", "12"}, {"rng", std::string("\0\xff\x10", 3)}};
  return m;
}

json random_value(std::mt19937_64& rng) {
  switch (rng() % 9) {
    case 0: return nullptr;
    case 1: return static_cast<int64_t>(rng());
    case 2: return static_cast<uint64_t>(rng());
    case 3: return -static_cast<int64_t>(rng() % 1000);
    case 4: return std::ldexp(static_cast<double>(rng() % 1000), static_cast<int>(rng() % 200) - 100);
    case 5: return std::string(rng() % 5, static_cast<char>('a' + rng() % 26));
    case 6: return json::array({static_cast<int64_t>(rng() % 300), static_cast<int64_t>(rng() % 300)});
    case 7: return json::object();
    default: return rng() % 2 == 0;
  }
}

// Replaces, removes or duplicates one random node of a JSON document.
void mutate_structure(json& j, std::mt19937_64& rng) {
  json* node = &j;
  for (int depth = 0; depth < 8 && (node->is_object() || node->is_array()) && !node->empty(); ++depth) {
    const size_t i = rng() % node->size();
    json* child = node->is_array() ? &(*node)[i] : &std::next(node->begin(), static_cast<long>(i)).value();
    if (rng() % 3 == 0) {
      if (rng() % 2 == 0) {
        if (node->is_array())
          node->erase(i);
        else
          node->erase(std::next(node->begin(), static_cast<long>(i)).key());
      } else {
        *child = random_value(rng);
      }
      return;
    }
    node = child;
  }
  *node = random_value(rng);
}

std::string mutate_bytes(std::string s, std::mt19937_64& rng) {
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits && !s.empty(); ++e) {
    const size_t at = rng() % s.size();
    switch (rng() % 5) {
      case 0: s[at] = static_cast<char>(rng()); break;
      case 1: s.erase(at, 1 + rng() % 16); break;
      case 2: s.insert(at, 1, "{}[]\",:-0123456789e"[rng() % 19]); break;
      case 3: s.resize(at); break;
      default: s.insert(at, s.substr(rng() % s.size(), rng() % 32)); break;
    }
  }
  return s;
}

// What a parsed manifest promises the loader.
bool extents_inside_files(const Manifest& m) {
  for (const auto* list : {&m.parameters, &m.buffers})
    for (const auto& t : *list) {
      const int64_t es = dtype_size(t.dtype);
      if (es == 0) return false;
      int64_t covered = 0;
      for (const auto& p : t.pieces) {
        if (p.file < 0 || p.file >= static_cast<int>(m.files.size()) || p.begin != covered || p.end <= p.begin)
          return false;
        covered = p.end;
        const uint64_t bytes = static_cast<uint64_t>((p.end - p.begin) * es), size = m.files[p.file].bytes;
        if (p.offset > size || bytes > size - p.offset) return false;
        for (const auto& kv : p.state)
          if (kv.second > size || bytes > size - kv.second) return false;
      }
      if (covered != t.numel) return false;
    }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const long iterations = argc > 1 ? std::atol(argv[1]) : 5000;
  const uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 12345;
  std::mt19937_64 rng(seed);
  const std::string manifest = to_json(seed_manifest());
  // The seed itself must parse, and survive a round trip.
  const Manifest parsed = parse_manifest(manifest, "seed");
  if (to_json(parsed).size() == 0 || !extents_inside_files(parsed)) {
    std::cerr << "the seed manifest does not round-trip\n";
    return 1;
  }
  std::vector<SafetensorsTensor> tensors{
      {"a.weight", "F32", {4, 8}, 0, 128}, {"a.bias", "BF16", {8}, 128, 144}, {"b", "I64", {3}, 144, 168}};
  const std::string header = make_safetensors_header(tensors, {{"format", "pt"}, {"libfsdp.aliases", "{\"c\":\"b\"}"}});
  const uint64_t seed_file_bytes = header.size() + 168;
  parse_safetensors_header(header.substr(8), seed_file_bytes, "seed");

  long parsed_ok = 0, errors = 0;
  for (long i = 0; i < iterations; ++i) {
    std::string input;
    const int mode = static_cast<int>(rng() % 3);
    if (mode == 0) {
      input = mutate_bytes(manifest, rng);  // caught by the checksum or the JSON parser, mostly
    } else {
      json j = json::parse(manifest);
      for (int k = 1 + static_cast<int>(rng() % 3); k > 0; --k) mutate_structure(j, rng);
      input = j.dump();
      if (mode == 2 || rng() % 2) input = reseal_manifest(input);  // reach the checks behind the checksum
    }
    try {
      const Manifest m = parse_manifest(input, "fuzz");
      ++parsed_ok;
      if (!extents_inside_files(m)) {
        std::cerr << "iteration " << i << ": a manifest with extents outside its files parsed:\n" << input << "\n";
        return 1;
      }
    } catch (const fsdp::Error&) {
      ++errors;
    } catch (const std::exception& e) {
      std::cerr << "iteration " << i << ": manifest raised " << e.what() << " (not fsdp::Error) for:\n"
                << input << "\n";
      return 1;
    }

    std::string h;
    uint64_t file_bytes = seed_file_bytes + (rng() % 4 == 0 ? rng() % 64 : 0) - (rng() % 4 == 0 ? rng() % 64 : 0);
    if (rng() % 2) {
      h = mutate_bytes(header, rng);
    } else {
      json j = json::parse(header.substr(8));
      mutate_structure(j, rng);
      const std::string text = j.dump();
      std::string prefix(8, '\0');
      uint64_t n = text.size();
      for (int b = 0; b < 8; ++b, n >>= 8) prefix[b] = static_cast<char>(n & 0xff);
      h = prefix + text;
    }
    try {
      const uint64_t n = safetensors_header_length(h.substr(0, 8), file_bytes, "fuzz");
      if (h.size() < 8 + n) throw fsdp::Error("short");  // the reader would hit the end of the file
      const auto parsed_header = parse_safetensors_header(h.substr(8, n), file_bytes, "fuzz");
      for (const auto& t : parsed_header.tensors)
        if (parsed_header.data_start + t.end > file_bytes || t.end < t.begin) {
          std::cerr << "iteration " << i << ": a safetensors tensor outside the file parsed\n";
          return 1;
        }
    } catch (const fsdp::Error&) {
    } catch (const std::exception& e) {
      std::cerr << "iteration " << i << ": safetensors header raised " << e.what() << " (not fsdp::Error)\n";
      return 1;
    }
  }
  std::cout << iterations << " mutations of each: " << parsed_ok << " manifests parsed, " << errors
            << " refused with fsdp::Error, no other outcome\n";
  if (errors == 0 || parsed_ok == 0) {
    std::cerr << "the mutations never reached one of the outcomes; the fuzzer is not exercising the parser\n";
    return 1;
  }
  return 0;
}
