"""The machine, packages and commit a report names."""
import os
import platform
import subprocess

from .config import ROOT


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
