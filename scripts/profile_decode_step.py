"""Where one decoding step of an attention layer goes: the operators it dispatches and its time.

    PYTHONPATH=src python3 scripts/profile_decode_step.py [--device cpu|cuda] [--out FILE.txt]

For each kind, a layer built for a 16k context (so MLR's block sizes are those of the benchmark)
decodes one token at a time, and the script prints:

- the operators one step dispatches, from ``torch.profiler``: views (no work: slices, reshapes)
  and the rest, each of which is at least one kernel launch on a GPU;
- the host's time per step with one head of 64 dims, batch 1 and a 130-token cache, where the
  arithmetic is negligible and what is left is Python and dispatch: the part of a GPU decoding
  step that the GPU waits on unless the step is captured in a CUDA graph;
- on CUDA, the benchmark's own size (batch 16, 8 heads, a 16k cache): host and device time per
  step, and the profiler's table in ``--out``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections import Counter

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from structured_attention.attention import build_attention

CONTEXT = 16384
KINDS = ("mha", "mlr:16|16|16|16", "mlr:8|8|8|8|8|8|8|8")
VIEWS = {"aten::view", "aten::slice", "aten::transpose", "aten::reshape", "aten::alias", "aten::split_with_sizes",
         "aten::split", "aten::select", "aten::unsqueeze", "aten::narrow", "aten::as_strided", "aten::expand",
         "aten::permute", "aten::t", "aten::_unsafe_view", "aten::detach", "aten::squeeze", "aten::unbind"}


def _decoder(spec: str, device: str, batch: int, heads: int, d_model: int, prompt: int, dtype: torch.dtype):
    layer = build_attention(spec, d_model=d_model, n_heads=heads, max_seq_len=CONTEXT).to(device, dtype).eval()
    cache = layer.new_cache(batch)
    layer(torch.randn(batch, prompt, d_model, device=device, dtype=dtype), cache)
    x = torch.randn(batch, 1, d_model, device=device, dtype=dtype)
    return lambda: layer(x, cache)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _ops_per_step(step, steps: int) -> tuple[float, float, Counter]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    top = [e.name for e in prof.events()
           if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    views = sum(name in VIEWS for name in top)
    work = Counter(name for name in top if name not in VIEWS)
    return views / steps, (len(top) - views) / steps, work


def _host_us(step, steps: int, device: str, repeats: int = 9) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
        times.append((time.perf_counter() - t0) / steps * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated attention specs")
    ap.add_argument("--out", default=None, help="also write the report here (on CUDA with the profiler's tables)")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.machine()}, {os.cpu_count()} CPUs"
    lines = [f"python {platform.python_version()}, torch {torch.__version__}, {args.device} ({where}, "
             f"{torch.get_num_threads()} threads); layers built for a {CONTEXT}-token context", "",
             "| kind | views / step | other ops / step | host us / step (1 head, batch 1, cache 130) |",
             "|---|---|---|---|"]
    detail = []
    with torch.no_grad():
        for spec in args.kinds.split(","):
            step = _decoder(spec, args.device, batch=1, heads=1, d_model=64, prompt=130, dtype=dtype)
            for _ in range(8):
                step()
            us = _host_us(step, 32, args.device)
            views, other, work = _ops_per_step(step, 32)
            lines.append(f"| {spec} | {views:.1f} | {other:.1f} | {us:.0f} |")
            detail.append(f"{spec}: " + ", ".join(f"{n.removeprefix('aten::')} {c / 32:g}" for n, c in work.most_common()))
    report = lines + ["", "other ops per step:"] + detail
    print("\n".join(report), flush=True)
    tables = []
    with torch.no_grad():
        for spec in args.kinds.split(",") if args.device == "cuda" else ():
            # a 16k cache, with room for the 168 steps below
            step = _decoder(spec, "cuda", batch=16, heads=8, d_model=512, prompt=CONTEXT - 256, dtype=dtype)
            for _ in range(8):
                step()
            us = _host_us(step, 16, "cuda")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(8):
                    step()
                torch.cuda.synchronize()
            events = prof.key_averages()
            # kernels only: an operator's row repeats the time of the kernels it launched
            gpu = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 8
            report.append(f"{spec}, batch 16, 8 heads, cache {CONTEXT - 256}: {us:.0f} us per step, "
                          f"{gpu:.0f} us of it on the GPU")
            print(report[-1], flush=True)
            tables.append(f"== {spec} ==\n" + events.table(sort_by="self_cpu_time_total", row_limit=25))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(report + ["", *tables]) + "\n")


if __name__ == "__main__":
    main()
