// The network model (include/fsdp/network_model.h): parsing FSDP_NETWORK_MODEL, and the ring
// formulas that every modeled time and byte count comes from.
#include "fsdp/network_model.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <map>
#include <sstream>

#include "fsdp/check.h"

namespace fsdp {
namespace {

constexpr const char* kEnvVar = "FSDP_NETWORK_MODEL";
constexpr const char* kExample =
    "intra_gbps=25,inter_gbps=12.5,ranks_per_host=8,latency_us=10 (bandwidths in GB/s = 1e9 bytes/s per rank, "
    "latencies in microseconds per ring step)";

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string fmt_number(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

// Keeps the model's arithmetic in one place: what Work::wait() sleeps for and what the statistics
// and the benchmark's formula column report come from here.
struct Formula {
  double steps;        // latency terms
  double wire_factor;  // bytes each rank sends / total bytes
};

Formula formula(Collective c, int n) {
  if (n <= 1) return {0, 0};
  const double nm1 = n - 1;
  switch (c) {
    case Collective::kAllGather:
    case Collective::kReduceScatter:
    case Collective::kAllToAll: return {nm1, nm1 / n};
    case Collective::kAllReduce: return {2 * nm1, 2 * nm1 / n};
    case Collective::kBroadcast: return {nm1, 1.0};
    case Collective::kBarrier: return {2 * nm1, 0.0};
  }
  return {0, 0};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// NetworkModel

void NetworkModel::validate(const std::string& source) const {
  auto check_link = [&](const Link& l, const char* which) {
    FSDP_CHECK(std::isfinite(l.bandwidth_gbps()) && l.bandwidth_gbps() > 0, source, ": the ", which,
               " bandwidth must be a positive number of GB/s, got ", l.bandwidth_gbps(), "; example: ", kExample);
    FSDP_CHECK(std::isfinite(l.latency_us()) && l.latency_us() >= 0, source, ": the ", which,
               " latency must be a non-negative number of microseconds, got ", l.latency_us(), "; example: ", kExample);
  };
  check_link(intra(), "intra-host");
  check_link(inter(), "inter-host");
  FSDP_CHECK(ranks_per_host() >= 0, source, ": ranks_per_host must be >= 1 (or 0 for LOCAL_WORLD_SIZE), got ",
             ranks_per_host());
}

NetworkModel NetworkModel::parse(const std::string& spec, const std::string& source) {
  const std::string where = source + "=\"" + spec + "\"";
  std::map<std::string, std::string> kv;
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item = trim(item);
    if (item.empty()) continue;
    const auto eq = item.find('=');
    FSDP_CHECK(eq != std::string::npos, where, ": '", item, "' is not key=value; example: ", kExample);
    const std::string key = lower(trim(item.substr(0, eq)));
    const std::string value = trim(item.substr(eq + 1));
    FSDP_CHECK(!kv.count(key), where, ": '", key, "' is given twice; give each key once");
    kv[key] = value;
  }
  FSDP_CHECK(!kv.empty(), where, ": no settings; example: ", kExample,
             ", or unset it / set it to \"off\" for no model");

  auto number = [&](const std::string& key) -> std::optional<double> {
    auto it = kv.find(key);
    if (it == kv.end()) return std::nullopt;
    const std::string& v = it->second;
    char* end = nullptr;
    errno = 0;
    const double x = std::strtod(v.c_str(), &end);
    FSDP_CHECK(!v.empty() && errno == 0 && end && *end == '\0' && std::isfinite(x), where, ": ", key, "='", v,
               "' is not a plain number (no units: bandwidths are GB/s, latencies microseconds); example: ", kExample);
    return x;
  };
  static const char* known[] = {
      "gbps", "intra_gbps", "inter_gbps", "latency_us", "intra_latency_us", "inter_latency_us", "ranks_per_host"};
  for (const auto& [key, value] : kv) {
    const bool ok = std::any_of(std::begin(known), std::end(known), [&name = key](const char* k) { return name == k; });
    FSDP_CHECK(ok, where, ": unknown key '", key,
               "'; known keys: gbps, intra_gbps, inter_gbps, latency_us, intra_latency_us, inter_latency_us, "
               "ranks_per_host; example: ",
               kExample);
  }

  NetworkModel m;
  const auto both_bw = number("gbps");
  const auto intra_bw = number("intra_gbps") ? number("intra_gbps") : both_bw;
  const auto inter_bw = number("inter_gbps") ? number("inter_gbps") : both_bw;
  FSDP_CHECK(intra_bw, where,
             ": the intra-host bandwidth is missing; add intra_gbps=<GB/s> (or gbps=<GB/s> for "
             "both links); example: ",
             kExample);
  FSDP_CHECK(inter_bw, where,
             ": the inter-host bandwidth is missing; add inter_gbps=<GB/s> (or gbps=<GB/s> for "
             "both links); example: ",
             kExample);
  const double both_lat = number("latency_us").value_or(0.0);
  m.intra(Link().bandwidth_gbps(*intra_bw).latency_us(number("intra_latency_us").value_or(both_lat)));
  m.inter(Link().bandwidth_gbps(*inter_bw).latency_us(number("inter_latency_us").value_or(both_lat)));
  if (auto rph = number("ranks_per_host")) {
    FSDP_CHECK(*rph >= 1 && *rph == std::floor(*rph) && *rph <= (1 << 20), where,
               ": ranks_per_host=", kv["ranks_per_host"],
               " must be a whole number >= 1 (omit it to use LOCAL_WORLD_SIZE)");
    m.ranks_per_host(static_cast<int>(*rph));
  }
  m.validate(where);
  return m;
}

std::optional<NetworkModel> NetworkModel::from_env() {
  const char* v = std::getenv(kEnvVar);
  if (!v) return std::nullopt;
  const std::string s = lower(trim(v));
  if (s.empty() || s == "off" || s == "none" || s == "0") return std::nullopt;
  return parse(v, kEnvVar);
}

std::string NetworkModel::describe() const {
  auto link = [](const Link& l) {
    return fmt_number(l.bandwidth_gbps()) + " GB/s + " + fmt_number(l.latency_us()) + " us/step";
  };
  return "modeled network: intra-host " + link(intra()) + ", inter-host " + link(inter()) + ", " +
         (ranks_per_host() ? std::to_string(ranks_per_host()) : std::string("LOCAL_WORLD_SIZE")) + " ranks/host";
}

double modeled_wire_bytes(Collective c, int64_t bytes, int n) {
  return formula(c, n).wire_factor * static_cast<double>(bytes);
}

double modeled_seconds(Collective c, int64_t bytes, int n, const Link& link) {
  const Formula f = formula(c, n);
  return f.steps * link.latency_us() * 1e-6 +
         f.wire_factor * static_cast<double>(bytes) / (link.bandwidth_gbps() * 1e9);
}

int fewest_per_host(const std::vector<int>& ranks, int ranks_per_host) {
  FSDP_CHECK(ranks_per_host >= 1, "fewest_per_host: ranks_per_host must be >= 1, got ", ranks_per_host);
  std::map<int, int> on_host;
  for (const int r : ranks) ++on_host[r / ranks_per_host];
  int fewest = 0;
  for (const auto& [host, count] : on_host) fewest = fewest == 0 ? count : std::min(fewest, count);
  return fewest;
}

Link spanning_link(const Link& intra, const Link& inter, int per_host) {
  if (per_host <= 1) return inter;
  const double h = per_host;
  return Link()
      .bandwidth_gbps(std::min(h * inter.bandwidth_gbps(), h / (h - 1) * intra.bandwidth_gbps()))
      .latency_us(inter.latency_us());
}

}  // namespace fsdp
