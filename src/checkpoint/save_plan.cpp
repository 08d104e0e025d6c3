#include "checkpoint/save_plan.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "checkpoint/collective.h"
#include "checkpoint/data_file.h"
#include "checkpoint/file_io.h"
#include "checkpoint/hash.h"
#include "checkpoint/optimizer_options.h"
#include "fsdp/check.h"

namespace fsdp::checkpoint::detail {

using nlohmann::json;

namespace {

std::string rank_file_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank-%05d.bin", rank);
  return buf;
}

// Which flat elements [lo, lo + shard_numel) this rank holds, and which part of them it writes:
// replicas (NO_SHARD, HYBRID_SHARD's groups) split their common shard so each element is written once.
struct WriteRange {
  int64_t lo = 0;              // this rank's shard in flat coordinates
  int64_t begin = 0, end = 0;  // the part it writes, flat coordinates
};

WriteRange write_range(const FsdpState& state, const FlatParam& fp) {
  const ShardingGroups& g = state.groups();
  const int world_rank = g.world_comm->rank();
  WriteRange w;
  int replicas = 1, replica = 0;
  if (g.keep_unsharded) {
    replicas = g.world_comm->size(), replica = world_rank;
  } else {
    w.lo = int64_t(g.shard_comm->rank()) * fp.shard_numel();
    if (g.replicate_comm) replicas = g.replicate_comm->size(), replica = g.replicate_comm->rank();
  }
  const int64_t n = fp.shard_numel();
  w.begin = w.lo + n * replica / replicas;
  w.end = w.lo + n * (replica + 1) / replicas;
  return w;
}

// A JSON pointer to `key` under `base` (escaped as RFC 6901 asks).
json::json_pointer pointer_to(const std::string& base, const std::string& key) {
  std::string escaped;
  for (char c : key) escaped += c == '~' ? std::string("~0") : c == '/' ? std::string("~1") : std::string(1, c);
  return json::json_pointer(base + "/" + escaped);
}

}  // namespace

RankPlan plan_rank_file(FsdpState& state, torch::optim::Optimizer* optimizer, OptimizerKind kind, int rank,
                        bool snapshot) {
  auto keep = [snapshot](const at::Tensor& t) {
    if (!snapshot) return t;
    return t.device().is_cpu() ? t.clone() : t.to(at::kCPU);
  };
  const auto groups = groups_by_tensor(optimizer);
  RankPlan plan;
  plan.file_name = rank_file_name(rank);
  json pieces = json::array();
  for (const auto& fp : state.flat_params()) {
    const WriteRange w = write_range(state, *fp);
    for (const auto& s : fp->slots()) {
      if (!s.piece.defined()) continue;
      const int64_t piece_lo = w.lo + s.piece_offset;  // flat coordinates
      const int64_t b = std::max(piece_lo, w.begin), e = std::min(piece_lo + s.piece_numel, w.end);
      if (b >= e) continue;
      const int64_t at = b - piece_lo, n = e - b;
      const std::string here = "/pieces/" + std::to_string(pieces.size());
      json pj{{"param", s.name}, {"begin", b - s.offset}, {"end", e - s.offset}, {"offset", 0}};
      plan.tensors.emplace_back(keep(s.piece.detach().narrow(0, at, n)), pointer_to(here, "offset"));
      auto g = groups.find(s.piece.unsafeGetTensorImpl());
      pj["group"] = g == groups.end() ? -1 : g->second;
      if (g != groups.end()) {
        const PieceState ps = get_piece_state(kind, *optimizer, s.piece);
        if (ps.present) {
          pj["step"] = ps.step;
          pj["state"] = json::object();
          for (const auto& [name, t] : ps.tensors) {
            FSDP_CHECK(t.scalar_type() == s.piece.scalar_type() && t.numel() == s.piece_numel,
                       "checkpoint::save: optimizer state '", name, "' of '", s.name, "' has dtype ", t.scalar_type(),
                       " and ", t.numel(), " elements, not the parameter piece's ", s.piece.scalar_type(), " and ",
                       s.piece_numel, "; was the optimizer built over FullyShardedModule::parameters()?");
            pj["state"][name] = 0;
            plan.tensors.emplace_back(keep(t.detach().reshape({-1}).narrow(0, at, n)),
                                      pointer_to(here + "/state", name));
          }
        }
      }
      pieces.push_back(std::move(pj));
    }
  }
  json buffers = json::array();
  if (rank == 0)
    for (const auto& w : state.whole_tensors()) {
      if (w.tensor.numel())
        plan.tensors.emplace_back(keep(w.tensor.detach()),
                                  pointer_to("/buffers/" + std::to_string(buffers.size()), "offset"));
      buffers.push_back({{"name", w.name}, {"offset", 0}});
    }
  plan.report = {{"pieces", std::move(pieces)}, {"buffers", std::move(buffers)}};
  return plan;
}

std::string write_rank_file(RankPlan& plan, const std::string& tmp) {
  DataWriter writer(join_path(tmp, plan.file_name), plan.file_name);
  for (auto& [t, where] : plan.tensors) {
    plan.report[where] = writer.append(t);
    t = at::Tensor();
  }
  const FileEntry f = writer.finish();
  std::vector<std::string> chunks;
  for (uint64_t h : f.chunk_hashes) chunks.push_back(to_hex(h));
  plan.report["file"] = {{"name", f.name}, {"bytes", f.bytes}, {"chunks", chunks}};
  return plan.report.dump();
}

