"""The GPT's shape and run length, as every GPU benchmark script takes them on its command line."""


def add_gpt_args(ap, warmup, steps, layers=True):
    """Adds --layers (unless the script searches over it), --width, --heads, --context, --batch,
    --warmup and --steps to the argparse parser `ap`, with the benchmarks' model as defaults."""
    if layers:
        ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--steps", type=int, default=steps)
