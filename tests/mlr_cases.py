"""Shared helpers of the MLR attention tests: inputs, the compressed cache, the naive definition,
the per-dtype tolerances and a pairwise (all-pairs) selection of a parameter grid.

Used by tests/test_mlr_grid.py (every backend against the reference) and by the per-backend test
files for the tests that check something else (memory, validation, threading, dispatch choice...).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

import torch

from structured_attention.ops.mlr import mlr_attention_reference
from structured_attention.ops.mlr.contract import mlr_block_sizes

DTYPE_IDS = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


def make_qkv(B, H, Hk, T, R, Dv, dtype=torch.float64, seed=0, *, requires_grad=False, dout=False, device="cpu"):
    """``q (B, H, T, R)``, ``k (B, Hk, T, R)``, ``v (B, Hk, T, Dv)`` (and, with ``dout``, an output
    gradient ``(B, H, T, Dv)``), drawn in float64 and rounded to ``dtype``, so that every dtype sees
    the same numbers and a float64 copy of the rounded inputs is the exact problem they pose."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, T, R), (B, Hk, T, R), (B, Hk, T, Dv)] + ([(B, H, T, Dv)] if dout else [])
    xs = [torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype) for shape in shapes]
    if requires_grad:
        for x in xs[:3]:
            x.requires_grad_()
    return xs


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` inside, the caller's after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class CacheStep:
    """``t`` new queries at the end of a ``T``-token sequence, and the cache they attend to."""

    q_new: torch.Tensor  # (B, H, t, R)
    keys: list[torch.Tensor]  # per level, (B, Hk, T - starts[l], r_l)
    starts: list[int]
    v: torch.Tensor  # (B, Hk, T, Dv)
    sizes: tuple[int, ...]
    q: torch.Tensor  # the whole sequence, (B, H, T, R)
    k: torch.Tensor  # (B, Hk, T, R)


def compressed_cache(k, ranks, sizes, t, capacity=0):
    """The per-level keys the MLR layer holds when ``t`` new tokens end a ``T``-token sequence, as
    attention/mlr.py and attention/cache.py build them: level 1 keeps every key; level ``l`` keeps
    the keys from the start of the first new query's level-``l`` block (``p - p % s_l``, ``p = T - t``:
    the layer drops the rest after each step), the new tokens' own keys included. Each level is a
    view into a buffer with ``capacity`` spare slots, as a ``TokenBuffer`` holds it."""
    B, Hk, T, _ = k.shape
    p = T - t
    starts = [0] + [p - p % s for s in sizes[1:]]
    keys = []
    for k_l, start in zip(k.split(list(ranks), dim=-1), starts):
        held = k_l[:, :, start:]
        buffer = torch.empty(B, Hk, held.shape[2] + capacity, held.shape[3], dtype=k.dtype, device=k.device)
        buffer[:, :, : held.shape[2]] = held
        keys.append(buffer[:, :, : held.shape[2]])
    return keys, starts


def cache_step(B, H, Hk, T, ranks, block_sizes, Dv, dtype=torch.float64, *, t=1, seed=0, capacity=0, device="cpu"):
    """A whole sequence drawn as :func:`make_qkv` does, its last ``t`` queries and the compressed cache
    (:func:`compressed_cache`) they meet, all in ``dtype``."""
    q, k, v = make_qkv(B, H, Hk, T, sum(ranks), Dv, dtype, seed, device=device)
    sizes = mlr_block_sizes(ranks, T, block_sizes)
    keys, starts = compressed_cache(k, ranks, sizes, t, capacity)
    return CacheStep(q[:, :, T - t :], keys, starts, v, sizes, q, k)


# --------------------------------------------------------------------------------------------------
# The naive definition (one dense mask per level), independent of the reference's code
# --------------------------------------------------------------------------------------------------


def naive_mlr(q, k, v, ranks, block_sizes=None, causal=True, scale=None, depth_normalize=False):
    """MLR attention written as its definition: a full ``T x T`` block mask per level, explicit
    ``repeat_interleave`` for GQA, an explicit causal mask; in ``q``'s dtype throughout."""
    B, H, T, R = q.shape
    Hk = k.shape[1]
    group = H // Hk
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    L = len(ranks)
    if block_sizes is None:
        block_sizes = [T // 2**l for l in range(L)]
    if scale is None:
        scale = 1.0 / math.sqrt(R)
    pos = torch.arange(T)
    S = torch.zeros(B, H, T, T, dtype=q.dtype)
    depth = torch.zeros(T, T, dtype=q.dtype)
    start = 0
    for r, s in zip(ranks, block_sizes):
        ql, kl = q[..., start : start + r], k[..., start : start + r]
        start += r
        same_block = (pos[:, None] // s) == (pos[None, :] // s)
        S = S + torch.where(same_block, ql @ kl.transpose(-1, -2), torch.zeros((), dtype=q.dtype))
        depth = depth + same_block.to(q.dtype)
    S = scale * S
    if depth_normalize:
        S = S / depth
    if causal:
        allowed = pos[None, :] <= pos[:, None]
        S = S.masked_fill(~allowed, float("-inf"))
    return torch.softmax(S, dim=-1) @ v


# --------------------------------------------------------------------------------------------------
# Tolerances
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tol:
    """``|got - want| <= atol * scale + rtol * |want|`` elementwise, with ``scale`` the tensor's
    largest magnitude (at least 1): a low-precision kernel errs in proportion to the sums it rounds,
    so a gradient entry near zero next to entries of 10 may carry an error of their size."""

    atol: float
    rtol: float


# Against the float64 reference of the same (rounded) inputs, per dtype of the inputs. Two columns:
# "fused": any backend; the Triton kernels round the softmax weights (and the backward's dS) to the
#   input dtype before their matmuls, as flash attention does, so half inputs lose a few units in
#   the last place of the sums. In Triton's interpreter (no GPU) a float32 -> bfloat16 cast
#   truncates instead of rounding to nearest, which about doubles the bfloat16 errors there;
# "rounded once": backends that, by the contract's dtype policy, compute half inputs entirely in
#   float32 and round only the result (and the gradients) to the input dtype: within one unit in the
#   last place (2^-7 relative for bfloat16, 2^-10 for float16; rounding alone takes up to half of
#   it, float32 noise can push it to the neighbour). A softmax or an A V product computed in half
#   precision misses this by far (the Triton kernels by 10-250x).
# Measured worst error / tolerance over the grid (seeded, so deterministic; Triton in the
# interpreter over the full product): float64 < 1e-3; float32 0.3; fused bfloat16 0.6 (Triton,
# the scale-3 case) and float16 0.3; rounded once 0.5.
TOLERANCES: dict[torch.dtype, tuple[Tol, Tol]] = {
    #                fused                      rounded once
    torch.float64: (Tol(1e-10, 1e-10), Tol(1e-10, 1e-10)),
    torch.float32: (Tol(2e-5, 2e-5), Tol(2e-5, 2e-5)),
    torch.bfloat16: (Tol(4e-2, 2e-2), Tol(1e-5, 2.0**-7)),
    torch.float16: (Tol(5e-3, 5e-3), Tol(1e-5, 2.0**-10)),
}


def tolerance(dtype: torch.dtype, rounded_once: bool) -> Tol:
    return TOLERANCES[dtype][1 if rounded_once else 0]


def assert_matches(got, want, dtype, what, rounded_once=False):
    """``got`` (in ``dtype``, any device) against the float64 ``want``, at the tolerance of the table."""
    tol = tolerance(dtype, rounded_once)
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, atol=tol.atol * scale, rtol=tol.rtol,
                               msg=lambda m: f"{what} ({DTYPE_IDS[dtype]}, scale {scale:.3g}): {m}")


# --------------------------------------------------------------------------------------------------
# Pairwise selection
# --------------------------------------------------------------------------------------------------


def value_pairs(combo: Sequence[Hashable]) -> set:
    """The pairs of values of two factors a combo holds, as ``(i, value_i, j, value_j)``."""
    return {(i, combo[i], j, combo[j]) for i, j in itertools.combinations(range(len(combo)), 2)}


def pairwise(combos: Sequence[Sequence[Hashable]]) -> list[tuple]:
    """A subset of ``combos`` (tuples of factor values) that holds every pair of values of two
    factors that some combo holds ("all-pairs" coverage): greedily the combo covering the most pairs
    not yet covered, the first such in order (so the choice is deterministic)."""
    combos = [tuple(c) for c in combos]
    pairs = [value_pairs(c) for c in combos]
    uncovered = set().union(*pairs) if pairs else set()
    chosen = []
    while uncovered:
        best = max(range(len(combos)), key=lambda i: len(pairs[i] & uncovered))
        chosen.append(combos[best])
        uncovered -= pairs[best]
    return chosen


# --------------------------------------------------------------------------------------------------
# One full-attention call against the reference
# --------------------------------------------------------------------------------------------------


def check_against_reference(fn, B, H, Hk, T, ranks, Dv, dtype=torch.float64, seed=0, rounded_once=True, **kwargs):
    """``fn(q, k, v, ranks, **kwargs)`` against ``mlr_attention_reference`` in float64 of the same
    (rounded) inputs: the output and the gradients ``dq, dk, dv``, at the tolerance table's entry."""
    q, k, v, do = make_qkv(B, H, Hk, T, sum(ranks), Dv, dtype, seed, dout=True)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    x64 = [t.double().requires_grad_() for t in (q, k, v)]
    out = fn(*x, ranks, **kwargs)
    ref = mlr_attention_reference(*x64, ranks, **kwargs)
    got = (out, *torch.autograd.grad(out, x, do))
    want = (ref, *torch.autograd.grad(ref, x64, do.double()))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert_matches(a, b, dtype, name, rounded_once)
