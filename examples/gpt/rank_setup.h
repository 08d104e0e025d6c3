#pragma once
// This process as a rank: its launcher's environment, its label in error messages, its threads, its heap.
#include <fsdp/fsdp.h>

#include <string>

namespace fsdp_gpt {

// " [rank R]" once the rank is known, for error messages (under any launcher, not only those setting RANK).
extern std::string g_rank_label;

// The launcher's rank environment (and g_rank_label); a single process's where it is broken.
fsdp::RankEnv read_rank_env();

// Sets this rank's compute threads (unless OMP_NUM_THREADS did; one under `deterministic`, as a
// kernel's bits may depend on its thread count) and returns how many it uses.
int set_threads_per_rank(const fsdp::RankEnv& env, bool deterministic);

// Applies `--malloc` ("keep": glibc keeps its heap between steps, Note [glibc malloc]; "default":
// glibc's settings) unless MALLOC_*_ or GLIBC_TUNABLES set them; returns what is in effect.
std::string set_malloc(const std::string& mode);

}  // namespace fsdp_gpt
