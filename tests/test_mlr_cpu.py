"""Tests for the fused C++ CPU kernel (structured_attention.ops.mlr.cpu) beyond its agreement with
the reference on the shared grid (tests/test_mlr_grid.py, backends ``cpu`` and ``dispatch``, in
float64, float32, bfloat16 and float16): extreme scores, causality, argument validation and memory
linear in T.
"""

from __future__ import annotations

import pytest
import torch

from mlr_cases import make_qkv
from structured_attention.functional import mlr_attention_reference
from structured_attention.ops.mlr import cpu as mlr_cpu
from structured_attention.ops.mlr.cpu import mlr_attention_cpu

pytestmark = pytest.mark.skipif(not mlr_cpu.available(), reason="the C++ kernel cannot be built here (no compiler or ninja)")


def test_extreme_scores_stay_finite():
    """Scores of about +-1e4: the online softmax never overflows."""
    q, k, v = make_qkv(1, 2, 2, 96, 8, 4, torch.float32, seed=2, requires_grad=True)
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
    q, k, v = make_qkv(1, 2, 2, 130, 8, 4, torch.float64, seed=3, requires_grad=True)
    out = mlr_attention_cpu(q, k, v, (4, 4), (256, 32))
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 70:] = 5.0
    v2[:, :, 70:] = -7.0
    out2 = mlr_attention_cpu(q, k2, v2, (4, 4), (256, 32))
    torch.testing.assert_close(out[:, :, :70], out2[:, :, :70], atol=1e-12, rtol=0)


def test_validation_names_the_parameter():
    q, k, v = make_qkv(1, 2, 2, 16, 8, 4, torch.float32, seed=4, requires_grad=True)
    with pytest.raises(ValueError, match="ranks"):
        mlr_attention_cpu(q, k, v, (4, 3))
    with pytest.raises(ValueError, match="block_sizes"):
        mlr_attention_cpu(q, k, v, (4, 4), (16, 6))


def test_memory_is_linear_in_T():
    """No allocation of T x T size, forward or backward: the kernel's own work buffers are a few
    tiles per thread, and every tensor it allocates is O(T)."""
    from torch.profiler import profile

    T, R = 2048, 16
    q, k, v = make_qkv(1, 2, 2, T, R, 16, torch.float32, seed=6, requires_grad=True)
    with profile(profile_memory=True) as prof:
        mlr_attention_cpu(q, k, v, (4, 4, 4, 4)).sum().backward()
    biggest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < biggest <= 4 * (2 * T * R * 4)  # a few (heads, T, R) tensors
    assert biggest < T * T * 4 / 16
