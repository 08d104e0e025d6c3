"""Correctness checks: losses against local training, and the written tables (--check)."""
import os

from .largest import largest_contenders
from .util import log


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


LOSS_TOLERANCE = 1e-4  # float32 sums in a different order (threads, ranks) stay far below this


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
        expected = set(largest_contenders(bench))
        if t is None or {row[0] for row in t[1:]} != expected:
            problems.append(f"largest.md lacks rows of {', '.join(sorted(expected))}")
        else:
            depth = t[0].index("largest depth")
            for row in t[1:]:
                if int(row[depth]) < 1:
                    problems.append(f"largest.md: {row[0]} found no depth that fits")
    return problems
