#include "checkpoint/manifest.h"

#include <algorithm>
#include <set>

#include "checkpoint/hash.h"
#include "fsdp/check.h"

namespace fsdp::checkpoint::detail {

using nlohmann::json;

namespace {

constexpr int64_t kMaxNumel = int64_t(1) << 56;  // keeps every byte count below 2^62
constexpr int64_t kMaxOffset = int64_t(1) << 62;
const std::set<std::string> kStateNames{
    "exp_avg",        "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "exp_avg_sq_row",
    "exp_avg_sq_col", "sum",        "square_avg",     "grad_avg"};
// A state tensor's name: one of kStateNames, or of fsdp::LBFGS's history (d, prev_flat_grad, s.<i>,
// y.<i>).
bool known_state_name(const std::string& name) {
  if (kStateNames.count(name) || name == "d" || name == "prev_flat_grad") return true;
  if (name.size() < 3 || name.size() > 8 || (name[0] != 's' && name[0] != 'y') || name[1] != '.') return false;
  return std::all_of(name.begin() + 2, name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

const std::set<std::string> kOptimizerKinds{"none",    "adamw", "adam", "sgd",       "adagrad",
                                            "rmsprop", "lamb",  "muon", "adafactor", "lbfgs"};

bool printable(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
}

std::string hex_bytes(const std::string& s) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(2 * s.size());
  for (unsigned char c : s) out += digits[c >> 4], out += digits[c & 15];
  return out;
}

// Throws for every problem, naming the manifest and the JSON path of the bad value.
struct Reader {
  const std::string& where;

  [[noreturn]] void fail(const std::string& path, const std::string& problem) const {
    FSDP_FAIL("checkpoint manifest '", where, "': ", path, " ", problem,
              "; the checkpoint is damaged or was not written by libfsdp (use another checkpoint)");
  }
  const json& member(const json& obj, const std::string& path, const char* key) const {
    if (!obj.is_object()) fail(path, "is not a JSON object");
    auto it = obj.find(key);
    if (it == obj.end()) fail(path, std::string("has no \"") + key + "\"");
    return *it;
  }
  int64_t integer(const json& v, const std::string& path, int64_t lo, int64_t hi) const {
    int64_t x = 0;
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(hi)) fail(path, "is out of range");
      x = static_cast<int64_t>(u);
    } else if (v.is_number_integer()) {
      x = v.get<int64_t>();
    } else {
      fail(path, "is not an integer");
    }
    if (x < lo || x > hi)
      fail(path, "is " + std::to_string(x) + ", outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return x;
  }
  int64_t integer(const json& obj, const std::string& path, const char* key, int64_t lo, int64_t hi) const {
    return integer(member(obj, path, key), path + "." + key, lo, hi);
  }
  std::string string(const json& obj, const std::string& path, const char* key) const {
    const json& v = member(obj, path, key);
    if (!v.is_string()) fail(path + "." + key, "is not a string");
    return v.get<std::string>();
  }
  const json& array(const json& obj, const std::string& path, const char* key) const {
    const json& v = member(obj, path, key);
    if (!v.is_array()) fail(path + "." + key, "is not an array");
    return v;
  }
};

// The manifest's own checksum: Hash64 of its compact dump without the "checksum" member
// (nlohmann's dump is canonical: sorted keys, shortest round-trip numbers).
uint64_t hash64_of_json(const json& j) {
  json copy = j;
  copy.erase("checksum");
  const std::string text = copy.dump(-1, ' ', false, json::error_handler_t::replace);
  return hash64(text.data(), text.size());
}

json tensor_to_json(const TensorEntry& t, bool with_group) {
  json pieces = json::array();
  for (const auto& p : t.pieces) {
    json j{{"begin", p.begin}, {"end", p.end}, {"file", p.file}, {"offset", p.offset}};
    if (p.has_state) {
      j["step"] = p.step;
      j["state"] = json::object();
      for (const auto& [name, offset] : p.state) j["state"][name] = offset;
    }
    pieces.push_back(std::move(j));
  }
  json j{{"name", t.name}, {"aliases", t.aliases}, {"shape", t.shape}, {"dtype", t.dtype}, {"pieces", pieces}};
  if (with_group) j["group"] = t.group;
  return j;
}

}  // namespace

int64_t dtype_size(const std::string& dtype) {
  static const std::map<std::string, int64_t> sizes{{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
                                                    {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},   {"BOOL", 1}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

int64_t checked_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && n > (int64_t(1) << 62) / d) return -1;
    n *= d;
  }
  return n;
}

std::string to_json(const Manifest& m) {
  json files = json::array();
  for (const auto& f : m.files) {
    json chunks = json::array();
    for (uint64_t h : f.chunk_hashes) chunks.push_back(to_hex(h));
    files.push_back({{"name", f.name}, {"bytes", f.bytes}, {"chunks", chunks}});
  }
  json params = json::array(), buffers = json::array();
  for (const auto& t : m.parameters) params.push_back(tensor_to_json(t, true));
  for (const auto& t : m.buffers) buffers.push_back(tensor_to_json(t, false));
  json extra = json::object();
  for (const auto& [k, v] : m.extra) {
    if (printable(v))
      extra[k] = v;
    else
      extra[k] = json{{"hex", hex_bytes(v)}};
  }
  json groups = json::array();
  for (const auto& g : m.optimizer_groups) groups.push_back(g);
  json j{{"format", kFormatName},
         {"version", kFormatVersion},
         {"created_unix_ns", m.created_unix_ns},
         {"saved_by",
          {{"world_size", m.world_size},
           {"sharding_strategy", m.sharding_strategy},
           {"sharding_factor", m.sharding_factor}}},
         {"hash", "fsdp-h64"},
         {"chunk_bytes", m.chunk_bytes},
         {"files", files},
         {"parameters", params},
         {"buffers", buffers},
         {"optimizer", {{"kind", m.optimizer_kind}, {"groups", groups}}},
         {"extra", extra}};
  j["checksum"] = to_hex(hash64_of_json(j));
  // Keys that are not valid UTF-8 cannot be written; replace them rather than fail a save.
  return j.dump(1, ' ', false, json::error_handler_t::replace) + "\n";
}

std::string reseal_manifest(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return text;
  j.erase("checksum");
  j["checksum"] = to_hex(hash64_of_json(j));
  return j.dump(1, ' ', false, json::error_handler_t::replace);
}

Manifest parse_manifest(const std::string& text, const std::string& where) {
  Reader r{where};
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) r.fail("the file", "is not valid JSON (truncated or corrupted)");
  if (!j.is_object()) r.fail("the top level", "is not a JSON object");
  uint64_t checksum = 0;
  if (!parse_hex(r.string(j, "$", "checksum"), &checksum)) r.fail("$.checksum", "is not 16 hex digits");
  if (checksum != hash64_of_json(j))
    FSDP_FAIL("checkpoint manifest '", where,
              "' is corrupted: its contents do not match its checksum; the "
              "checkpoint is damaged (or the manifest was edited), use another checkpoint");
  if (r.string(j, "$", "format") != kFormatName) r.fail("$.format", "is not \"" + std::string(kFormatName) + "\"");
  const int64_t version = r.integer(j, "$", "version", 0, 1 << 30);
  if (version != kFormatVersion)
    FSDP_FAIL("checkpoint manifest '", where, "' has format version ", version, "; this libfsdp reads version ",
              kFormatVersion, " only (use the libfsdp that wrote it, or export_full / load_full to move models)");
  if (r.string(j, "$", "hash") != "fsdp-h64") r.fail("$.hash", "names an unknown checksum");

