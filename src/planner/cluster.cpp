// Cluster presets, the compact spec, JSON files, and byte sizes (include/fsdp/cluster.h).
#include "fsdp/cluster.h"

#include <sys/stat.h>
#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <vector>

#include "fsdp/check.h"

namespace fsdp {
namespace {

constexpr double kBytesPerGiB = 1024.0 * 1024.0 * 1024.0;

struct Preset {
  const char* name;
  const char* about;
  DeviceSpec device;
  Link intra;
  Link inter;
  int ranks_per_node;
  double host_gib;
  double host_device_gbps;
  bool device_is_host;
};

// Vendor peak figures; links are what NCCL's ring reaches per rank (bus bandwidth), not line rates.
// The CPU preset's figures are this kind of 2-core machine's, with the shared-memory transport.
const std::vector<Preset>& presets() {
  static const std::vector<Preset> all{
      {"cpu",
       "this CPU machine, shared-memory transport",
       {"cpu", int64_t(24 * kBytesPerGiB), 40e9, 40e9, 10, 1.0},
       Link().bandwidth_gbps(4).latency_us(20),
       Link().bandwidth_gbps(4).latency_us(20),
       4,
       24,
       0,
       true},
      {"a100-40g",
       "A100 40 GB SXM, NVLink within a node, 200 Gb/s per GPU between nodes",
       {"A100-40GB", int64_t(40 * kBytesPerGiB), 19.5e12, 312e12, 1555, 0.75},
       Link().bandwidth_gbps(230).latency_us(5),
       Link().bandwidth_gbps(22).latency_us(10),
       8,
       1024,
       25,
       false},
      {"a100-80g",
       "A100 80 GB SXM, NVLink within a node, 200 Gb/s per GPU between nodes",
       {"A100-80GB", int64_t(80 * kBytesPerGiB), 19.5e12, 312e12, 2039, 0.75},
       Link().bandwidth_gbps(230).latency_us(5),
       Link().bandwidth_gbps(22).latency_us(10),
       8,
       1024,
       25,
       false},
      {"paper",
       "the FSDP paper's cluster: A100 80 GB, 8 per node on NVLink, 2 Tb/s RoCE between nodes",
       {"A100-80GB", int64_t(80 * kBytesPerGiB), 19.5e12, 312e12, 2039, 0.75},
       Link().bandwidth_gbps(230).latency_us(5),
       Link().bandwidth_gbps(25).latency_us(10),
       8,
       1024,
       25,
       false},
      {"h100",
       "H100 80 GB SXM, NVLink 4 within a node, 400 Gb/s per GPU between nodes",
       {"H100-80GB", int64_t(80 * kBytesPerGiB), 67e12, 989e12, 3350, 0.7},
       Link().bandwidth_gbps(360).latency_us(5),
       Link().bandwidth_gbps(45).latency_us(10),
       8,
       2048,
       50,
       false},
      {"h200",
       "H200 141 GB SXM, NVLink 4 within a node, 400 Gb/s per GPU between nodes",
       {"H200-141GB", int64_t(141e9), 67e12, 989e12, 4800, 0.7},
       Link().bandwidth_gbps(360).latency_us(5),
       Link().bandwidth_gbps(45).latency_us(10),
       8,
       2048,
       50,
       false},
  };
  return all;
}

std::string lower_case(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string short_number(double v, int precision = 3) {
  std::ostringstream o;
  o.precision(precision);
  o << v;
  return o.str();
}

using nlohmann::json;

// Refuses a key of `obj` that `known` does not list (a misspelling would otherwise be ignored).
void json_keys(const json& obj, std::initializer_list<const char*> known, const std::string& where) {
  for (const auto& item : obj.items()) {
    bool ok = false;
    std::string names;
    for (const char* k : known) {
      ok = ok || item.key() == k;
      names += (names.empty() ? "" : ", ") + std::string(k);
    }
    FSDP_CHECK(ok, where, ": unknown key \"", item.key(), "\"; known: ", names);
  }
}

// obj[key] (fallback where absent): a finite number >= 0, or > 0 where `positive`, at most `most`.
double json_number(const json& obj, const char* key, double fallback, const std::string& where, bool positive = false,
                   double most = 1e15) {
  if (!obj.contains(key)) return fallback;
  const json& v = obj.at(key);
  const double x = v.is_number() ? v.get<double>() : -1;
  FSDP_CHECK(v.is_number() && std::isfinite(x) && (positive ? x > 0 : x >= 0) && x <= most, where, ": \"", key,
             "\" must be a ", positive ? "positive" : "non-negative", " number of at most ", most, ", got ", v.dump());
  return x;
}

// obj[key] (fallback where absent): a whole number from 1 to 2^20.
int json_count(const json& obj, const char* key, int fallback, const std::string& where) {
  const double x = json_number(obj, key, fallback, where, true, double(1 << 20));
  FSDP_CHECK(x == std::floor(x), where, ": \"", key, "\" must be a whole number, got ", obj.at(key).dump());
  return static_cast<int>(x);
}

Link json_link(const json& obj, const char* key, Link link, const std::string& where) {
  if (!obj.contains(key)) return link;
  const json& v = obj.at(key);
  const std::string at = where + "." + key;
  FSDP_CHECK(v.is_object(), at, " must be an object {\"bandwidth_gbps\": ..., \"latency_us\": ...}");
  json_keys(v, {"bandwidth_gbps", "latency_us"}, at);
  link.bandwidth_gbps(json_number(v, "bandwidth_gbps", link.bandwidth_gbps(), at, true));
  link.latency_us(json_number(v, "latency_us", link.latency_us(), at));
  return link;
}

}  // namespace

std::vector<std::string> Cluster::preset_names() {
  std::vector<std::string> names;
  for (const auto& p : presets()) names.emplace_back(p.name);
  return names;
}

namespace {
// The preset's own ranks per node (8 GPUs of a node; 1 for the CPU machine), or 0 for an unknown name.
int preset_ranks_per_node(const std::string& name) {
  for (const auto& p : presets())
    if (lower_case(name) == p.name) return p.ranks_per_node;
  return 0;
}
}  // namespace

Cluster Cluster::preset(const std::string& name, int nodes, int ranks_per_node) {
  FSDP_CHECK(nodes >= 1 && ranks_per_node >= 1, "cluster ", name, ": nodes and ranks per node must be >= 1, got ",
             nodes, "x", ranks_per_node);
  FSDP_CHECK(int64_t{nodes} * ranks_per_node <= (int64_t{1} << 24), "cluster ", name, ": ", nodes, "x", ranks_per_node,
             " is ", int64_t{nodes} * ranks_per_node, " ranks; at most 2^24 are planned");
  for (const auto& p : presets()) {
    if (lower_case(name) != p.name) continue;
    Cluster c;
    c.device = p.device;
    c.nodes = nodes;
    c.ranks_per_node = ranks_per_node;
    c.intra = p.intra;
    c.inter = p.inter;
    c.host_memory_bytes = int64_t(p.host_gib * kBytesPerGiB);
    c.host_device_gbps = p.host_device_gbps;
    c.device_is_host = p.device_is_host;
    c.separate_comm_lanes = !p.device_is_host;
    // Ranks on one host share its memory.
    if (c.device_is_host) c.device.memory_bytes = c.host_memory_bytes / ranks_per_node;
    return c;
  }
  std::string known;
  for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
  FSDP_FAIL("unknown cluster preset '", name, "'; known: ", known);
}

Cluster Cluster::parse(const std::string& text) {
  const auto first = text.find_first_not_of(" \t\r\n");
  const std::string spec =
      first == std::string::npos ? "" : text.substr(first, text.find_last_not_of(" \t\r\n") + 1 - first);
  FSDP_CHECK(!spec.empty(), "empty cluster spec; expected e.g. a100-80g:64x8, cpu:1x4 or a JSON file");
  // A path: a JSON file by its name, or anything naming a directory.
  if ((spec.size() > 5 && lower_case(spec.substr(spec.size() - 5)) == ".json") || spec.find('/') != std::string::npos)
    return from_file(spec);
  const auto colon = spec.find(':');
  if (colon == std::string::npos) {
    struct stat info {};
    const bool is_preset = preset_ranks_per_node(spec) > 0;
    if (!is_preset && ::stat(spec.c_str(), &info) == 0) return from_file(spec);
    return preset(spec, 1, std::max(1, preset_ranks_per_node(spec)));
  }
  const std::string shape = lower_case(spec.substr(colon + 1));
  const auto x = shape.find('x');
  int nodes = 0, ranks = 0;
  try {
    FSDP_CHECK(x != std::string::npos, "");
    size_t used = 0;
    nodes = std::stoi(shape.substr(0, x), &used);
    FSDP_CHECK(used == x, "");
    ranks = std::stoi(shape.substr(x + 1), &used);
    FSDP_CHECK(used == shape.size() - x - 1, "");
  } catch (const std::exception&) {
    FSDP_FAIL("cluster spec '", spec, "': expected NAME:NODESxRANKS_PER_NODE, e.g. a100-80g:64x8");
  }
  return preset(spec.substr(0, colon), nodes, ranks);
}

Cluster Cluster::from_file(const std::string& path) {
  struct stat info {};
  FSDP_CHECK(::stat(path.c_str(), &info) == 0, "cannot read the cluster file ", path, ": no such file");
  FSDP_CHECK(S_ISREG(info.st_mode), "cannot read the cluster file ", path,
             ": not a regular file (give a JSON file's path, a preset's name or NAME:NODESxRANKS_PER_NODE)");
  std::ifstream in(path);
  FSDP_CHECK(in.good(), "cannot read the cluster file ", path);
  std::stringstream text;
  text << in.rdbuf();
  FSDP_CHECK(!in.bad(), "cannot read the cluster file ", path, ": read failed");
  return from_json(text.str(), path);
}

Cluster Cluster::from_json(const std::string& text, const std::string& source) {
  json j;
  // Keys seen so far in each object being parsed: a repeated key would otherwise keep its last value silently.
  std::vector<std::vector<std::string>> open;
  std::string repeated;
  const json::parser_callback_t track = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) open.emplace_back();
    if (event == json::parse_event_t::object_end && !open.empty()) open.pop_back();
    if (event == json::parse_event_t::key && !open.empty() && parsed.is_string()) {
      const std::string key = parsed.get<std::string>();
      for (const auto& k : open.back())
        if (k == key && repeated.empty()) repeated = key;
      open.back().push_back(key);
    }
    return true;
  };
  try {
    j = json::parse(text, track);
  } catch (const std::exception& e) {
    FSDP_FAIL(source, ": not JSON: ", e.what());
  }
  FSDP_CHECK(repeated.empty(), source, ": the key \"", repeated, "\" appears twice in one object; keep one");
  FSDP_CHECK(j.is_object(), source, ": expected a JSON object");
  json_keys(j, {"preset", "nodes", "ranks_per_node", "device", "intra", "inter", "host_memory_gib", "host_device_gbps"},
            source);
  FSDP_CHECK(!j.contains("preset") || j.at("preset").is_string(), source, ": \"preset\" must be a preset's name");
  const std::string name = j.contains("preset") ? j.at("preset").get<std::string>() : "cpu";
  Cluster c = preset(name, json_count(j, "nodes", 1, source),
                     json_count(j, "ranks_per_node", std::max(1, preset_ranks_per_node(name)), source));
  if (j.contains("device")) {
    const json& d = j.at("device");
    const std::string at = source + ".device";
    FSDP_CHECK(d.is_object(), at, " must be an object");
    json_keys(d, {"name", "memory_gib", "peak_tflops_fp32", "peak_tflops_16", "memory_gbps", "matmul_efficiency"}, at);
    FSDP_CHECK(!d.contains("name") || d.at("name").is_string(), at, ": \"name\" must be a string");
    if (d.contains("name")) c.device.name = d.at("name").get<std::string>();
    c.device.memory_bytes = int64_t(
        json_number(d, "memory_gib", double(c.device.memory_bytes) / kBytesPerGiB, at, true, 1e9) * kBytesPerGiB);
    c.device.peak_flops_fp32 = json_number(d, "peak_tflops_fp32", c.device.peak_flops_fp32 / 1e12, at, true) * 1e12;
    c.device.peak_flops_16 = json_number(d, "peak_tflops_16", c.device.peak_flops_16 / 1e12, at, true) * 1e12;
    c.device.memory_gbps = json_number(d, "memory_gbps", c.device.memory_gbps, at, true);
    c.device.matmul_efficiency = json_number(d, "matmul_efficiency", c.device.matmul_efficiency, at, true, 1.0);
  }
  c.intra = json_link(j, "intra", c.intra, source);
  c.inter = json_link(j, "inter", c.inter, source);
  c.host_memory_bytes = int64_t(
      json_number(j, "host_memory_gib", double(c.host_memory_bytes) / kBytesPerGiB, source, true, 1e9) * kBytesPerGiB);
  // A device apart from the host moves offloaded shards over a link that must have a rate.
  c.host_device_gbps = json_number(j, "host_device_gbps", c.host_device_gbps, source, !c.device_is_host);
  return c;
}

