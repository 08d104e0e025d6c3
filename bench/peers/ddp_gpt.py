#!/usr/bin/python3
"""PyTorch DDP and FSDP contenders of the peer benchmark: the example GPT (examples/gpt/model.cpp)
in Python, trained with torch.nn.parallel.DistributedDataParallel (or, with --fsdp, PyTorch 2.x's
FullyShardedDataParallel) over Gloo on the CPU.

Runs with Debian's python3-torch (1.13). Launch one process per rank with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set (bench/peers/run.py uses build/tools/fsdp-run; torchrun is broken
on Debian's Python 3.11). The initial weights and every step's global batch come from the file
that `gpt_bench --write-inputs` writes, so this run starts from the same model and sees the same
tokens as the LibTorch and libfsdp contenders; rank r trains on rows [r*B/W, (r+1)*B/W).

The timed step matches gpt_bench's: zero_grad, forward, loss, backward (DDP all-reduces
gradient buckets during it), AdamW step and reading the loss. DDP runs with its defaults.
"""
import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------------
# The model: the same modules, names, layer order and operations as examples/gpt/model.cpp.

class CausalSelfAttention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        assert width % heads == 0
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        batch, time_, width = x.shape
        head_dim = width // self.heads
        q, k, v = self.qkv(x).chunk(3, dim=-1)

        def split_heads(t):
            return t.view(batch, time_, self.heads, head_dim).transpose(1, 2)

        q, k, v = split_heads(q), split_heads(k), split_heads(v)
        if hasattr(F, "scaled_dot_product_attention"):
            # PyTorch 2.x, as model.cpp on LibTorch 2.x: the fused kernel, same math.
            mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(mixed.transpose(1, 2).reshape(batch, time_, width))
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(head_dim)
        future = torch.ones(time_, time_, dtype=torch.bool, device=x.device).triu(diagonal=1)
        weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        mixed = torch.matmul(weights, v).transpose(1, 2).reshape(batch, time_, width)
        return self.proj(mixed)


class MLP(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln_attn = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_mlp = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x):
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class TiedLMHead(nn.Module):
    """Logits from the token embedding's weight (weight tying), as TiedLMHeadImpl. The weight is
    read from the embedding at each call and not registered here, so it has one owner: FSDP's
    meta-device materialization (to_empty + reset_parameters, module by module) keeps it tied."""

    def __init__(self, embedding):
        super().__init__()
        self._embedding = [embedding]  # a list: not registered as a submodule either

    def forward(self, x):
        return F.linear(x, self._embedding[0].weight)


