"""Numerics of every attention path: scores of about +-1e4, float16 and bfloat16 inputs, rows that
see only themselves (the first causal token) and GQA. Outputs and gradients stay finite and agree
with a float64 computation of the same (rounded) inputs."""

from __future__ import annotations

import math

import pytest
import torch

from structured_attention.attention import build_attention
from structured_attention.functional import (
    mlr_attention,
    mlr_attention_reference,
    scaled_dot_product_attention,
    sliding_window_attention,
)
from structured_attention.ops.mlr import cpu as mlr_cpu
from structured_attention.ops.mlr.blocked import mlr_attention_blocked
from test_attention import SPECS

RANKS = (4, 2, 2)
SIZES = (64, 16, 4)


def _paths():
    paths = {
        "mlr_reference": lambda q, k, v, causal: mlr_attention_reference(q, k, v, RANKS, SIZES, causal),
        "mlr_blocked": lambda q, k, v, causal: mlr_attention_blocked(q, k, v, RANKS, SIZES, causal),
        "mlr_dispatched": lambda q, k, v, causal: mlr_attention(q, k, v, RANKS, SIZES, causal),
        "sdpa": lambda q, k, v, causal: scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]),
        "sliding_window": lambda q, k, v, causal: sliding_window_attention(q, k, v, 5, causal=causal),
    }
    if mlr_cpu.available():
        paths["mlr_cpu"] = lambda q, k, v, causal: mlr_cpu.mlr_attention_cpu(q, k, v, RANKS, SIZES, causal)
    return paths


PATHS = _paths()


def _exact(name, q, k, v, causal):
    """The float64 answer: the MLR reference, or plain (banded) softmax attention for the others."""
    q, k, v = (x.double() for x in (q, k, v))
    if name.startswith("mlr"):
        return mlr_attention_reference(q, k, v, RANKS, SIZES, causal)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    S = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i = torch.arange(q.shape[2])
    keep = torch.ones(len(i), len(i), dtype=torch.bool)
    if causal:
        keep &= i[None, :] <= i[:, None]
    if name == "sliding_window":
        keep &= (i[:, None] - i[None, :]).abs() <= 5
    return torch.softmax(S.masked_fill(~keep, float("-inf")), -1) @ v


def _inputs(T, H, Hk, dtype, magnitude, seed=0):
    g = torch.Generator().manual_seed(seed)
    R = sum(RANKS)
    q = torch.randn(1, H, T, R, generator=g) * magnitude
    k = torch.randn(1, Hk, T, R, generator=g) * magnitude
    v = torch.randn(1, Hk, T, 8, generator=g)
    return [x.to(dtype).requires_grad_() for x in (q, k, v)]


@pytest.mark.parametrize("name", sorted(PATHS))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_scores_of_1e4_stay_finite_and_exact(name, causal, heads):
    # |q| ~ |k| ~ 60 per dim over 8 dims: scores q.k / sqrt(8) of order 1e4 (checked below).
    q, k, v = _inputs(40, *heads, torch.float32, magnitude=60.0)
    assert (q[0, 0] @ k[0, 0].T).abs().max() / math.sqrt(8) > 5e3
    out = PATHS[name](q, k, v, causal)
    assert torch.isfinite(out).all()
    # float32 scores of 1e4 carry rounding errors of ~1e-3, which move near-tied weights that much
    torch.testing.assert_close(out.double(), _exact(name, q, k, v, causal), atol=5e-3, rtol=5e-3)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", sorted(PATHS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(name, dtype):
    q, k, v = _inputs(33, 4, 2, dtype, magnitude=3.0, seed=1)
    out = PATHS[name](q, k, v, True)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _exact(name, q, k, v, True), atol=3e-2, rtol=3e-2)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert all(g.dtype == dtype and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", sorted(PATHS))
def test_a_row_that_sees_only_itself(name):
    """The first token of a causal sequence attends to itself alone: its output is its value, even
    with huge scores; a one-token sequence likewise."""
    for T in (1, 12):
        q, k, v = _inputs(T, 4, 2, torch.float32, magnitude=100.0, seed=2)
        out = PATHS[name](q, k, v, True)
        torch.testing.assert_close(out[:, :, 0], v.repeat_interleave(2, 1)[:, :, 0], atol=1e-6, rtol=0)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_every_layer_kind_is_finite_with_huge_scores_and_in_half_precision(spec):
    torch.manual_seed(0)
    layer = build_attention(SPECS[spec], d_model=32, n_heads=4, max_seq_len=64)
    with torch.no_grad():  # blow up the query/key side: scores of order 1e4
        for name, p in layer.named_parameters():
            if p.dim() > 1 and "v_proj" not in name and "out_proj" not in name:
                p.mul_(60.0)
    x = torch.randn(2, 40, 32, requires_grad=True)
    out = layer(x)
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)
    # the first token sees itself only: decoding it alone gives the same output
    first = layer(x[:, :1])
    torch.testing.assert_close(first, out[:, :1], atol=1e-4, rtol=1e-4)
    for dtype in (torch.float16, torch.bfloat16):
        half = build_attention(SPECS[spec], d_model=32, n_heads=4, max_seq_len=64).to(dtype)
        y = half(torch.randn(2, 40, 32, dtype=dtype))
        assert y.dtype == dtype and torch.isfinite(y).all(), dtype
