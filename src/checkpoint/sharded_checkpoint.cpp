// Sharded checkpoints: save (each rank writes its pieces, rank 0 publishes the manifest last),
// load at any layout (each rank reads only the saved byte ranges its pieces overlap), latest().
// See Note [Checkpoint format] in docs/design.md.
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "checkpoint/collective.h"
#include "checkpoint/data_file.h"
#include "checkpoint/file_io.h"
#include "checkpoint/manifest.h"
#include "checkpoint/optimizer_state.h"
#include "fsdp/check.h"
#include "fsdp/checkpoint.h"
#include "internal_op_guard.h"
#include "state_access.h"

namespace fsdp::checkpoint {

using namespace detail;
using nlohmann::json;

namespace {

std::string rank_file_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank-%05d.bin", rank);
  return buf;
}

std::string join(const std::string& dir, const std::string& name) { return dir + "/" + name; }

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream o;
  o << at::IntArrayRef(shape);
  return o.str();
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

// Optimizer parameter group of each tensor (by TensorImpl), for the pieces the optimizer holds.
std::map<const c10::TensorImpl*, int> groups_by_tensor(const torch::optim::Optimizer* optimizer) {
  std::map<const c10::TensorImpl*, int> out;
  if (!optimizer) return out;
  const auto& groups = optimizer->param_groups();
  for (size_t g = 0; g < groups.size(); ++g)
    for (const auto& p : groups[g].params()) out[p.unsafeGetTensorImpl()] = static_cast<int>(g);
  return out;
}

// The optimizer must hold shard pieces of this model only.
void check_optimizer_holds_pieces(const FsdpState& state, const torch::optim::Optimizer* optimizer, const char* what) {
  if (!optimizer) return;
  std::set<const c10::TensorImpl*> pieces;
  for (const auto& fp : state.flat_params())
    for (const auto& s : fp->slots())
      if (s.piece.defined()) pieces.insert(s.piece.unsafeGetTensorImpl());
  for (const auto& group : optimizer->param_groups())
    for (const auto& p : group.params())
      FSDP_CHECK(
          pieces.count(p.unsafeGetTensorImpl()), what, ": the optimizer holds a tensor (shape ", p.sizes(),
          ") that is not a shard piece of this model; build the optimizer over FullyShardedModule::parameters()");
}

// A JSON pointer to `key` under `base` (escaped as RFC 6901 asks).
json::json_pointer pointer_to(const std::string& base, const std::string& key) {
  std::string escaped;
  for (char c : key) escaped += c == '~' ? std::string("~0") : c == '/' ? std::string("~1") : std::string(1, c);
  return json::json_pointer(base + "/" + escaped);
}

}  // namespace

namespace detail {
// What one rank writes: its tensors in file order, each with the place in `report` (the JSON the
// manifest needs from this rank) that receives its offset in the file.
struct RankPlan {
  std::string file_name;
  json report;
  std::vector<std::pair<at::Tensor, json::json_pointer>> tensors;
};
}  // namespace detail

namespace {

// This rank's plan. snapshot: the tensors are host copies (training may go on), else views.
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
    for (const auto& [name, t] : state.buffers()) {
      if (t.numel())
        plan.tensors.emplace_back(keep(t.detach()), pointer_to("/buffers/" + std::to_string(buffers.size()), "offset"));
      buffers.push_back({{"name", name}, {"offset", 0}});
    }
  plan.report = {{"pieces", std::move(pieces)}, {"buffers", std::move(buffers)}};
  return plan;
}

