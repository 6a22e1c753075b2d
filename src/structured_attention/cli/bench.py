"""``sattn bench attention``: time every attention kind in one run, next to standard attention.

For each kind and sequence length: forward ms, forward+backward ms (medians over ``--repeats``
after ``--warmup`` runs), peak memory of forward+backward (CUDA allocator peak; on the CPU the
growth of the resident set, sampled in a fresh process per case, Linux only), and decode ms per token
with a cache of ``--decode-cache`` tokens. ``speedup`` columns are ``mha`` time / kind time at
equal width and heads (``mha`` runs PyTorch SDPA). Writes JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import platform
import resource
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..attention import build_attention

DEFAULT_KINDS = "mha,swa:128,global_swa:32|32:window=128,mlr:8|8|8|8|8|8|8|8"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    what = p.add_subparsers(dest="what", required=True)
    a = what.add_parser("attention", help="time the attention kinds against standard attention (SDPA)")
    a.add_argument("--kinds", default=DEFAULT_KINDS, help=f"comma-separated attention specs (default {DEFAULT_KINDS})")
    a.add_argument("--seq-lens", default="1024,2048,4096", help="comma-separated sequence lengths (default 1024,2048,4096)")
    a.add_argument("--d-model", type=int, default=512, help="width (default 512)")
    a.add_argument("--n-heads", type=int, default=8, help="heads (default 8)")
    a.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    a.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    a.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a.add_argument("--warmup", type=int, default=1, help="untimed runs before timing (default 1)")
    a.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported (default 3)")
    a.add_argument("--decode-cache", type=int, default=None, help="cache length for decode timing (default: longest seq-len minus decode steps)")
    a.add_argument("--decode-steps", type=int, default=16, help="tokens decoded per timed run (default 16)")
    a.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    a.add_argument("--out", default="runs/bench", help="folder for attention.json and attention.png (default runs/bench)")
    a.set_defaults(run=run)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _layer(spec: str, args: argparse.Namespace, seq_len: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = build_attention(spec, d_model=args.d_model, n_heads=args.n_heads, max_seq_len=seq_len)
    return layer.to(device=args.device, dtype=getattr(torch, args.dtype))


def _inputs(args: argparse.Namespace, seq_len: int, grad: bool) -> torch.Tensor:
    x = torch.randn(args.batch, seq_len, args.d_model, device=args.device, dtype=getattr(torch, args.dtype))
    return x.requires_grad_(grad)


def _peak_memory_mb(spec: str, args: argparse.Namespace, seq_len: int) -> float:
    """Peak memory of one forward+backward, in MiB."""
    if torch.device(args.device).type == "cuda":
        layer, x = _layer(spec, args, seq_len), _inputs(args, seq_len, True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        layer(x).sum().backward()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_cpu_peak_rss_growth, (spec, vars(args), seq_len))


def _cpu_peak_rss_growth(spec: str, arg_dict: dict[str, Any], seq_len: int) -> float:
    """Run in a fresh process: resident-set growth over the pre-run level, sampled every 0.2 ms."""
    args = argparse.Namespace(**arg_dict)
    layer, x = _layer(spec, args, seq_len), _inputs(args, seq_len, True)
    page = resource.getpagesize()

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    before, peak, done = rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    layer(x).sum().backward()
    done.set()
    sampler.join()
    return max(peak[0], rss()) / 2**20 - before / 2**20


def _decode_ms(spec: str, args: argparse.Namespace, cache_len: int, context: int) -> float:
    """Median ms per token of ``--decode-steps`` one-token steps after a ``cache_len`` prompt."""
    layer = _layer(spec, args, context).eval()
    device = torch.device(args.device)
    times = []
    with torch.no_grad():
        tokens = _inputs(args, args.decode_steps, False)
        prefilled = layer.new_cache(args.batch)
        layer(_inputs(args, cache_len, False), prefilled)
        for run in range(args.warmup + args.repeats):
            cache = copy.deepcopy(prefilled)
            _sync(device)
            start = time.perf_counter()
            for t in range(args.decode_steps):
                layer(tokens[:, t : t + 1], cache)
            _sync(device)
            if run >= args.warmup:
                times.append((time.perf_counter() - start) * 1e3 / args.decode_steps)
    return statistics.median(times)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    seq_lens = [int(t) for t in args.seq_lens.split(",")]
    records = []
    for seq_len in seq_lens:
        for spec in args.kinds.split(","):
            layer = _layer(spec, args, seq_len)
            with torch.no_grad():
                x = _inputs(args, seq_len, False)
                fwd = _median_ms(lambda: layer(x), device, args.warmup, args.repeats)
            xg = _inputs(args, seq_len, True)
            fwd_bwd = _median_ms(lambda: layer(xg).sum().backward(), device, args.warmup, args.repeats)
            record = {"kind": spec, "seq_len": seq_len, "forward_ms": fwd, "forward_backward_ms": fwd_bwd}
            if not args.no_memory:
                record["peak_memory_mib"] = _peak_memory_mb(spec, args, seq_len)
            records.append(record)
            print(f"  {spec:28s} T={seq_len:6d}  fwd {fwd:9.2f} ms  fwd+bwd {fwd_bwd:9.2f} ms", flush=True)
    context = max(seq_lens)
    cache_len = args.decode_cache or context - args.decode_steps
    if not 0 < cache_len <= context - args.decode_steps:
        raise ValueError(f"--decode-cache: expected 1..{context - args.decode_steps} (longest seq-len minus decode steps), got {cache_len}")
    for spec in args.kinds.split(","):
        ms = _decode_ms(spec, args, cache_len, context)
        for r in records:
            if r["kind"] == spec:
                r["decode_ms_per_token"] = ms
                r["decode_cache_len"] = cache_len
    return records


def environment(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return {
        "device": name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": args.dtype,
        "batch": args.batch,
        "d_model": args.d_model,
        "n_heads": args.n_heads,
    }


def add_speedups(records: list[dict[str, Any]], baseline: str = "mha") -> None:
    """``speedup_*`` = baseline time / kind time at the same sequence length."""
    base = {r["seq_len"]: r for r in records if r["kind"] == baseline}
    for r in records:
        ref = base.get(r["seq_len"])
        if ref is None:
            continue
        for key in ("forward_ms", "forward_backward_ms", "decode_ms_per_token"):
            if key in r and key in ref:
                r["speedup_" + key.removesuffix("_ms").removesuffix("_ms_per_token")] = ref[key] / r[key]


def plot(records: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "forward_ms", "forward"), (axes[1], "forward_backward_ms", "forward + backward")):
        for kind in dict.fromkeys(r["kind"] for r in records):
            pts = [(r["seq_len"], r[key]) for r in records if r["kind"] == kind]
            ax.plot(*zip(*pts), marker="o", label=kind)
        ax.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="ms", title=title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> int:
    for name in ("d_model", "n_heads", "batch", "repeats", "decode_steps"):
        value = getattr(args, name)
        if value <= 0:
            raise ValueError(f"--{name.replace('_', '-')}: expected a positive integer, got {value}")
    try:
        [int(t) for t in args.seq_lens.split(",")]
    except ValueError:
        raise ValueError(f"--seq-lens: expected comma-separated integers, got {args.seq_lens!r}") from None
    env = environment(args)
    print(f"sattn bench attention on {env['device']} ({env['threads']} threads), torch {env['torch']}, {args.dtype}")
    records = measure(args)
    add_speedups(records)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention.json").write_text(json.dumps({"environment": env, "results": records}, indent=2))
    print(f"wrote {out / 'attention.json'}")
    if plot(records, out / "attention.png"):
        print(f"wrote {out / 'attention.png'}")
    print(markdown_table(records))
    return 0


def markdown_table(records: list[dict[str, Any]]) -> str:
    cols = [
        ("kind", "kind", "{}"), ("seq_len", "T", "{}"), ("forward_ms", "fwd ms", "{:.2f}"),
        ("forward_backward_ms", "fwd+bwd ms", "{:.2f}"), ("peak_memory_mib", "peak MiB", "{:.0f}"),
        ("decode_ms_per_token", "decode ms/token", "{:.3f}"), ("speedup_forward", "fwd speedup", "{:.2f}x"),
        ("speedup_forward_backward", "fwd+bwd speedup", "{:.2f}x"), ("speedup_decode", "decode speedup", "{:.2f}x"),
    ]
    cols = [c for c in cols if any(c[0] in r for r in records)]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        lines.append("| " + " | ".join(c[2].format(r[c[0]]) if c[0] in r else "" for c in cols) + " |")
    return "\n".join(lines)
