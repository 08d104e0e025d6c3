#include "checkpoint/safetensors.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "checkpoint/manifest.h"
#include "fsdp/check.h"

namespace fsdp::checkpoint::detail {

using nlohmann::json;

std::string make_safetensors_header(const std::vector<SafetensorsTensor>& tensors,
                                    const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  for (const auto& t : tensors)
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
  std::string text = h.dump(-1, ' ', false, json::error_handler_t::replace);
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i, n >>= 8) out[i] = static_cast<char>(n & 0xff);
  return out + text;
}

uint64_t safetensors_header_length(const std::string& prefix, uint64_t file_bytes, const std::string& where) {
  FSDP_CHECK(prefix.size() == 8 && file_bytes >= 8, "safetensors file '", where,
             "' is shorter than 8 bytes; it is "
             "truncated or not a safetensors file");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(prefix[i]);
  FSDP_CHECK(n > 0 && n <= kMaxSafetensorsHeader && n <= file_bytes - 8, "safetensors file '", where,
             "' announces a header of ", n, " bytes in a file of ", file_bytes,
             " bytes; it is truncated or not a safetensors file");
  return n;
}

SafetensorsHeader parse_safetensors_header(const std::string& json_text, uint64_t file_bytes,
                                           const std::string& where) {
  auto fail = [&](const std::string& problem) {
    FSDP_FAIL("safetensors file '", where, "': ", problem, "; the file is damaged or not a safetensors file");
  };
  SafetensorsHeader h;
  h.data_start = 8 + json_text.size();
  if (h.data_start > file_bytes) fail("the header reaches past the end of the file");
  const uint64_t data_bytes = file_bytes - h.data_start;
  const json j = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail("the header is not valid JSON");
  if (!j.is_object()) fail("the header is not a JSON object");
  auto integer = [&](const json& v, const std::string& what, uint64_t hi) -> uint64_t {
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
      fail(what + " is not a non-negative integer");
    const uint64_t x = v.get<uint64_t>();
    if (x > hi) fail(what + " is out of range");
    return x;
  };
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) fail("__metadata__ is not a JSON object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) fail("__metadata__." + m.key() + " is not a string");
        h.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    const std::string what = "tensor '" + it.key() + "'";
    if (!it->is_object()) fail(what + " is not a JSON object");
    SafetensorsTensor t;
    t.name = it.key();
    auto dt = it->find("dtype");
    if (dt == it->end() || !dt->is_string()) fail(what + " has no dtype");
    t.dtype = dt->get<std::string>();
    const int64_t esize = dtype_size(t.dtype);
    if (esize == 0) fail(what + " has dtype '" + t.dtype + "', which libfsdp does not read");
    auto shape = it->find("shape");
    if (shape == it->end() || !shape->is_array() || shape->size() > 64) fail(what + " has no valid shape");
    for (const auto& d : *shape)
      t.shape.push_back(static_cast<int64_t>(integer(d, what + "'s shape", uint64_t(1) << 56)));
    const int64_t numel = checked_numel(t.shape);
    if (numel < 0 || numel > (int64_t(1) << 56)) fail(what + " has too many elements");
    auto off = it->find("data_offsets");
    if (off == it->end() || !off->is_array() || off->size() != 2) fail(what + " has no data_offsets [begin, end]");
    t.begin = integer((*off)[0], what + "'s data_offsets", data_bytes);
    t.end = integer((*off)[1], what + "'s data_offsets", data_bytes);
    if (t.end < t.begin) fail(what + "'s data_offsets are reversed");
    if (t.end - t.begin != static_cast<uint64_t>(numel * esize))
      fail(what + " has " + std::to_string(t.end - t.begin) + " bytes of data for " + std::to_string(numel) +
           " elements of " + t.dtype);
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < h.tensors.size(); ++i)
    if (h.tensors[i].begin < h.tensors[i - 1].end)
      fail("tensors '" + h.tensors[i - 1].name + "' and '" + h.tensors[i].name + "' overlap");
  return h;
}

}  // namespace fsdp::checkpoint::detail