class GPT(nn.Module):
    def __init__(self, vocab_size, context, width, layers, heads):
        super().__init__()
        self.context = context
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(context, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.ln_final = nn.LayerNorm(width)
        self.lm_head = TiedLMHead(self.token_embedding)

    def forward(self, tokens):
        time_ = tokens.shape[1]
        assert time_ <= self.context
        positions = torch.arange(time_, dtype=torch.long, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_final(x))


# ---------------------------------------------------------------------------------------------

def read_inputs(path):
    """The file gpt_bench --write-inputs wrote: a JSON header line, then raw tensors."""
    with open(path, "rb") as f:
        header = json.loads(f.readline())
        data = f.read()

    def tensor(entry, dtype, itemsize):
        count = math.prod(entry["shape"])
        start = entry["offset"]
        t = torch.frombuffer(bytearray(data[start:start + count * itemsize]), dtype=dtype)
        return t.reshape(entry["shape"])

    params = {p["name"]: tensor(p, torch.float32, 4) for p in header["parameters"]}
    batches = tensor(header["batches"], torch.int64, 8)
    return header["config"], params, batches


def start_memory_watchdog(cap_bytes):
    """Exits the process (status 3) as soon as its resident set passes cap_bytes, as gpt_bench's
    MemoryWatchdog: an over-budget probe of the largest-model search stops early. The verdict
    itself uses VmHWM, which a sampler can miss between two samples."""
    import threading

    def watch():
        while True:
            rss = status_bytes("VmRSS")
            if rss > cap_bytes:
                print(f"ddp_gpt [rank {os.environ.get('RANK', '0')}]: resident set {rss / 1048576:.1f} MiB exceeds "
                      f"the cap of {cap_bytes / 1048576:.1f} MiB; aborting", file=sys.stderr, flush=True)
                os._exit(3)
            time.sleep(0.001)

    threading.Thread(target=watch, daemon=True).start()


def status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class _Plain:
    """The model called directly, with DDP's `.module` attribute."""

    def __init__(self, module):
        self.module = module

    def __call__(self, *args):
        return self.module(*args)


def unwrapped_name(name):
    """A parameter's name in the plain model, from its name under FSDP's wrappers."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def wrap_fsdp(model, strategy, factor, rank, world):
    """PyTorch FSDP (FSDP1) on the CPU with its best documented settings for throughput: every
    Block a unit, use_orig_params (per-parameter weight decay), the rate limiter, forward and
    BACKWARD_PRE prefetch. HYBRID_SHARD gets an explicit (shard, replicate) group pair of
    consecutive ranks, as libfsdp's sharding_factor: on one host FSDP's own default would shard
    over the whole world."""
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    process_group = None
    if strategy == "HYBRID_SHARD":
        f = factor or max(1, world // 2)
        if world % f:
            sys.exit(f"ddp_gpt: --sharding-factor {f} does not divide the world size {world}")
        for g in range(world // f):  # every rank creates every group, in the same order
            ranks = list(range(g * f, (g + 1) * f))
            group = dist.new_group(ranks)
            if rank in ranks:
                shard = group
        for i in range(f):
            ranks = list(range(i, world, f))
            group = dist.new_group(ranks)
            if rank in ranks:
                replicate = group
        process_group = (shard, replicate)
    return FullyShardedDataParallel(
        model, process_group=process_group, sharding_strategy=getattr(ShardingStrategy, strategy),
        auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"), use_orig_params=True,
        limit_all_gathers=True, forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", required=True, help="file written by gpt_bench --write-inputs")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: OMP_NUM_THREADS)")
    ap.add_argument("--result", help="rank 0 writes the result as JSON here")
    ap.add_argument("--label", default="pytorch-ddp")
    ap.add_argument("--fsdp", choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"],
                    help="train with PyTorch FSDP (FullyShardedDataParallel, PyTorch 2.x on the CPU) with this "
                         "strategy instead of DDP; every Block is a unit")
    ap.add_argument("--sharding-factor", type=int, default=0,
                    help="HYBRID_SHARD: ranks per shard group (consecutive ranks; 0: half the world)")
    ap.add_argument("--no-ddp", action="store_true",
                    help="train the plain model without the DDP wrapper (world size 1 only): the same model "
                         "and step in Python, for comparing eager Python with the C++ frontend")
    ap.add_argument("--init", choices=["file", "meta"], default="file",
                    help="file: the initial weights of --inputs; meta (FSDP only): build the model on the meta "
                         "device and let FSDP materialize and initialize it unit by unit (reset_parameters), as "
                         "gpt_bench --init deferred; the largest-model search uses it")
    ap.add_argument("--layers", type=int, default=0,
                    help="with --init meta: this many blocks instead of the inputs file's")
    ap.add_argument("--memory-cap-mib", type=int, default=0,
                    help="abort a rank whose resident set passes this many MiB (sampled every millisecond)")
    args = ap.parse_args()
    if args.memory_cap_mib > 0:
        start_memory_watchdog(args.memory_cap_mib * 1048576)

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        sys.exit(f"ddp_gpt: {', '.join(missing)} not set; launch one process per rank, e.g. "
                 "build/tools/fsdp-run --nproc-per-node 2 /usr/bin/python3 bench/peers/ddp_gpt.py --inputs FILE")
    if not os.path.isfile(args.inputs):
        sys.exit(f"ddp_gpt: --inputs {args.inputs} does not exist; write it with gpt_bench --write-inputs")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.no_ddp and world != 1:
        sys.exit(f"ddp_gpt: --no-ddp trains without communication and needs WORLD_SIZE=1, got {world}")
    # PyTorch 2.4 asks for TCPStore's libuv backend, which builds without libuv (Debian's) refuse;
    # the classic backend is in every build (PyTorch 1.x has no other and ignores the variable).
    os.environ.setdefault("USE_LIBUV", "0")
    dist.init_process_group("gloo", rank=rank, world_size=world)

    config, params, batches = read_inputs(args.inputs)
    total_steps = args.warmup + args.steps
    if batches.shape[0] < total_steps:
        sys.exit(f"ddp_gpt: the inputs file has {batches.shape[0]} steps of batches, fewer than "
                 f"--warmup + --steps = {total_steps}")
    if config["global_batch"] % world:
        sys.exit(f"ddp_gpt: global batch {config['global_batch']} is not divisible by the world size {world}")
    rows = config["global_batch"] // world
    context = config["context"]
    batches = batches[:total_steps, rank * rows:(rank + 1) * rows].contiguous()

    if args.init == "meta" and not args.fsdp:
        sys.exit("ddp_gpt: --init meta needs --fsdp (DDP cannot materialize a meta-device model)")
    if args.layers and args.init != "meta":
        sys.exit("ddp_gpt: --layers needs --init meta (the inputs file's weights are for its own depth)")
    layers = args.layers or config["layers"]
    if args.init == "meta":
        with torch.device("meta"):
            model = GPT(256, context, config["width"], layers, config["heads"])
        params = {}
    else:
        model = GPT(256, context, config["width"], layers, config["heads"])
    with torch.no_grad():
        named = dict(model.named_parameters()) if args.init == "file" else {}  # the tied weight once
        missing = set(named) - set(params)
        if missing:
            sys.exit(f"ddp_gpt: the inputs file lacks parameters {sorted(missing)}")
        for name, p in named.items():
            if tuple(p.shape) != tuple(params[name].shape):
                sys.exit(f"ddp_gpt: parameter {name} has shape {tuple(params[name].shape)} in the inputs "
                         f"file but {tuple(p.shape)} here")
            p.copy_(params[name])
    del params
    parameter_count = sum(p.numel() for p in model.parameters())
    dims = {name: p.dim() for name, p in model.named_parameters()}

    if args.fsdp:
        ddp = wrap_fsdp(model, args.fsdp, args.sharding_factor, rank, world)
        named_now = [(unwrapped_name(n), p) for n, p in ddp.named_parameters()]
    else:
        ddp = _Plain(model) if args.no_ddp else nn.parallel.DistributedDataParallel(model)
        named_now = list(ddp.module.named_parameters())
    decayed = [p for n, p in named_now if dims[n] >= 2]
    not_decayed = [p for n, p in named_now if dims[n] < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": args.weight_decay}, {"params": not_decayed, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.99))

    if rank == 0:
        how = ("without DDP (plain model)" if args.no_ddp else
               f"FSDP {args.fsdp} over Gloo" if args.fsdp else "DDP over Gloo")
        print(f"ddp_gpt {args.label}: PyTorch {torch.__version__} {how}, world {world}, "
              f"{torch.get_num_threads()} threads per process; model {layers} layers, width "
              f"{config['width']}, {config['heads']} heads, context {context}, {parameter_count} parameters; "
              f"global batch {config['global_batch']} x {context} tokens; steps {args.warmup} warm-up + "
              f"{args.steps} timed", flush=True)

    # The initialization peak, then the high-water mark restarts so the steps' own peak is seen.
    hwm_init = status_bytes("VmHWM")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        hwm_reset = True
    except OSError:
        hwm_reset = False
    step_seconds, losses = [], []
    def resource_use():
        """CPU seconds (user, system), minor page faults, voluntary and involuntary switches."""
        u = resource.getrusage(resource.RUSAGE_SELF)
        return [u.ru_utime, u.ru_stime, u.ru_minflt, u.ru_nvcsw, u.ru_nivcsw]

    use_at_timed_start = resource_use()
    phases = {"zero_grad": [], "forward": [], "backward": [], "optimizer": []}
    for step in range(total_steps):
        if step == args.warmup:
            use_at_timed_start = resource_use()
        window = batches[step]
        inputs, targets = window[:, :context], window[:, 1:context + 1]
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)  # in place, as gpt_bench (PyTorch 2.x's default drops them)
        zeroed = time.perf_counter()
        logits = ddp(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        forwarded = time.perf_counter()
        loss.backward()
        backwarded = time.perf_counter()
        optimizer.step()
        value = loss.item()
        end = time.perf_counter()
        seconds = end - start
        losses.append(value)
        if step >= args.warmup:
            step_seconds.append(seconds)
            for name, a, b in (("zero_grad", start, zeroed), ("forward", zeroed, forwarded),
                               ("backward", forwarded, backwarded), ("optimizer", backwarded, end)):
                phases[name].append(b - a)
        if rank == 0:
            tag = " (warm-up)" if step < args.warmup else ""
            print(f"step {step + 1}/{total_steps}{tag} | loss {value:.6f} (rank 0) | {seconds * 1000:.1f} ms",
                  flush=True)

    use = [(b - a) / args.steps for a, b in zip(use_at_timed_start, resource_use())]
    adam_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                     for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    hwm_train = status_bytes("VmHWM") if hwm_reset else 0
    hwm = max(hwm_init, hwm_train)
    fields = [hwm_init, hwm_train, hwm, adam_bytes, statistics.median(step_seconds)] + use
    per_rank = torch.zeros(world, len(fields), dtype=torch.float64)
    per_rank[rank] = torch.tensor(fields, dtype=torch.float64)
    dist.all_reduce(per_rank)
    loss_sum = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(loss_sum)
    loss_sum /= world

    if rank == 0:
        med = statistics.median(step_seconds)
        result = {
            "label": args.label,
            "implementation": "pytorch-local" if args.no_ddp else "pytorch-fsdp" if args.fsdp else "pytorch-ddp",
            "mode": "local" if args.no_ddp else "fsdp" if args.fsdp else "ddp",
            "strategy": "" if args.no_ddp else args.fsdp or "DDP",
            "world": world,
            "threads_per_process": torch.get_num_threads(),
            "torch_version": torch.__version__,
            "config": dict(config, layers=layers, warmup=args.warmup, steps=args.steps, lr=args.lr, init=args.init),
            "parameters": parameter_count,
            "tokens_per_step": config["global_batch"] * context,
            "step_seconds": step_seconds,
            "median_step_s": med,
            "tokens_per_s": config["global_batch"] * context / med,
            "losses": loss_sum.tolist(),
            "ranks": [{"rank": r, "vmhwm_init_bytes": per_rank[r, 0].item(),
                       "vmhwm_train_bytes": per_rank[r, 1].item(), "vmhwm_bytes": per_rank[r, 2].item(),
                       "adamw_state_bytes": per_rank[r, 3].item(), "median_step_s": per_rank[r, 4].item(),
                       "cpu_user_s_per_step": per_rank[r, 5].item(),
                       "cpu_system_s_per_step": per_rank[r, 6].item()}
                      for r in range(world)],
            "cpu_user_s_per_step": per_rank[:, 5].sum().item(),
            "cpu_system_s_per_step": per_rank[:, 6].sum().item(),
            "cpu_s_per_step": per_rank[:, 5:7].sum().item(),
            "minor_faults_per_step": per_rank[:, 7].sum().item(),
            "voluntary_switches_per_step": per_rank[:, 8].sum().item(),
            "involuntary_switches_per_step": per_rank[:, 9].sum().item(),
            "phase_median_s": {k: statistics.median(v) for k, v in phases.items()},
            "ru_maxrss_bytes_rank0": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        print(f"median step {med * 1000:.2f} ms, {result['tokens_per_s']:.0f} tokens/s, "
              f"peak RSS (rank 0) {hwm / 1048576:.1f} MiB", flush=True)
        if args.result:
            with open(args.result, "w") as f:
                json.dump(result, f, indent=1)
    dist.barrier()  # no rank tears down its connections while another still writes its result
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