Manifest manifest_skeleton(FsdpState& state, torch::optim::Optimizer* optimizer, OptimizerKind kind,
                           const std::map<std::string, std::string>& extra) {
  Manifest m;
  m.world_size = state.groups().world_size;
  m.sharding_strategy = to_string(state.options().sharding_strategy());
  m.sharding_factor = state.groups().sharding_factor;
  m.chunk_bytes = kChunkBytes;
  m.optimizer_kind = to_string(kind);
  if (optimizer)
    for (const auto& g : optimizer->param_groups()) m.optimizer_groups.push_back(group_options(kind, g.options()));
  if (optimizer && !m.optimizer_groups.empty()) add_optimizer_scalars(kind, *optimizer, m.optimizer_groups.front());
  m.extra = extra;
  for (const auto& fp : state.flat_params())
    for (const auto& s : fp->slots()) {
      TensorEntry t;
      t.name = s.name;
      t.aliases = s.aliases;
      t.shape = s.shape;
      t.dtype = dtype_name(fp->dtype());
      t.numel = s.numel;
      m.parameters.push_back(std::move(t));
    }
  for (const auto& w : state.whole_tensors()) {  // buffers and ignored parameters: rank 0's, whole
    TensorEntry b;
    b.name = w.name;
    b.shape = w.tensor.sizes().vec();
    b.dtype = dtype_name(w.tensor.scalar_type());
    b.numel = w.tensor.numel();
    m.buffers.push_back(std::move(b));
  }
  return m;
}

void add_reports(Manifest& m, const std::vector<std::string>& reports) {
  std::map<std::string, size_t> index, buffer_index;
  for (size_t i = 0; i < m.parameters.size(); ++i) index[m.parameters[i].name] = i;
  for (size_t i = 0; i < m.buffers.size(); ++i) buffer_index[m.buffers[i].name] = i;
  std::vector<bool> group_seen(m.parameters.size(), false);
  for (size_t r = 0; r < reports.size(); ++r) {
    const json j = json::parse(reports[r]);
    FileEntry f;
    f.name = j["file"]["name"].get<std::string>();
    f.bytes = j["file"]["bytes"].get<uint64_t>();
    for (const auto& h : j["file"]["chunks"]) {
      uint64_t v = 0;
      FSDP_CHECK(parse_hex(h.get<std::string>(), &v), "internal: bad chunk checksum from rank ", r);
      f.chunk_hashes.push_back(v);
    }
    const int file = static_cast<int>(m.files.size());
    m.files.push_back(std::move(f));
    for (const auto& pj : j["pieces"]) {
      auto it = index.find(pj["param"].get<std::string>());
      FSDP_CHECK(it != index.end(), "internal: rank ", r, " saved an unknown parameter");
      TensorEntry& t = m.parameters[it->second];
      PieceEntry p;
      p.begin = pj["begin"].get<int64_t>();
      p.end = pj["end"].get<int64_t>();
      p.file = file;
      p.offset = pj["offset"].get<uint64_t>();
      p.has_state = pj.contains("state");
      if (p.has_state) {
        p.step = pj["step"].get<int64_t>();
        for (auto s = pj["state"].begin(); s != pj["state"].end(); ++s) p.state[s.key()] = s->get<uint64_t>();
      }
      const int group = pj["group"].get<int>();
      FSDP_CHECK(!group_seen[it->second] || t.group == group, "checkpoint::save: parameter '", t.name,
                 "' is in different optimizer groups on different ranks; build the same groups on every rank");
      group_seen[it->second] = true;
      t.group = group;
      t.pieces.push_back(std::move(p));
    }
    for (const auto& bj : j["buffers"]) {
      TensorEntry& b = m.buffers[buffer_index.at(bj["name"].get<std::string>())];
      if (b.numel > 0) {
        PieceEntry p;
        p.begin = 0;
        p.end = b.numel;
        p.file = file;
        p.offset = bj["offset"].get<uint64_t>();
        b.pieces.push_back(p);
      }
    }
  }
}

void publish(const Manifest& m, const std::string& tmp, const std::string& dir, bool overwrite, uint64_t random) {
  const std::string text = to_json(m);
  parse_manifest(text, join_path(tmp, kManifestName));  // never publish what load() would refuse
  File f = File::create(join_path(tmp, kManifestName));
  f.write_all(text.data(), text.size());
  f.sync();
  f.close();
  sync_dir(tmp);
  const std::string parent = parent_dir(dir);
  if (path_exists(dir)) {
    FSDP_CHECK(overwrite, "checkpoint::save: '", dir,
               "' exists; save to a new directory, or set "
               "SaveOptions().overwrite(true) to replace it");
    // The old checkpoint stays complete until the new one has its name.
    std::string old = dir;
    while (old.size() > 1 && old.back() == '/') old.pop_back();
    old += ".old-" + to_hex(random);
    rename_path(dir, old);
    rename_path(tmp, dir);
    sync_dir(parent);
    remove_all(old);
  } else {
    rename_path(tmp, dir);
  }
  sync_dir(parent);
}

}  // namespace fsdp::checkpoint::detail
