"""Tests for the Triton MLR attention kernels (structured_attention.ops.mlr.triton_general).

Without a CUDA device the kernels run on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, set before Triton is imported). Outputs and gradients are compared with the
exact reference :func:`structured_attention.functional.mlr_attention_reference` evaluated in float32.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install 'triton>=3.0')")

from structured_attention.functional import mlr_attention_reference as mlr_attention  # noqa: E402
from structured_attention.ops.mlr.contract import mlr_block_sizes  # noqa: E402
from structured_attention.ops.mlr.triton_general import mlr_attention_triton  # noqa: E402
from structured_attention.ops.mlr.triton_prefix import (  # noqa: E402
    PrefixTiles,
    mlr_attention_prefix,
    square_tiles,
)
from structured_attention.ops.mlr.triton_common import device_table  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)


def _inputs(B, H, Hk, T, R, Dv, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, R, generator=gen)
    k = torch.randn(B, Hk, T, R, generator=gen)
    v = torch.randn(B, Hk, T, Dv, generator=gen)
    do = torch.randn(B, H, T, Dv, generator=gen)
    return [x.to(device=DEVICE, dtype=dtype) for x in (q, k, v, do)]


def _check(B, H, Hk, T, ranks, block_sizes, causal, depth_normalize, Dv=16, dtype=torch.float32,
           scale=None, seed=0, **tiles):
    q, k, v, do = _inputs(B, H, Hk, T, sum(ranks), Dv, dtype, seed)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = mlr_attention_triton(q, k, v, ranks, block_sizes, causal=causal, scale=scale,
                               depth_normalize=depth_normalize, **tiles)
    grads = torch.autograd.grad(out, (q, k, v), do)

    qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = mlr_attention(qr, kr, vr, ranks, block_sizes, causal=causal, scale=scale,
                        depth_normalize=depth_normalize)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), do.float())

    assert out.dtype == dtype and out.shape == ref.shape
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == dtype and g.shape == x.shape
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(a.float(), b, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")


# (B, H, Hk, T, ranks, block_sizes, causal, depth_normalize, extra kwargs)
FP32_CASES = [
    # T=40: not a multiple of the tile (16) nor of the finest block (4); uneven ranks 16|8|8.
    pytest.param(1, 2, 2, 40, (16, 8, 8), (64, 16, 4), True, False, {}, id="causal-T40-16|8|8"),
    pytest.param(1, 2, 2, 40, (16, 8, 8), (64, 16, 4), False, False, {}, id="bidir-T40-16|8|8"),
    # GQA (H=4, Hk=2), 4 levels with ranks 8|4|2|2 (padded), depth_normalize.
    pytest.param(1, 4, 2, 40, (8, 4, 2, 2), (64, 16, 8, 2), True, True, {}, id="gqa-causal-dn-8|4|2|2"),
    pytest.param(1, 4, 2, 40, (8, 4, 2, 2), (40, 20, 10, 5), False, True, {}, id="gqa-bidir-dn-blocks40"),
    # Default block sizes T / 2^(l-1), non-power-of-two Dv, batch 2, custom scale.
    pytest.param(2, 2, 1, 32, (8, 8, 8, 8), None, False, True, {"Dv": 12, "scale": 0.3},
                 id="default-blocks-Dv12-scale"),
    # Single level (plain attention), non-power-of-two R.
    pytest.param(1, 2, 2, 24, (12,), None, True, False, {"Dv": 20}, id="single-level-R12"),
    # Non-power-of-two ranks 12|6|3, blocks not aligned with tiles, rectangular tiles.
    pytest.param(1, 2, 1, 45, (12, 6, 3), (48, 12, 3), True, False,
                 {"Dv": 8, "block_m": 32, "block_n": 16}, id="ranks12|6|3-tiles32x16"),
    pytest.param(1, 1, 1, 45, (12, 6, 3), (48, 12, 3), False, True,
                 {"block_m": 16, "block_n": 32}, id="ranks12|6|3-tiles16x32-bidir-dn"),
    # Finest block larger than a tile: many tiles skip the fine levels entirely.
    pytest.param(1, 1, 1, 64, (8, 8), (64, 32), True, False, {}, id="skip-fine-tiles"),
]


@pytest.mark.parametrize("B,H,Hk,T,ranks,block_sizes,causal,depth_normalize,extra", FP32_CASES)
def test_matches_reference_float32(B, H, Hk, T, ranks, block_sizes, causal, depth_normalize, extra):
    _check(B, H, Hk, T, ranks, block_sizes, causal, depth_normalize, **extra)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "H,Hk,T,ranks,block_sizes,causal,depth_normalize",
    [
        pytest.param(4, 2, 40, (16, 8, 8), (64, 16, 4), True, False, id="gqa-causal"),
        pytest.param(2, 2, 40, (8, 4, 2, 2), (64, 16, 8, 2), False, True, id="bidir-dn"),
    ],
)
def test_matches_reference_half(dtype, H, Hk, T, ranks, block_sizes, causal, depth_normalize):
    _check(1, H, Hk, T, ranks, block_sizes, causal, depth_normalize, dtype=dtype)


# Prefix-rank tiles: every fine block size is a multiple of the tiles, so each tile pair has one
# depth. (B, H, Hk, T, ranks, block_sizes, causal, depth_normalize, extra kwargs)
PREFIX_CASES = [
    # Default halving blocks (128/64/32/16), 8|8|8|8: chunks of 16 columns, depths 1-2 use the first,
    # depths 3-4 both.
    pytest.param(1, 2, 2, 128, (8, 8, 8, 8), None, True, False, {}, id="causal-8|8|8|8"),
    pytest.param(1, 2, 2, 128, (8, 8, 8, 8), None, False, True, {}, id="bidir-dn-8|8|8|8"),
    # GQA, T not a multiple of the tile, ranks that end inside a chunk.
    pytest.param(1, 4, 2, 72, (16, 8, 8), (128, 32, 16), True, True, {}, id="gqa-causal-dn-T72"),
    pytest.param(1, 4, 2, 72, (16, 8, 8), (128, 32, 16), False, False, {}, id="gqa-bidir-T72"),
    # Odd ranks and Dv; level 1 already needs two chunks (the first tier is empty).
    pytest.param(1, 2, 1, 50, (12, 6, 3), (64, 32, 16), True, False, {"Dv": 12}, id="ranks12|6|3-Dv12"),
    pytest.param(1, 2, 2, 100, (24, 24, 16), (128, 32, 16), True, False, {}, id="ranks24|24|16"),
    # R = 100: chunks of 32 columns; one level (plain attention) with batch 2.
    pytest.param(1, 2, 1, 80, (40, 30, 30), (96, 32, 16), False, True, {}, id="R100-bidir-dn"),
    pytest.param(2, 2, 2, 48, (40,), None, True, False, {}, id="single-level-R40"),
]


@pytest.mark.parametrize("B,H,Hk,T,ranks,block_sizes,causal,depth_normalize,extra", PREFIX_CASES)
def test_prefix_tiles_match_reference(B, H, Hk, T, ranks, block_sizes, causal, depth_normalize, extra):
    sizes = block_sizes or mlr_block_sizes(ranks, T)
    assert square_tiles(sizes[1:], 16) is not None  # this case takes the prefix-rank kernels
    _check(B, H, Hk, T, ranks, block_sizes, causal, depth_normalize, **extra)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_prefix_tiles_rectangular(causal):
    # Own tiles of 32 stepping over 16: the diagonal spans two steps.
    tiles = PrefixTiles(fwd_m=32, fwd_n=16, dkdv_n=32, dkdv_m=16, dq_m=32, dq_n=16)
    sizes = (128, 64, 32)
    assert tiles.fits(sizes[1:])
    q, k, v, do = _inputs(1, 2, 2, 96, 24, 16, torch.float32)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    ranks, scale = (8, 8, 8), 24 ** -0.5
    out = mlr_attention_prefix(q, k, v, ranks, sizes, causal, scale, not causal, tiles)
    grads = torch.autograd.grad(out, (q, k, v), do)
    qr, kr, vr = (x.detach().requires_grad_() for x in (q, k, v))
    ref = mlr_attention(qr, kr, vr, ranks, sizes, causal=causal, depth_normalize=not causal)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), do)
    for a, b in zip((out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_prefix_tiles_fit_only_aligned_blocks():
    assert square_tiles((32, 16), 64) == PrefixTiles(16, 16, 16, 16, 16, 16)
    assert square_tiles((96, 48), 64).fwd_m == 16
    assert square_tiles((24, 12), 64) is None
    assert not PrefixTiles(fwd_m=16, fwd_n=32).fits((64,))  # the step must divide the own tile
    assert not PrefixTiles().fits((32,))  # 64-row tiles straddle 32-row blocks


@pytest.mark.parametrize("sizes", [(64, 16), (64, 8)], ids=["prefix-rank", "general"])
def test_metadata_tables_are_made_once(sizes):
    # A repeated call reuses its device tables instead of copying them from the host again.
    q, k, v, _ = _inputs(1, 2, 2, 64, 16, 8, torch.float32)
    mlr_attention_triton(q, k, v, (8, 8), sizes)
    before = device_table.cache_info()
    mlr_attention_triton(q, k, v, (8, 8), sizes)
    after = device_table.cache_info()
    assert after.misses == before.misses and after.hits > before.hits


def test_forward_without_grad_and_prefix_consistency():
    # Block sizes fixed by the model: a prefix is scored exactly as inside the full sequence.
    q, k, v, _ = _inputs(1, 2, 2, 40, 16, 8, torch.float32)
    ranks, sizes = (8, 4, 4), (64, 16, 4)
    full = mlr_attention_triton(q, k, v, ranks, sizes)
    part = mlr_attention_triton(q[:, :, :23], k[:, :, :23], v[:, :, :23], ranks, sizes)
    torch.testing.assert_close(part, full[:, :, :23], atol=1e-5, rtol=1e-5)


def test_invalid_arguments_raise_value_error():
    q, k, v, _ = _inputs(1, 2, 2, 16, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="ranks"):
        mlr_attention_triton(q, k, v, (8, 4))
    with pytest.raises(ValueError, match="block_sizes"):
        mlr_attention_triton(q, k, v, (8, 8), (16, 6))
    with pytest.raises(ValueError, match="k"):
        mlr_attention_triton(q, k[:, :1].expand(1, 3, 16, 16), v, (16,))
    with pytest.raises(ValueError, match="dtype"):
        mlr_attention_triton(q.double(), k.double(), v.double(), (16,))


def test_has_triton_flag_and_clean_import_without_triton():
    from structured_attention.ops.mlr.dispatch import has_triton

    assert has_triton()
    # Without Triton the package imports, reports it, and CUDA-less calls never touch it.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from structured_attention.ops.mlr import mlr_attention, mlr_attention_reference\n"
        "from structured_attention.ops.mlr.dispatch import has_triton\n"
        "assert has_triton() is False\n"
        "q = torch.randn(1, 2, 8, 4)\n"
        "assert torch.allclose(mlr_attention(q, q, q, (4,)), mlr_attention_reference(q, q, q, (4,)), atol=1e-5)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
