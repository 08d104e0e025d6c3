#include "runtime/cross_rank_check.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <sstream>
#include <thread>

#include "fsdp/check.h"

namespace fsdp {

std::string describe_options(const Options& o) {
  const MixedPrecision& mp = o.mixed_precision();
  auto dtype = [](const c10::optional<at::ScalarType>& t) {
    return t ? std::string(c10::toString(*t)) : std::string("none");
  };
  std::ostringstream d;
  d << "sharding_strategy " << to_string(o.sharding_strategy()) << "\nsharding_factor " << o.sharding_factor()
    << "\nreshard_after_forward_size " << o.reshard_after_forward_size() << "\nbackward_prefetch "
    << to_string(o.backward_prefetch()) << "\nforward_prefetch " << o.forward_prefetch() << "\nlimit_all_gathers "
    << o.limit_all_gathers() << "\nall_gather_limit " << o.all_gather_limit() << "\nsync_module_states "
    << o.sync_module_states() << "\nbroadcast_buffers " << o.broadcast_buffers() << "\nshared_parameters "
    << static_cast<int>(o.shared_parameters()) << "\nauto_wrap_policy " << (o.auto_wrap_policy() ? "set" : "unset")
    << "\nwrap_modules " << o.wrap_modules().size() << "\nreshard_after_forward policy "
    << (o.reshard_after_forward_policy() ? "set" : "unset") << "\nmixed_precision param_dtype "
    << dtype(mp.param_dtype()) << "\nmixed_precision reduce_dtype " << dtype(mp.reduce_dtype())
    << "\nmixed_precision buffer_dtype " << dtype(mp.buffer_dtype()) << "\nmixed_precision output_dtype "
    << dtype(mp.output_dtype()) << "\nmixed_precision cast_forward_inputs " << mp.cast_forward_inputs()
    << "\nmixed_precision keep_full_precision " << (mp.keep_full_precision() ? "set" : "unset")
    << "\nmixed_precision keep_low_precision_grads " << mp.keep_low_precision_grads();
  for (const auto& [q, name] : {std::pair{&o.all_gather_quantization(), "all_gather_quantization "},
                                std::pair{&o.reduce_quantization(), "reduce_quantization "}})
    d << "\n"
      << name << (q->enabled() ? to_string(q->dtype()) + " block " + std::to_string(q->block_size()) : "off")
      << " units " << (q->units() ? "set" : "unset") << " error feedback " << q->error_feedback();
  return d.str();
}

std::string describe_model(const Options& options, int sharding_factor, const std::vector<bool>& reshard_after_forward,
                           const UnitPlan& plan) {
  std::ostringstream d;
  const MixedPrecision& mp = options.mixed_precision();
  auto name = [](const c10::optional<at::ScalarType>& t) {
    return t ? std::string(c10::toString(*t)) : std::string("-");
  };
  d << "strategy " << to_string(options.sharding_strategy()) << " factor " << sharding_factor << " mixed precision "
    << name(mp.param_dtype()) << "/" << name(mp.reduce_dtype()) << "/" << name(mp.buffer_dtype())
    << "\nreshard after forward";
  for (bool r : reshard_after_forward) d << " " << r;
  d << " to " << options.reshard_after_forward_size() << " ranks";
  d << "\nquantized all-gathers, reductions";
  for (const auto& u : plan.units)
    d << " " << options.all_gather_quantization().applies_to(u.name, *u.module)
      << options.reduce_quantization().applies_to(u.name, *u.module);
  d << "\n" << plan.describe();
  return d.str();
}

void check_same_on_all_ranks(ProcessGroup& pg, const std::string& mine, const char* differ, const char* fix) {
  // Every rank publishes its description, reads all of them, says it has, and then names the first
  // line where one differs: every rank reports the real difference. A rank that exited before
  // publishing is named at once where its process can be seen (the same host), at the timeout
  // otherwise. Rank 0 hosts the store, so it fails only once the others have failed too (or after
  // a bound), not under their reads.
  if (pg.size() == 1) return;
  const std::string key = "fsdp/agree/" + std::to_string(pg.next_sequence()) + "/";
  auto store = pg.store();
  store->set(key + std::to_string(pg.rank()), std::vector<uint8_t>(mine.begin(), mine.end()));
  const auto timeout = pg.options().timeout;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string error;
  std::vector<bool> exited(pg.size(), false);
  auto lost_store = [&](const std::exception& e) {
    FSDP_FAIL("fully_shard: rank ", pg.rank(),
              " lost the rendezvous store (hosted by rank 0) while comparing "
              "models: ",
              e.what(), ". Rank 0 failed or exited: see its output");
  };
  for (int r = 0; r < pg.size() && error.empty(); ++r) {
    if (r == pg.rank()) continue;
    const std::string theirs_key = key + std::to_string(r);
    auto pause = std::chrono::milliseconds(1);
    auto check_published = [&] {
      try {
        return store->check({theirs_key});
      } catch (const std::exception& e) {
        lost_store(e);
      }
      return false;
    };
    bool published = false;
    while (error.empty()) {
      if ((published = check_published())) break;
      if (pg.rank_exited(r)) {
        // It may have published, compared and exited since the check above: look once more.
        if ((published = check_published())) break;
        exited[r] = true;
        error = detail::compose("fully_shard: rank ", r,
                                " exited before it reached fully_shard() (it failed earlier: "
                                "see its output). ",
                                fix);
      } else if (std::chrono::steady_clock::now() >= deadline) {
        error = detail::compose("fully_shard: rank ", r, " did not reach fully_shard() within the timeout (",
                                std::chrono::duration_cast<std::chrono::seconds>(timeout).count(),
                                " s; set ProcessGroupOptions::timeout or FSDP_TIMEOUT_S); it failed earlier (see its "
                                "output) or runs a different program. ",
                                fix);
      } else {
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::milliseconds(100));
      }
    }
    if (!published) break;
    std::vector<uint8_t> raw;
    try {
      raw = store->get(theirs_key);
    } catch (const std::exception& e) {
      lost_store(e);
    }
    const std::string theirs(raw.begin(), raw.end());
    if (theirs == mine) continue;
    std::istringstream a(mine), b(theirs);
    std::string la, lb;
    int line = 0;
    while (error.empty()) {
      const bool ga = static_cast<bool>(std::getline(a, la)), gb = static_cast<bool>(std::getline(b, lb));
      ++line;
      if (!ga && !gb) break;
      if (!ga) la = "<nothing>";
      if (!gb) lb = "<nothing>";
      if (la != lb)
        error =
            detail::compose("fully_shard: rank ", pg.rank(), " and rank ", r, " ", differ, "; first difference (line ",
                            line, "): this rank has '", la, "', rank ", r, " has '", lb, "'. ", fix);
    }
  }
  // Each rank says it is done reading (failed/ or read/); rank 0 waits (bounded) for every verdict
  // before it goes on, so an error of its own right after this cannot take the store from under
  // ranks still reading.
  const std::string verdict = error.empty() ? "read/" : "failed/";
  try {
    store->set(key + verdict + std::to_string(pg.rank()), std::vector<uint8_t>{1});
  } catch (const std::exception& e) {
    if (error.empty()) lost_store(e);
  }
  if (pg.rank() == 0) {
    const auto until = std::chrono::steady_clock::now() +
                       std::min<std::chrono::milliseconds>(timeout, std::chrono::milliseconds(10000));
    for (int r = 1; r < pg.size(); ++r) {
      const std::string failed = key + "failed/" + std::to_string(r), read = key + "read/" + std::to_string(r);
      while (!exited[r] && std::chrono::steady_clock::now() < until) {
        if (store->check({failed}) || store->check({read}) || pg.rank_exited(r)) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }
  if (!error.empty()) FSDP_FAIL(error);
}

}  // namespace fsdp
