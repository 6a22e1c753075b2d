"""The host's share of one MLR attention call on CUDA: Python, the custom op, the Triton launches.

    PYTHONPATH=src python3 scripts/profile_host.py [--seq-len 1024] [--out FILE.txt]

``sattn bench mlr`` times one call between two synchronisations, so whatever the host spends before
the kernels start counts in full; in a training step it counts wherever the host, not the GPU, is
the slower of the two. At a short sequence (default 1024 tokens, B=1, H=8, 8 levels of rank 8,
R=Dv=64, bfloat16) the kernels take microseconds, so calls issued back to back without a
synchronisation take the host's time each. The script prints, per call, for SDPA's flash kernel and
for MLR entered at each layer of its stack:

- ``mlr_attention``: the public function (argument checks, dispatch, tile choice; outside
  ``torch.compile`` the kernels' functions in an ``autograd.Function``);
- ``op (compiled)``: the prefix-rank forward's custom op called directly, as a compiled graph calls
  it (the op's dispatch, plan, launch);
- ``launch``: the op's function without the op (the plan, the output buffers, the Triton launch);

then the same for forward+backward; on a GPU, one forward+backward between two synchronisations
as ``sattn bench`` times it, with when the host's calls return and when the GPU has done each part
(which side the other waits for); and ``cProfile``'s table of ``mlr_attention``'s calls (the
functions that take the host's time). Without a GPU (``TRITON_INTERPRET=1``, CPU tensors) the
kernels are replaced by no-ops and the dispatcher takes the Triton route for CPU tensors, so the
figures are this machine's Python alone, with no Triton launch; the script then also prints when,
in one forward+backward, each kernel would be launched (on a GPU the forward kernel runs from its
launch on, and a backward kernel launched later than the forward kernel's time leaves the GPU idle).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from structured_attention.ops.mlr import dispatch, mlr_attention
from structured_attention.ops.mlr import triton_prefix as tp
from structured_attention.ops.mlr.contract import mlr_block_sizes
from structured_attention.ops.mlr.triton_general import _prefix_tiles

RANKS = (8,) * 8
launched: dict[str, float] = {}  # when each no-op kernel was last launched (the CPU's figures)


def per_call_us(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    """Microseconds per call of ``fn`` called ``calls`` times back to back (after a warm-up)."""
    for _ in range(10):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def no_op_kernels() -> None:
    """Without a GPU: the prefix-rank kernels and the backward's delta kernel become no-ops that
    note when they are launched (``launched``), and CPU tensors take the dispatcher's Triton route,
    as CUDA ones do, so what runs is the host's part of a GPU call alone."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("no CUDA device: run with TRITON_INTERPRET=1 (the kernels become no-ops)")

    class _NoLaunch:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: object) -> Callable[..., None]:
            return lambda *a, **k: launched.__setitem__(self.name, time.perf_counter())

    for name in ("_prefix_fwd_kernel", "_prefix_dkdv_kernel", "_prefix_dq_kernel"):
        setattr(tp, name, _NoLaunch(name))

    def row_dots(a: torch.Tensor, b: torch.Tensor, zeroed: torch.Tensor | None = None) -> torch.Tensor:
        launched["row_dots"] = time.perf_counter()  # the backward's delta kernel
        return torch.empty(a.shape[:-1])

    tp.row_dots = row_dots
    dispatch.on_triton = lambda x: True
    dispatch.cpu.available = lambda: False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--out", default=None, help="also write the report here")
    args = p.parse_args()
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        no_op_kernels()
    device = "cuda" if on_gpu else "cpu"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    B, H, T, R, Dv = 1, 8, args.seq_len, sum(RANKS), 64
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d, device=device, dtype=torch.bfloat16, requires_grad=True) for d in (R, R, Dv))
    sizes = mlr_block_sizes(RANKS, T, None)
    scale = R ** -0.5
    tiles = _prefix_tiles(tuple(sizes), q.dtype, "cuda", 64, 64, False)  # the tiles mlr_attention takes on CUDA
    assert tiles is not None, f"block sizes {sizes} take the general kernels"
    plan = tp.plan_of(q, v, RANKS, sizes, tiles)
    tile_list = [int(x) for x in (tiles.fwd_m, tiles.fwd_n, tiles.dkdv_n, tiles.dkdv_m, tiles.dq_m, tiles.dq_n,
                                  tiles.num_warps, tiles.num_stages)]
    forwards = {
        "sdpa flash": lambda: _flash(q, k, v),
        "mlr_attention": lambda: mlr_attention(q, k, v, RANKS),
        "op (compiled)": lambda: torch.ops.sattn.mlr_triton_prefix_forward(q, k, v, None, list(RANKS), list(sizes), True, scale, False, tile_list),
        "launch": lambda: tp._forward(q, k, v, None, T, plan, True, scale, False),
    }
    lines = [f"{torch.cuda.get_device_name() if on_gpu else 'CPU (kernels are no-ops)'} | torch {torch.__version__}"
             f" | B={B} H={H} T={T} ranks {'|'.join(map(str, RANKS))} Dv={Dv} bfloat16 | tiles {tile_list}"
             f" | launched with {plan.num_warps} warps",
             "microseconds per call, calls back to back:"]
    with torch.no_grad():
        for name, fn in forwards.items():
            lines.append(f"  forward           {name:15s} {per_call_us(fn, args.calls, sync):8.1f}")
    grad = torch.randn(B, H, T, Dv, device=device, dtype=torch.bfloat16)
    for name in ("sdpa flash", "mlr_attention"):
        fn = forwards[name]
        lines.append(f"  forward+backward  {name:15s} {per_call_us(lambda: fn().backward(grad), args.calls, sync):8.1f}")
    if not on_gpu:
        marks = [launch_times(forwards["mlr_attention"], grad, (q, k, v)) for _ in range(args.calls)][args.calls // 5:]
        lines += ["", "one forward+backward, when the host launches each kernel (us, medians): from the call, then from",
                  "backward()"]
        lines.append("  " + "  ".join(f"{key} {statistics.median(m[key] for m in marks):6.1f}" for key in marks[0]))
    if on_gpu:
        lines += ["", "one forward+backward between two synchronisations, as sattn bench times it (ms from the",
                  "first; medians of 10): when the host's calls return, and when the GPU has done each part"]
        for name in ("sdpa flash", "mlr_attention"):
            marks = [one_call(forwards[name], grad, (q, k, v)) for _ in range(13)][3:]
            lines.append(f"  {name:15s} " + "  ".join(f"{key} {statistics.median(m[key] for m in marks):6.3f}"
                                                      for key in marks[0]))
    prof = cProfile.Profile()
    with torch.no_grad():
        prof.enable()
        for _ in range(args.calls):
            forwards["mlr_attention"]()
        prof.disable()
    table = io.StringIO()
    pstats.Stats(prof, stream=table).sort_stats("tottime").print_stats(25)
    lines += ["", f"cProfile, {args.calls} forward calls of mlr_attention, by own time:", table.getvalue()]
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")


def one_call(forward: Callable[[], torch.Tensor], grad: torch.Tensor, leaves: tuple[torch.Tensor, ...]) -> dict:
    """One forward+backward on CUDA: the host's time when the forward and the backward return and
    when the synchronisation does, and the GPU's (events) when it has done the forward and the
    backward, in ms from a synchronised start. A GPU done long after the host returned is GPU-bound;
    a host that returns late, with the GPU done soon after, is what the GPU waited for."""
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    for x in leaves:
        x.grad = None
    torch.cuda.synchronize()
    start = time.perf_counter()
    marks[0].record()
    out = forward()
    forward_returned = time.perf_counter()
    marks[1].record()
    out.backward(grad)
    backward_returned = time.perf_counter()
    marks[2].record()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return {"host fwd": (forward_returned - start) * 1e3, "host bwd": (backward_returned - start) * 1e3,
            "synced": (done - start) * 1e3, "GPU fwd": marks[0].elapsed_time(marks[1]),
            "GPU bwd": marks[0].elapsed_time(marks[2])}


def launch_times(forward: Callable[[], torch.Tensor], grad: torch.Tensor, leaves: tuple[torch.Tensor, ...]) -> dict:
    """One forward+backward with the no-op kernels: when the forward kernel is launched and the
    forward returns (us from the call), and when the backward's kernels are launched and it returns
    (us from ``backward()``)."""
    for x in leaves:
        x.grad = None
    start = time.perf_counter()
    out = forward()
    returned = time.perf_counter()
    out.backward(grad)
    done = time.perf_counter()
    return {"fwd launch": (launched["_prefix_fwd_kernel"] - start) * 1e6, "fwd return": (returned - start) * 1e6,
            "| delta launch": (launched["row_dots"] - returned) * 1e6,
            "dK/dV launch": (launched["_prefix_dkdv_kernel"] - returned) * 1e6, "bwd return": (done - returned) * 1e6}


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if not q.is_cuda:
        return q  # no flash kernel on the CPU: nothing to compare with
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


if __name__ == "__main__":
    main()
