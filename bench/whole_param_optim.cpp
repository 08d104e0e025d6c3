// Step time of the optimizers that need whole parameters (fsdp::Lamb, fsdp::Adafactor, fsdp::Muon)
// against AdamW on the example GPT (FULL_SHARD, one unit per block, the trainer's parameter groups),
// and the bytes their own collectives send per rank and step against the naive way: an all-gather
// of every whole parameter the step needs on every rank. Rank 0 prints a markdown table.
//
//   fsdp-run --nproc-per-node 4 build/bench/fsdp_bench_whole_param_optim [--layers L] [--width D]
//       [--heads H] [--context T] [--batch B] [--steps S] [--warmup W] [--rounds R]
#include <fsdp/fsdp.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "model.h"
#include "optimizer.h"

namespace {

struct Config {
  gpt::GPTConfig model;
  int batch = 8, steps = 10, warmup = 2, rounds = 3;
};

struct Result {
  std::vector<double> step_ms, optimizer_ms;
  int64_t bytes = 0, naive_bytes = 0;  // per rank and step
  fsdp::MuonStepStats muon;            // Muon's plan on this rank
  // Muon's plan by each way of exchanging, with the trainer's Muon matrices (the blocks' matrices).
  std::vector<std::pair<std::string, fsdp::MuonStepStats>> muon_by_exchange;
};

// Muon planned over `sharded` with each exchange: the blocks' parameters in a Muon group, the rest
// stepped by AdamW, as the trainer's groups do.
std::vector<std::pair<std::string, fsdp::MuonStepStats>> muon_plans(fsdp::FullyShardedModule& sharded) {
  using fsdp::MuonExchange;
  std::vector<torch::Tensor> blocks, rest;
  for (const auto& p : sharded.shard_pieces())
    if (p.piece.requires_grad()) (p.name.rfind("blocks.", 0) == 0 ? blocks : rest).push_back(p.piece);
  std::vector<std::pair<std::string, fsdp::MuonStepStats>> out;
  for (auto [name, exchange] : {std::pair<const char*, MuonExchange>{"kAuto", MuonExchange::kAuto},
                                {"kAllToAll", MuonExchange::kAllToAll},
                                {"kReduceScatterAllGather", MuonExchange::kReduceScatterAllGather},
                                {"kAllGather", MuonExchange::kAllGather},
                                {"kAutoWithoutAllToAll", MuonExchange::kAutoWithoutAllToAll}}) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(blocks, std::make_unique<fsdp::MuonOptions>());
    groups.emplace_back(rest, std::make_unique<fsdp::MuonOptions>(fsdp::MuonOptions().use_muon(false)));
    out.emplace_back(name, fsdp::Muon(sharded, std::move(groups), fsdp::MuonOptions(), exchange).stats());
  }
  return out;
}

