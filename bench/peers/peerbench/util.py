"""Progress lines and the number formats of the tables."""
import datetime

from .config import MiB


def log(msg):
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


def fmt(x, digits=2):
    return "n/a" if x is None else f"{x:.{digits}f}"


def mib(b, digits=1):
    return "n/a" if b is None else f"{b / MiB:.{digits}f}"

