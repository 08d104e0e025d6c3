"""Bench: starts each contender (gpt_bench, ddp_gpt.py) under fsdp-run and records its result."""
import json
import os
import shlex
import socket
import subprocess
import sys
import time

from .config import FSDP_STRATEGIES, MALLOC_MODES, PYTORCH_KINDS, ROOT
from .machine import usable_cpus
from .util import log


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        # --threads), and a passive OpenMP wait policy. On a shared machine a 2-thread process
        # whose threads spin while waiting runs several times slower than with 1 thread when other
        # jobs hold the cores; passive waiting makes the whole-machine local run comparable.
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