const char* exchange_name(fsdp::MuonExchange e) {
  switch (e) {
    case fsdp::MuonExchange::kAllToAll: return "all-to-all";
    case fsdp::MuonExchange::kReduceScatterAllGather: return "reduce-scatter and all-gather";
    case fsdp::MuonExchange::kAllGather: return "all-gather of the straddling matrices";
    default: return "none";
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// `steps` timed steps of `kind` after `warmup` untimed ones, appended to `r`.
void run(const std::string& kind, const Config& c, fsdp::ProcessGroupPtr pg, Result& r) {
  torch::manual_seed(1);
  gpt::GPT model(c.model);
  auto sharded = fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<gpt::BlockImpl>()));
  std::map<std::string, int64_t> dims;
  std::vector<std::pair<std::string, torch::Tensor>> pieces;
  for (const auto& p : sharded->shard_pieces()) {
    dims[p.name] = static_cast<int64_t>(p.shape.size());
    pieces.emplace_back(p.name, p.piece);
  }
  const int64_t trained = gpt::count_parameters(*model);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (kind == "adamw")
    opt = gpt::make_adamw(pieces, dims, 1e-3, 0.1);
  else
    opt = gpt::make_whole_param_optimizer(kind, *sharded, dims, 1e-3, 0.1);
  const int world = pg->size();
  for (int s = 0; s < c.warmup + c.steps; ++s) {
    const auto x = torch::randint(0, c.model.vocab_size, {c.batch, c.model.context},
                                  at::detail::createCPUGenerator(100 + s * world + pg->rank()));
    const auto t0 = std::chrono::steady_clock::now();
    opt->zero_grad();
    auto logits = model->forward(x);
    torch::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), x.roll(1, 1).reshape({-1})).backward();
    const auto t1 = std::chrono::steady_clock::now();
    opt->step();
    if (s >= c.warmup) {
      r.optimizer_ms.push_back(since(t1));
      r.step_ms.push_back(since(t0));
    }
  }
  // Bytes sent per rank and step by a ring algorithm: (W - 1) x the per-rank share of each collective.
  const int64_t f32 = 4;
  if (auto* w = dynamic_cast<fsdp::WholeParamOptimizer*>(opt.get())) {
    const int64_t collectives = w->reduction().collectives();
    if (auto* m = dynamic_cast<fsdp::Muon*>(opt.get())) {
      r.bytes = m->stats().bytes_sent;
      r.naive_bytes = m->stats().naive_bytes_sent;
      r.muon = m->stats();
      if (r.muon_by_exchange.empty()) r.muon_by_exchange = muon_plans(*sharded);
    } else if (collectives > 0) {
      r.bytes = (world - 1) * w->reduction().bytes_sent() / (c.warmup + c.steps);
      r.naive_bytes = (world - 1) * ((trained + world - 1) / world) * f32;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  c.model.layers = 4;  // the trainer's defaults
  c.model.width = 128;
  c.model.heads = 4;
  c.model.context = 64;
  CLI::App app{"Whole-parameter optimizers against AdamW on the example GPT"};
  app.add_option("--layers", c.model.layers);
  app.add_option("--width", c.model.width);
  app.add_option("--heads", c.model.heads);
  app.add_option("--context", c.model.context);
  app.add_option("--batch", c.batch, "Sequences per rank");
  app.add_option("--steps", c.steps, "Timed steps per round");
  app.add_option("--warmup", c.warmup, "Untimed steps per round");
  app.add_option("--rounds", c.rounds, "Rounds, the optimizers interleaved");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);
  auto pg = fsdp::ProcessGroup::from_env();
  const std::vector<std::string> kinds{"adamw", "lamb", "adafactor", "muon"};
  std::map<std::string, Result> results;
  for (int round = 0; round < c.rounds; ++round)
    for (const auto& k : kinds) run(k, c, pg, results[k]);
  // The slowest rank's medians.
  std::map<std::string, std::pair<double, double>> ms;
  for (const auto& k : kinds) {
    auto t = torch::tensor({median(results[k].step_ms), median(results[k].optimizer_ms)}, torch::kDouble);
    at::Tensor gathered = at::empty({pg->size() * 2}, torch::kDouble);
    pg->world()->all_gather_into(gathered, t)->wait();
    auto v = gathered.view({pg->size(), 2}).amax(0);
    ms[k] = {v[0].item<double>(), v[1].item<double>()};
  }
  // Muon's Newton-Schulz work on the busiest rank against the mean.
  auto owned = torch::tensor({double(results["muon"].muon.owned_cost)}, torch::kDouble);
  at::Tensor all_owned = at::empty({pg->size()}, torch::kDouble);
  pg->world()->all_gather_into(all_owned, owned)->wait();
  if (pg->rank() != 0) return 0;
  const double base = ms["adamw"].first, base_opt = ms["adamw"].second;
  std::printf("| optimizer | ms/step | / AdamW | optimizer step ms | / AdamW's | collective bytes sent per rank and "
              "step | naive (every whole parameter gathered on every rank) |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const auto& k : kinds) {
    const Result& r = results[k];
    std::printf("| %s | %.1f | %.2f | %.2f | %.2f | %s | %s |\n", k.c_str(), ms[k].first, ms[k].first / base,
                ms[k].second, ms[k].second / base_opt, k == "adamw" ? "0" : std::to_string(r.bytes).c_str(),
                k == "adamw" ? "-" : std::to_string(r.naive_bytes).c_str());
  }
  const fsdp::MuonStepStats& st = results["muon"].muon;
  std::printf("\nMuon at world %d: %lld matrices; elements moved to their owners %lld (of %lld in the matrices); "
              "exchange by %s, %lld elements per destination; busiest rank's Newton-Schulz work / mean %.2f\n",
              pg->size(), static_cast<long long>(st.matrices), static_cast<long long>(st.moved_numel),
              static_cast<long long>(st.matrices_numel), exchange_name(st.exchange),
              static_cast<long long>(st.exchange_numel),
              all_owned.max().item<double>() * pg->size() / std::max<double>(1, double(st.total_cost)));
  std::printf("\n| world | MuonExchange | runs | bytes sent per rank and step | naive | / naive | elements moved |\n");
  std::printf("| ---: | --- | --- | ---: | ---: | ---: | ---: |\n");
  for (const auto& [name, plan] : results["muon"].muon_by_exchange)
    std::printf("| %d | %s | %s | %lld | %lld | %.3f | %lld |\n", pg->size(), name.c_str(),
                exchange_name(plan.exchange), static_cast<long long>(plan.bytes_sent),
                static_cast<long long>(plan.naive_bytes_sent),
                double(plan.bytes_sent) / std::max<double>(1, double(plan.naive_bytes_sent)),
                static_cast<long long>(plan.moved_numel));
  return 0;
}
