// The full model as one safetensors file, without the memory spike: export_full gathers one unit
// at a time and rank 0 writes it straight from the unsharded storage; load_full has rank 0 read
// one FlatParameter at a time and broadcast it for every rank to copy its shard.
#include <unistd.h>

#include <cstring>
#include <map>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "checkpoint/collective.h"
#include "checkpoint/file_io.h"
#include "checkpoint/safetensors.h"
#include "flat_param_collectives.h"
#include "fsdp/check.h"
#include "fsdp/checkpoint.h"
#include "state_access.h"

namespace fsdp::checkpoint {

using detail::dtype_name;
using detail::File;
using detail::make_dirs;
using detail::make_safetensors_header;
using detail::parent_dir;
using detail::parse_safetensors_header;
using detail::rename_path;
using detail::run_agreed;
using detail::safetensors_header_length;
using detail::SafetensorsHeader;
using detail::SafetensorsTensor;
using detail::scalar_type_of;
using detail::shared_random;
using detail::sync_dir;
using detail::temporary_name;

namespace {

void check_little_endian() {
  const uint16_t probe = 1;
  unsigned char first = 0;
  std::memcpy(&first, &probe, 1);
  FSDP_CHECK(first == 1, "safetensors files are little-endian and this host is not; convert on a little-endian host");
}

// Runs `fn` unless an earlier step failed; keeps the first error instead of throwing, so this
// rank goes on taking part in the collectives of the others and reports at the end.
struct FirstError {
  std::string message;
  template <class Fn>
  void run(Fn&& fn) {
    if (!message.empty()) return;
    try {
      fn();
    } catch (const std::exception& e) {
      message = e.what();
    }
  }
  void rethrow() const {
    if (!message.empty()) throw Error(message);
  }
};

void write_tensor(File& f, const at::Tensor& t) {
  at::Tensor c = t.device().is_cpu() ? t.detach().contiguous() : t.detach().to(at::kCPU).contiguous();
  f.write_all(c.data_ptr(), c.nbytes());
}

}  // namespace

void export_full(const std::string& file, FullyShardedModule& model) {
  FsdpState& state = fsdp::detail::StateAccess::of(model);
  RuntimeCall call(state);
  Communicator& world = *state.groups().world_comm;
  const bool writer = world.rank() == 0;
  const std::string what = "checkpoint::export_full('" + file + "')";
  const std::string tmp = temporary_name(file, shared_random(world));

  // The header lists every tensor before any data: parameters unit by unit, then buffers.
  std::vector<SafetensorsTensor> tensors;
  nlohmann::json aliases = nlohmann::json::object();
  uint64_t offset = 0;
  run_agreed(world, what, [&] {
    check_little_endian();
    auto add = [&](const std::string& name, at::ScalarType dtype, std::vector<int64_t> shape, int64_t bytes) {
      tensors.push_back({name, dtype_name(dtype), std::move(shape), offset, offset + static_cast<uint64_t>(bytes)});
      offset += static_cast<uint64_t>(bytes);
    };
    for (const Unit& unit : state.units())
      for (const FlatParam* fp : unit.flat_params())
        for (const auto& s : fp->slots()) {
          add(s.name, fp->dtype(), s.shape, s.numel * fp->element_size());
          for (const auto& a : s.aliases) aliases[a] = s.name;
        }
    for (const auto& w : state.whole_tensors()) {
      add(w.name, w.tensor.scalar_type(), w.tensor.sizes().vec(), w.tensor.numel() * w.tensor.element_size());
      for (const auto& a : w.aliases) aliases[a] = w.name;
    }
  });
  std::map<std::string, std::string> metadata{{"format", "pt"}};
  if (!aliases.empty()) metadata["libfsdp.aliases"] = aliases.dump();

  state.scheduler().reshard_all();
  state.scheduler().forget_last_used();
  FirstError error;
  std::optional<File> out;
  if (writer)
    error.run([&] {
      make_dirs(parent_dir(file));
      out.emplace(File::create(tmp));
      const std::string header = make_safetensors_header(tensors, metadata);
      out->write_all(header.data(), header.size());
    });
  for (const Unit& unit : state.units())
    for (const FlatParam* fp : unit.flat_params()) {
      // Collective: every rank gathers the shards (full precision under mixed precision), rank 0 writes.
      const at::Tensor full = gather_full_values(*fp);
      if (writer)
        error.run([&] {
          for (const auto& s : fp->slots()) write_tensor(*out, full.narrow(0, s.offset, s.numel).view(s.shape));
        });
    }
  if (writer)
    error.run([&] {
      for (const auto& w : state.whole_tensors()) write_tensor(*out, w.tensor.detach());
      out->sync();
      out->close();
      rename_path(tmp, file);
      sync_dir(parent_dir(file));
    });
  try {
    run_agreed(world, what, [&] { error.rethrow(); });
  } catch (...) {
    if (writer) ::unlink(tmp.c_str());  // best effort: the error above is the one to report
    throw;
  }
}

void load_full(const std::string& file, FullyShardedModule& model) {
  FsdpState& state = fsdp::detail::StateAccess::of(model);
  RuntimeCall call(state);
  Communicator& world = *state.groups().world_comm;
  const bool reader = world.rank() == 0;
  const std::string what = "checkpoint::load_full('" + file + "')";

  // Rank 0 reads and checks the header against the model before anything is changed.
  std::optional<File> in;
  SafetensorsHeader header;
  std::map<std::string, const SafetensorsTensor*> by_name;
  run_agreed(world, what, [&] {
    if (!reader) return;
    check_little_endian();
    in.emplace(File::open_read(file));
    const uint64_t size = in->size();
    std::string prefix(8, '\0');
    FSDP_CHECK(size >= 8, "safetensors file '", file,
               "' is shorter than 8 bytes; it is truncated or not a safetensors file");
    in->pread_all(prefix.data(), 8, 0);
    std::string text(static_cast<size_t>(safetensors_header_length(prefix, size, file)), '\0');
    in->pread_all(text.data(), text.size(), 8);
    header = parse_safetensors_header(text, size, file);
    for (const auto& t : header.tensors) by_name[t.name] = &t;
    const std::string hint = "; load a file written from this model (same parameter names and shapes)";
    std::set<std::string> used;
    auto check = [&](const std::vector<std::string>& names, const std::vector<int64_t>& shape, const char* kind) {
      const SafetensorsTensor* found = nullptr;
      for (const auto& n : names) {
        auto it = by_name.find(n);
        if (it == by_name.end()) continue;
        FSDP_CHECK(!found, "safetensors file '", file, "' holds the tied ", kind, " '", names[0], "' twice (as '",
                   found->name, "' and '", n, "'); keep one");
        found = it->second;
      }
      FSDP_CHECK(found, "safetensors file '", file, "' has no ", kind, " '", names[0], "'", hint);
      FSDP_CHECK(found->shape == shape, "safetensors file '", file, "': ", kind, " '", found->name, "' has shape ",
                 at::IntArrayRef(found->shape), " but the model's is ", at::IntArrayRef(shape), hint);
      used.insert(found->name);
      by_name[names[0]] = found;  // look it up by the model's first name from now on
    };
    for (const auto& fp : state.flat_params())
      for (const auto& s : fp->slots()) {
        std::vector<std::string> names{s.name};
        names.insert(names.end(), s.aliases.begin(), s.aliases.end());
        check(names, s.shape, "parameter");
      }
    for (const auto& w : state.whole_tensors()) {
      std::vector<std::string> names{w.name};
      names.insert(names.end(), w.aliases.begin(), w.aliases.end());
      check(names, w.tensor.sizes().vec(), w.kind);
    }
    for (const auto& t : header.tensors)
      FSDP_CHECK(used.count(t.name), "safetensors file '", file, "' has tensor '", t.name,
                 "', which the model does not have", hint);
  });

  state.scheduler().reshard_all();
  state.scheduler().forget_last_used();
  FirstError error;
  const auto device = world.device();
  // Rank 0's copy of one tensor from the file, converted to `like`'s dtype, into `dest`.
  auto read_into = [&](const std::string& name, at::Tensor dest) {
    error.run([&] {
      const SafetensorsTensor& t = *by_name.at(name);
      at::Tensor raw = at::empty(t.shape, at::TensorOptions().dtype(scalar_type_of(t.dtype)));
      in->pread_all(raw.data_ptr(), static_cast<size_t>(t.end - t.begin), header.data_start + t.begin);
      dest.copy_(raw.reshape(dest.sizes()));
    });
  };
  for (auto& fp : state.flat_params()) {
    at::Tensor full = at::zeros({fp->padded_numel()}, at::TensorOptions().dtype(fp->dtype()).device(device));
    if (reader)
      for (const auto& s : fp->slots()) read_into(s.name, full.narrow(0, s.offset, s.numel));
    if (world.size() > 1)
      world.broadcast(full, 0, CollectiveOptions::labeled("load_full_state_dict: flat parameter"))->wait();
    fp->copy_full_into_shard(full);
  }
  for (const auto& w : state.whole_tensors()) {
    at::Tensor value = at::empty(w.tensor.sizes(), w.tensor.options().device(device).requires_grad(false));
    if (reader) read_into(w.name, value);
    if (world.size() > 1)
      world
          .broadcast(value, 0,
                     CollectiveOptions::labeled("load_full_state_dict: " + std::string(w.kind) + " " + w.name))
          ->wait();
    w.tensor.detach().copy_(value);
  }
  state.drop_feedback_residuals();
  run_agreed(world, what, [&] { error.rethrow(); });
}

}  // namespace fsdp::checkpoint
