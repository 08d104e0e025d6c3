// The planner at the FSDP paper's scale (bench/results/planner_scale.md): GPT-175B on 128-512
// A100s at batch 1 and 2 per GPU, with and without backward prefetch, and FULL_SHARD against
// NO_SHARD (DDP) on GPTs of T5-611M's, T5-2.28B's and T5-11B's parameter counts. Every model is
// the example trainer's GPT (examples/gpt/model.h) built on the meta device; nothing is allocated.
//
//   fsdp_bench_planner_scale $(git rev-parse --short HEAD) > bench/results/planner_scale.md
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "model.h"
#include "model_cost.h"

namespace {

gpt::GPT build(int64_t layers, int64_t width, int64_t heads, int64_t context, int64_t vocab) {
  gpt::GPTConfig c;
  c.layers = layers;
  c.width = width;
  c.heads = heads;
  c.context = context;
  c.vocab_size = vocab;
  fsdp::DeferredInit deferred;
  return gpt::GPT(c);
}

fsdp::PlanRequest request(int world, int per_gpu, int64_t context) {
  return fsdp::PlanRequest()
      .world(world)
      .global_batch(world * per_gpu)
      .micro_batches({per_gpu})
      .seq_len(context)
      .module_cost(gpt::module_cost)
      .wrap_policies({{"block", fsdp::wrap::by_type<gpt::BlockImpl>()}})
      .precisions({at::kBFloat16})
      .cpu_offload({false});
}

std::string fixed(double v, int digits) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(digits) << v;
  return o.str();
}

std::string gib(int64_t b) { return fixed(static_cast<double>(b) / (1024.0 * 1024.0 * 1024.0), 1); }

}  // namespace

int main(int argc, char** argv) {
  const std::string commit = argc > 1 ? argv[1] : "(not given)";
  std::cout << "# The planner at the FSDP paper's scale\n\n"
            << "Produced by `build/bench/fsdp_bench_planner_scale $(git rev-parse --short HEAD)` "
               "(bench/planner_scale.cpp) at commit "
            << commit
            << ": predictions only, nothing run, so no machine figures. Cluster preset `paper` (A100 80 GB, 8 per "
               "node, NVLink within a node, 2 Tb/s RoCE "
               "per node), bf16 parameters with float32 reductions, every block a unit, AdamW.\n\n";

  gpt::GPT g175 = build(96, 12288, 96, 2048, 50000);
  std::cout << "## GPT-175B (96 layers, width 12288, 96 heads, context 2048, vocabulary 50,000; "
            << gpt::count_parameters(*g175) / 1000000 << "M parameters), FULL_SHARD, checkpointed blocks\n\n"
            << "Paper (Figures 6-7): more than 173 and 186 TFLOP/s per GPU at batch 1 and 2 (55-60% of peak), "
               "scaling linearly from 128 to 512 GPUs; backward prefetch about 18% faster.\n\n"
            << "| GPUs | batch per GPU | backward prefetch | peak GiB per GPU | fits 80 GiB | step s | exposed comm % "
               "| TFLOP/s per GPU | MFU % |\n| ---: | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: |\n";
  for (const int nodes : {16, 32, 64})
    for (const int batch : {1, 2}) {
      const auto cluster = fsdp::Cluster::parse("paper:" + std::to_string(nodes) + "x8");
      const fsdp::Plan plan =
          fsdp::plan(*g175, cluster,
                     request(cluster.world(), batch, 2048)
                         .strategies({fsdp::ShardingStrategy::kFullShard})
                         .activation_checkpointing({true})
                         .backward_prefetch({fsdp::BackwardPrefetch::kBackwardPre, fsdp::BackwardPrefetch::kNone}));
      for (const auto& e : plan.entries)
        std::cout << "| " << cluster.world() << " | " << batch << " | "
                  << fsdp::to_string(e.candidate.backward_prefetch) << " | " << gib(e.memory.peak) << " | "
                  << (e.fits ? "yes" : "no") << " | " << fixed(e.time.step_s, 2) << " | "
                  << fixed(100.0 * e.time.exposed_comm_s / e.time.step_s, 1) << " | "
                  << fixed(e.time.tflops_per_device, 1) << " | " << fixed(100.0 * e.time.mfu, 1) << " |\n";
    }

  struct Stand {
    const char* name;
    int64_t layers, width, heads;
  };
  std::cout << "\n## FULL_SHARD against NO_SHARD (DDP) on 8 GPUs (one node), batch 8 per GPU, context 512\n\n"
            << "GPTs with the parameter counts of the paper's T5 models (this library has no T5 module). Paper: "
               "FSDP and DDP about equal where DDP fits; DDP out of memory above 2.28B.\n\n"
            << "| model | parameters | strategy | peak GiB per GPU | fits 80 GiB | step s | TFLOP/s per GPU |\n"
            << "| --- | ---: | --- | ---: | --- | ---: | ---: |\n";
  for (const Stand& s : {Stand{"T5-611M's size", 24, 1456, 16}, Stand{"T5-2.28B's size", 32, 2432, 32},
                         Stand{"T5-11B's size", 48, 4352, 32}}) {
    gpt::GPT model = build(s.layers, s.width, s.heads, 512, 32128);
    const fsdp::Plan plan =
        fsdp::plan(*model, fsdp::Cluster::parse("paper:1x8"),
                   request(8, 8, 512)
                       .strategies({fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kNoShard})
                       .activation_checkpointing({false}));
    for (const auto& e : plan.entries)
      std::cout << "| " << s.name << " | " << gpt::count_parameters(*model) / 1000000 << "M | "
                << fsdp::to_string(e.candidate.strategy) << " | " << gib(e.memory.peak) << " | "
                << (e.fits ? "yes" : "no") << " | " << fixed(e.time.step_s, 3) << " | "
                << fixed(e.time.tflops_per_device, 1) << " |\n";
  }
  return 0;
}
