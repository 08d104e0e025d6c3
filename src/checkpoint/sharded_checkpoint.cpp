// Sharded checkpoints, the public calls: save and async_save (each rank writes its pieces, rank 0
// publishes the manifest last: save_plan.h), load at any layout (sharded_load.h), latest(),
// load_latest().
// See Note [Checkpoint format] in docs/design.md.
#include <sys/stat.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <typeinfo>
#include <vector>

#include "checkpoint/collective.h"
#include "checkpoint/file_io.h"
#include "checkpoint/manifest.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/save_plan.h"
#include "checkpoint/sharded_load.h"
#include "fsdp/check.h"
#include "fsdp/checkpoint.h"
#include "fsdp/whole_param_optimizer.h"
#include "state_access.h"

namespace fsdp::checkpoint {

using detail::add_reports;
using detail::all_gather_strings;
using detail::complete_manifest;
using detail::load_local;
using detail::make_dirs;
using detail::Manifest;
using detail::manifest_skeleton;
using detail::optimizer_kind;
using detail::OptimizerKind;
using detail::path_exists;
using detail::plan_rank_file;
using detail::publish;
using detail::RankPlan;
using detail::run_agreed;
using detail::shared_random;
using detail::temporary_name;
using detail::write_rank_file;

namespace {

// The optimizer must hold shard pieces of this model only.
void check_optimizer_holds_pieces(const FsdpState& state, const torch::optim::Optimizer* optimizer, const char* what) {
  if (!optimizer) return;
  std::set<const c10::TensorImpl*> pieces;
  for (const auto& fp : state.flat_params())
    for (const auto& s : fp->slots())
      if (s.piece.defined()) pieces.insert(s.piece.unsafeGetTensorImpl());
  std::map<const c10::TensorImpl*, std::string> ignored;
  for (const auto& [name, t] : state.ignored_parameters()) ignored[t.unsafeGetTensorImpl()] = name;
  for (const auto& group : optimizer->param_groups())
    for (const auto& p : group.params()) {
      auto it = ignored.find(p.unsafeGetTensorImpl());
      FSDP_CHECK(it == ignored.end(), what, ": the optimizer holds ignored parameter '",
                 it == ignored.end() ? "" : it->second,
                 "'; checkpoints hold the optimizer state of shard pieces only (ignored parameters' values are in the "
                 "checkpoint). Step ignored parameters with an optimizer of their own and save its state yourself "
                 "(torch::save)");
      FSDP_CHECK(
          pieces.count(p.unsafeGetTensorImpl()), what, ": the optimizer holds a tensor (shape ", p.sizes(),
          ") that is not a shard piece of this model; build the optimizer over FullyShardedModule::parameters()");
    }
}

// What `optimizer` is, for messages: its class, or "none".
std::string optimizer_name(const torch::optim::Optimizer* optimizer) {
  return optimizer == nullptr ? "none" : c10::demangle(typeid(*optimizer).name());
}

// Collective: every rank names the same directory (where `same_dir`) and passes an optimizer of
// the same class, or none; otherwise every rank throws, naming what each passed.
void agree_on_arguments(Communicator& world, const std::string& what, const std::string& dir, bool same_dir,
                        const torch::optim::Optimizer* optimizer) {
  std::string trimmed = same_dir ? dir : "";
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  const std::vector<std::string> all = all_gather_strings(world, optimizer_name(optimizer) + "\n" + trimmed);
  std::vector<std::string> optimizers, dirs;
  for (const std::string& one : all) {
    const size_t cut = one.find('\n');
    optimizers.push_back(one.substr(0, cut));
    dirs.push_back(one.substr(cut + 1));
  }
  auto differ = [&](const std::vector<std::string>& values, const char* quote) {
    if (std::all_of(values.begin(), values.end(), [&](const std::string& v) { return v == values[0]; })) return;
    std::ostringstream o;
    for (size_t r = 0; r < values.size(); ++r)
      o << (r ? ", " : "") << "rank " << r << ": " << quote << values[r] << quote;
    FSDP_FAIL(what,
              quote[0] != 0 ? ": the ranks name different directories (" : ": the ranks pass different optimizers (",
              o.str(),
              quote[0] != 0 ? "); pass the same path on every rank (a name built from the clock or the rank differs "
                              "between ranks)"
                            : "); pass this model's optimizer on every rank, or nullptr on every rank");
  };
  differ(dirs, "'");
  differ(optimizers, "");
}

// Rank 0, overwrite: `dir` holds a checkpoint (its manifest and rank files, nothing else) or nothing.
void check_replaceable(const std::string& dir) {
  struct stat st {};
  FSDP_CHECK(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "checkpoint::save: '", dir,
             "' exists and is not a directory; overwrite(true) replaces only a checkpoint: save elsewhere, or "
             "remove it yourself");
  std::vector<std::string> names;
  detail::list_dir(dir, &names);
  std::sort(names.begin(), names.end());
  const bool manifest = names.empty() || std::find(names.begin(), names.end(), detail::kManifestName) != names.end();
  for (const std::string& name : names) {
    const bool rank_file = name.size() == 14 && name.compare(0, 5, "rank-") == 0 && name.compare(10, 4, ".bin") == 0 &&
                           name.find_first_not_of("0123456789", 5) == 10;
    FSDP_CHECK(manifest && (rank_file || name == detail::kManifestName), "checkpoint::save: '", dir, "' holds '", name,
               "'", manifest ? "" : " and no manifest.json",
               ", which is not part of a checkpoint; overwrite(true) replaces only a checkpoint and would delete "
               "it: save to another directory, or move what you keep out of '",
               dir, "'");
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

using detail::PreparedSave;

namespace {

void remove_temporary(int rank, const std::string& tmp) {
  if (rank != 0) return;
  try {
    detail::remove_all(tmp);
  } catch (const Error&) {
    // best effort: a partial save is never loaded anyway
  }
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
  agree_on_arguments(world, what, dir, /*same_dir=*/true, optimizer);
  try {
    run_agreed(world, what, [&] {
      const OptimizerKind kind = optimizer_kind(optimizer);
      check_optimizer_holds_pieces(state, optimizer, "checkpoint::save");
      FSDP_CHECK(options.overwrite() || rank != 0 || !path_exists(dir), "checkpoint::save: '", dir,
                 "' exists; save to a new directory, or set SaveOptions().overwrite(true) to replace it");
      if (options.overwrite() && rank == 0 && path_exists(dir)) check_replaceable(dir);
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
  RuntimeCall call(state);
  wait_for_in_flight_save(state);
  Communicator& world = *state.groups().world_comm;
  PreparedSave p = prepare_save(state, world, "checkpoint::save('" + dir + "')", dir, optimizer, extra, options, false);
  write_and_publish(world, p);
}

SaveHandle async_save(const std::string& dir, FullyShardedModule& model, torch::optim::Optimizer* optimizer,
                      const Extra& extra, const SaveOptions& options) {
  FsdpState& state = fsdp::detail::StateAccess::of(model);
  RuntimeCall call(state);
  wait_for_in_flight_save(state);
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

namespace {

// Collective: load() once the runtime is held and no save is in flight.
void load_agreed(FsdpState& state, const std::string& dir, torch::optim::Optimizer* optimizer, Extra* extra) {
  Manifest m;
  agree_on_arguments(*state.groups().world_comm, "checkpoint::load('" + dir + "')", dir, /*same_dir=*/false, optimizer);
  run_agreed(*state.groups().world_comm, "checkpoint::load('" + dir + "')", [&] {
    check_optimizer_holds_pieces(state, optimizer, "checkpoint::load");
    load_local(dir, state, optimizer, m);
    state.drop_feedback_residuals();
  });
  // Collective: whole-parameter optimizers plan again from the options just restored.
  if (auto* w = dynamic_cast<WholeParamOptimizer*>(optimizer)) w->after_load();
  if (extra) *extra = m.extra;
}

}  // namespace

void load(const std::string& dir, FullyShardedModule& model, torch::optim::Optimizer* optimizer, Extra* extra) {
  FsdpState& state = fsdp::detail::StateAccess::of(model);
  RuntimeCall call(state);
  wait_for_in_flight_save(state);
  load_agreed(state, dir, optimizer, extra);
}

std::string load_latest(const std::string& root, FullyShardedModule& model, torch::optim::Optimizer* optimizer,
                        Extra* extra) {
  FsdpState& state = fsdp::detail::StateAccess::of(model);
  RuntimeCall call(state);
  wait_for_in_flight_save(state);
  const std::vector<std::string> found = all_gather_strings(*state.groups().world_comm, latest(root));
  if (std::any_of(found.begin(), found.end(), [&](const std::string& dir) { return dir != found[0]; })) {
    std::ostringstream o;
    for (size_t r = 0; r < found.size(); ++r) o << (r ? ", " : "") << "rank " << r << ": '" << found[r] << "'";
    FSDP_FAIL("checkpoint::load_latest: the ranks found different newest checkpoints under '", root, "' (", o.str(),
              "); put '", root, "' on a file system every rank sees at the same path");
  }
  FSDP_CHECK(!found[0].empty(), "checkpoint::load_latest: no complete checkpoint under '", root, "' (",
             path_exists(root) ? "saves that did not finish, *.tmp-*, do not count" : "the directory does not exist",
             "). Save one there first, or, to start from scratch when there is none, test "
             "checkpoint::latest(root).empty() before loading");
  load_agreed(state, found[0], optimizer, extra);
  return found[0];
}

bool is_complete(const std::string& dir) { return complete_manifest(dir, nullptr); }

Extra read_extra(const std::string& dir) {
  Manifest m;
  FSDP_CHECK(complete_manifest(dir, &m), "checkpoint::read_extra: '", dir, "' holds no complete checkpoint");
  return m.extra;
}

std::string latest(const std::string& root) {
  std::vector<std::string> names;
  detail::list_dir(root, &names);  // an unreadable root has no checkpoints: ""
  std::string best;
  int64_t best_time = -1;
  for (const auto& name : names) {
    if (name.find(".tmp-") != std::string::npos) continue;
    const std::string path = root.empty() || root.back() == '/' ? root + name : detail::join_path(root, name);
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;  // symlinks are followed
    Manifest m;
    if (!complete_manifest(path, &m)) continue;
    if (m.created_unix_ns > best_time || (m.created_unix_ns == best_time && path > best)) {
      best_time = m.created_unix_ns;
      best = path;
    }
  }
  return best;
}

}  // namespace fsdp::checkpoint
