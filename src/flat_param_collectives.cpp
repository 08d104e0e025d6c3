#include "flat_param_collectives.h"

#include "fsdp/check.h"
#include "internal_op_guard.h"
#include "quantized_collectives.h"

namespace fsdp {

namespace {

// What a collective is for, as its members compare it (Note [Collective fingerprints]): the flat
// parameter, the purpose, and how many collectives of that purpose it issued before.
CollectiveOptions label(const FlatParam& fp, const char* purpose, int64_t count) {
  return CollectiveOptions::labeled(
      detail::compose("unit ", fp.unit(), " flat parameter ", fp.id(), ": ", purpose, " #", count));
}

// label() of an all-gather, with the backward passes finished before it: a rank that gathers a unit
// once more than its peers (a parameter read on that rank alone) fails at the first gather whose
// pair would mix shards from different steps, instead of pairing it (Note [Collective fingerprints]).
CollectiveOptions gather_label(const FlatParam& fp, const char* purpose) {
  CollectiveOptions o = label(fp, purpose, fp.count_gather());
  o.label = detail::compose(o.label, " after backward ", fp.backwards_finished());
  return o;
}

// label(), naming the earlier backward passes whose gradients this rank adds in.
CollectiveOptions reduction_label(const FlatParam& fp, const char* purpose, int64_t count) {
  CollectiveOptions o = label(fp, purpose, count);
  // Deterministic mode: the counts of backward passes travel with the sums instead.
  const int64_t held = fp.grad().deterministic() ? 0 : fp.grad().backwards_held();
  if (held > 0)
    o.label = detail::compose(o.label, " (gradients of ", held, " earlier backward", held > 1 ? "s" : "", " held)");
  return o;
}

// The all-gather of fp's shard as block-quantized codes (Note [Quantized communication]).
WorkPtr start_quantized_all_gather(FlatParam& fp, const BlockFormat& format) {
  const ShardingGroups& group = fp.groups();
  const int W = group.shard_comm->size();
  // Rank r's shard is the flat buffer's part from r * n; each travels in a slot of the largest size.
  const int64_t n = fp.shard_numel(), per = packed_slot_bytes(format, W, n, 0);
  auto bytes = fp.shard().options().dtype(at::kByte);
  at::Tensor packed = fp.buffers().empty(per, bytes), gathered = fp.buffers().empty(W * per, bytes);
  fp.memory().add_param((W + 1) * per);
  quantize_into_slot(packed, fp.shard(), at::Tensor(), format, fp.shard_rank() * n);
  WorkPtr work =
      group.shard_comm->all_gather_into(gathered, packed, gather_label(fp, "quantized parameter all-gather"));
  at::Tensor out = fp.unsharded_alias();
  MemoryTracker* memory = &fp.memory();
  auto unpack = [packed, gathered, out, W, n, per, format, memory]() mutable {
    for (int r = 0; r < W; ++r)
      dequantize_into(out.narrow(0, r * n, n), gathered.narrow(0, r * per, format.packed_bytes(n, r * n)), format,
                      r * n);
    memory->add_param(-(W + 1) * per);
    packed = at::Tensor();
    gathered = at::Tensor();
  };
  auto dequantizing = std::make_shared<DequantizingWork>(work, std::move(unpack));
  fp.set_pending_gather(dequantizing, at::Tensor(), false);
  return dequantizing;
}

// Where fp's quantized reductions take their buffers, and its error feedback's residuals.
// `origin`: where the reduced values start in the flat buffer.
QuantizedBuffers reduction_buffers(FlatParam& fp, int64_t origin = 0) {
  return {*fp.reduce_format(), &fp.buffers(), &fp.memory(), origin};
}
QuantizationResiduals* feedback(FlatParam& fp) { return fp.residuals().enabled ? &fp.residuals() : nullptr; }

// The all-reduce of `t` (fp's flat values from `origin`) over `comm`, quantized when fp's
// reductions are (Note [Quantized communication]).
WorkPtr all_reduce(FlatParam& fp, Communicator& comm, const at::Tensor& t, int64_t origin, CollectiveOptions opts) {
  if (!fp.reduce_format() || fp.grad().deterministic()) return comm.all_reduce(t, std::move(opts));
  opts.label = detail::compose(opts.label, " (quantized)");
  return quantized_all_reduce(comm, t, reduction_buffers(fp, origin), feedback(fp), std::move(opts));
}

}  // namespace

WorkPtr start_all_gather(FlatParam& fp, bool cast_on_host) {
  if (fp.keep_unsharded()) return nullptr;
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  fp.wait_unshard();  // a gather of older shard values: let it land first
  fp.alloc_unsharded();
  const ShardingGroups& group = fp.groups();
  CpuOffloader* offload = fp.offload();
  if (!fp.sharded_over_peers() && offload) {
    // F == 1 offloaded: the "gather" is the shard's copy to the device (cast on the way).
    WorkPtr copy = offload->to_device(fp.unsharded_alias(), fp.shard(), cast_on_host);
    fp.set_pending_gather(copy, at::Tensor(), false);
    return copy;
  }
  if (!fp.sharded_over_peers()) {
    // F == 1 under mixed precision: the "gather" is a cast of the whole shard. Written through a
    // tensor of its own, so no version counter that autograd checks moves.
    fp.unsharded_alias().copy_(fp.shard());
    return nullptr;
  }
  if (at::Tensor kept = fp.take_post_forward_shard(); kept.defined()) {
    // hpZ: the parts kept after forward, gathered within their group; freed when the gather lands.
    WorkPtr work =
        group.post_forward_comm->all_gather_into(fp.unsharded(), kept, gather_label(fp, "parameter all-gather"));
    fp.set_pending_gather(work, kept, true);
    return work;
  }
  at::Tensor input = fp.shard();
  if (offload) {
    // The host shard to the device (cast on the host or there) on the copy stream; the gather,
    // issued from that stream, follows it, so compute goes on meanwhile.
    input = fp.buffers().empty(fp.shard_numel(), fp.unsharded().options());
    offload->to_device(input, fp.shard(), cast_on_host);
    fp.memory().add_param(fp.shard_numel() * fp.compute_element_size());
    WorkPtr work;
    offload->on_copy_stream([&] {
      work = group.shard_comm->all_gather_into(fp.unsharded(), input, gather_label(fp, "parameter all-gather"));
    });
    fp.set_pending_gather(work, input, false);
    return work;
  }
  if (fp.gather_format()) return start_quantized_all_gather(fp, *fp.gather_format());
  at::Tensor gather_input;
  if (fp.compute_dtype() != fp.dtype()) {
    // Cast before the gather, so the gather moves compute-dtype bytes.
    input = fp.buffers().empty(fp.shard_numel(), fp.unsharded().options());
    input.copy_(fp.shard());
    fp.memory().add_param(fp.shard_numel() * fp.compute_element_size());
    gather_input = input;
  }
  // Gloo writes through the raw pointer: no tensor op, so the parameters' version counters (which
  // autograd checks for saved tensors) do not move.
  WorkPtr work = group.shard_comm->all_gather_into(fp.unsharded(), input, gather_label(fp, "parameter all-gather"));
  fp.set_pending_gather(work, gather_input, false);
  return work;
}

void start_reduction(FlatParam& fp, bool across_replicas) {
  FlatGrad& grad = fp.grad();
  grad.begin_reduction();
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  const ShardingGroups& group = fp.groups();
  // Deterministic mode reduces the exact sums instead (Note [Deterministic training]).
  const at::Tensor input = grad.deterministic() ? grad.take_exact() : grad.buffer();
  if (!fp.sharded_over_peers()) {
    // F == 1: the whole buffer is the shard (NO_SHARD, a world of one), reduced in place.
    WorkPtr work = group.world_size > 1 ? all_reduce(fp, *group.world_comm, input, 0,
                                                     reduction_label(fp, "gradient all-reduce", grad.count_reduction()))
                                        : nullptr;
    grad.set_reduction(input, work, false, false);
    return;
  }
  at::Tensor sums = grad.new_reduction_output();
  WorkPtr work =
      fp.reduce_format() && !grad.deterministic()
          ? quantized_reduce_scatter(*group.shard_comm, sums, input, reduction_buffers(fp),
                                     fp.residuals().enabled ? &fp.residuals().scatter : nullptr,
                                     reduction_label(fp, "quantized gradient reduce-scatter", grad.count_reduction()))
          : group.shard_comm->reduce_scatter(sums, input,
                                             reduction_label(fp, "gradient reduce-scatter", grad.count_reduction()));
  const bool replicas = group.replicate_comm && group.replicate_comm->size() > 1;
  const int64_t shard_origin = fp.shard_rank() * fp.shard_numel();  // where this rank's sums start in the flat buffer
  if (replicas && !across_replicas) {
    grad.set_reduction(sums, work, /*defer_replicas=*/true, false);  // completion adds them to the partial sums
  } else if (replicas && grad.has_partial()) {
    // The earlier micro-batches' shard-group sums join this one before the replica all-reduce.
    work->wait();
    grad.add_partial_into(sums);
    work = all_reduce(fp, *group.replicate_comm, sums, shard_origin,
                      reduction_label(fp, "replica gradient all-reduce", grad.count_replica_reduction()));
    grad.set_reduction(sums, work, false, true);
  } else if (replicas) {
    // Hybrid: the shard's sum across replicas, chained after the reduce-scatter on the replica
    // group's thread, so both overlap the rest of backward.
    CollectiveOptions after_scatter =
        reduction_label(fp, "replica gradient all-reduce", grad.count_replica_reduction());
    after_scatter.after = work;
    work = all_reduce(fp, *group.replicate_comm, sums, shard_origin, std::move(after_scatter));
    grad.set_reduction(sums, work, false, true);
  } else {
    grad.set_reduction(sums, work, false, false);
  }
}

bool finish_reduction(FlatParam& fp, bool defer_landing) {
  FlatGrad& grad = fp.grad();
  if (!grad.reduce_pending()) return false;
  if (WorkPtr work = grad.take_reduce_work()) {
    try {
      work->wait();
    } catch (...) {
      grad.abandon_reduction();
      throw;
    }
  }
  return grad.complete_reduction(defer_landing);
}

at::Tensor gather_full_values(const FlatParam& fp) {
  if (fp.keep_unsharded()) return fp.unsharded();
  InternalOpGuard internal;
  // Offloaded: on the device, as without offload (the collectives move device tensors).
  at::Tensor shard = fp.offloaded() ? fp.shard().to(fp.unsharded().device()) : fp.shard();
  if (!fp.sharded_over_peers()) return shard;
  at::Tensor out = at::empty({fp.padded_numel()}, shard.options().requires_grad(false));
  fp.groups().shard_comm->all_gather_into(out, shard, label(fp, "full-values all-gather", fp.count_gather()))->wait();
  return out;
}

std::pair<at::Tensor, std::vector<bool>> gather_full_gradient(const FlatParam& fp) {
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  const auto& slots = fp.slots();
  const int64_t n = static_cast<int64_t>(slots.size());
  const c10::Device device = fp.unsharded().device();
  at::Tensor shard = at::zeros({fp.shard_numel()}, at::TensorOptions().dtype(fp.dtype()).device(device));
  at::Tensor has = at::zeros({n}, at::TensorOptions().dtype(at::kFloat).device(device));
  for (int64_t i = 0; i < n; ++i) {
    const ParamSlot& s = slots[i];
    if (!s.piece.defined() || !s.piece.grad().defined()) continue;
    const at::Tensor g = s.piece.grad();
    shard.narrow(0, s.piece_offset, s.piece_numel).copy_(g.is_sparse() ? g.to_dense() : g);
    has[i] = 1;
  }
  at::Tensor full = shard;
  if (fp.sharded_over_peers()) {
    const CommunicatorPtr& comm = fp.groups().shard_comm;
    const int64_t count = fp.count_gather();
    full = at::empty({fp.padded_numel()}, shard.options());
    comm->all_gather_into(full, shard, label(fp, "full-gradient all-gather", count))->wait();
    comm->all_reduce(has, label(fp, "full-gradient presence all-reduce", count))->wait();
  }
  const at::Tensor present = has.cpu();
  std::vector<bool> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = present[i].item<float>() > 0;
  return {full, out};
}

}  // namespace fsdp
