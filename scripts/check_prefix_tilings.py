"""Check the prefix-rank kernels' tilings with sub-tile levels, output and each gradient apart.

    PYTHONPATH=src python3 scripts/check_prefix_tilings.py [--cases 0,1] [--tile-warps] [--out FILE.txt]

On the H200 (Triton 3.6) 64-row tiles with one sub-tile level (8 levels of rank 8 at T = 4096)
gave wrong values with four or eight warps, while the same tiles were right at 2048 (two sub-tile
levels), at 8192 (none) and under the interpreter. Each case here changes one thing against that
one: the number of sub-tile levels, whether the coarse levels' prefix reaches the last head-dim
chunk (``NCC == NCH``), the length, the dtype, and the deterministic backward (the separate dQ
kernel instead of the dK/dV kernel's atomics), so the failing ones name the trigger and the
kernel (the output: forward; dK, dV: the dK/dV kernel; dQ: fused or the dQ kernel). The kernels are
called with explicit tiles, past the dispatcher's choice, with the pipeline stages it would give
them. Since that run the near tiles' loops are no longer software-pipelined (triton_prefix.py's docstring): with every case ``ok`` the dispatcher's
guard for a single sub-tile level (``miscompiled_on_cuda``) can go. On CUDA the kernels launch
tilings with sub-tile levels with eight warps (``launch_warps``, for the same fault with four);
``--tile-warps`` launches them with the tiles' own four, to tell whether that guard can go too. On
CUDA by default; without a GPU (``TRITON_INTERPRET=1``, slow: minutes a case) on the CPU.
"""

from __future__ import annotations

import argparse
import time

import torch

from structured_attention.functional import mlr_attention_reference
from structured_attention.ops.mlr import triton_prefix
from structured_attention.ops.mlr.contract import check_mlr_arguments
from structured_attention.ops.mlr.triton_prefix import PrefixTiles, mlr_attention_prefix, plan_of

# (label, ranks, T, block sizes or None for the default halving ones, tile rows, dtype, deterministic)
CASES = [
    ("one sub-tile level, NCC == NCH (wrong on the H200 at f0f7f8e)", (8,) * 8, 4096, None, 64, "bfloat16", False),
    ("  the same, deterministic backward", (8,) * 8, 4096, None, 64, "bfloat16", True),
    ("  the same, float16", (8,) * 8, 4096, None, 64, "float16", False),
    ("  the same at T = 8192 (blocks 128 -> 32)", (8,) * 8, 8192, (8192, 4096, 2048, 1024, 512, 256, 128, 32), 64,
     "bfloat16", False),
    ("one sub-tile level, NCC < NCH", (8,) * 6 + (16,), 2048, None, 64, "bfloat16", False),
    ("two sub-tile levels, NCC == NCH", (8,) * 7 + (4, 4), 4096, None, 64, "bfloat16", False),
    ("two sub-tile levels, NCC < NCH (right on the H200)", (8,) * 8, 2048, None, 64, "bfloat16", False),
    ("32-row tiles, one sub-tile level, NCC == NCH (float32's default at 2048)", (8,) * 8, 2048, None, 32,
     "float32", False),
    ("no sub-tile level (control)", (8,) * 8, 4096, None, 32, "bfloat16", False),
]


def use_tile_warps() -> None:
    """From now on in this process, launch every tiling with its own warps, past ``launch_warps``'
    eight on CUDA for tilings with sub-tile levels."""
    triton_prefix.launch_warps = lambda tiles, sizes, device_type: tiles.num_warps
    triton_prefix._plan.cache_clear()


def errors(tiles: PrefixTiles, ranks: tuple[int, ...], T: int, sizes: tuple[int, ...] | None = None,
           dtype: str = "bfloat16", deterministic: bool = False,
           device: str = "cuda", dv: int = 64) -> tuple[dict[str, float], str] | None:
    """Relative error of the output and each gradient against the float64 reference (B=1, H=2,
    value dim ``dv``, causal) and the plan's layout, or None where ``tiles`` do not fit the block sizes."""
    gen = torch.Generator(device=device).manual_seed(1)
    q, k = (torch.randn(1, 2, T, sum(ranks), device=device, generator=gen) for _ in range(2))
    v, do = (torch.randn(1, 2, T, dv, device=device, generator=gen) for _ in range(2))
    low = getattr(torch, dtype)
    ql, kl, vl = (x.to(low).requires_grad_() for x in (q, k, v))
    ranks_, sizes_, scale = check_mlr_arguments(ql, kl, vl, ranks, sizes, True, None, False)
    if not tiles.fits(sizes_[1:]):
        return None
    plan = plan_of(ql, vl, ranks_, sizes_, tiles)
    layout = f"NSUB={plan.NSUB} NCC={plan.NCC} NCH={plan.NCH} warps={plan.num_warps}"
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        out = mlr_attention_prefix(ql, kl, vl, ranks_, sizes_, True, scale, False, tiles)
        grads = torch.autograd.grad(out, (ql, kl, vl), do.to(low))
    finally:
        torch.use_deterministic_algorithms(previous)
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (ql, kl, vl))
    ref = mlr_attention_reference(qr, kr, vr, ranks, sizes)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), do.to(low).double())
    found = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        found[name] = float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max())
    return found, layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write the report here")
    parser.add_argument("--cases", default=None, help="comma-separated case numbers (default: all)")
    parser.add_argument("--tile-warps", action="store_true",
                        help="launch with the tiles' own warps (four), not eight where there are sub-tile levels")
    args = parser.parse_args()
    if args.tile_warps:
        use_tile_warps()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    picked = range(len(CASES)) if args.cases is None else [int(i) for i in args.cases.split(",")]
    lines = [f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU (interpreter)'} | torch {torch.__version__}"
             f" | triton {__import__('triton').__version__}"]
    print(lines[0], flush=True)
    for i in picked:
        label, ranks, T, sizes, tile, dtype, deterministic = CASES[i]
        start = time.perf_counter()
        tiles = PrefixTiles(*(tile,) * 6, num_stages=0)  # the stages the launch picks, as the dispatcher's tiles
        checked = errors(tiles, ranks, T, sizes, dtype, deterministic, device)
        if checked is None:
            raise SystemExit(f"case {i}: tiles of {tile} rows do not fit its block sizes")
        found, layout = checked
        worst = max(found.values())
        line = (f"{i} {label}: T={T} ranks={'|'.join(map(str, ranks))} tile={tile} {dtype} {layout} | "
                + " ".join(f"{k} {e:.1e}" for k, e in found.items())
                + f" | {'WRONG' if worst > 0.05 else 'ok'} ({time.perf_counter() - start:.0f} s)")
        print(line, flush=True)
        lines.append(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