// Writes the plan's data file into `tmp` (each host copy released once written); its report.
std::string write_rank_file(RankPlan& plan, const std::string& tmp) {
  DataWriter writer(join(tmp, plan.file_name), plan.file_name);
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

// Rank 0: the manifest's model, optimizer and user parts (no files or pieces yet).
Manifest manifest_skeleton(FsdpState& state, torch::optim::Optimizer* optimizer, OptimizerKind kind,
                           const Extra& extra) {
  Manifest m;
  m.world_size = state.groups().world_size;
  m.sharding_strategy = to_string(state.options().sharding_strategy());
  m.sharding_factor = state.groups().sharding_factor;
  m.chunk_bytes = kChunkBytes;
  m.optimizer_kind = to_string(kind);
  if (optimizer)
    for (const auto& g : optimizer->param_groups()) m.optimizer_groups.push_back(group_options(kind, g.options()));
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
  for (const auto& [name, t] : state.buffers()) {
    TensorEntry b;
    b.name = name;
    b.shape = t.sizes().vec();
    b.dtype = dtype_name(t.scalar_type());
    b.numel = t.numel();
    m.buffers.push_back(std::move(b));
  }
  return m;
}

// Rank 0: every rank's file and pieces into the manifest, from their reports.
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

// Rank 0: writes the manifest into `tmp` last, makes it durable and renames `tmp` to `dir`.
void publish(const Manifest& m, const std::string& tmp, const std::string& dir, bool overwrite, uint64_t random) {
  const std::string text = to_json(m);
  parse_manifest(text, join(tmp, kManifestName));  // never publish what load() would refuse
  File f = File::create(join(tmp, kManifestName));
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

std::string last_component(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const auto slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

// The manifest of a complete checkpoint at `dir`, with every file's size checked.
Manifest read_manifest(const std::string& dir) {
  FSDP_CHECK(last_component(dir).find(".tmp-") == std::string::npos, "'", dir,
             "' is the directory of a save that did not finish (*.tmp-*); it is not a checkpoint. "
             "Use checkpoint::latest(root) to find the newest complete one");
  const std::string path = join(dir, kManifestName);
  if (!path_exists(path)) {
    FSDP_CHECK(path_exists(dir), "no checkpoint at '", dir, "': the directory does not exist");
    FSDP_FAIL("'", dir, "' has no ", kManifestName,
              ": it is not a complete checkpoint (a save that did not "
              "finish, or not a checkpoint directory). Use checkpoint::latest(root) to find a complete one");
  }
  return parse_manifest(read_file(path, kMaxManifestBytes), path);
}

// Checks that `m` describes this model: the same parameters (names, tied names, shapes, dtypes)
// and buffers. Returns, per FlatParam and slot, the manifest entry.
std::vector<std::vector<const TensorEntry*>> match_model(const FsdpState& state, const Manifest& m,
                                                         const std::string& dir) {
  const std::string prefix = "checkpoint '" + dir + "' does not match the model: ";
  const std::string hint = " (a checkpoint of another model? load a checkpoint of this model, or load_full "
                           "a safetensors file with these names)";
  std::map<std::string, const TensorEntry*> by_name;
  for (const auto& t : m.parameters) {
    by_name[t.name] = &t;
    for (const auto& a : t.aliases) by_name[a] = &t;
  }
  std::set<const TensorEntry*> matched;
  std::vector<std::vector<const TensorEntry*>> out;
  for (const auto& fp : state.flat_params()) {
    out.emplace_back();
    for (const auto& s : fp->slots()) {
      auto it = by_name.find(s.name);
      FSDP_CHECK(it != by_name.end(), prefix, "it has no parameter '", s.name, "'", hint);
      const TensorEntry& t = *it->second;
      FSDP_CHECK(t.shape == s.shape, prefix, "parameter '", s.name, "' has shape ", shape_str(t.shape),
                 " in the checkpoint and ", shape_str(s.shape), " in the model", hint);
      FSDP_CHECK(t.dtype == dtype_name(fp->dtype()), prefix, "parameter '", s.name, "' has dtype ", t.dtype,
                 " in the checkpoint and ", dtype_name(fp->dtype()), " in the model", hint);
      std::set<std::string> mine{s.name}, theirs{t.name};
      mine.insert(s.aliases.begin(), s.aliases.end());
      theirs.insert(t.aliases.begin(), t.aliases.end());
      FSDP_CHECK(mine == theirs, prefix, "parameter '", s.name, "' is tied to ", mine.size() - 1,
                 " other names in the model and to ", theirs.size() - 1, " in the checkpoint", hint);
      matched.insert(&t);
      out.back().push_back(&t);
    }
  }
  for (const auto& t : m.parameters)
    FSDP_CHECK(matched.count(&t), prefix, "the model has no parameter '", t.name, "'", hint);
  std::map<std::string, const TensorEntry*> buffers;
  for (const auto& b : m.buffers) buffers[b.name] = &b;
  for (const auto& [name, t] : state.buffers()) {
    auto it = buffers.find(name);
    FSDP_CHECK(it != buffers.end(), prefix, "it has no buffer '", name, "'", hint);
    FSDP_CHECK(it->second->shape == t.sizes().vec() && it->second->dtype == dtype_name(t.scalar_type()), prefix,
               "buffer '", name, "' is ", it->second->dtype, " ", shape_str(it->second->shape),
               " in the checkpoint and ", dtype_name(t.scalar_type()), " ", shape_str(t.sizes().vec()), " in the model",
               hint);
    buffers.erase(it);
  }
  FSDP_CHECK(buffers.empty(), prefix, "the model has no buffer '", buffers.empty() ? "" : buffers.begin()->first, "'",
             hint);
  return out;
}

// Reads checkpoint data files on demand, each opened once.
class Readers {
 public:
  Readers(const std::string& dir, const Manifest& m) : dir_(dir), m_(m), readers_(m.files.size()) {}
  void add(int file, uint64_t offset, uint64_t bytes, void* dest) {
    requests_[file].push_back({offset, bytes, static_cast<char*>(dest)});
  }
  void run() {
    for (auto& [file, reqs] : requests_) {
      if (!readers_[file])
        readers_[file] = std::make_unique<DataReader>(join(dir_, m_.files[file].name), m_.files[file], m_.chunk_bytes);
      readers_[file]->read(std::move(reqs));
    }
    requests_.clear();
  }

 private:
  std::string dir_;
  const Manifest& m_;
  std::vector<std::unique_ptr<DataReader>> readers_;
  std::map<int, std::vector<ReadRequest>> requests_;
};

// Requests for elements [b, e) of a flattened tensor described by `t` (its pieces, or one of their
// state tensors) into `dest` (CPU, contiguous, element b at dest).
void request_range(Readers& readers, const TensorEntry& t, int64_t b, int64_t e, int64_t esize, char* dest,
                   const std::string& state_name) {
  for (const auto& p : t.pieces) {
    const int64_t ob = std::max(b, p.begin), oe = std::min(e, p.end);
    if (ob >= oe) continue;
    uint64_t base = p.offset;
    if (!state_name.empty()) {
      auto it = p.state.find(state_name);
      FSDP_CHECK(it != p.state.end(), "internal: state '", state_name, "' missing from a piece of '", t.name, "'");
      base = it->second;
    }
    readers.add(p.file, base + static_cast<uint64_t>((ob - p.begin) * esize), static_cast<uint64_t>((oe - ob) * esize),
                dest + (ob - b) * esize);
  }
}

void load_local(const std::string& dir, FsdpState& state, torch::optim::Optimizer* optimizer, Manifest& m) {
  const OptimizerKind kind = optimizer_kind(optimizer);
  check_optimizer_holds_pieces(state, optimizer, "checkpoint::load");
  m = read_manifest(dir);
  const auto entries = match_model(state, m, dir);
  if (optimizer) {
    FSDP_CHECK(m.optimizer_kind != "none", "checkpoint '", dir,
               "' was saved without optimizer state; pass no "
               "optimizer (nullptr) to load the model alone");
    FSDP_CHECK(m.optimizer_kind == to_string(kind), "checkpoint '", dir, "' holds the state of an optimizer of kind '",
               m.optimizer_kind, "', but the optimizer given is of kind '", to_string(kind),
               "'; load it into one of "
               "kind '",
               m.optimizer_kind, "', or pass nullptr to load the model alone");
  }
  const auto groups = groups_by_tensor(optimizer);

  // Group options: each optimizer group takes the saved options of the group its parameters were in.
  if (optimizer) {
    std::vector<int> saved_group(optimizer->param_groups().size(), -1);
    for (size_t f = 0; f < state.flat_params().size(); ++f) {
      const auto& slots = state.flat_params()[f]->slots();
      for (size_t i = 0; i < slots.size(); ++i) {
        auto g = slots[i].piece.defined() ? groups.find(slots[i].piece.unsafeGetTensorImpl()) : groups.end();
        const int saved = entries[f][i]->group;
        if (g == groups.end() || saved < 0) continue;
        FSDP_CHECK(saved_group[g->second] < 0 || saved_group[g->second] == saved, "checkpoint '", dir,
                   "': optimizer group ", g->second, " holds parameters that were saved in different groups (",
                   saved_group[g->second], " and ", saved, "); build the optimizer's groups as when it was saved");
        saved_group[g->second] = saved;
      }
    }
    for (size_t g = 0; g < saved_group.size(); ++g)
      if (saved_group[g] >= 0)
        restore_group_options(kind, m.optimizer_groups[saved_group[g]], optimizer->param_groups()[g].options(), dir);
  }

  state.scheduler().reshard_all();
  state.scheduler().forget_last_used();
  Readers readers(dir, m);
  const int64_t lo_rank = state.groups().keep_unsharded ? 0 : state.groups().shard_comm->rank();
  for (size_t f = 0; f < state.flat_params().size(); ++f) {
    FlatParam& fp = *state.flat_params()[f];
    const int64_t lo = lo_rank * fp.shard_numel();
    const int64_t esize = fp.element_size();
    struct Pending {
      at::Tensor piece, staging;  // staging: CPU copy for a piece on another device
      PieceState optimizer_state;
    };
    std::vector<Pending> pending;
    for (size_t i = 0; i < fp.slots().size(); ++i) {
      const ParamSlot& s = fp.slots()[i];
      if (!s.piece.defined()) continue;
      const TensorEntry& t = *entries[f][i];
      const int64_t b = lo + s.piece_offset - s.offset, e = b + s.piece_numel;  // the piece's elements of the parameter
      Pending p;
      p.piece = s.piece;
      at::Tensor dest = s.piece.device().is_cpu()
                            ? s.piece.detach()
                            : at::empty({s.piece_numel}, s.piece.options().device(at::kCPU).requires_grad(false));
      if (!s.piece.device().is_cpu()) p.staging = dest;
      request_range(readers, t, b, e, esize, static_cast<char*>(dest.data_ptr()), "");
      const bool in_optimizer = groups.count(s.piece.unsafeGetTensorImpl()) > 0;
      if (optimizer && in_optimizer && !t.pieces.empty() && t.pieces.front().has_state) {
        p.optimizer_state.present = true;
        p.optimizer_state.step = t.pieces.front().step;
        for (const auto& kv : t.pieces.front().state) {
          at::Tensor st = at::empty({s.piece_numel}, at::TensorOptions().dtype(fp.dtype()));
          request_range(readers, t, b, e, esize, static_cast<char*>(st.data_ptr()), kv.first);
          p.optimizer_state.tensors[kv.first] = st;
        }
      }
      pending.push_back(std::move(p));
    }
    readers.run();
    for (auto& p : pending) {
      if (p.staging.defined())
        p.piece.detach().copy_(p.staging);
      else
        torch::autograd::impl::bump_version(p.piece);  // written in place: the shard changed
      if (!optimizer || !groups.count(p.piece.unsafeGetTensorImpl())) continue;
      for (auto& kv : p.optimizer_state.tensors) kv.second = kv.second.to(p.piece.device());
      set_piece_state(kind, *optimizer, p.piece, p.optimizer_state);
    }
  }
  // Buffers (replicated): every rank reads them whole.
  std::map<std::string, const TensorEntry*> buffers;
  for (const auto& b : m.buffers) buffers[b.name] = &b;
  std::vector<std::pair<at::Tensor, at::Tensor>> buffer_copies;
  for (const auto& [name, t] : state.buffers()) {
    const TensorEntry& e = *buffers.at(name);
    at::Tensor staging = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()));
    request_range(readers, e, 0, e.numel, t.element_size(), static_cast<char*>(staging.data_ptr()), "");
    buffer_copies.emplace_back(t, staging);
  }
  readers.run();
  for (auto& [buffer, staging] : buffer_copies) buffer.detach().copy_(staging);
}

bool complete_manifest(const std::string& dir, Manifest* out) {
  try {
    Manifest m = read_manifest(dir);
    for (const auto& f : m.files) {
      std::error_code ec;
      const auto size = std::filesystem::file_size(join(dir, f.name), ec);
      if (ec || size != f.bytes) return false;
    }
    if (out) *out = std::move(m);
    return true;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace

namespace detail {

// A save between its collective start (validated, temporary directory made, this rank's plan)
// and its end (files written, failures agreed, manifest published).
struct PreparedSave {
  std::string what, dir, tmp;
  bool overwrite = false;
  uint64_t random = 0;
  RankPlan plan;
  Manifest manifest;  // rank 0: all but the files and pieces
};

// The background half of async_save: the thread finishing one PreparedSave over `comm`.
struct SaveJob {
  PreparedSave save;
  CommunicatorPtr comm;
  std::thread thread;
  std::mutex join_mu;
  std::atomic<bool> finished{false};
  std::exception_ptr error;
  void join() {
    std::lock_guard<std::mutex> lock(join_mu);
    if (thread.joinable()) thread.join();
  }
  ~SaveJob() { join(); }
};

}  // namespace detail

namespace {

void remove_temporary(int rank, const std::string& tmp) {
  if (rank != 0) return;
  std::error_code ec;
  std::filesystem::remove_all(tmp, ec);  // best effort: a partial save is never loaded anyway
}

// Collective over `world`: validates, makes the temporary directory and plans this rank's file.
PreparedSave prepare_save(FsdpState& state, Communicator& world, const std::string& what, const std::string& dir,
                          torch::optim::Optimizer* optimizer, const Extra& extra, const SaveOptions& options,
                          bool snapshot) {
  const int rank = world.rank();
  PreparedSave p;
  p.what = what;
  p.dir = dir;
  p.overwrite = options.overwrite();
  p.random = shared_random(world);
  p.tmp = temporary_name(dir, p.random);
  try {
    run_agreed(world, what, [&] {
      const OptimizerKind kind = optimizer_kind(optimizer);
      check_optimizer_holds_pieces(state, optimizer, "checkpoint::save");
      FSDP_CHECK(options.overwrite() || rank != 0 || !path_exists(dir), "checkpoint::save: '", dir,
                 "' exists; save to a new directory, or set SaveOptions().overwrite(true) to replace it");
      make_dirs(p.tmp);
      p.plan = plan_rank_file(state, optimizer, kind, rank, snapshot);
      if (rank == 0) p.manifest = manifest_skeleton(state, optimizer, kind, extra);
    });
  } catch (...) {
    remove_temporary(rank, p.tmp);
    throw;
  }
  return p;
}

// Collective over `comm`: writes this rank's file; rank 0 then publishes the manifest. A failure
// anywhere fails every rank and removes the temporary directory.
void write_and_publish(Communicator& comm, PreparedSave& p) {
  const int rank = comm.rank();
  try {
    std::string report;
    run_agreed(comm, p.what, [&] { report = write_rank_file(p.plan, p.tmp); });
    const auto reports = all_gather_strings(comm, report);
    run_agreed(comm, p.what, [&] {
      if (rank != 0) return;
      add_reports(p.manifest, reports);
      p.manifest.created_unix_ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
              .count();
      publish(p.manifest, p.tmp, p.dir, p.overwrite, p.random);
    });
  } catch (...) {
    remove_temporary(rank, p.tmp);
    throw;
  }
}

// A save of this model still finishing in the background completes first.
void wait_for_in_flight_save(FsdpState& state) {
  if (auto job = state.in_flight_save().lock()) job->join();
}

// Joins a job nobody will wait() for, printing its error (destructors cannot throw).
void finish_unwaited(std::shared_ptr<detail::SaveJob>& job) {
  if (!job) return;
  job->join();
  if (job->error) {
    try {
      std::rethrow_exception(job->error);
    } catch (const std::exception& e) {
      std::cerr << "libfsdp: a checkpoint save that was never waited for failed: " << e.what() << std::endl;
    }
  }
  job.reset();
}

}  // namespace

void save(const std::string& dir, FullyShardedModule& model, torch::optim::Optimizer* optimizer, const Extra& extra,
          const SaveOptions& options) {
  FsdpState& state = fsdp::detail::StateAccess::of(model);
  std::lock_guard<std::recursive_mutex> lock(state.mutex());
  state.rethrow_pending_error();
  wait_for_in_flight_save(state);
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  Communicator& world = *state.groups().world_comm;
  PreparedSave p = prepare_save(state, world, "checkpoint::save('" + dir + "')", dir, optimizer, extra, options, false);
  write_and_publish(world, p);
}

SaveHandle async_save(const std::string& dir, FullyShardedModule& model, torch::optim::Optimizer* optimizer,
                      const Extra& extra, const SaveOptions& options) {
  FsdpState& state = fsdp::detail::StateAccess::of(model);
  std::lock_guard<std::recursive_mutex> lock(state.mutex());
  state.rethrow_pending_error();
  wait_for_in_flight_save(state);
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  Communicator& world = *state.groups().world_comm;
  // Its own communicator: the background thread's collectives never interleave with training's.
  std::vector<int> all(world.size());
  std::iota(all.begin(), all.end(), 0);
  auto job = std::make_shared<detail::SaveJob>();
  job->comm = state.process_group().new_group(all, "checkpoint");
  job->save = prepare_save(state, world, "checkpoint::async_save('" + dir + "')", dir, optimizer, extra, options, true);
  detail::SaveJob* j = job.get();
  job->thread = std::thread([j] {
    try {
      write_and_publish(*j->comm, j->save);
    } catch (...) {
      j->error = std::current_exception();
    }
    j->finished = true;
  });
  state.in_flight_save() = job;
  return SaveHandle(std::move(job));
}

SaveHandle::SaveHandle(std::shared_ptr<detail::SaveJob> job) : job_(std::move(job)) {}

SaveHandle& SaveHandle::operator=(SaveHandle&& other) noexcept {
  if (this != &other) {
    finish_unwaited(job_);
    job_ = std::move(other.job_);
  }
  return *this;
}

SaveHandle::~SaveHandle() { finish_unwaited(job_); }

void SaveHandle::wait() {
  if (!job_) return;
  auto job = std::move(job_);
  job->join();
  if (job->error) std::rethrow_exception(job->error);
}

bool SaveHandle::done() const { return !job_ || job_->finished.load(); }

void load(const std::string& dir, FullyShardedModule& model, torch::optim::Optimizer* optimizer, Extra* extra) {
  FsdpState& state = fsdp::detail::StateAccess::of(model);
  std::lock_guard<std::recursive_mutex> lock(state.mutex());
  state.rethrow_pending_error();
  wait_for_in_flight_save(state);
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  Manifest m;
  run_agreed(*state.groups().world_comm, "checkpoint::load('" + dir + "')",
             [&] { load_local(dir, state, optimizer, m); });
  if (extra) *extra = m.extra;
}

bool is_complete(const std::string& dir) { return complete_manifest(dir, nullptr); }

std::string latest(const std::string& root) {
  std::error_code ec;
  std::filesystem::directory_iterator it(root, ec), end;
  std::string best;
  int64_t best_time = -1;
  for (; !ec && it != end; it.increment(ec)) {
    if (!it->is_directory(ec)) continue;
    const std::string name = it->path().filename().string();
    if (name.find(".tmp-") != std::string::npos) continue;
    Manifest m;
    if (!complete_manifest(it->path().string(), &m)) continue;
    const std::string path = it->path().string();
    if (m.created_unix_ns > best_time || (m.created_unix_ns == best_time && path > best)) {
      best_time = m.created_unix_ns;
      best = path;
    }
  }
  return best;
}

}  // namespace fsdp::checkpoint