  Manifest m;
  m.created_unix_ns = r.integer(j, "$", "created_unix_ns", 0, INT64_MAX);
  const json& by = r.member(j, "$", "saved_by");
  m.world_size = static_cast<int>(r.integer(by, "$.saved_by", "world_size", 1, 1 << 24));
  m.sharding_strategy = r.string(by, "$.saved_by", "sharding_strategy");
  m.sharding_factor = static_cast<int>(r.integer(by, "$.saved_by", "sharding_factor", 1, 1 << 24));
  m.chunk_bytes = static_cast<uint64_t>(r.integer(j, "$", "chunk_bytes", 64, int64_t(1) << 30));

  std::set<std::string> file_names;
  const json& files = r.array(j, "$", "files");
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string path = "$.files[" + std::to_string(i) + "]";
    FileEntry f;
    f.name = r.string(files[i], path, "name");
    if (f.name.empty() || f.name.find('/') != std::string::npos || f.name == "." || f.name == "..")
      r.fail(path + ".name", "is not a plain file name");
    if (!file_names.insert(f.name).second) r.fail(path + ".name", "repeats '" + f.name + "'");
    f.bytes = static_cast<uint64_t>(r.integer(files[i], path, "bytes", 0, kMaxOffset));
    const json& chunks = r.array(files[i], path, "chunks");
    const uint64_t expected = (f.bytes + m.chunk_bytes - 1) / m.chunk_bytes;
    if (chunks.size() != expected)
      r.fail(path + ".chunks",
             "has " + std::to_string(chunks.size()) + " checksums for " + std::to_string(expected) + " chunks");
    for (size_t c = 0; c < chunks.size(); ++c) {
      uint64_t h = 0;
      if (!chunks[c].is_string() || !parse_hex(chunks[c].get<std::string>(), &h))
        r.fail(path + ".chunks[" + std::to_string(c) + "]", "is not 16 hex digits");
      f.chunk_hashes.push_back(h);
    }
    m.files.push_back(std::move(f));
  }

  const json& opt = r.member(j, "$", "optimizer");
  m.optimizer_kind = r.string(opt, "$.optimizer", "kind");
  if (!kOptimizerKinds.count(m.optimizer_kind))
    r.fail("$.optimizer.kind", "is not one of none, adamw, adam, sgd, adagrad, rmsprop, lamb, muon, adafactor, lbfgs");
  const json& groups = r.array(opt, "$.optimizer", "groups");
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string path = "$.optimizer.groups[" + std::to_string(g) + "]";
    if (!groups[g].is_object()) r.fail(path, "is not a JSON object");
    for (auto it = groups[g].begin(); it != groups[g].end(); ++it)
      if (!it->is_number() && !it->is_boolean() && !it->is_array() && !it->is_string() && !it->is_object())
        r.fail(path + "." + it.key(), "is not a number, boolean, string, array or object");
    m.optimizer_groups.push_back(groups[g]);
  }
  if (m.optimizer_kind == "none" && !m.optimizer_groups.empty())
    r.fail("$.optimizer.groups", "must be empty for kind none");

  std::set<std::string> names;
  auto read_tensors = [&](const char* key, bool parameters, std::vector<TensorEntry>& out) {
    const json& arr = r.array(j, "$", key);
    for (size_t i = 0; i < arr.size(); ++i) {
      const std::string path = std::string("$.") + key + "[" + std::to_string(i) + "]";
      const json& tj = arr[i];
      TensorEntry t;
      t.name = r.string(tj, path, "name");
      const json& aliases = r.array(tj, path, "aliases");
      for (const auto& a : aliases) {
        if (!a.is_string()) r.fail(path + ".aliases", "holds a non-string");
        t.aliases.push_back(a.get<std::string>());
      }
      for (const std::string* n : [&] {
             std::vector<const std::string*> all{&t.name};
             for (const auto& a : t.aliases) all.push_back(&a);
             return all;
           }()) {
        if (n->empty()) r.fail(path, "has an empty name");
        if (!names.insert(*n).second) r.fail(path, "repeats the name '" + *n + "'");
      }
      const json& shape = r.array(tj, path, "shape");
      if (shape.size() > 64) r.fail(path + ".shape", "has more than 64 dimensions");
      for (size_t d = 0; d < shape.size(); ++d)
        t.shape.push_back(r.integer(shape[d], path + ".shape[" + std::to_string(d) + "]", 0, kMaxNumel));
      t.numel = checked_numel(t.shape);
      if (t.numel < 0 || t.numel > kMaxNumel) r.fail(path + ".shape", "has too many elements");
      t.dtype = r.string(tj, path, "dtype");
      const int64_t esize = dtype_size(t.dtype);
      if (esize == 0) r.fail(path + ".dtype", "'" + t.dtype + "' is not a known dtype");
      if (parameters)
        t.group =
            static_cast<int>(r.integer(tj, path, "group", -1, static_cast<int64_t>(m.optimizer_groups.size()) - 1));
      const json& pieces = r.array(tj, path, "pieces");
      for (size_t p = 0; p < pieces.size(); ++p) {
        const std::string pp = path + ".pieces[" + std::to_string(p) + "]";
        const json& pj = pieces[p];
        PieceEntry e;
        e.begin = r.integer(pj, pp, "begin", 0, t.numel);
        e.end = r.integer(pj, pp, "end", 0, t.numel);
        if (e.end <= e.begin) r.fail(pp, "has an empty or reversed element range");
        e.file = static_cast<int>(r.integer(pj, pp, "file", 0, static_cast<int64_t>(m.files.size()) - 1));
        const uint64_t bytes = static_cast<uint64_t>((e.end - e.begin) * esize);
        const uint64_t file_bytes = m.files[e.file].bytes;
        auto check_extent = [&](uint64_t offset, const std::string& what) {
          if (offset > file_bytes || bytes > file_bytes - offset)
            r.fail(what,
                   "reaches past the end of '" + m.files[e.file].name + "' (" + std::to_string(file_bytes) + " bytes)");
        };
        e.offset = static_cast<uint64_t>(r.integer(pj, pp, "offset", 0, kMaxOffset));
        check_extent(e.offset, pp + ".offset");
        e.has_state = pj.is_object() && pj.contains("state");
        if (e.has_state) {
          if (!parameters) r.fail(pp, "of a buffer has optimizer state");
          e.step = r.integer(pj, pp, "step", 0, INT64_MAX);
          const json& st = r.member(pj, pp, "state");
          if (!st.is_object()) r.fail(pp + ".state", "is not a JSON object");
          for (auto it = st.begin(); it != st.end(); ++it) {
            if (!known_state_name(it.key())) r.fail(pp + ".state", "names an unknown state tensor '" + it.key() + "'");
            const uint64_t off = static_cast<uint64_t>(r.integer(*it, pp + ".state." + it.key(), 0, kMaxOffset));
            check_extent(off, pp + ".state." + it.key());
            e.state[it.key()] = off;
          }
        }
        t.pieces.push_back(std::move(e));
      }
      std::sort(t.pieces.begin(), t.pieces.end(),
                [](const PieceEntry& a, const PieceEntry& b) { return a.begin < b.begin; });
      int64_t covered = 0;
      for (const auto& e : t.pieces) {
        if (e.begin != covered)
          r.fail(path + ".pieces", "do not cover elements " + std::to_string(covered) + " onwards exactly once");
        covered = e.end;
        const PieceEntry& first = t.pieces.front();
        bool same_keys = e.state.size() == first.state.size();
        for (auto a = e.state.begin(), b = first.state.begin(); same_keys && a != e.state.end(); ++a, ++b)
          same_keys = a->first == b->first;
        if (e.has_state != first.has_state || e.step != first.step || !same_keys)
          r.fail(path + ".pieces", "disagree on the optimizer state (step or state tensors)");
      }
      if (covered != t.numel)
        r.fail(path + ".pieces", "cover " + std::to_string(covered) + " of " + std::to_string(t.numel) + " elements");
      out.push_back(std::move(t));
    }
  };
  read_tensors("parameters", true, m.parameters);
  read_tensors("buffers", false, m.buffers);

  const json& extra = r.member(j, "$", "extra");
  if (!extra.is_object()) r.fail("$.extra", "is not a JSON object");
  for (auto it = extra.begin(); it != extra.end(); ++it) {
    const std::string path = "$.extra." + it.key();
    if (it->is_string()) {
      m.extra[it.key()] = it->get<std::string>();
      continue;
    }
    const std::string hex = r.string(*it, path, "hex");
    if (hex.size() % 2) r.fail(path + ".hex", "has an odd number of digits");
    std::string bytes;
    for (size_t i = 0; i < hex.size(); i += 2) {
      int v = 0;
      for (size_t k = i; k < i + 2; ++k) {
        const char c = hex[k];
        if (c >= '0' && c <= '9')
          v = v * 16 + (c - '0');
        else if (c >= 'a' && c <= 'f')
          v = v * 16 + (c - 'a' + 10);
        else
          r.fail(path + ".hex", "is not lowercase hex");
      }
      bytes += static_cast<char>(v);
    }
    m.extra[it.key()] = bytes;
  }
  return m;
}

}  // namespace fsdp::checkpoint::detail
