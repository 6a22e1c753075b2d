"""Tests for the tiled CPU fast path structured_attention.ops.mlr.blocked.

Everything is checked against the exact reference ``mlr_attention`` in float64 (outputs and all
three gradients through autograd), plus a clock-free memory check via the profiler's allocation
records.
"""

from __future__ import annotations

import pytest
import torch

import structured_attention.ops.mlr.blocked as mb
from structured_attention.functional import mlr_attention_reference as mlr_attention
from structured_attention.ops.mlr.blocked import mlr_attention_blocked

TOL = 1e-9


def _inputs(B, H, Hk, T, R, Dv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, R, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(B, Hk, T, R, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(B, Hk, T, Dv, generator=g, dtype=dtype).requires_grad_()
    return q, k, v


def _compare(B, H, Hk, T, ranks, Dv, tile=None, **kw):
    q, k, v = _inputs(B, H, Hk, T, sum(ranks), Dv, seed=T + len(ranks))
    ref = mlr_attention(q, k, v, ranks, **kw)
    grad = torch.randn_like(ref)
    gref = torch.autograd.grad(ref, (q, k, v), grad)
    out = mlr_attention_blocked(q, k, v, ranks, tile=tile, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=TOL, rtol=0)
    gout = torch.autograd.grad(out, (q, k, v), grad)
    for name, a, b in zip("qkv", gout, gref):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, atol=TOL, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")


CONFIGS = [
    # (ranks, block_sizes): uneven ranks, ratio-2 / ratio-4 / mixed nesting, one level
    ((2, 3, 1), (128, 32, 8)),
    ((1, 2, 3, 2), (256, 64, 16, 4)),
    ((4, 4), (96, 48)),
    ((3, 1, 2), (128, 64, 16)),
    ((3,), (128,)),
]


@pytest.mark.parametrize("T", [1, 7, 40, 64, 96])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("depth_normalize", [False, True])
def test_matches_reference_custom_blocks(T, causal, depth_normalize):
    for i, (ranks, sizes) in enumerate(CONFIGS):
        tile = (None, 16, 5)[i % 3]  # default (block-aligned), aligned, and misaligned tiles
        _compare(1, 4, 2, T, ranks, 5, tile=tile, block_sizes=sizes, causal=causal,
                 depth_normalize=depth_normalize)


@pytest.mark.parametrize("T", [8, 40, 64, 96])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tile", [None, 4, 24, 128])
def test_matches_reference_default_blocks(T, causal, tile):
    _compare(2, 2, 2, T, (2, 2, 1, 3), 3, tile=tile, causal=causal)  # 4 levels: 8 | T needed


def test_gqa_and_scale_and_depth_normalize():
    _compare(2, 6, 3, 48, (2, 3, 3), 4, tile=8, block_sizes=(64, 16, 4), scale=0.7,
             depth_normalize=True)
    _compare(1, 4, 1, 33, (2, 2), 7, tile=None, block_sizes=(40, 8), causal=False)


def test_low_precision_runs_in_float32():
    q, k, v = _inputs(1, 2, 2, 32, 8, 8, dtype=torch.bfloat16)
    out = mlr_attention_blocked(q, k, v, (4, 4))
    ref = mlr_attention(q, k, v, (4, 4))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("causal", [True, False])
def test_head_threads_path(monkeypatch, causal):
    """The heads-over-Python-threads path (normally only for T >= 2048) forced on at small T."""
    monkeypatch.setattr(mb, "_THREADED_MIN_T", 1)
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _compare(1, 5, 5, 64, (2, 3, 1), 4, tile=16, block_sizes=(64, 32, 8), causal=causal)
        _compare(2, 4, 2, 40, (2, 2), 3, tile=None, block_sizes=(64, 16), causal=causal,
                 depth_normalize=True)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(prev)


def test_float32_matches_and_threads_restored(monkeypatch):
    monkeypatch.setattr(mb, "_THREADED_MIN_T", 1)
    before = torch.get_num_threads()
    q, k, v = _inputs(1, 4, 4, 256, 16, 16, dtype=torch.float32)
    out = mlr_attention_blocked(q, k, v, (4, 4, 4, 4), tile=32)
    ref = mlr_attention(q, k, v, (4, 4, 4, 4))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.autograd.grad(out.square().sum(), (q, k, v))
    gr = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(g, gr):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ranks=(4, 3)), "ranks"),
        (dict(ranks=(4, 4), block_sizes=(16, 6)), "block_sizes"),
        (dict(ranks=(4, 4), block_sizes=(8, 4)), "block_sizes"),  # s_1 < T
        (dict(ranks=(4, 4), tile=0), "tile"),
        (dict(ranks=(4, 4), scale=-1.0), "scale"),
        (dict(ranks=(4, 4), causal=1), "causal"),
    ],
)
def test_validation(kwargs, match):
    q, k, v = _inputs(1, 2, 2, 16, 8, 4)
    with pytest.raises(ValueError, match=match):
        mlr_attention_blocked(q, k, v, **kwargs)


def test_default_blocks_need_divisible_T():
    q, k, v = _inputs(1, 1, 1, 6, 8, 4)
    with pytest.raises(ValueError, match="block_sizes"):
        mlr_attention_blocked(q, k, v, (2, 2, 2, 2))


def test_memory_is_linear_in_T():
    """No allocation of T x T size, forward or backward (the reference makes several)."""
    from torch.profiler import profile

    T, R = 2048, 16
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # single thread: every allocation is recorded on this thread
    try:
        q, k, v = _inputs(1, 2, 2, T, R, 16, dtype=torch.float32)
        with profile(profile_memory=True) as prof:
            mlr_attention_blocked(q, k, v, (4, 4, 4, 4), tile=64).sum().backward()
    finally:
        torch.set_num_threads(prev)
    biggest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < biggest <= 2 * 64 * T * 4 * 2  # O(heads * tile * T), far below one T x T matrix
    assert biggest < T * T * 4 / 4
