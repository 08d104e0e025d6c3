#include "checkpoint/sharded_load.h"

#include <sys/stat.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <vector>

#include "checkpoint/collective.h"
#include "checkpoint/data_file.h"
#include "checkpoint/file_io.h"
#include "checkpoint/optimizer_options.h"
#include "fsdp/check.h"

namespace fsdp::checkpoint::detail {

namespace {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream o;
  o << at::IntArrayRef(shape);
  return o.str();
}

}  // namespace

Manifest read_manifest(const std::string& dir) {
  FSDP_CHECK(!dir.empty(),
             "the checkpoint directory is \"\": checkpoint::latest(root) returns \"\" when root holds no complete "
             "checkpoint. Test its result before loading (and start from scratch when it is empty), or call "
             "checkpoint::load_latest(root, ...), whose error names root");
  FSDP_CHECK(last_component(dir).find(".tmp-") == std::string::npos, "'", dir,
             "' is the directory of a save that did not finish (*.tmp-*); it is not a checkpoint. "
             "Use checkpoint::latest(root) to find the newest complete one");
  const std::string path = join_path(dir, kManifestName);
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
  for (const auto& w : state.whole_tensors()) {
    const at::Tensor& t = w.tensor;
    auto it = buffers.find(w.name);
    FSDP_CHECK(it != buffers.end(), prefix, "it has no ", w.kind, " '", w.name, "'", hint);
    FSDP_CHECK(it->second->shape == t.sizes().vec() && it->second->dtype == dtype_name(t.scalar_type()), prefix, w.kind,
               " '", w.name, "' is ", it->second->dtype, " ", shape_str(it->second->shape), " in the checkpoint and ",
               dtype_name(t.scalar_type()), " ", shape_str(t.sizes().vec()), " in the model", hint);
    buffers.erase(it);
  }
  FSDP_CHECK(buffers.empty(), prefix, "the model has no buffer or ignored parameter '",
             buffers.empty() ? "" : buffers.begin()->first, "'", hint);
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
        readers_[file] =
            std::make_unique<DataReader>(join_path(dir_, m_.files[file].name), m_.files[file], m_.chunk_bytes);
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
    if (!m.optimizer_groups.empty()) restore_optimizer_scalars(kind, m.optimizer_groups.front(), *optimizer, dir);
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
  for (const auto& w : state.whole_tensors()) {
    const at::Tensor& t = w.tensor;
    const TensorEntry& e = *buffers.at(w.name);
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
      struct stat st {};  // symlinks are followed; only a regular file has a size
      if (::stat(join_path(dir, f.name).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
      if (static_cast<uint64_t>(st.st_size) != f.bytes) return false;
    }
    if (out) *out = std::move(m);
    return true;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace fsdp::checkpoint::detail