Link Cluster::link_for_group(int n) const {
  if (n <= ranks_per_node) return intra;
  // Where the groups fall on the nodes repeats every lcm(n, ranks_per_node) ranks: at most
  // ranks_per_node groups to look at, each's fewest ranks on a node at its first or last node.
  const int64_t period = std::lcm(static_cast<int64_t>(n), static_cast<int64_t>(ranks_per_node)) / n;
  const int64_t groups = std::min<int64_t>(period, world() / n);
  int64_t fewest = ranks_per_node;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t first = g * n, end = first + n;  // [first, end)
    fewest = std::min(fewest, ranks_per_node - first % ranks_per_node);
    if (end % ranks_per_node != 0) fewest = std::min(fewest, end % ranks_per_node);
  }
  return spanning_link(intra, inter, static_cast<int>(fewest));
}

std::string Cluster::describe() const {
  std::ostringstream o;
  o << device.name << ": " << nodes << " node" << (nodes == 1 ? "" : "s") << " x " << ranks_per_node << " rank"
    << (ranks_per_node == 1 ? "" : "s") << ", " << format_bytes(device.memory_bytes) << " per rank, "
    << short_number(device.peak_flops_16 / 1e12) << " TFLOP/s 16-bit, " << short_number(device.peak_flops_fp32 / 1e12)
    << " TFLOP/s fp32, intra " << short_number(intra.bandwidth_gbps()) << " GB/s, inter "
    << short_number(inter.bandwidth_gbps()) << " GB/s";
  return o.str();
}

