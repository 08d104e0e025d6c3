#!/usr/bin/python3
"""libfsdp against its peers: PyTorch DDP, local LibTorch training, the paper's memory formula and
the largest trainable model under a per-rank memory cap.

    bench/peers/run.py                      # the full benchmark; writes bench/results/*.md and *.png
    bench/peers/run.py --preset ci --check  # the CI-sized variant (ctest bench.peers_ci)

Sections (--sections, default all):
  peers    The same GPT (examples/gpt/model.cpp: architecture, initial weights, batches, AdamW) as
           (a) one LibTorch process on the whole machine, (b) libfsdp NO_SHARD, FULL_SHARD,
           SHARD_GRAD_OP, HYBRID_SHARD, (c) PyTorch DDP over Gloo (bench/peers/ddp_gpt.py, Debian's
           python3-torch), for each model size and world size. Contenders are interleaved: every
           repetition runs each once, in an order rotated per repetition; the tables give medians
           over repetitions of each run's median step time, as ratios to DDP measured in the same
           run. Before timing counts, every contender's per-step losses are compared with local
           training's (they start from the same weights and see the same tokens).
  memory   FULL_SHARD at one world size for several wrap granularities: measured peak
           parameter, gradient and AdamW-state bytes per rank against the formula computed from
           the units (FullyShardedModule::units()), and the step time of each granularity.
  malloc   Diagnosis of the step-time gap, in one process (world 1, no communication): the
           compute-bound model in eager Python, in the LibTorch C++ frontend, in the C++ frontend
           with an operator callback like libfsdp's interception, and under libfsdp NO_SHARD, each
           with glibc's default malloc and with the steady setting every other section uses.
  largest  With a fixed per-rank memory cap, the deepest GPT (fixed width) that trains under
           NO_SHARD and under FULL_SHARD, found by doubling then bisection, one short run per probe.

Uses only the Python standard library; the DDP contender needs /usr/bin/python3 with python3-torch
(scripts/setup.sh --bench installs it, and gnuplot-nox for the plots).
"""
import argparse
import datetime
import json
import math
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MiB = 1048576.0

# Model sizes: name -> GPT shape and sequences per rank per step.
#  compute-bound: 3.3 M parameters and 256 tokens per rank: ~5 GFLOP per rank per step against
#                 13 MB of gradients, so the step is dominated by compute.
#  comm-bound:    12.9 M parameters (52 MB) and 32 tokens per rank: ~2.5 GFLOP per rank against
#                 52 MB all-reduced (DDP) or gathered twice and reduce-scattered (FSDP).
# Contender kinds that run PyTorch's own processes (Python); every other kind runs our binaries.
PYTORCH_KINDS = ("pylocal", "ddp", "pyfsdp")

PRESETS = {
    "full": {
        "sizes": [
            {"name": "compute-bound", "layers": 4, "width": 256, "heads": 4, "context": 64, "batch_per_rank": 4},
            {"name": "comm-bound", "layers": 4, "width": 512, "heads": 8, "context": 32, "batch_per_rank": 1},
        ],
        "worlds": [2, 4],
        "reps": 7,
        "warmup": 2,
        "steps": 6,
        "threads_per_rank": 1,
        "tcp_strategies": ["NO_SHARD", "FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"],
        "memory": {"world": 4, "size": "comm-bound", "wraps": ["none", "block", "sublayer", "linear"], "reps": 3},
        "malloc_diagnosis": {"size": "compute-bound", "batch_per_rank": 4,
                             "contenders": ["pylocal", "local1", "local_callback", "NO_SHARD"], "reps": 7},
        "contender_malloc": "steady",
        "largest": {"world": 4, "cap_mib": 1024, "width": 512, "heads": 8, "context": 32, "batch_per_rank": 1,
                    "max_layers": 256, "criteria": ["whole", "steps"], "malloc": ["default", "mmap"],
                    "init": "deferred"},
    },
    "ci": {
        "sizes": [{"name": "tiny", "layers": 2, "width": 64, "heads": 4, "context": 32, "batch_per_rank": 2}],
        "worlds": [2],
        "reps": 1,
        "warmup": 1,
        "steps": 2,
        "threads_per_rank": 1,
        "tcp_strategies": ["FULL_SHARD", "HYBRID_SHARD"],
        "memory": {"world": 2, "size": "tiny", "wraps": ["none", "block"], "reps": 1},
        "malloc_diagnosis": {"size": "tiny", "batch_per_rank": 2,
                             "contenders": ["pylocal", "local1", "local_callback", "NO_SHARD"], "reps": 1},
        "contender_malloc": "steady",
        "largest": {"world": 2, "cap_mib": 0, "cap_over_baseline_mib": 16, "width": 256, "heads": 4, "context": 16,
                    "batch_per_rank": 1, "max_layers": 2, "criteria": ["whole"], "malloc": ["default"],
                    # The cap sits just above libfsdp's own 1-layer footprint, below a Python process's.
                    "contenders": ["NO_SHARD", "FULL_SHARD"]},
    },
}

FSDP_STRATEGIES = ["NO_SHARD", "FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"]

