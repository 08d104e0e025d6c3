// The workers of the killed- and stopped-rank tests: FULL_SHARD training of a Skippy with a full
// state dict every other step and checkpoints, in which one rank (the victim) sends itself a
// signal at a chosen point of step 2, and a loader that checks the last complete checkpoint.
#include <signal.h>
#include <unistd.h>

#include <fstream>
#include <random>
#include <thread>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

namespace ckpt = fsdp::checkpoint;

fsdp::Options skippy_options() {
  return fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>());
}

}  // namespace

// args: victim rank, point (forward, backward, step, full_state_dict, save, anywhere), signal (KILL,
// STOP, or KILL_HOLDING: before its SIGKILL at a point of forward, backward or step, the victim
// forks a child that keeps every descriptor it had open, its connections included, for 60 s and
// writes the child's pid to <root>/holder.pid), seed, checkpoint root. Checkpoints go to <root>/step-0 and <root>/step-2; the victim's
// signal comes in step 2: inside forward (between units), inside backward (after the last unit's
// reduction is issued), before the optimizer step, a random moment (0-2 ms, from the seed) into
// full_state_dict() or the save, or ("anywhere") a random moment (0-30 ms) after step 2 starts,
// the job then running until it lands.
FSDP_WORKER(fault_in_step_worker) {
  const int victim = std::stoi(ctx.args.at(0));
  const std::string point = ctx.args.at(1);
  const std::string how = ctx.args.at(2);
  const int sig = how == "STOP" ? SIGSTOP : SIGKILL;
  std::mt19937 rng(static_cast<unsigned>(std::stoi(ctx.args.at(3))));
  const std::string root = ctx.args.at(4);
  auto pg = fsdp::ProcessGroup::from_env();
  torch::manual_seed(1);
  Skippy model;
  auto sharded = fsdp::fully_shard(model, pg, skippy_options());
  torch::optim::SGD opt(sharded->parameters(), torch::optim::SGDOptions(0.1));
  const bool is_victim = ctx.rank == victim;
  int step = 0;
  auto fire_at = [&](const char* here) {
    if (!is_victim || step != 2 || point != here) return;
    if (how == "KILL_HOLDING") {
      const pid_t holder = fork();
      if (holder == 0) {
        sleep(60);
        _exit(0);
      }
      std::ofstream(root + "/holder.pid") << holder << std::endl;
    }
    raise(sig);
  };
  // A signal `max_us` or less from now, from another thread, whatever this one is doing then.
  std::thread timer;
  auto fire_later = [&](int max_us) {
    const int us = std::uniform_int_distribution<int>(0, max_us)(rng);
    timer = std::thread([us, sig] {
      std::this_thread::sleep_for(std::chrono::microseconds(us));
      raise(sig);
    });
    timer.detach();
  };
  model->in_forward = [&] {
    fire_at("forward");
  };
  model->in_backward = [&] {
    fire_at("backward");
  };
  const int steps = point == "anywhere" ? 100000 : 4;
  for (; step < steps; ++step) {
    if (is_victim && step == 2 && point == "anywhere") fire_later(30000);
    at::Tensor x = at::randn({4, 8}, at::detail::createCPUGenerator(step + ctx.rank));
    model->forward(x).pow(2).mean().backward();
    fire_at("step");
    opt.step();
    zero_grad_in_place(opt);
    if (step % 2 == 0) {
      if (is_victim && step == 2 && point == "full_state_dict") fire_later(2000);
      sharded->full_state_dict();
    }
    if (step == 0 || step == 2) {
      if (is_victim && step == 2 && point == "save") fire_later(2000);
      ckpt::save(root + "/step-" + std::to_string(step), *sharded, opt, {{"step", std::to_string(step)}});
    }
  }
  if (is_victim) std::this_thread::sleep_for(std::chrono::seconds(60));  // a late timer still lands
}

// args: checkpoint root. Loads the newest complete checkpoint under it into a fresh model.
FSDP_WORKER(fault_checkpoint_loader) {
  const std::string dir = ckpt::latest(ctx.args.at(0));
  WORKER_CHECK(!dir.empty(), "no complete checkpoint under ", ctx.args.at(0));
  auto pg = fsdp::ProcessGroup::from_env();
  Skippy model;
  auto sharded = fsdp::fully_shard(model, pg, skippy_options());
  torch::optim::SGD opt(sharded->parameters(), torch::optim::SGDOptions(0.1));
  ckpt::Extra extra;
  ckpt::load(dir, *sharded, opt, &extra);
  WORKER_CHECK(extra.count("step") == 1, "the checkpoint's extra state lost its step");
  std::printf("loaded %s (step %s)\n", dir.c_str(), extra["step"].c_str());
}

}  // namespace fsdp_test
