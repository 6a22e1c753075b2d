"""Tests for the fused C++ CPU kernel (structured_attention.ops.mlr.cpu).

Outputs and all three gradients are compared with the exact reference
``functional.mlr_attention_reference`` in float64 (the kernel's double instantiation runs the same
tiling, masks and online softmax as the float one, with exact loops in place of oneDNN's GEMM) and
in float32 (oneDNN's GEMM and the vectorised exponential) against a float64 reference.
"""

from __future__ import annotations

import pytest
import torch

from structured_attention.functional import mlr_attention_reference
from structured_attention.ops.mlr import cpu as mlr_cpu
from structured_attention.ops.mlr.cpu import mlr_attention_cpu

pytestmark = pytest.mark.skipif(not mlr_cpu.available(), reason="the C++ kernel cannot be built here (no compiler or ninja)")

# (B, H, Hk, T, ranks, block_sizes): default and custom nesting (ratios 2, 3, 4, 8), GQA, one level,
# T not a multiple of the finest block, T = 1, a sequence longer than one key piece (256).
CASES = [
    (1, 2, 2, 64, (8, 4, 4), None),
    (2, 4, 2, 40, (8, 4, 4), (64, 16, 4)),
    (1, 2, 1, 37, (6, 3, 3), (40, 8, 2)),
    (1, 2, 2, 33, (4, 4), (33, 11)),
    (1, 1, 1, 200, (8,), None),
    (1, 2, 2, 256, (4, 4, 4, 4), None),
    (1, 3, 3, 100, (5, 3), (128, 8)),
    (2, 2, 2, 96, (4, 2, 2), (96, 24, 3)),
    (1, 2, 2, 1, (4, 4), (8, 2)),
    (1, 2, 2, 700, (8, 4, 4), (1024, 128, 32)),
]


def _inputs(B, H, Hk, T, R, Dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
            for shape in ((B, H, T, R), (B, Hk, T, R), (B, Hk, T, Dv))]


def _compare(case, causal, depth_normalize, dtype, tol, scale=None, Dv=5):
    B, H, Hk, T, ranks, sizes = case
    q, k, v = _inputs(B, H, Hk, T, sum(ranks), Dv, dtype, seed=T + len(ranks))
    out = mlr_attention_cpu(q, k, v, ranks, sizes, causal, scale, depth_normalize)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = mlr_attention_reference(q64, k64, v64, ranks, sizes, causal, scale, depth_normalize)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    want = torch.autograd.grad(ref, (q64, k64, v64), grad)
    for name, a, b in zip("qkv", got, want):
        assert a.dtype == dtype and a.shape == b.shape
        torch.testing.assert_close(a.double(), b, atol=tol, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[3]}-{'|'.join(map(str, c[4]))}")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("depth_normalize", [False, True])
def test_float64_matches_reference(case, causal, depth_normalize):
    _compare(case, causal, depth_normalize, torch.float64, 1e-10)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[3]}-{'|'.join(map(str, c[4]))}")
@pytest.mark.parametrize("causal", [True, False])
def test_float32_matches_reference(case, causal):
    _compare(case, causal, True, torch.float32, 2e-5)
    _compare(case, causal, False, torch.float32, 2e-5, scale=0.7, Dv=16)


def test_long_sequence_default_blocks_float32():
    """Eight levels of rank 8 at T = 1024: many key pieces per tile, all prefix widths."""
    _compare((1, 2, 2, 1024, (8,) * 8, None), True, False, torch.float32, 1e-5, Dv=64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_compute_in_float32(dtype):
    q, k, v = _inputs(1, 2, 2, 48, 8, 8, dtype, seed=1)
    out = mlr_attention_cpu(q, k, v, (4, 4), (64, 16))
    ref = mlr_attention_reference(q.double(), k.double(), v.double(), (4, 4), (64, 16))
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == dtype


def test_extreme_scores_stay_finite():
    """Scores of about +-1e4: the online softmax never overflows."""
    q, k, v = _inputs(1, 2, 2, 96, 8, 4, torch.float32, seed=2)
    with torch.no_grad():
        q.mul_(300.0)
        k.mul_(300.0)
    out = mlr_attention_cpu(q, k, v, (4, 4), (128, 32), scale=1.0)
    ref = mlr_attention_reference(q.double(), k.double(), v.double(), (4, 4), (128, 32), scale=1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=0)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


def test_causal_rows_ignore_future_keys():
    q, k, v = _inputs(1, 2, 2, 130, 8, 4, torch.float64, seed=3)
    out = mlr_attention_cpu(q, k, v, (4, 4), (256, 32))
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 70:] = 5.0
    v2[:, :, 70:] = -7.0
    out2 = mlr_attention_cpu(q, k2, v2, (4, 4), (256, 32))
    torch.testing.assert_close(out[:, :, :70], out2[:, :, :70], atol=1e-12, rtol=0)


def test_validation_names_the_parameter():
    q, k, v = _inputs(1, 2, 2, 16, 8, 4, torch.float32, seed=4)
    with pytest.raises(ValueError, match="ranks"):
        mlr_attention_cpu(q, k, v, (4, 3))
    with pytest.raises(ValueError, match="block_sizes"):
        mlr_attention_cpu(q, k, v, (4, 4), (16, 6))


def test_memory_is_linear_in_T():
    """No allocation of T x T size, forward or backward: the kernel's own work buffers are a few
    tiles per thread, and every tensor it allocates is O(T)."""
    from torch.profiler import profile

    T, R = 2048, 16
    q, k, v = _inputs(1, 2, 2, T, R, 16, torch.float32, seed=6)
    with profile(profile_memory=True) as prof:
        mlr_attention_cpu(q, k, v, (4, 4, 4, 4)).sum().backward()
    biggest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < biggest <= 4 * (2 * T * R * 4)  # a few (heads, T, R) tensors
    assert biggest < T * T * 4 / 16
