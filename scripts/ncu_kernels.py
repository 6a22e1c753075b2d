"""One call of each kernel under comparison, for Nsight Compute's per-kernel profile.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \
        python3 scripts/ncu_kernels.py decode|prefill

The kernels run twice first (Triton compiles, SDPA picks its kernel), then once between
``cudaProfilerStart`` and ``cudaProfilerStop``, so ncu sees only that call:

- ``decode``: one step's attention at a 16k cache (batch 16, 8 heads, bfloat16), MLR
  ``8|8|8|8|8|8|8|8`` through the Triton decoding kernel and SDPA's flash
  kernel over 64-dim keys;
- ``prefill``: the causal forward at T = 8192 (batch 1, 8 heads), the prefix-rank Triton kernel
  and SDPA's flash kernel, the shapes of ``sattn bench mlr``.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from structured_attention.ops.mlr.contract import check_mlr_arguments
from structured_attention.ops.mlr.triton_decode import mlr_decode_triton
from structured_attention.ops.mlr.triton_prefix import PrefixTiles, mlr_attention_prefix
from tune_mlr_triton import DECODE_RANKS, decode_case  # scripts/ is on the path when run as a script


def _decode_cases() -> dict:
    q, keys, starts, v, k = decode_case()
    return {"mlr": lambda: mlr_decode_triton(q, keys, starts, v, DECODE_RANKS, 0.125),
            "flash": lambda: F.scaled_dot_product_attention(q, k, v)}


def _prefill_cases() -> dict:
    T = 8192
    ranks = DECODE_RANKS  # the same 8 levels of rank 8
    q, k = (torch.randn(1, 8, T, sum(ranks), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, 8, T, 64, device="cuda", dtype=torch.bfloat16)
    ranks, sizes, _ = check_mlr_arguments(q, k, v, ranks, None, True, None, False)
    scale = 1 / math.sqrt(sum(ranks))
    tiles = PrefixTiles(num_stages=0)  # the dispatcher's tiles here (the stages the launch picks)
    return {"mlr": lambda: mlr_attention_prefix(q, k, v, ranks, sizes, True, scale, False, tiles),
            "flash": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=("decode", "prefill"))
    args = ap.parse_args()
    torch.manual_seed(0)
    cases = _decode_cases() if args.case == "decode" else _prefill_cases()
    with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for _ in range(2):
            for fn in cases.values():
                fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for fn in cases.values():
            fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one call each of: {', '.join(cases)}")


if __name__ == "__main__":
    main()
