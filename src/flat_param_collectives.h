#pragma once
// The collectives of one FlatParameter, as free functions over its state (flat_param.h,
// flat_grad.h): the all-gather that unshards it, the gradient reduction (reduce-scatter, the
// all-reduce of NO_SHARD, the replica all-reduce of HYBRID_SHARD) and the gather of its full values
// for state dicts. Each is labeled for the cross-rank fingerprint (Note [Collective fingerprints]).
#include <torch/torch.h>

#include <utility>
#include <vector>

#include "flat_param.h"
#include "fsdp/comm.h"

namespace fsdp {

// Unshard: gives the flat storage memory and issues the all-gather of the shards into it (a cast
// or a copy to the device at F == 1); returns the work, or null if nothing is in flight (kept
// unsharded, or done at once). The storage must not be read before FlatParam::wait_unshard().
// Offloaded under mixed precision, `cast_on_host` casts the host shard before its copy to the device.
WorkPtr start_all_gather(FlatParam& fp, bool cast_on_host = false);
inline void unshard(FlatParam& fp) {
  start_all_gather(fp);
  fp.wait_unshard();
}

// Issues the reduction of fp's flat gradient buffer (asynchronous). Hybrid with `across_replicas`
// false: only the shard group's reduce-scatter runs, and its sums are kept (partial) until a
// reduction across replicas includes them.
void start_reduction(FlatParam& fp, bool across_replicas = true);
// Waits for fp's reduction in flight and averages it into the shard pieces' .grad; the result is
// FlatGrad::complete_reduction's (false: kept, on its way to the host, or left for FlatGrad::land()).
bool finish_reduction(FlatParam& fp, bool defer_landing = false);

// Collective over the shard group: the full padded flat values in the shard's dtype (a gather of
// the shards into a new tensor; the unsharded storage itself when kept unsharded).
at::Tensor gather_full_values(const FlatParam& fp);
// Collective over the shard group: the full padded flat gradient from the shard pieces' .grad (zeros
// where a piece has none), and per slot whether any member's piece of it has a gradient.
std::pair<at::Tensor, std::vector<bool>> gather_full_gradient(const FlatParam& fp);

}  // namespace fsdp