int64_t parse_bytes(const std::string& text) {
  const std::string range = "' is not a size: it must be a number of bytes from 0 to 8 EiB (2^63 - 1 B)";
  size_t i = 0;
  double value = 0;
  try {
    value = std::stod(text, &i);
  } catch (const std::exception&) {
    FSDP_FAIL("'", text, "' is not a size; expected e.g. 40GiB, 70GB, 512MiB");
  }
  // A decimal number only: stod also reads hexadecimal, inf and nan.
  const size_t first = text.find_first_not_of(" \t");
  const std::string number = text.substr(first, i - first);
  const bool decimal = number.find_first_not_of("0123456789.eE+-") == std::string::npos && number[0] != '+' &&
                       number[0] != '-' && number.find_first_of("0123456789") != std::string::npos;
  FSDP_CHECK(decimal, "'", text, range, ", e.g. 40GiB, 70GB, 512MiB");
  std::string unit;
  for (; i < text.size(); ++i)
    if (!std::isspace(static_cast<unsigned char>(text[i]))) unit += static_cast<char>(std::tolower(text[i]));
  // B, or a prefix k m g t p e with B (powers of 1000) or iB (powers of 1024).
  int64_t scale = unit.empty() || unit == "b" ? 1 : 0;
  const size_t prefix = unit.size() >= 2 ? std::string("kmgtpe").find(unit[0]) : std::string::npos;
  if (prefix != std::string::npos && (unit.substr(1) == "b" || unit.substr(1) == "ib")) {
    scale = 1;
    for (size_t k = 0; k <= prefix; ++k) scale *= unit[1] == 'i' ? 1024 : 1000;
  }
  FSDP_CHECK(scale > 0, "'", text, "' is not a size; units: B, KiB, MiB, GiB, TiB, PiB, EiB, KB, MB, GB, TB, PB, EB");
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  if (number.find_first_not_of("0123456789") == std::string::npos) {
    // Whole numbers exactly, up to 2^63 - 1 bytes: a double would round those past 2^53.
    int64_t whole = 0;
    for (const char c : number) {
      FSDP_CHECK(whole <= (kMax - (c - '0')) / 10, "'", text, range);
      whole = whole * 10 + (c - '0');
    }
    FSDP_CHECK(whole <= kMax / scale, "'", text, range);
    return whole * scale;
  }
  const double bytes = value * static_cast<double>(scale);
  // 2^63 is the first double past int64's range.
  FSDP_CHECK(std::isfinite(value) && value >= 0 && bytes < 9223372036854775808.0, "'", text, range);
  return static_cast<int64_t>(std::llround(bytes));
}

std::string format_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(2);
  const double m = std::fabs(b);
  if (m < 1024.0) return std::to_string(bytes) + " B";
  const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  double scaled = b / 1024.0;
  while (u < 5 && std::fabs(scaled) >= 1024.0) {
    scaled /= 1024.0;
    ++u;
  }
  o << scaled << " " << units[u];
  return o.str();
}

}  // namespace fsdp