# glibc malloc settings for the largest-model search. "default": glibc's dynamic mmap threshold,
# which rises to the size of the largest block freed so far (up to 32 MiB), after which blocks of
# that size come from the heap and freed ones often stay resident. "mmap": a fixed 512 KiB threshold
# (glibc's MALLOC_MMAP_THRESHOLD_ tunable), so every parameter-sized tensor is mapped and unmapped
# on its own and the resident set follows the live tensors. (1 MiB, used before, left one rank's
# AdamW state of a 1,043,968-byte shard piece on the heap, where it fragmented: +50 MiB on that
# rank only at width 512, world 4.)
MALLOC_MODES = {
    "default": {},
    # Every contender of the peers section (DDP's Python process too): glibc's mmap threshold fixed
    # at 32 MiB (the most its dynamic threshold reaches) and the heap trimmed only when more than
    # 64 MiB at its top are free. With glibc's defaults a LibTorch C++ process returns the top of
    # its heap to the kernel after every backward and faults it in again, zero-filled, in the next
    # step (about 4,000 page faults per step on the compute-bound model); the Python process does
    # not (its own small objects keep the heap top in use). See malloc.md.
    "steady": {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "67108864"},
    "mmap": {"MALLOC_MMAP_THRESHOLD_": "524288"},
    # Diagnosis only (section "malloc"): large blocks come from the heap and freed memory is never
    # returned to the kernel, so a buffer freed and allocated again reuses resident pages instead
    # of faulting in freshly zeroed ones.
    "keep": {"MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "4294967296"},
}


def log(msg):
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


def fmt(x, digits=2):
    return "n/a" if x is None else f"{x:.{digits}f}"


def mib(b, digits=1):
    return "n/a" if b is None else f"{b / MiB:.{digits}f}"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def usable_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def command_output(argv):
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def head_commit_without_git(root):
    """The short commit of root's checked-out HEAD, read from .git's files; "" where that fails."""
    git = os.path.join(root, ".git")
    try:
        with open(os.path.join(git, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref: "):
            return head[:7]
        ref = head[5:]
        if os.path.exists(os.path.join(git, ref)):
            with open(os.path.join(git, ref)) as f:
                return f.read().strip()[:7]
        with open(os.path.join(git, "packed-refs")) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref:
                    return parts[0][:7]
    except OSError:
        pass
    return ""


def machine_description(python):
    lines = []
    lscpu = command_output(["lscpu"])
    keep = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "CPU max MHz",
            "L2 cache", "L3 cache")
    for line in lscpu.splitlines():
        key = line.split(":")[0].strip()
        if key in keep:
            lines.append(f"{key}: {line.split(':', 1)[1].strip()}")
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f.readline().split(":")[1].strip()
    except OSError:
        pass
    versions = {}
    for pkg in ("libtorch-dev", "libgloo-dev", "python3-torch", "libopenblas0-pthread", "gnuplot-nox"):
        versions[pkg] = command_output(["dpkg-query", "-W", "-f=${Version}", pkg]) or "not installed"
    debian = ""
    try:
        with open("/etc/debian_version") as f:
            debian = f.read().strip()
    except OSError:
        pass
    commit = command_output(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"])
    # Earlier results in bench/results do not change what runs.
    dirty = command_output(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":(exclude)bench/results"])
    if not commit:  # no git here (the trixie root has none): read the checkout's HEAD by hand
        commit = head_commit_without_git(ROOT)
        if commit:
            commit += " (uncommitted changes not checked: no git)"
    return {
        "cpu": lines,
        "usable_cpus": usable_cpus(),
        "memory": mem,
        "kernel": platform.release(),
        "debian": debian,
        "packages": versions,
        "python": python,
        "commit": commit + (" (with uncommitted changes)" if dirty else ""),
    }


class Bench:
    def __init__(self, args, preset):
        self.args = args
        self.preset = preset
        self.build = os.path.abspath(args.build_dir)
        self.gpt_bench = os.path.join(self.build, "bench", "gpt_bench")
        self.largest_fsdp_args = shlex.split(args.largest_fsdp_args)
        self.launcher = os.path.join(self.build, "tools", "fsdp-run")
        self.out = os.path.abspath(args.out)
        self.work = os.path.join(self.out, "work")
        os.makedirs(self.work, exist_ok=True)
        for exe in (self.gpt_bench, self.launcher):
            if not os.access(exe, os.X_OK):
                sys.exit(f"run.py: {exe} is missing; build it first: cmake --build {args.build_dir} "
                         f"--target gpt_bench fsdp-run")
        self.python = args.python
        self.ddp_available, self.ddp_reason = self.check_ddp()
        # FSDP1 trains on the CPU from PyTorch 2.x (Debian trixie's 2.6; bookworm's 1.13 cannot).
        self.pyfsdp_available = self.ddp_available and int(self.ddp_reason.split(".")[0]) >= 2
        self.raw = []  # every run, as recorded
        # (strategy, layers, malloc) -> (result or None, rc, log tail, wall s, watchdog limit passed)
        self.probe_cache = {}
        self.counter = 0
        # Every contender gets the same environment: threads per rank via the launcher (and
        # --threads), and a passive OpenMP wait policy. On this shared machine a 2-thread process
        # whose threads spin while waiting ran up to 9x slower than with 1 thread when other jobs
        # held the cores; passive waiting makes the whole-machine local run comparable.
        self.env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")

    def check_ddp(self):
        if not os.access(self.python, os.X_OK):
            return False, f"{self.python} not found"
        r = subprocess.run([self.python, "-c", "import torch, torch.distributed as d; "
                            "assert d.is_available() and d.is_gloo_available(); print(torch.__version__)"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return False, f"python3-torch is not usable by {self.python} (install it: scripts/setup.sh --bench)"
        return True, r.stdout.strip()

    # -----------------------------------------------------------------------------------------
    def model_args(self, size, world, warmup, steps):
        return ["--layers", str(size["layers"]), "--width", str(size["width"]), "--heads", str(size["heads"]),
                "--context", str(size["context"]), "--global-batch", str(size["batch_per_rank"] * world),
                "--warmup", str(warmup), "--steps", str(steps)]

    def write_inputs(self, size, world, warmup, steps):
        """Initial weights and every step's global batch, which every contender reads."""
        path = os.path.join(self.work, f"inputs-{size['name']}-L{size['layers']}-w{world}.bin")
        argv = [self.gpt_bench, "--write-inputs", path] + self.model_args(size, world, warmup, steps)
        r = subprocess.run(argv, capture_output=True, text=True, env=self.env)
        if r.returncode != 0:
            sys.exit(f"run.py: writing inputs failed: {shlex.join(argv)}\n{r.stderr}")
        return path

    def launch(self, argv, world, threads, label, timeout, extra=None, env=None):
        """Runs one contender; returns (result dict or None, return code, stderr tail, wall s)."""
        self.counter += 1
        result_path = os.path.join(self.work, f"run-{self.counter:04d}.json")
        log_path = os.path.join(self.work, f"run-{self.counter:04d}.log")
        if os.path.exists(result_path):
            os.remove(result_path)
        argv = argv + ["--result", result_path, "--label", label]
        if world is not None:
            argv = [self.launcher, "--nproc-per-node", str(world), "--threads-per-rank", str(threads),
                    "--master-port", str(free_port())] + argv
        load = os.getloadavg()
        start = time.monotonic()
        try:
            with open(log_path, "w") as logf:
                logf.write("$ " + shlex.join(argv) + "\n")
                logf.flush()
                rc = subprocess.run(argv, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout,
                                    env=dict(self.env, **(env or {}))).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        wall = time.monotonic() - start
        with open(log_path) as f:
            tail = f.read()[-3000:]
        result = None
        if rc == 0 and os.path.exists(result_path):
            with open(result_path) as f:
                result = json.load(f)
            result["load_before"] = load
            result["wall_s"] = wall
            result["command"] = shlex.join(argv)
            if extra:
                result.update(extra)
            if env:
                result["env"] = env
            self.raw.append(result)
        return result, rc, tail, wall

    def contenders(self, world):
        threads = self.preset["threads_per_rank"]
        cs = [{"key": "local", "label": f"LibTorch local (1 process, {usable_cpus()} threads)", "kind": "local"}]
        if self.ddp_available:
            cs.append({"key": "ddp", "label": "PyTorch DDP (Gloo)", "kind": "ddp"})
        if self.pyfsdp_available:
            # PyTorch FSDP (FSDP1, PyTorch 2.x on the CPU): each strategy, Gloo over TCP.
            for s in FSDP_STRATEGIES:
                c = {"key": f"py_{s}", "label": f"PyTorch FSDP {s}", "kind": "pyfsdp", "strategy": s, "factor": 0}
                if s == "HYBRID_SHARD":
                    c["factor"] = max(1, world // 2)
                    c["label"] = f"PyTorch FSDP HYBRID_SHARD (F={c['factor']})"
                cs.append(c)
        def ours(s, suffix="", label_suffix=""):
            c = {"key": s + suffix, "label": f"libfsdp {s}{label_suffix}", "kind": "fsdp", "strategy": s, "factor": 0}
            if s == "HYBRID_SHARD":
                c["factor"] = max(1, world // 2)
                c["label"] = f"libfsdp HYBRID_SHARD (F={c['factor']}){label_suffix}"
            return c
        cs += [ours(s) for s in FSDP_STRATEGIES]
        # The preset's strategies again on Gloo over TCP, DDP's and PyTorch FSDP's transport: how
        # much of the difference is libfsdp's default shared-memory transport.
        for s in self.preset.get("tcp_strategies", []):
            c = ours(s, "_tcp", " (Gloo TCP)")
            c["env"] = {"FSDP_TRANSPORT": "tcp"}
            cs.append(c)
        for c in cs:
            c["threads"] = usable_cpus() if c["kind"] == "local" else threads
        return cs

    def run_contender(self, c, size, world, inputs, warmup, steps, timeout=900, wrap="block", env=None):
        if env is None:
            env = MALLOC_MODES[self.preset["contender_malloc"]]
        margs = self.model_args(size, world, warmup, steps)
        if c["kind"] == "local":
            argv = [self.gpt_bench, "--mode", "local", "--threads", str(c["threads"]), "--inputs", inputs] + margs
            if c.get("callback"):
                argv.append("--operator-callback")
            # As fsdp-run does for every rank: OpenBLAS sizes its own thread pool from this, not from
            # torch::set_num_threads.
            return self.launch(argv, None, None, c["label"], timeout, env=dict(env, OMP_NUM_THREADS=str(c["threads"])))
        if c["kind"] == "pylocal":
            argv = [self.python, os.path.join(ROOT, "bench", "peers", "ddp_gpt.py"), "--no-ddp", "--inputs", inputs,
                    "--warmup", str(warmup), "--steps", str(steps), "--threads", str(c["threads"])]
            return self.launch(argv, 1, c["threads"], c["label"], timeout, env=env)
        if c["kind"] == "ddp":
            argv = [self.python, os.path.join(ROOT, "bench", "peers", "ddp_gpt.py"), "--inputs", inputs,
                    "--warmup", str(warmup), "--steps", str(steps), "--threads", str(c["threads"])]
            return self.launch(argv, world, c["threads"], c["label"], timeout, env=env)
        if c["kind"] == "pyfsdp":
            argv = [self.python, os.path.join(ROOT, "bench", "peers", "ddp_gpt.py"), "--fsdp", c["strategy"],
                    "--sharding-factor", str(c["factor"]), "--inputs", inputs, "--warmup", str(warmup),
                    "--steps", str(steps), "--threads", str(c["threads"])]
            return self.launch(argv, world, c["threads"], c["label"], timeout, env=env)
        argv = [self.gpt_bench, "--mode", "fsdp", "--strategy", c["strategy"], "--sharding-factor",
                str(c["factor"]), "--wrap", wrap, "--threads", str(c["threads"]), "--inputs", inputs] + margs
        return self.launch(argv, world, c["threads"], c["label"], timeout, env=dict(env, **c.get("env", {})))

    def run_tried(self, c, where, size, world, inputs, warmup, steps, env=None):
        """run_contender, logging each failure with the end of its output; a PyTorch process that
        dies gets one more try ("Failed peer runs" in bench/results/README.md), a libfsdp run none
        (its failure is ours). Returns (result or None, wall s, failures as "exit N: output")."""
        tries = 2 if c["kind"] in PYTORCH_KINDS else 1
        failed = []
        for attempt in range(tries):
            res, rc, tail, wall = self.run_contender(c, size, world, inputs, warmup, steps, env=env)
            if res is not None:
                return res, wall, failed
            failed.append(f"exit {rc}: {tail[-600:]}")
            again = ", trying once more" if attempt + 1 < tries else ""
            log(f"{where}: {c['label']} FAILED (exit {rc}{again}); its output ends:\n{tail[-600:]}")
        return None, 0.0, failed

    # -----------------------------------------------------------------------------------------
    def section_peers(self):
        p = self.preset
        groups = []
        for size in p["sizes"]:
            for world in p["worlds"]:
                inputs = self.write_inputs(size, world, p["warmup"], p["steps"])
                cs = self.contenders(world)
                runs = {c["key"]: [] for c in cs}
                failures = {c["key"]: [] for c in cs}
                for rep in range(p["reps"]):
                    order = cs[rep % len(cs):] + cs[:rep % len(cs)]  # rotated: no contender always first
                    for c in order:
                        res, wall, failed = self.run_tried(c, f"{size['name']} w{world} rep {rep + 1}", size, world,
                                                           inputs, p["warmup"], p["steps"])
                        failures[c["key"]] += failed
                        if res is None:
                            continue
                        res.update({"section": "peers", "size": size["name"], "rep": rep, "key": c["key"]})
                        runs[c["key"]].append(res)
                        log(f"{size['name']} w{world} rep {rep + 1}/{p['reps']}: {c['label']:<40} "
                            f"{res['median_step_s'] * 1000:9.1f} ms/step  (load {res['load_before'][0]:.1f}, "
                            f"{wall:.0f} s)")
                groups.append({"size": size, "world": world, "contenders": cs, "runs": runs, "failures": failures})
        return groups

    def section_malloc(self):
        """Diagnosis of the step-time gap without communication: one process, one thread, the
        per-rank batch of the peers section; Python eager, the C++ frontend, the C++ frontend with
        an operator callback, libfsdp NO_SHARD at world 1; glibc default and steady malloc;
        interleaved."""
        m = self.preset["malloc_diagnosis"]
        size = dict(next(s for s in self.preset["sizes"] if s["name"] == m["size"]), batch_per_rank=m["batch_per_rank"])
        warmup, steps = self.preset["warmup"], self.preset["steps"]
        inputs = self.write_inputs(size, 1, warmup, steps)
        catalog = {
            "pylocal": {"key": "pylocal", "label": "PyTorch eager (Python, no DDP)", "kind": "pylocal"},
            "local1": {"key": "local1", "label": "LibTorch C++ frontend", "kind": "local"},
            "local_callback": {"key": "local_callback", "label": "LibTorch C++ + operator callback", "kind": "local",
                               "callback": True},
            "NO_SHARD": {"key": "NO_SHARD", "label": "libfsdp NO_SHARD (world 1)", "kind": "fsdp",
                         "strategy": "NO_SHARD", "factor": 0},
        }
        cs = []
        for key in m["contenders"]:
            if key == "pylocal" and not self.ddp_available:
                continue
            cs.append(dict(catalog[key], threads=1))
        variants = [(c, mode) for mode in ("default", "steady") for c in cs]
        runs = {(c["key"], mode): [] for c, mode in variants}
        for rep in range(m["reps"]):
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for c, mode in order:
                res, wall, failed = self.run_tried(c, f"malloc ({mode})", size, 1, inputs, warmup, steps,
                                                   env=MALLOC_MODES[mode])
                if res is None:
                    continue
                res.update({"section": "malloc", "size": size["name"], "rep": rep, "key": c["key"], "malloc": mode})
                runs[(c["key"], mode)].append(res)
                log(f"malloc rep {rep + 1}/{m['reps']}: {c['label']:<34} {mode:<8} "
                    f"{res['median_step_s'] * 1000:8.1f} ms/step  (load {res['load_before'][0]:.1f})")
        return {"size": size, "contenders": cs, "runs": runs}

    def section_memory(self):
        m = self.preset["memory"]
        size = next(s for s in self.preset["sizes"] if s["name"] == m["size"])
        world = m["world"]
        warmup, steps = max(2, self.preset["warmup"]), self.preset["steps"]
        c = {"key": "FULL_SHARD", "label": "libfsdp FULL_SHARD", "kind": "fsdp", "strategy": "FULL_SHARD",
             "factor": 0, "threads": self.preset["threads_per_rank"]}
        inputs = self.write_inputs(size, world, warmup, steps)
        runs = {w: [] for w in m["wraps"]}
        for rep in range(m["reps"]):
            order = m["wraps"][rep % len(m["wraps"]):] + m["wraps"][:rep % len(m["wraps"])]
            for wrap in order:
                margs = self.model_args(size, world, warmup, steps)
                argv = [self.gpt_bench, "--mode", "fsdp", "--strategy", "FULL_SHARD", "--wrap", wrap,
                        "--threads", str(c["threads"]), "--count-allocations", "--inputs", inputs] + margs
                res, rc, tail, wall = self.launch(argv, world, c["threads"], f"FULL_SHARD wrap={wrap}", 900)
                if res is None:
                    sys.exit(f"run.py: memory run failed (exit {rc}):\n{tail}")
                res.update({"section": "memory", "size": size["name"], "rep": rep, "wrap": wrap})
                runs[wrap].append(res)
                log(f"memory w{world} rep {rep + 1}/{m['reps']}: wrap {wrap:<9} {res['median_step_s'] * 1000:9.1f} "
                    f"ms/step, {len(res['units'])} units")
        return {"size": size, "world": world, "runs": runs}

    def section_largest(self):
        L = self.preset["largest"]
        world = L["world"]
        cap = L["cap_mib"]
        size0 = {"name": "largest", "layers": 1, "width": L["width"], "heads": L["heads"], "context": L["context"],
                 "batch_per_rank": L["batch_per_rank"]}
        # The batches depend on context, global batch and steps only: one file (with a 1-layer
        # model's weights, which the probes ignore) serves every depth.
        self.largest_inputs = self.write_inputs(dict(size0, layers=1), world, 1, 1)
        baseline = None
        if not cap:
            # CI: a cap just above the process's own footprint, so a tiny search exercises the logic.
            res, rc, tail, wall = self.probe(dict(size0, layers=1), "NO_SHARD", world, 0, "default")
            self.probe_cache[("NO_SHARD", 1, "default")] = (res, rc, tail, wall, 0)
            if res is None:
                sys.exit(f"run.py: baseline probe failed (exit {rc}):\n{tail}")
            baseline = max(r["vmhwm_bytes"] for r in res["ranks"])
            cap = int(math.ceil(baseline / MiB)) + L["cap_over_baseline_mib"]
        searches = []
        for malloc in L["malloc"]:
            for criterion in L["criteria"]:
                for strategy in self.largest_contenders():
                    log(f"largest: {strategy}, cap {cap} MiB per rank ({criterion}, malloc {malloc})")
                    searches.append(self.search(size0, strategy, world, cap, criterion, L["max_layers"], malloc))
        return {"world": world, "cap_mib": cap, "size": size0, "searches": searches, "baseline_bytes": baseline,
                "init": L.get("init", "deferred")}

    def largest_contenders(self):
        """libfsdp NO_SHARD and FULL_SHARD; PyTorch FSDP FULL_SHARD (key py_FULL_SHARD) where the
        Python's torch is 2.x."""
        chosen = self.preset["largest"].get("contenders")
        if chosen:
            if any(c.startswith("py_") for c in chosen) and not self.pyfsdp_available:
                sys.exit(f"run.py: PyTorch FSDP contenders need PyTorch 2.x in {self.python} ({self.ddp_reason})")
            return chosen
        return ["NO_SHARD", "FULL_SHARD"] + (["py_FULL_SHARD"] if self.pyfsdp_available else [])

    def probe(self, size, strategy, world, watchdog_mib, malloc):
        if strategy.startswith("py_"):
            # PyTorch FSDP: the model built on the meta device, each unit materialized by FSDP
            # (to_empty + reset_parameters) as it is wrapped: the counterpart of --init deferred.
            argv = [self.python, os.path.join(ROOT, "bench", "peers", "ddp_gpt.py"), "--fsdp", strategy[3:],
                    "--init", "meta", "--layers", str(size["layers"]), "--inputs", self.largest_inputs,
                    "--warmup", "1", "--steps", "1", "--threads", str(self.preset["threads_per_rank"])]
            if watchdog_mib:
                argv += ["--memory-cap-mib", str(watchdog_mib)]
            return self.launch(argv, world, self.preset["threads_per_rank"], f"{strategy} probe L={size['layers']}",
                               1800, extra={"section": "largest", "malloc": malloc}, env=MALLOC_MODES[malloc])
        argv = [self.gpt_bench, "--mode", "fsdp", "--strategy", strategy, "--wrap", "block", "--threads",
                str(self.preset["threads_per_rank"]), "--inputs", self.largest_inputs,
                "--init", self.preset["largest"].get("init", "deferred")] + self.model_args(size, world, 1, 1)
        argv += self.largest_fsdp_args
        if watchdog_mib:
            argv += ["--memory-cap-mib", str(watchdog_mib)]
        return self.launch(argv, world, self.preset["threads_per_rank"], f"{strategy} probe L={size['layers']}",
                           1800, extra={"section": "largest", "malloc": malloc}, env=MALLOC_MODES[malloc])

    def search(self, size0, strategy, world, cap_mib, criterion, max_layers, malloc):
        """Deepest model whose peak resident set stays within cap_mib on every rank. criterion
        'whole': the whole process (initialization included); 'steps': the training steps only
        (VmHWM restarted after initialization). The watchdog aborts a rank that passes the cap
        (whole) or twice the cap (steps: initialization may exceed it; a safety limit)."""
        probes = []
        watchdog = cap_mib if criterion == "whole" else 2 * cap_mib
        key = "vmhwm_bytes" if criterion == "whole" else "vmhwm_train_bytes"

        def fits(layers):
            # A completed probe answers every criterion (it reports both peaks), whatever its
            # watchdog; an aborted one only says that the peak passed the watchdog's limit.
            cache_key = (strategy, layers, malloc)
            for attempt in range(2):
                cached = self.probe_cache.get(cache_key)
                if cached and (cached[0] is not None or cached[4] >= watchdog):
                    res, rc, tail, wall, aborted_over = cached
                else:
                    cached = None
                    res, rc, tail, wall = self.probe(dict(size0, layers=layers), strategy, world, watchdog, malloc)
                    aborted_over = watchdog if res is None and "exceeds the cap" in tail else 0
                    if res is not None or aborted_over:
                        self.probe_cache[cache_key] = (res, rc, tail, wall, aborted_over)
                if res is not None:
                    peak = max(r[key] for r in res["ranks"])
                    ok = peak <= cap_mib * MiB
                    probes.append({"layers": layers, "parameters": res["parameters"], "ok": ok, "peak_bytes": peak,
                                   "init_bytes": max(r["vmhwm_init_bytes"] for r in res["ranks"]),
                                   "steps_bytes": max(r["vmhwm_train_bytes"] for r in res["ranks"]),
                                   "aborted": False, "wall_s": wall, "reused": bool(cached)})
                    log(f"  L={layers:<4} {res['parameters'] / 1e6:8.1f} M params  peak {peak / MiB:8.1f} MiB  "
                        f"{'fits' if ok else 'over the cap'}  ({'earlier probe' if cached else f'{wall:.0f} s'})")
                    return ok
                if aborted_over:
                    probes.append({"layers": layers, "parameters": None, "ok": False, "peak_bytes": None,
                                   "aborted": True, "wall_s": wall, "reused": bool(cached)})
                    log(f"  L={layers:<4} aborted by the watchdog (over {aborted_over} MiB)  "
                        f"({'earlier probe' if cached else f'{wall:.0f} s'})")
                    return False
                log(f"  L={layers}: probe failed (exit {rc}), attempt {attempt + 1}:\n{tail[-800:]}")
            sys.exit("run.py: a largest-model probe failed twice for a reason other than memory")

        lo, hi = 0, None
        layers = 1
        while layers <= max_layers:
            if fits(layers):
                lo = layers
                layers *= 2
            else:
                hi = layers
                break
        if hi is None:
            hi = max_layers + 1
            log(f"  reached --max-layers {max_layers} without passing the cap")
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        best = next((p for p in probes if p["layers"] == lo and p["ok"]), None)
        return {"strategy": strategy, "criterion": criterion, "malloc": malloc, "largest_layers": lo,
                "largest_parameters": best["parameters"] if best else 0, "best": best, "probes": probes,
                "capped_by_search_limit": hi > max_layers}


# ---------------------------------------------------------------------------------------------
# Memory formula (FULL_SHARD), per rank, from the units FSDP built. All float32.

def memory_formula(units, world, rank, in_flight):
    """Bytes the libfsdp runtime holds at its peaks (see src/flat_param.cpp, src/runtime/*):
    parameters: every unit's shard + the root (unsharded from forward until the end of backward)
      + the largest two consecutive other units: with BACKWARD_PRE (the default) the next unit's
      all-gather is issued when the current unit's backward starts, and the rate limiter (default 2)
      allows exactly that pair; without prefetch it would be the largest single unit;
    gradients: the shard pieces' gradients (kept between steps: the step zeroes them in place,
      zero_grad(set_to_none=false)) + the root's unsharded gradient buffer (its ln_final gradient
      arrives first in backward, its tied embedding gradient last) + the unit computing its gradients (its
      unsharded gradient buffer) + the `in_flight` (Options::reductions_in_flight) reductions
      issued before it (unsharded gradient and reduce-scatter output each). Before issuing a
      reduction the runtime waits for and frees the oldest ones until fewer than `in_flight`
      remain, then allocates the new one's output; it frees them at no other time;
    AdamW: exp_avg and exp_avg_sq for every shard piece."""
    F = world
    shard_real = []
    for u in units:
        shard_numel = u["padded_numel"] // F
        shard_real.append(max(0, min(shard_numel, u["numel"] - rank * shard_numel)) * 4)
    pieces = sum(shard_real)
    shards = sum(u["shard_bytes"] for u in units)
    root = units[0]
    others = units[1:]

    def chain(i):
        total, u = 0, units[i]
        while True:
            total += u["padded_bytes"]
            if u["parent"] < 0:
                return total
            u = units[u["parent"]]

    params_peak = shards + max(chain(i) for i in range(len(units)))
    # Backward prefetch: unit b (and its enclosing units) unsharded while the unit before it in
    # forward order, next in backward, is being gathered.
    for a, b in zip(range(1, len(units)), range(2, len(units))):
        ancestors, u = set(), units[b]
        while u["parent"] >= 0:
            ancestors.add(u["parent"])
            u = units[u["parent"]]
        if a not in ancestors:
            params_peak = max(params_peak, shards + chain(b) + units[a]["padded_bytes"])
    # Backward issues the non-root units' reductions in reverse forward order, then the root's.
    pending, current = [], root["padded_bytes"]
    grads_transient = current
    for u in list(reversed(others)) + [root]:
        if u is not root:
            current += u["padded_bytes"]  # its gradient buffer, from its first gradient on
            grads_transient = max(grads_transient, current)
        while pending and len(pending) > max(in_flight - 1, 0):
            done = pending.pop(0)
            current -= done["padded_bytes"] + done["shard_bytes"]
        current += u["shard_bytes"]  # the reduce-scatter output
        grads_transient = max(grads_transient, current)
        pending.append(u)
        if in_flight == 0:
            done = pending.pop(0)
            current -= done["padded_bytes"] + done["shard_bytes"]
    return {
        "params_rest": shards,
        "params_peak": params_peak,
        "grads_rest": pieces,
        "grads_peak": pieces + grads_transient,
        "adamw": 2 * pieces,
        "largest_unit_bytes": max(u["padded_bytes"] for u in units),
    }


# ---------------------------------------------------------------------------------------------
# Reports

def median_of(runs, field="median_step_s"):
    vals = [r[field] for r in runs]
    return statistics.median(vals) if vals else None


def table(header, rows, align=None):
    align = align or ["l"] + ["r"] * (len(header) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def loss_check(runs, reference):
    """Largest relative difference of any step's loss from local training's (first runs)."""
    if not runs or not reference:
        return None
    ref = reference[0]["losses"]
    worst = 0.0
    for r in runs:
        for a, b in zip(r["losses"], ref):
            worst = max(worst, abs(a - b) / abs(b))
    return worst


LOSS_TOLERANCE = 1e-4  # float32 sums in a different order (threads, ranks) differ by ~1e-6


def header_block(bench, title, started, finished):
    m = bench.machine
    lines = [f"# {title}", "",
             f"Produced by `{bench.command}` from the repository root, {started:%Y-%m-%d %H:%M} to "
             f"{finished:%H:%M} UTC, commit {m['commit']}.", "",
             "Machine: " + "; ".join(m["cpu"]) + f"; {m['usable_cpus']} usable CPUs; memory {m['memory']}; "
             f"Linux {m['kernel']}; Debian {m['debian']}.",
             "Packages: " + ", ".join(f"{k} {v}" for k, v in m["packages"].items()) + ".",
             f"Load average (1 min) at the start {bench.load_start[0]:.2f}, at the end "
             f"{os.getloadavg()[0]:.2f}. Other jobs share this machine: contenders are interleaved and "
             "the tables give medians over repetitions; each run's load average is in the raw data.", ""]
    return lines


def report_peers(bench, groups):
    p = bench.preset
    lines = [f"Every contender trains the example GPT (`examples/gpt/model.cpp`; byte-level vocabulary 256, "
             "tied embedding and head, pre-norm blocks, GELU MLP, GPT-2 initialization, no dropout) from the "
             "same initial weights on the same fortunes batches, with AdamW (lr 3e-4, betas (0.9, 0.99), "
             "weight decay 0.1 on matrices and embeddings). `gpt_bench --write-inputs` writes the weights "
             "and batches that the Python DDP contender loads. Per rank: "
             f"{p['threads_per_rank']} intra-op thread (`--threads-per-rank` of `fsdp-run`, "
             "`torch.set_num_threads`); the local contender is one process with all usable CPUs. "
             "All use `OMP_WAIT_POLICY=PASSIVE` and glibc malloc's 'steady' setting `" +
             " ".join(f"{k}={v}" for k, v in MALLOC_MODES[p["contender_malloc"]].items()) +
             "` (fixed mmap threshold, heap trimmed only past 64 MiB free; see malloc.md for why and what it "
             "changes). Launcher for every distributed contender: "
             "`build/tools/fsdp-run`. Transport: PyTorch DDP runs Gloo over TCP (loopback); libfsdp runs its "
             "default, shared memory between the ranks of one host (`FSDP_TRANSPORT=auto`), and the "
             "'(Gloo TCP)' rows run the same strategy with `FSDP_TRANSPORT=tcp`, the transport of DDP and PyTorch FSDP.", "",
             f"Each run: {p['warmup']} warm-up steps, then {p['steps']} timed steps; a step is zero_grad, "
             "forward, loss, backward, optimizer step and reading the loss. Per run the median step time; "
             f"per contender the median over {p['reps']} interleaved runs (min-max of the runs' medians in "
             "brackets). Ratios are to PyTorch DDP's median in the same group. Peak RSS is VmHWM, the "
             "largest over ranks, for the whole process (initialization included) and for the steps alone "
             "(VmHWM restarted after initialization). FSDP-managed peak: `memory_stats()` parameter peak + "
             "gradient peak during the timed steps (largest over ranks). Loss check: largest relative "
             "difference of any step's loss (mean over ranks) from local training's; CPU s per step: user + "
             "system time of the timed steps summed over all ranks' processes (getrusage), per step; "
             f"tolerance {LOSS_TOLERANCE:g}.", ""]
    if not bench.ddp_available:
        lines += [f"**PyTorch DDP was not run: {bench.ddp_reason}.**", ""]
    summary_rows = {}
    for g in groups:
        size, world = g["size"], g["world"]
        ddp = median_of(g["runs"].get("ddp", []))
        ddp_cpu = median_of(g["runs"].get("ddp", []), "cpu_s_per_step")
        params = next((r["parameters"] for runs in g["runs"].values() for r in runs), 0)
        lines += [f"## {size['name']}, world {world}", "",
                  f"{size['layers']} layers, width {size['width']}, {size['heads']} heads, context "
                  f"{size['context']}, {params / 1e6:.2f} M parameters; global batch "
                  f"{size['batch_per_rank'] * world} x {size['context']} = "
                  f"{size['batch_per_rank'] * world * size['context']} tokens per step.", ""]
        rows = []
        for c in g["contenders"]:
            runs = g["runs"][c["key"]]
            med = median_of(runs)
            if med is None:
                rows.append([c["label"], 0] + ["failed"] * 11)
                continue
            lo = min(r["median_step_s"] for r in runs)
            hi = max(r["median_step_s"] for r in runs)
            tps = runs[0]["tokens_per_step"] / med
            ratio = med / ddp if ddp else None
            tratio = ddp / med if ddp else None
            cpu = median_of(runs, "cpu_s_per_step")
            cpu_ratio = cpu / ddp_cpu if ddp_cpu else None
            rss = statistics.median(max(x["vmhwm_bytes"] for x in r["ranks"]) for r in runs)
            rss_steps = statistics.median(max(x["vmhwm_train_bytes"] for x in r["ranks"]) for r in runs)
            if c["kind"] == "fsdp":
                fsdp_peak = statistics.median(max(x["fsdp_param_peak_bytes"] + x["fsdp_grad_peak_bytes"]
                                                  for x in r["ranks"]) for r in runs)
                fsdp_col = mib(fsdp_peak)
            else:
                fsdp_col = "-"
            worst = loss_check(runs, g["runs"]["local"])
            wrong = sum(1 for r in runs if loss_check([r], g["runs"]["local"]) > LOSS_TOLERANCE) \
                if worst is not None else "n/a"
            rows.append([c["label"], len(runs), f"{med * 1000:.1f} [{lo * 1000:.0f}-{hi * 1000:.0f}]",
                         f"{tps:.0f}", fmt(ratio), fmt(tratio), f"{cpu:.3f}", fmt(cpu_ratio),
                         mib(rss), mib(rss_steps), fsdp_col,
                         "n/a" if worst is None else f"{worst:.1e}", wrong])
            # The factor differs between worlds, so the summary row's label leaves it out.
            row = summary_rows.setdefault(c["key"], {"label": re.sub(r" \(F=\d+\)", "", c["label"]), "cpu": {}})
            row[(size["name"], world)] = ratio
            row["cpu"][(size["name"], world)] = cpu_ratio
        lines.append(table(["contender", "runs", "step ms", "tokens/s", "step time / DDP", "tokens/s / DDP",
                            "CPU s per step (all ranks)", "CPU / DDP", "peak RSS MiB", "peak RSS, steps only", "FSDP-managed peak MiB",
                            "loss vs local", "#wrong"], rows))
        # Where the time goes: per-phase wall time (rank 0) and user / system CPU time (all ranks).
        prow = []
        for c in g["contenders"]:
            runs = g["runs"][c["key"]]
            if not runs:
                continue
            ph = {k: statistics.median(r["phase_median_s"][k] for r in runs)
                  for k in ("zero_grad", "forward", "backward", "optimizer")}
            prow.append([c["label"]] + [f"{ph[k] * 1000:.1f}" for k in ph] +
                        [f"{median_of(runs, 'cpu_user_s_per_step'):.3f}",
                         f"{median_of(runs, 'cpu_system_s_per_step'):.3f}",
                         f"{median_of(runs, 'minor_faults_per_step'):.0f}",
                         f"{median_of(runs, 'voluntary_switches_per_step'):.0f}"])
        lines += ["", "Where the time goes (medians over the runs): wall time of each phase of a step on rank 0; "
                  "per step, summed over ranks: CPU time (user, system), minor page faults (each a freshly "
                  "mapped 4 KiB page the kernel zeroes) and voluntary context switches (a thread blocked, "
                  "e.g. waiting for a peer). System time is mostly loopback TCP copies of the collectives "
                  "and those page faults.", "",
                  table(["contender", "zero_grad ms", "forward + loss ms", "backward ms", "optimizer step ms",
                         "CPU user s", "CPU system s", "page faults", "voluntary switches"], prow)]
        fails = {k: v for k, v in g["failures"].items() if v}
        if fails:
            lines += ["", "Failed runs: " + "; ".join(f"{k}: {len(v)}" for k, v in fails.items())]
        lines.append("")
    # Summary and targets.
    cols = [(g["size"]["name"], g["world"]) for g in groups]
    lines += ["## Summary: step time / PyTorch DDP (lower is faster)", ""]
    rows = []
    for key, row in summary_rows.items():
        rows.append([row["label"]] + [fmt(row.get(col)) for col in cols])
    lines.append(table(["contender"] + [f"{s}, world {w}" for s, w in cols], rows))
    lines += ["", "## Summary: CPU time per step / PyTorch DDP (all ranks' user + system time; lower is cheaper)",
              "", "Other jobs on the machine change the wall time of a step far more than the CPU time it "
              "consumes, so this is the steadier comparison of the work each contender does per step.", ""]
    rows = []
    for key, row in summary_rows.items():
        rows.append([row["label"]] + [fmt(row["cpu"].get(col)) for col in cols])
    lines.append(table(["contender"] + [f"{s}, world {w}" for s, w in cols], rows))
    lines += ["", "![step time / DDP](peers_step_ratio.png)", "", "![CPU time / DDP](peers_cpu_ratio.png)", "",
              "![peak RSS](peers_rss.png)", ""]
    targets = []
    for g in groups:
        if g["size"]["name"] != "compute-bound":
            continue
        for key, goal in (("FULL_SHARD", 1.0), ("NO_SHARD", 0.95)):
            r = summary_rows.get(key, {}).get((g["size"]["name"], g["world"]))
            if r is None:
                continue
            verdict = "met" if r <= goal else f"missed by {100 * (r / goal - 1):.1f}%"
            cpu_r = summary_rows[key]["cpu"].get((g["size"]["name"], g["world"]))
            targets.append([f"{key} step time / DDP, {g['size']['name']}, world {g['world']}", f"<= {goal}",
                            fmt(r, 3), verdict, fmt(cpu_r)])
    if targets:
        lines += ["## Targets", "", table(["target", "goal", "measured", "verdict", "CPU time / DDP (same runs)"],
                                          targets, ["l", "r", "r", "l", "r"]), ""]
    # Against PyTorch FSDP, where it ran: libfsdp's median step time / PyTorch FSDP's, same group.
    vs = []
    for g in groups:
        for ours, theirs, goal, how in (("FULL_SHARD", "py_FULL_SHARD", 0.75, "default transport"),
                                        ("SHARD_GRAD_OP", "py_SHARD_GRAD_OP", 0.75, "default transport"),
                                        ("HYBRID_SHARD", "py_HYBRID_SHARD", 0.75, "default transport"),
                                        ("NO_SHARD", "py_NO_SHARD", None, "default transport"),
                                        ("FULL_SHARD_tcp", "py_FULL_SHARD", 0.9, "both on Gloo TCP"),
                                        ("SHARD_GRAD_OP_tcp", "py_SHARD_GRAD_OP", 0.9, "both on Gloo TCP"),
                                        ("HYBRID_SHARD_tcp", "py_HYBRID_SHARD", 0.9, "both on Gloo TCP"),
                                        ("NO_SHARD_tcp", "py_NO_SHARD", None, "both on Gloo TCP")):
            a, b = median_of(g["runs"].get(ours, [])), median_of(g["runs"].get(theirs, []))
            if a is None or b is None:
                continue
            r = a / b
            verdict = "-" if goal is None else "met" if r <= goal else f"missed by {100 * (r / goal - 1):.1f}%"
            peer_worst = loss_check(g["runs"][theirs], g["runs"]["local"])
            if goal is not None and peer_worst is not None and peer_worst > LOSS_TOLERANCE:
                verdict = (f"not comparable: PyTorch FSDP trains a different model here (losses {peer_worst:.1e} "
                           f"from local training), so it skips work")
            vs.append([f"libfsdp {ours.replace('_tcp', '')} / PyTorch FSDP {theirs[3:]}, {how}, "
                       f"{g['size']['name']}, world {g['world']}", "-" if goal is None else f"<= {goal}", fmt(r, 3),
                       verdict])
    if vs:
        lines += ["## Step time against PyTorch FSDP", "",
                  table(["ratio", "goal", "measured", "verdict"], vs, ["l", "r", "r", "l"]), ""]
    return lines, summary_rows, cols


def report_memory(bench, mem):
    world = mem["world"]
    size = mem["size"]
    lines = [f"FULL_SHARD, world {world}, model {size['name']} ({size['layers']} layers, width {size['width']}, "
             f"context {size['context']}, {size['batch_per_rank']} sequences per rank), AdamW. Measured per rank "
             "during the timed steps (peaks reset after the warm-up steps, so gradients and AdamW state exist): "
             "`memory_stats()` parameter and gradient peaks, and the bytes of the optimizer's exp_avg and "
             "exp_avg_sq tensors. Formula, from `units()` (padded and shard bytes of each unit; "
             "`memory_formula()` in bench/peers/run.py), per rank:", "",
             "- parameters: sum of the shards + the root unit (unsharded from forward until the end of "
             "backward, paper 3.3.1) + the largest two consecutive other units (BACKWARD_PRE, the default, issues "
             "the next unit's all-gather when the current unit's backward starts; the rate limiter's default of 2 "
             "allows exactly that pair): the paper's sum of psi_i / F + max psi_i, with the root held as well and "
             "max psi_i taken over prefetched pairs;",
             "- gradients: this rank's shard-piece gradients (kept between steps: the step zeroes them in place, "
             "`zero_grad(set_to_none=false)`) + the root's unsharded gradient buffer (its ln_final gradient arrives "
             "first in backward, its tied-embedding gradient last) + the unsharded gradient buffer of the unit computing its "
             "gradients + the k earlier units' reductions still in flight (unsharded gradient + reduce-scatter "
             "output each), k = `Options::reductions_in_flight` (default 2). Before issuing a reduction the "
             "runtime waits for the oldest ones until fewer than k remain and frees their buffers then, never "
             "earlier, so the gradient peak does not depend on when a reduce-scatter happens to finish;",
             "- AdamW: 2 x this rank's shard-piece bytes (padding excluded).", "",
             "Rank 0's figures; the ratio columns are the worst over all ranks and runs. 'At rest' compares the "
             "live tensor bytes after the warm-up steps, counted by a wrapping CPU allocator "
             "(`--count-allocations`), with shards + piece gradients + AdamW + the rank's batches + the communicators' "
             "allocator scratch (`memory_stats().comm_scratch_bytes`: Gloo's reduce-scatter receive ring, at most 2 MiB "
             "per communicator; none on the shared-memory transport, whose segment is not allocator memory): an "
             "independent "
             "check of the library's accounting. 'All tensors at peak' is that allocator's peak (activations, "
             "communication scratch and the model state together). 'Cached' is `memory_stats().cached_bytes` at rest: "
             "released unsharded parameter and gradient buffers that `reuse_buffers` keeps for the next "
             "iteration (outside the allocator's count and the peaks above).", ""]
    rows, plot = [], []
    block_time = median_of(mem["runs"].get("block", []))
    for wrap, runs in mem["runs"].items():
        r0 = runs[0]
        units = r0["units"]
        k = r0.get("overlap", {}).get("reductions_in_flight", 2)
        worst = {"formula": 0.0, "rest": 0.0}
        for run in runs:
            for st in run["ranks"]:
                rank = int(st["rank"])
                measured = st["fsdp_param_peak_bytes"] + st["fsdp_grad_peak_bytes"] + st["adamw_state_bytes"]
                f = memory_formula(units, world, rank, k)
                # + the communicators' reduce-scatter receive ring, which the library reports
                rest = (f["params_rest"] + f["grads_rest"] + f["adamw"] + st["batch_bytes"] +
                        st.get("comm_scratch_at_rest_bytes", 0))
                for key, value in (("formula", measured / (f["params_peak"] + f["grads_peak"] + f["adamw"])),
                                   ("rest", st["alloc_live_at_rest_bytes"] / rest)):
                    if abs(value - 1) > abs(worst[key] - 1) or worst[key] == 0.0:
                        worst[key] = value
        s0 = r0["ranks"][0]
        f0 = memory_formula(units, world, 0, k)
        med = median_of(runs)
        n = len(units)
        meas_total = s0["fsdp_param_peak_bytes"] + s0["fsdp_grad_peak_bytes"] + s0["adamw_state_bytes"]
        form_total = f0["params_peak"] + f0["grads_peak"] + f0["adamw"]
        rows.append([wrap, n, mib(f0["largest_unit_bytes"], 2),
                     f"{mib(s0['fsdp_param_peak_bytes'], 2)} / {mib(f0['params_peak'], 2)}",
                     f"{mib(s0['fsdp_grad_peak_bytes'], 2)} / {mib(f0['grads_peak'], 2)}",
                     f"{mib(s0['adamw_state_bytes'], 2)} / {mib(f0['adamw'], 2)}",
                     f"{mib(meas_total, 2)} / {mib(form_total, 2)}",
                     f"{worst['formula']:.4f}",
                     f"{worst['rest']:.4f}", mib(s0.get("fsdp_cached_at_rest_bytes", 0), 2),
                     mib(s0["alloc_peak_bytes"], 1),
                     f"{2 * n - 1} + {n}", f"{med * 1000:.1f}",
                     fmt(med / block_time) if block_time else "n/a"])
        plot.append((wrap, n, f0["params_peak"], f0["grads_peak"], f0["adamw"], meas_total, form_total, med))
    lines.append(table(["wrap", "units", "largest unit MiB", "params peak MiB (meas. / formula)",
                        "grads peak MiB (meas. / formula)", "AdamW MiB (meas. / formula)",
                        "model state MiB (meas. / formula)", "measured / formula (worst rank and run)",
                        "at rest: allocator / formula", "cached MiB", "all tensors at peak MiB",
                        "collectives per step (all-gather + reduce-scatter)", "step ms (median)",
                        "step time / block"], rows))
    lines += ["", "Model state is the sum of the three peaks (parameters, gradients, AdamW), which do not all "
              "occur at the same instant; each is compared with its own formula. Collectives per step: every "
              "unit is all-gathered in forward and, except the root (kept unsharded until backward ends), "
              "again in backward: 2N - 1 all-gathers and N reduce-scatters for N units (the counts "
              "`FSDP_DEBUG_COMM=1` prints).", "",
              "![memory and step time per wrap granularity](memory_wrap.png)", ""]
    return lines, plot


def report_malloc(bench, md):
    size = md["size"]
    steady = " ".join(f"{k}={v}" for k, v in MALLOC_MODES["steady"].items())
    base_key = "pylocal" if any(c["key"] == "pylocal" for c in md["contenders"]) else md["contenders"][0]["key"]
    base = median_of(md["runs"].get((base_key, "default"), []))
    base_label = next(c["label"] for c in md["contenders"] if c["key"] == base_key)
    lines = [f"Model {size['name']} ({size['layers']} layers, width {size['width']}, context {size['context']}), "
             f"{size['batch_per_rank']} sequences per step: the per-rank work of the peers section's world-2 runs, "
             "in one process with one thread and no communication, so that what remains is the cost of the "
             "language, the allocator and the FSDP runtime. Contenders: the same model and step in eager Python "
             "(`ddp_gpt.py --no-ddp`), in the LibTorch C++ frontend (`gpt_bench --mode local`), in the C++ frontend "
             "with a global operator callback that does what libfsdp's interception does for every operator "
             "(`--operator-callback`: boxes the inputs, looks each tensor's storage up among the parameters'), and "
             "under libfsdp NO_SHARD at world 1 (interception, autograd hooks, flat gradient buffers; its "
             "all-reduce over one rank moves nothing). Each with glibc's default malloc and with the 'steady' "
             f"setting every contender of peers.md runs with (`{steady}`). Medians over "
             f"{bench.preset['malloc_diagnosis']['reps']} interleaved runs; ratios to {base_label} with the default "
             "malloc.", ""]
    rows = []
    for c in md["contenders"]:
        for mode in ("default", "steady"):
            runs = md["runs"].get((c["key"], mode), [])
            med = median_of(runs)
            if med is None:
                rows.append([c["label"], mode, 0] + ["failed"] * 10)
                continue
            ph = lambda k: f"{statistics.median(r['phase_median_s'].get(k, 0) for r in runs) * 1000:.1f}"
            rows.append([c["label"], mode, len(runs), f"{med * 1000:.1f}", fmt(med / base) if base else "n/a",
                         ph("forward"), ph("backward"), ph("optimizer"),
                         f"{median_of(runs, 'cpu_user_s_per_step'):.3f}",
                         f"{median_of(runs, 'cpu_system_s_per_step'):.3f}",
                         f"{median_of(runs, 'minor_faults_per_step'):.0f}",
                         f"{statistics.median(max(x['vmhwm_bytes'] for x in r['ranks']) for r in runs) / MiB:.1f}"])
    lines.append(table(["contender", "malloc", "runs", "step ms", f"step time / {base_label} (default malloc)",
                        "forward + loss ms", "backward ms", "optimizer ms", "CPU user s per step",
                        "CPU system s per step", "page faults per step", "peak RSS MiB"], rows))
    lines.append("")
    return lines


def report_largest(bench, lg):
    cap = lg["cap_mib"]
    size = lg["size"]
    lines = [f"World {lg['world']}, width {size['width']}, {size['heads']} heads, context {size['context']}, "
             f"{size['batch_per_rank']} sequence(s) per rank, wrap block, AdamW; depth found by doubling then "
             f"bisection. Cap: {cap} MiB of resident memory per rank. Each probe trains 2 steps (the first "
             "allocates AdamW state; the second is the steady state) and passes if every rank's VmHWM "
             "(the kernel's exact resident high-water mark) stays within the cap. A watchdog thread in each "
             "rank samples VmRSS every millisecond and aborts a probe that passes the cap early (with the "
             "'steps only' criterion it aborts at twice the cap: initialization may exceed the cap there). "
             "The cap is enforced on measured peaks, not by the kernel (no cgroup or rlimit: the machine's "
             "memory cgroups belong to its sandbox, and RLIMIT_AS/RLIMIT_DATA count reserved address space, "
             "not memory).", ""]
    if bench.largest_fsdp_args:
        lines += [f"libfsdp options of every probe (both strategies): `{' '.join(bench.largest_fsdp_args)}`.", ""]
    if lg.get("baseline_bytes"):
        lines += [f"CI variant: the cap is the 1-layer NO_SHARD footprint ({mib(lg['baseline_bytes'])} MiB) "
                  "plus a small margin.", ""]
    rows = []
    by = {}
    for s in lg["searches"]:
        b = s["best"]
        by[(s["strategy"], s["criterion"], s["malloc"])] = s
        fresh = sum(1 for p in s["probes"] if not p.get("reused"))
        rows.append([s["strategy"], s["criterion"], s["malloc"], s["largest_layers"],
                     f"{s['largest_parameters'] / 1e6:.1f}" if s["largest_parameters"] else "0",
                     mib(b["peak_bytes"]) if b else "n/a", mib(b["init_bytes"]) if b else "n/a",
                     mib(b["steps_bytes"]) if b else "n/a", f"{len(s['probes'])} ({fresh} new)",
                     "yes" if s["capped_by_search_limit"] else "no"])
    lines.append(table(["strategy", "criterion", "malloc", "largest depth", "parameters (M)",
                        "peak MiB (criterion)", "init peak MiB", "steps peak MiB", "probes",
                        "hit search limit"], rows))
    lines.append("")
    ratios = []
    for malloc in dict.fromkeys(s["malloc"] for s in lg["searches"]):
        for crit in ("whole", "steps"):
            n, f = by.get(("NO_SHARD", crit, malloc)), by.get(("FULL_SHARD", crit, malloc))
            if n and f and n["largest_parameters"]:
                ratios.append([crit, malloc, f"{n['largest_parameters'] / 1e6:.1f}",
                               f"{f['largest_parameters'] / 1e6:.1f}",
                               f"{f['largest_parameters'] / n['largest_parameters']:.2f}"])
    if ratios:
        lines += ["Largest trainable model, FULL_SHARD / NO_SHARD (parameters):", "",
                  table(["criterion", "malloc", "NO_SHARD M params", "FULL_SHARD M params", "ratio"], ratios), ""]
    peers = []
    for malloc in dict.fromkeys(s["malloc"] for s in lg["searches"]):
        for crit in ("whole", "steps"):
            f, py = by.get(("FULL_SHARD", crit, malloc)), by.get(("py_FULL_SHARD", crit, malloc))
            if f and py:
                ratio = f["largest_parameters"] / py["largest_parameters"] if py["largest_parameters"] else None
                foot = [min((p["peak_bytes"] for p in s["probes"] if p["layers"] == 1 and p["peak_bytes"]),
                            default=None) for s in (f, py)]

                def per_layer(s):
                    """Peak MiB added per block: from the shallowest completed probe of 8 or more
                    blocks to the deepest one that fits."""
                    done = sorted((p["layers"], p["peak_bytes"]) for p in s["probes"] if p["peak_bytes"])
                    lo = next((d for d in done if d[0] >= 8), None)
                    hi = max((d for d in done if d[1] <= cap * MiB), default=None)
                    return (hi[1] - lo[1]) / MiB / (hi[0] - lo[0]) if lo and hi and hi[0] > lo[0] else None
                peers.append([crit, malloc, f"{f['largest_parameters'] / 1e6:.1f}",
                              f"{py['largest_parameters'] / 1e6:.1f}", fmt(ratio),
                              "met" if ratio and ratio >= 1.2 else "missed",
                              mib(foot[0]) if foot[0] else "n/a", mib(foot[1]) if foot[1] else "n/a",
                              fmt(per_layer(f), 1), fmt(per_layer(py), 1)])
    if peers:
        lines += ["Largest trainable model, libfsdp FULL_SHARD / PyTorch FSDP FULL_SHARD (parameters; goal >= 1.2). "
                  "PyTorch FSDP (FSDP1, `ddp_gpt.py --fsdp FULL_SHARD --init meta`) builds the model on the meta "
                  "device and materializes it unit by unit as it wraps it (`to_empty` + `reset_parameters`), "
                  "with its throughput settings (`limit_all_gathers`, forward prefetch, BACKWARD_PRE); part of "
                  "its footprint is the Python interpreter and PyTorch's Python modules, which a C++ program "
                  "does not have: the 1-layer columns are each contender's peak with a 1-layer model, and the "
                  "per-block columns the peak added by each further block (from the shallowest probe of 8 or "
                  "more blocks to the deepest that fits), which that fixed footprint does not enter.", "",
                  table(["criterion", "malloc", "libfsdp M params", "PyTorch FSDP M params", "ratio", "goal",
                         "libfsdp 1-layer peak MiB", "PyTorch 1-layer peak MiB", "libfsdp MiB per block",
                         "PyTorch MiB per block"], peers), ""]
    lines += ["malloc 'default': glibc as it comes (its mmap threshold rises to the largest block freed so far, "
              "up to 32 MiB; later blocks of that size come from the heap, and freed ones often stay resident). "
              "'mmap': `MALLOC_MMAP_THRESHOLD_=524288` in every rank's environment, so every tensor of 512 KiB or "
              "more (every parameter-sized one here) is mapped and unmapped on its own and the resident set "
              "follows the live tensors.", ""]
    init = lg.get("init", "eager")
    how = ("the model is built under `fsdp::DeferredInit` and `fully_shard` allocates, initializes and shards "
           "it one unit at a time (`gpt_bench --init deferred`)" if init == "deferred" else
           "every rank builds the whole model before `fully_shard` shards it (`gpt_bench --init eager`)")
    lines += [f"Criterion 'whole': the whole process, initialization included ({how}). 'steps': the training "
              "steps only (VmHWM restarted after initialization), i.e. what the model needs once it is sharded.", "",
              "![probes](largest.png)", ""]
    return lines


# ---------------------------------------------------------------------------------------------
# Plots (gnuplot)

def gnuplot(bench, name, script, data):
    gp = os.path.join(bench.out, "plots")
    os.makedirs(gp, exist_ok=True)
    with open(os.path.join(gp, f"{name}.dat"), "w") as f:
        f.write(data)
    with open(os.path.join(gp, f"{name}.gp"), "w") as f:
        f.write(script)
    if not bench.gnuplot:
        return False
    r = subprocess.run([bench.gnuplot, f"{name}.gp"], cwd=gp, capture_output=True, text=True)
    if r.returncode != 0:
        log(f"gnuplot failed for {name}: {r.stderr[-500:]}")
        return False
    return True


PNG = "set terminal pngcairo noenhanced size 1000,560 font 'DejaVu Sans,10'\n"


# Bar colours by strategy; PyTorch's contenders and libfsdp's Gloo TCP runs are told apart by fill.
STRATEGY_COLOURS = {"NO_SHARD": "#d62728", "FULL_SHARD": "#1f77b4", "SHARD_GRAD_OP": "#9467bd",
                    "HYBRID_SHARD": "#2ca02c", "DDP": "#17becf", "local": "#7f7f7f"}


def histogram_clause(dat, labels):
    """gnuplot plot clause: one bar per column of `dat` (labels in column order), styled by label."""
    parts = []
    for i, label in enumerate(labels, start=2):
        strategy = next((k for k in STRATEGY_COLOURS if k in label), "local")
        fill = ("fs pattern 2" if label.startswith("PyTorch FSDP") else
                "fs pattern 4" if "(Gloo TCP)" in label else "fs solid 0.8")
        parts.append(f"'{dat}' using {i}:xtic(1) title columnhead({i}) lc rgb '{STRATEGY_COLOURS[strategy]}' {fill}")
    return ", \\\n     ".join(parts)


def plot_peers(bench, summary_rows, cols, groups):
    keys = list(summary_rows)
    data = "group " + " ".join(f'"{summary_rows[k]["label"]}"' for k in keys) + "\n"
    for s, w in cols:
        data += f'"{s}, w{w}" ' + " ".join(
            "NaN" if summary_rows[k].get((s, w)) is None else f"{summary_rows[k][(s, w)]:.4f}" for k in keys) + "\n"
    script = PNG + f"""set output '../peers_step_ratio.png'
set title 'Step time / PyTorch DDP (median of interleaved runs; lower is faster)'
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set key below
set ylabel 'step time / DDP'
set yrange [0:*]
set grid ytics
plot {histogram_clause('peers_step_ratio.dat', [summary_rows[k]['label'] for k in keys])}, \\
     1 with lines lc 'black' dt 2 notitle
"""
    ok = gnuplot(bench, "peers_step_ratio", script, data)
    data = "group " + " ".join(f'"{summary_rows[k]["label"]}"' for k in keys) + "\n"
    for s, w in cols:
        data += f'"{s}, w{w}" ' + " ".join(
            "NaN" if summary_rows[k]["cpu"].get((s, w)) is None else f"{summary_rows[k]['cpu'][(s, w)]:.4f}"
            for k in keys) + "\n"
    script = script.replace("peers_step_ratio", "peers_cpu_ratio").replace(
        "Step time / PyTorch DDP (median of interleaved runs; lower is faster)",
        "CPU time per step (all ranks) / PyTorch DDP (median of interleaved runs; lower is cheaper)").replace(
        "ylabel 'step time / DDP'", "ylabel 'CPU time / DDP'")
    ok = gnuplot(bench, "peers_cpu_ratio", script, data) and ok
    # Peak RSS per contender and group.
    data = "group " + " ".join(f'"{summary_rows[k]["label"]}"' for k in keys) + "\n"
    for g in groups:
        vals = []
        for k in keys:
            runs = g["runs"].get(k, [])
            vals.append("NaN" if not runs else
                        f"{statistics.median(max(x['vmhwm_bytes'] for x in r['ranks']) for r in runs) / MiB:.1f}")
        data += f'"{g["size"]["name"]}, w{g["world"]}" ' + " ".join(vals) + "\n"
    script = PNG + f"""set output '../peers_rss.png'
set title 'Peak resident memory per rank (VmHWM, largest over ranks, MiB)'
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set key below
set ylabel 'MiB'
set yrange [0:*]
set grid ytics
plot {histogram_clause('peers_rss.dat', [summary_rows[k]['label'] for k in keys])}
"""
    return gnuplot(bench, "peers_rss", script, data) and ok


def plot_memory(bench, plot):
    data = "# wrap(units) params grads adamw measured formula step_ms\n"
    for wrap, n, p, g, a, meas, form, med in plot:
        data += f"{wrap}({n}) {p / MiB:.3f} {g / MiB:.3f} {a / MiB:.3f} {meas / MiB:.3f} {form / MiB:.3f} " \
                f"{med * 1000:.2f}\n"
    script = PNG + """set output '../memory_wrap.png'
set title 'FULL_SHARD per-rank model state at peak (formula, stacked; points: measured) and step time'
set style data histograms
set style histogram rowstacked
set style fill solid 0.7 border -1
set boxwidth 0.6
set key outside right top
set ylabel 'MiB per rank'
set y2label 'step time (ms)'
set yrange [0:*]
set y2range [0:*]
set ytics nomirror
set y2tics
set grid ytics
plot 'memory_wrap.dat' using 2:xtic(1) title 'parameters peak', '' using 3 title 'gradients peak', \\
     '' using 4 title 'AdamW state', \\
     '' using 0:5 with points pt 7 ps 2 lc 'black' title 'measured total', \\
     '' using 0:7 axes x1y2 with linespoints pt 5 lw 2 lc 'red' title 'step time (right axis)'
"""
    return gnuplot(bench, "memory_wrap", script, data)


def plot_largest(bench, lg):
    """Every completed probe (from any search) of each strategy and malloc mode: the whole
    process's peak (solid) and the steps' own peak (dashed) per rank, largest over ranks."""
    series = {}
    for r in bench.raw:
        if r.get("section") != "largest" or not r.get("malloc"):
            continue
        key = (r["label"].split()[0], r["malloc"])
        series.setdefault(key, {})[r["parameters"]] = (max(x["vmhwm_bytes"] for x in r["ranks"]),
                                                       max(x["vmhwm_train_bytes"] for x in r["ranks"]))
    data, plots, colors = "", [], ["'#1f77b4'", "'#d62728'", "'#2ca02c'", "'#ff7f0e'"]
    for i, (key, points) in enumerate(sorted(series.items())):
        data += f"# {key[0]} malloc {key[1]}: parameters (M), whole-process peak MiB, steps peak MiB\n"
        for n in sorted(points):
            data += f"{n / 1e6:.3f} {points[n][0] / MiB:.1f} {points[n][1] / MiB:.1f}\n"
        data += "\n\n"
        color = colors[i % len(colors)]
        plots.append(f"'largest.dat' index {i} using 1:2 with linespoints pt 7 lc rgb {color} "
                     f"title '{key[0]}, malloc {key[1]}: whole process'")
        plots.append(f"'largest.dat' index {i} using 1:3 with linespoints pt 6 dt 2 lc rgb {color} "
                     f"title '{key[0]}, malloc {key[1]}: steps only'")
    script = PNG + f"""set output '../largest.png'
set title 'Largest-model search, world {lg["world"]}: peak resident memory per rank (largest over ranks) of every probe'
set xlabel 'parameters (millions)'
set ylabel 'peak RSS per rank (MiB)'
set logscale x
set grid
set key left top
set yrange [0:{2 * lg['cap_mib']}]
plot {", ".join(plots)}, {lg['cap_mib']} with lines lw 2 lc 'black' dt 3 title 'cap ({lg['cap_mib']} MiB)'
"""
    return gnuplot(bench, "largest", script, data)


# ---------------------------------------------------------------------------------------------

def parse_markdown_tables(path):
    """Every markdown table in the file as a list of rows (cells); checks each row's width."""
    tables, current = [], None
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("|"):
                cells = [c.strip() for c in line.strip("|").split("|")]
                if current is None:
                    current = [cells]
                elif set("".join(cells)) <= set("-: "):
                    continue
                else:
                    if len(cells) != len(current[0]):
                        raise ValueError(f"{path}: row has {len(cells)} cells, header {len(current[0])}: {line}")
                    current.append(cells)
            elif current is not None:
                tables.append(current)
                current = None
    if current is not None:
        tables.append(current)
    return tables


def check_outputs(bench, groups, sections):
    problems = []
    if "peers" in sections:
        tables = parse_markdown_tables(os.path.join(bench.out, "peers.md"))
        group_tables = [t for t in tables if t[0][0] == "contender" and "runs" in t[0]]
        if len(group_tables) != len(groups):
            problems.append(f"peers.md has {len(group_tables)} group tables, expected {len(groups)}")
        for g, t in zip(groups, group_tables):
            labels = [row[0] for row in t[1:]]
            for c in g["contenders"]:
                if c["label"] not in labels:
                    problems.append(f"peers.md lacks contender {c['label']}")
            for row in t[1:]:
                if row[1] == "0":
                    key = next((c["key"] for c in g["contenders"] if c["label"] == row[0]), None)
                    last = g["failures"].get(key) or ["no output recorded"]
                    problems.append(f"{row[0]}: no successful run; the last failure: {last[-1]}")
                elif row[-1] not in ("0", "n/a"):
                    if row[0] == "PyTorch FSDP HYBRID_SHARD (F=1)":
                        # PyTorch's own defect, not the benchmark's: with a shard group of one rank
                        # FSDP1 falls back to NO_SHARD over that group and never reduces across
                        # the replicas (bench/results/peers_pytorch_fsdp/README.md).
                        log(f"note: {row[0]}: losses differ from local training ({row[-2]}), PyTorch's known defect")
                    else:
                        problems.append(f"{row[0]}: losses differ from local training ({row[-2]})")
                else:
                    float(row[2].split()[0])  # the step time parses
        if not bench.ddp_available:
            problems.append("skip: " + bench.ddp_reason)
    if "malloc" in sections:
        tables = parse_markdown_tables(os.path.join(bench.out, "malloc.md"))
        t = next((t for t in tables if t[0][0] == "contender"), None)
        if t is None or any(row[2] == "0" for row in t[1:]) or len(t) < 3:
            problems.append("malloc.md: missing or failed rows")
    if "memory" in sections:
        tables = parse_markdown_tables(os.path.join(bench.out, "memory.md"))
        t = next((t for t in tables if t[0][0] == "wrap"), None)
        if t is None:
            problems.append("memory.md has no wrap table")
        else:
            col = t[0].index("measured / formula (worst rank and run)")
            rest = t[0].index("at rest: allocator / formula")
            for row in t[1:]:
                if abs(float(row[col]) - 1) > 1e-9:
                    problems.append(f"memory.md wrap {row[0]}: peak model state differs from the formula")
                if abs(float(row[rest]) - 1) > 1e-9:
                    problems.append(f"memory.md wrap {row[0]}: live tensor bytes at rest differ from the formula")
    if "largest" in sections:
        tables = parse_markdown_tables(os.path.join(bench.out, "largest.md"))
        t = next((t for t in tables if t[0][0] == "strategy"), None)
        expected = set(bench.largest_contenders())
        if t is None or {row[0] for row in t[1:]} != expected:
            problems.append(f"largest.md lacks rows of {', '.join(sorted(expected))}")
        else:
            depth = t[0].index("largest depth")
            for row in t[1:]:
                if int(row[depth]) < 1:
                    problems.append(f"largest.md: {row[0]} found no depth that fits")
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full")
    ap.add_argument("--sections", default="peers,malloc,memory,largest",
                    help="comma-separated: peers,malloc,memory,largest")
    ap.add_argument("--reps", type=int, help="override the preset's repetitions (peers section)")
    ap.add_argument("--largest-fsdp-args", default="",
                    help="extra gpt_bench options for every probe of the largest section, e.g. "
                         "'--reductions-in-flight 1 --all-gather-limit 1' (FSDP's memory-saving settings)")
    ap.add_argument("--largest-malloc", help="comma-separated malloc modes of the largest section (default: the "
                                             "preset's, e.g. default,mmap)")
    ap.add_argument("--largest-criteria", help="comma-separated criteria of the largest section: whole, steps")
    ap.add_argument("--largest-contenders",
                    help="comma-separated contenders of the largest section (default: NO_SHARD,FULL_SHARD, and "
                         "py_FULL_SHARD, PyTorch FSDP, where the Python's torch is 2.x)")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--python", default="/usr/bin/python3", help="Python with python3-torch, for DDP")
    ap.add_argument("--check", action="store_true",
                    help="verify the written tables (exit 1 on a problem, 77 if DDP could not run)")
    args = ap.parse_args()
    preset = json.loads(json.dumps(PRESETS[args.preset]))
    if args.reps:
        preset["reps"] = args.reps
    if args.largest_malloc:
        preset["largest"]["malloc"] = args.largest_malloc.split(",")
        for m in preset["largest"]["malloc"]:
            if m not in MALLOC_MODES:
                sys.exit(f"run.py: unknown --largest-malloc {m!r}; choose from {', '.join(MALLOC_MODES)}")
    if args.largest_criteria:
        preset["largest"]["criteria"] = args.largest_criteria.split(",")
        for c in preset["largest"]["criteria"]:
            if c not in ("whole", "steps"):
                sys.exit(f"run.py: unknown --largest-criteria {c!r}; choose from whole, steps")
    if args.largest_contenders:
        preset["largest"]["contenders"] = args.largest_contenders.split(",")
        for c in preset["largest"]["contenders"]:
            if c not in ("NO_SHARD", "FULL_SHARD", "py_FULL_SHARD", "py_NO_SHARD"):
                sys.exit(f"run.py: unknown --largest-contenders {c!r}; choose from NO_SHARD, FULL_SHARD, "
                         "py_FULL_SHARD, py_NO_SHARD")
    sections = [s for s in args.sections.split(",") if s]
    for s in sections:
        if s not in ("peers", "malloc", "memory", "largest"):
            sys.exit(f"run.py: unknown section {s!r}; choose from peers, malloc, memory, largest")

    bench = Bench(args, preset)
    argv = sys.argv[1:]
    bench.command = shlex.join(["bench/peers/run.py"] + argv)
    bench.machine = machine_description(args.python)
    bench.load_start = os.getloadavg()
    bench.gnuplot = next((os.path.join(d, "gnuplot") for d in os.environ.get("PATH", "").split(":")
                          if os.access(os.path.join(d, "gnuplot"), os.X_OK)), None)
    log(f"preset {args.preset}, sections {','.join(sections)}; DDP: "
        f"{bench.ddp_reason if not bench.ddp_available else 'PyTorch ' + bench.ddp_reason}; "
        f"gnuplot: {bench.gnuplot or 'not found (no plots)'}")
    started = datetime.datetime.utcnow()

    groups = []
    if "peers" in sections:
        groups = bench.section_peers()
        lines, summary_rows, cols = report_peers(bench, groups)
        plot_peers(bench, summary_rows, cols, groups)
        with open(os.path.join(bench.out, "peers.md"), "w") as f:
            f.write("\n".join(header_block(bench, "libfsdp against PyTorch DDP and local training", started,
                                           datetime.datetime.utcnow()) + lines) + "\n")
    if "malloc" in sections:
        md = bench.section_malloc()
        with open(os.path.join(bench.out, "malloc.md"), "w") as f:
            f.write("\n".join(header_block(bench, "Diagnosis of the step-time gap: language, allocator and FSDP runtime, without communication", started,
                                           datetime.datetime.utcnow()) + report_malloc(bench, md)) + "\n")
    if "memory" in sections:
        mem = bench.section_memory()
        lines, plot = report_memory(bench, mem)
        plot_memory(bench, plot)
        with open(os.path.join(bench.out, "memory.md"), "w") as f:
            f.write("\n".join(header_block(bench, "FULL_SHARD memory against the formula, by wrap granularity",
                                           started, datetime.datetime.utcnow()) + lines) + "\n")
    if "largest" in sections:
        lg = bench.section_largest()
        lines = report_largest(bench, lg)
        plot_largest(bench, lg)
        with open(os.path.join(bench.out, "largest.md"), "w") as f:
            f.write("\n".join(header_block(bench, "Largest trainable model under a per-rank memory cap",
                                           started, datetime.datetime.utcnow()) + lines) + "\n")
    # Every run's full result, one file per section, so that running one section again leaves the
    # others' raw data alone.
    for section in sections:
        with open(os.path.join(bench.out, f"raw-{section}.jsonl"), "w") as f:
            for r in bench.raw:
                if r.get("section") == section:
                    f.write(json.dumps(r) + "\n")
    log(f"wrote {', '.join(s + '.md' for s in sections)} and raw-*.jsonl to {bench.out}")

    if args.check:
        problems = check_outputs(bench, groups, sections)
        skips = [p for p in problems if p.startswith("skip: ")]
        errors = [p for p in problems if not p.startswith("skip: ")]
        for p in errors:
            print("CHECK FAILED: " + p)
        if errors:
            return 1
        if skips:
            print("SKIPPED (the rest passed): " + "; ".join(p[6:] for p in skips))
            return 77
        print("check passed: every table parses and names every contender; losses agree with local training")
    return 0


if __name__ == "__main__":
    sys.exit(main())
