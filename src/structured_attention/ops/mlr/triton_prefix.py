"""Triton kernels for MLR attention on tiles of one depth ("prefix-rank tiles").

Where every fine block size is a multiple of the tile sizes, each (query tile, key tile) pair lies
inside one block of every level, so all its scores share one depth ``d``: the tile's score is one
matmul over the prefix ``R_d = r_1 + ... + r_d`` of the head dims (docs/design.md), with no per-level
masks. The head dims are cut into ``NCH <= 4`` chunks of ``CH`` columns, and a tile multiplies only
the chunks its prefix reaches, the last one cut at ``R_d``. The cut is applied to the products (the
queries operand, held in registers, for the scores; the last chunk's product for the gradients),
not to the loads: a walked tile's chunks are loaded with a mask that changes only with the rows,
so Triton's software pipelining issues them a tile ahead, into shared memory, from where they go
to the matrix units as loaded.

Blocks are nested, so walking from a program's own tile outwards the depth only falls: the tiles
that need ``t`` chunks form one run on each side (a *tier*), bounded by the block of size ``S_t``
(the block of the shallowest level whose prefix passes ``(t - 1) * CH`` columns) that holds the own
tile. Each tier is its own loop with the chunk count a compile-time constant, so the loops carry no
run-time branches. The diagonal tiles (depth ``L``, full rank) are the only ones that need the
causal mask.

*Sub-tile levels*: the levels whose blocks are not multiples of the tiles (short sequences, whose
finest blocks are a few rows, or lengths such as ``3 * 2^k``) come after the *coarse* ones, since
blocks are nested. A tile pair shares one of their blocks only within the blocks of the coarsest
of them that meet the own tile: a few *near* tiles around the diagonal. The tiers above walk the
coarse levels alone up to the near tiles; a near tile pair adds each sub-tile level's columns
(a product of the chunks its columns fall in, with the other columns zeroed) where row and column
share the level's block, so each of its pairs has its own depth. Without sub-tile levels the near
tiles are the diagonal ones. The near tiles' loops are not software-pipelined (``num_stages=1``):
with one sub-tile level Triton 3.6 pipelined them (the walked tiles loaded ahead into shared memory
that the level's product reads inside a branch) and an H200 computed wrong values; with two or
more, the level loop inside kept them unpipelined, and the values right. Unpipelined, one level
compiles to the structure of two (sm_90 TTGIR); ``scripts/check_prefix_tilings.py`` checks it on a
GPU. They are a tile or two per program, so loading ahead buys little there.

The forward stores the row log-sum-exp in base 2 for the backward; the backward is the
flash-attention backward, recomputing the scores tier by tier: one kernel for ``dK, dV`` that loops
over the query heads of a GQA group and adds each walked query tile's ``dQ`` (its prefix-rank
chunks) into a float32 buffer atomically; under ``torch.use_deterministic_algorithms(True)`` a
separate ``dQ`` kernel instead. Numerics match :mod:`.triton_general`, which takes the calls whose
sub-tile blocks reach further from the diagonal.

Packed documents are segments of one launch, as in :mod:`.triton_general`: a program reads its
segment's row, start and length from a table, and every position inside is local to the segment,
so a document's tile pairs have the depths a whole row's would.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .contract import VARLEN_TAGS, differentiable_ops, eager_autograd
from .triton_common import (INTERPRETED, blocks_meet, cdiv, cuda_properties, dense_rows, device_table, dot, dot_acc,
                            empty_rows, launch, load_segment, pow2, row_dots, segments_of_documents, segments_of_rows)

__all__ = ["HOPPER_SHARED_PER_BLOCK", "PrefixTiles", "miscompiled_on_cuda", "pipeline_stages", "square_tiles",
           "mlr_attention_prefix"]


# --------------------------------------------------------------------------------------------------
# Tile helpers
# --------------------------------------------------------------------------------------------------


@triton.jit
def _depth_rank(x0, y0, fsize, frank, R1):
    """Depth and prefix rank of the tile pair starting at rows ``x0`` / columns ``y0``."""
    same = ((x0 // fsize) == (y0 // fsize)) & (frank > 0)
    depth = 1 + tl.sum(same.to(tl.int32), axis=0)
    rank = R1 + tl.sum(tl.where(same, frank, 0), axis=0)
    return depth, rank


@triton.jit
def _depth_rank_near(x0, y0, fsize, frank, R1, RC, NEAR: tl.constexpr):
    """:func:`_depth_rank`, or for a near tile pair (inside the own tile's block of every coarse
    level) the coarse depth and prefix ``RC``: its sub-tile levels are added pair by pair."""
    if NEAR:
        depth = 1 + tl.sum((frank > 0).to(tl.int32), axis=0)
        rank = RC
    else:
        depth, rank = _depth_rank(x0, y0, fsize, frank, R1)
    return depth, rank


@triton.jit
def _depth_scale(scale, depth, DEPTH_NORM: tl.constexpr):
    """The score scale of a tile pair: divided by its depth under ``depth_normalize``."""
    if DEPTH_NORM:
        scale = scale / depth
    return scale


@triton.jit
def _chunk(base, offs, ok, stride_t, C: tl.constexpr, CH: tl.constexpr, R):
    """Columns ``[C * CH, (C + 1) * CH)`` of rows ``offs``, zero from the head's ``R`` columns on.

    The mask changes with nothing but the rows, so the loads of a walk are issued ahead of the tile
    that uses them (Triton's software pipelining into shared memory); a tile pair's prefix rank is
    applied to the products instead (:func:`_operands`, :func:`_grad_into`)."""
    cols = C * CH + tl.arange(0, CH)
    return tl.load(base + offs[:, None] * stride_t + cols[None, :],
                   mask=ok[:, None] & (cols < R)[None, :], other=0.0)


@triton.jit
def _chunks(base, offs, ok, stride_t, R, CH: tl.constexpr, NC: tl.constexpr):
    """The first ``NC`` chunks of rows ``offs`` (the unused ones repeat the first)."""
    c0 = _chunk(base, offs, ok, stride_t, 0, CH, R)
    c1 = c0
    c2 = c0
    c3 = c0
    if NC > 1:
        c1 = _chunk(base, offs, ok, stride_t, 1, CH, R)
    if NC > 2:
        c2 = _chunk(base, offs, ok, stride_t, 2, CH, R)
    if NC > 3:
        c3 = _chunk(base, offs, ok, stride_t, 3, CH, R)
    return c0, c1, c2, c3


@triton.jit
def _pick(x0, x1, x2, x3, C: tl.constexpr):
    """Chunk ``C`` of four (a compile-time choice)."""
    x = x0
    if C == 1:
        x = x1
    if C == 2:
        x = x2
    if C == 3:
        x = x3
    return x


@triton.jit
def _columns(x, C: tl.constexpr, CH: tl.constexpr, lo, hi):
    """Chunk ``C`` of some rows (or of their gradient) with every column outside ``[lo, hi)`` zeroed."""
    cols = C * CH + tl.arange(0, CH)
    return tl.where(((cols >= lo) & (cols < hi))[None, :], x, 0.0)


@triton.jit
def _operands(own, walked, C: tl.constexpr, CH: tl.constexpr, lo, hi, MASK: tl.constexpr, OWN_ROWS: tl.constexpr):
    """Chunk ``C``'s (queries, keys) operands: the own chunk first when the own rows are queries
    (``OWN_ROWS``), else the walked one; with ``MASK`` the queries' columns outside ``[lo, hi)``
    zeroed. The queries are the operand held in registers, so the keys reach the matrix units as
    they were loaded, from shared memory."""
    if OWN_ROWS:
        a = own
        b = walked
    else:
        a = walked
        b = own
    if MASK:
        a = _columns(a, C, CH, lo, hi)
    return a, b


@triton.jit
def _prefix_scores(o0, o1, o2, o3, w0, w1, w2, w3, rank, NC: tl.constexpr, CH: tl.constexpr,
                   OWN_ROWS: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Queries x keys scores over the first ``rank`` columns, of the own chunks ``o*`` and the walked
    ones ``w*``: ``NC`` chunk products, the last one cut at ``rank`` (a tile pair that needs ``NC``
    chunks has more than ``NC - 1`` chunks' columns, so only the last one is cut)."""
    a, b = _operands(o0, w0, 0, CH, 0, rank, NC == 1, OWN_ROWS)
    s = dot(a, tl.trans(b), PREC, UPCAST)
    for C in tl.static_range(1, NC):
        a, b = _operands(_pick(o0, o1, o2, o3, C), _pick(w0, w1, w2, w3, C), C, CH, 0, rank, C == NC - 1, OWN_ROWS)
        s = dot_acc(a, tl.trans(b), s, PREC, UPCAST)
    return s


@triton.jit
def _grad_into(g0, g1, g2, g3, a, w, C: tl.constexpr, CH: tl.constexpr, lo, hi, MASK: tl.constexpr,
               PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Add ``a @ w`` into gradient chunk ``C``; with ``MASK`` only its columns in ``[lo, hi)`` (the
    product is cut, not ``w``, which reaches the matrix units as loaded)."""
    if MASK:
        x = _columns(dot(a, w, PREC, UPCAST), C, CH, lo, hi)
        if C == 0:
            g0 += x
        if C == 1:
            g1 += x
        if C == 2:
            g2 += x
        if C == 3:
            g3 += x
    else:
        if C == 0:
            g0 = dot_acc(a, w, g0, PREC, UPCAST)
        if C == 1:
            g1 = dot_acc(a, w, g1, PREC, UPCAST)
        if C == 2:
            g2 = dot_acc(a, w, g2, PREC, UPCAST)
        if C == 3:
            g3 = dot_acc(a, w, g3, PREC, UPCAST)
    return g0, g1, g2, g3


@triton.jit
def _prefix_grads(g0, g1, g2, g3, a, w0, w1, w2, w3, rank, NC: tl.constexpr, CH: tl.constexpr,
                  PREC: tl.constexpr, UPCAST: tl.constexpr):
    """The own rows' gradient chunks plus ``a`` (``dS`` or ``dS^T``) times the walked chunks, over
    the first ``rank`` columns (the last of ``NC`` chunks cut, as in :func:`_prefix_scores`)."""
    for C in tl.static_range(0, NC):
        g0, g1, g2, g3 = _grad_into(g0, g1, g2, g3, a, _pick(w0, w1, w2, w3, C), C, CH, 0, rank, C == NC - 1,
                                    PREC, UPCAST)
    return g0, g1, g2, g3


@triton.jit
def _store_chunks(ptr, ok, R, c0, c1, c2, c3, CH: tl.constexpr, NCH: tl.constexpr):
    """Store the gradient chunks of the program's own rows (``ptr``: their row starts)."""
    cols = tl.arange(0, CH)
    tl.store(ptr + cols[None, :], c0.to(ptr.dtype.element_ty), mask=ok[:, None] & (cols < R)[None, :])
    if NCH > 1:
        tl.store(ptr + CH + cols[None, :], c1.to(ptr.dtype.element_ty), mask=ok[:, None] & (CH + cols < R)[None, :])
    if NCH > 2:
        tl.store(ptr + 2 * CH + cols[None, :], c2.to(ptr.dtype.element_ty),
                 mask=ok[:, None] & (2 * CH + cols < R)[None, :])
    if NCH > 3:
        tl.store(ptr + 3 * CH + cols[None, :], c3.to(ptr.dtype.element_ty),
                 mask=ok[:, None] & (3 * CH + cols < R)[None, :])


@triton.jit
def _add_chunks(ptr, ok, R, c0, c1, c2, c3, CH: tl.constexpr, NC: tl.constexpr):
    """Add the first ``NC`` chunks of some rows' gradient into float32 rows at ``ptr`` (their row
    starts) with atomics: other programs add into the same rows."""
    cols = tl.arange(0, CH)
    tl.atomic_add(ptr + cols[None, :], c0, mask=ok[:, None] & (cols < R)[None, :], sem="relaxed")
    if NC > 1:
        tl.atomic_add(ptr + CH + cols[None, :], c1, mask=ok[:, None] & (CH + cols < R)[None, :], sem="relaxed")
    if NC > 2:
        tl.atomic_add(ptr + 2 * CH + cols[None, :], c2, mask=ok[:, None] & (2 * CH + cols < R)[None, :],
                      sem="relaxed")
    if NC > 3:
        tl.atomic_add(ptr + 3 * CH + cols[None, :], c3, mask=ok[:, None] & (3 * CH + cols < R)[None, :],
                      sem="relaxed")


@triton.jit
def _sub_level(SUB, f, alive, m0, m_last, n0, n_last):
    """Sub-tile level ``f``'s head-dim columns ``[lo, hi)`` and block size, and whether the tile pair
    (rows ``[m0, m_last]``, columns ``[n0, n_last]``) shares one of its blocks anywhere (``alive``
    carries the coarser levels' answer: blocks are nested)."""
    size = tl.load(SUB + 3 * f + 2)
    return tl.load(SUB + 3 * f), tl.load(SUB + 3 * f + 1), size, alive & blocks_meet(size, m0, m_last, n0, n_last)


@triton.jit
def _near_scores(o0, o1, o2, o3, w0, w1, w2, w3, offs_m, offs_n, m0, m_last, n0, n_last, RC, SUB,
                 NSUB: tl.constexpr, NCC: tl.constexpr, NCH: tl.constexpr, CH: tl.constexpr,
                 OWN_ROWS: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Scores of a tile pair near the diagonal, where sub-tile levels give each pair its own depth:
    the coarse prefix (the first ``RC`` columns, shared by every pair of the tile pair) plus each
    sub-tile level's columns where row and column share its block. ``o*``: the own tile's chunks,
    ``w*``: the walked tile's (both of full rank). Returns the scores (queries x keys) and the number
    of sub-tile levels each pair shares."""
    s = _prefix_scores(o0, o1, o2, o3, w0, w1, w2, w3, RC, NCC, CH, OWN_ROWS, PREC, UPCAST)
    shared_levels = tl.zeros_like(s)
    alive = n0 >= 0  # True, as a tensor: the loop carries it
    for f in range(NSUB):
        lo, hi, size, alive = _sub_level(SUB, f, alive, m0, m_last, n0, n_last)
        if alive:
            part = tl.zeros_like(s)
            for C in tl.static_range(NCC - 1, NCH):
                if (lo < (C + 1) * CH) & (hi > C * CH):
                    a, b = _operands(_pick(o0, o1, o2, o3, C), _pick(w0, w1, w2, w3, C), C, CH, lo, hi, True,
                                     OWN_ROWS)
                    part = dot_acc(a, tl.trans(b), part, PREC, UPCAST)
            shared = (offs_m[:, None] // size) == (offs_n[None, :] // size)
            s += tl.where(shared, part, 0.0)
            shared_levels += shared.to(tl.float32)
    return s, shared_levels


@triton.jit
def _tile_scores(o0, o1, o2, o3, base, offs, ok, stride_t, offs_m, offs_n, m0, m_last, n0, n_last, R, rank, SUB,
                 NEAR: tl.constexpr, NSUB: tl.constexpr, NCC: tl.constexpr, NC: tl.constexpr, CH: tl.constexpr,
                 OWN_ROWS: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Load the first ``NC`` chunks of the walked tile's rows ``offs`` and score the tile pair
    against the own tile's chunks ``o*`` (queries x keys, rows ``[m0, m_last]``, columns
    ``[n0, n_last]``): over the first ``rank`` columns, or ``NEAR`` the diagonal pair by pair
    (:func:`_near_scores`, ``rank`` the coarse prefix). Returns the scores, the number of sub-tile levels each pair shares (0
    away from the diagonal) and the walked chunks, whole (the gradients cut them as the scores did)."""
    w0, w1, w2, w3 = _chunks(base, offs, ok, stride_t, R, CH, NC)
    if NEAR:
        s, shared = _near_scores(o0, o1, o2, o3, w0, w1, w2, w3, offs_m, offs_n, m0, m_last, n0, n_last, rank, SUB,
                                 NSUB, NCC, NC, CH, OWN_ROWS, PREC, UPCAST)
    else:
        s = _prefix_scores(o0, o1, o2, o3, w0, w1, w2, w3, rank, NC, CH, OWN_ROWS, PREC, UPCAST)
        shared = 0
    return s, shared, w0, w1, w2, w3


@triton.jit
def _near_grads(g0, g1, g2, g3, ds, w0, w1, w2, w3, offs_m, offs_n, m0, m_last, n0, n_last, RC, SUB,
                NSUB: tl.constexpr, NCC: tl.constexpr, NCH: tl.constexpr, CH: tl.constexpr,
                OWN_ROWS: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """The own tile's gradient chunks ``g*`` plus a near tile pair's share, with the column split of
    :func:`_near_scores`: ``dS`` (queries x keys, float32; transposed when the own rows are keys)
    times the walked chunks ``w*``, each sub-tile level's columns only where row and column share
    its block."""
    if OWN_ROWS:
        a = ds.to(w0.dtype)
    else:
        a = tl.trans(ds.to(w0.dtype))
    g0, g1, g2, g3 = _prefix_grads(g0, g1, g2, g3, a, w0, w1, w2, w3, RC, NCC, CH, PREC, UPCAST)
    alive = n0 >= 0
    for f in range(NSUB):
        lo, hi, size, alive = _sub_level(SUB, f, alive, m0, m_last, n0, n_last)
        if alive:
            shared = (offs_m[:, None] // size) == (offs_n[None, :] // size)
            dsl = tl.where(shared, ds, 0.0).to(w0.dtype)
            if not OWN_ROWS:
                dsl = tl.trans(dsl)
            for C in tl.static_range(NCC - 1, NCH):
                if (lo < (C + 1) * CH) & (hi > C * CH):
                    g0, g1, g2, g3 = _grad_into(g0, g1, g2, g3, dsl, _pick(w0, w1, w2, w3, C), C, CH, lo, hi,
                                                True, PREC, UPCAST)
    return g0, g1, g2, g3


@triton.jit
def _near_bounds(x0, OWN: tl.constexpr, STEP: tl.constexpr, T, SF, NSUB: tl.constexpr):
    """The steps ``[lo, hi)`` around the own tile ``[x0, x0 + OWN)`` whose pairs may share a sub-tile
    level's block: the blocks of the coarsest one (size ``SF``) that meet the own tile, widened to
    whole steps; without sub-tile levels the own tile itself."""
    lo = x0
    hi = tl.minimum(x0 + OWN, T)
    if NSUB > 0:
        lo = ((x0 // SF) * SF) // STEP * STEP
        hi = tl.minimum(((x0 + OWN + SF - 1) // SF * SF + STEP - 1) // STEP * STEP, T)
    return lo, hi


@triton.jit
def _tier_start(x0, S):
    return (x0 // S) * S


@triton.jit
def _tier_end(x0, S, T):
    return tl.minimum((x0 // S) * S + S, T)


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_tile(acc, m_i, l_i, q0, q1, q2, q3, k_base, v_base, m0, offs_m, n0, depth, rank, R, stride_kt, stride_vt,
              T, DV, qk_scale, SUB, NC: tl.constexpr, NEAR: tl.constexpr, DIAG: tl.constexpr, CAUSAL: tl.constexpr,
              DEPTH_NORM: tl.constexpr, NSUB: tl.constexpr, NCC: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, CH: tl.constexpr, DVP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    dv = tl.arange(0, DVP)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < T
    s, shared, _, _, _, _ = _tile_scores(q0, q1, q2, q3, k_base, offs_n, n_ok, stride_kt, offs_m, offs_n, m0,
                                         tl.minimum(m0 + BLOCK_M, T) - 1, n0, tl.minimum(n0 + BLOCK_N, T) - 1, R,
                                         rank, SUB, NEAR, NSUB, NCC, NC, CH, True, PREC, UPCAST)
    s = s * _depth_scale(qk_scale, depth + shared, DEPTH_NORM)
    if DIAG:
        if CAUSAL:
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
    if not CAUSAL:
        s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    vt = tl.load(v_base + offs_n[:, None] * stride_vt + dv[None, :],
                 mask=n_ok[:, None] & (dv < DV)[None, :], other=0.0)
    acc = dot_acc(p.to(vt.dtype), vt, acc * alpha[:, None], PREC, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q0, q1, q2, q3, k_base, v_base, m0, offs_m, lo, hi,
               fsize, frank, stride_kt, stride_vt, T, R, R1, DV, qk_scale, RC, SUB,
               NC: tl.constexpr, NEAR: tl.constexpr, DIAG: tl.constexpr, CAUSAL: tl.constexpr,
               DEPTH_NORM: tl.constexpr, NSUB: tl.constexpr, NCC: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, CH: tl.constexpr, DVP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=1 if NEAR else None):  # near tiles: not pipelined (docstring)
        depth, rank = _depth_rank_near(m0, n0, fsize, frank, R1, RC, NEAR)
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q0, q1, q2, q3, k_base, v_base, m0, offs_m, n0, depth, rank, R,
                                  stride_kt, stride_vt, T, DV, qk_scale, SUB, NC, NEAR, DIAG, CAUSAL, DEPTH_NORM,
                                  NSUB, NCC, BLOCK_M, BLOCK_N, CH, DVP, PREC, UPCAST)
    return acc, m_i, l_i


@triton.jit
def _prefix_fwd_kernel(
    Q, K, V, O, LSE, SEG, FSIZE, FRANK, TIERS, SUB,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    H, G, TFULL, R, R1, RC, SF, DV, qk_scale,
    CAUSAL: tl.constexpr, DEPTH_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr, NCH: tl.constexpr, NCC: tl.constexpr,
    NSUB: tl.constexpr, LP: tl.constexpr, DVP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows of tiles start first
    pid_sh = tl.program_id(1)
    b, start, T = load_segment(SEG, pid_sh // H)
    h = pid_sh % H
    hk = h // G
    m0 = pid_m * BLOCK_M
    if m0 >= T:  # the grid covers the longest segment
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < T
    dv = tl.arange(0, DVP)
    lv = tl.arange(0, LP)
    fsize = tl.load(FSIZE + lv)
    frank = tl.load(FRANK + lv)
    # Positions are the segment's own: its rows start at `start` in the batch row.
    q_base = Q + b * stride_qb + h * stride_qh + start * stride_qt
    k_base = K + b * stride_kb + hk * stride_kh + start * stride_kt
    v_base = V + b * stride_vb + hk * stride_vh + start * stride_vt

    q0, q1, q2, q3 = _chunks(q_base, offs_m, m_ok, stride_qt, R, CH, NCH)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DVP], tl.float32)
    near_lo, near_hi = _near_bounds(m0, BLOCK_M, BLOCK_N, T, SF, NSUB)
    # Left of the near tiles, fewest chunks first: tier t ends where the block of size TIERS[t] starts.
    lo = 0
    for t in tl.static_range(1, NCC):
        hi = _tier_start(m0, tl.load(TIERS + t))
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q0, q1, q2, q3, k_base, v_base, m0, offs_m, lo, hi,
                                   fsize, frank, stride_kt, stride_vt, T, R, R1, DV, qk_scale, RC, SUB,
                                   t, False, False, CAUSAL, DEPTH_NORM, NSUB, NCC, BLOCK_M, BLOCK_N, CH, DVP,
                                   PREC, UPCAST)
        lo = hi
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q0, q1, q2, q3, k_base, v_base, m0, offs_m, lo, near_lo,
                               fsize, frank, stride_kt, stride_vt, T, R, R1, DV, qk_scale, RC, SUB,
                               NCC, False, False, CAUSAL, DEPTH_NORM, NSUB, NCC, BLOCK_M, BLOCK_N, CH, DVP,
                               PREC, UPCAST)
    # The near tiles left of the diagonal (none without sub-tile levels), then the diagonal: full
    # rank, the only tiles that need the causal mask.
    if NSUB > 0:
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q0, q1, q2, q3, k_base, v_base, m0, offs_m, near_lo, m0,
                                   fsize, frank, stride_kt, stride_vt, T, R, R1, DV, qk_scale, RC, SUB,
                                   NCH, True, False, CAUSAL, DEPTH_NORM, NSUB, NCC, BLOCK_M, BLOCK_N, CH, DVP,
                                   PREC, UPCAST)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q0, q1, q2, q3, k_base, v_base, m0, offs_m,
                               m0, tl.minimum(m0 + BLOCK_M, T),
                               fsize, frank, stride_kt, stride_vt, T, R, R1, DV, qk_scale, RC, SUB,
                               NCH, NSUB > 0, True, CAUSAL, DEPTH_NORM, NSUB, NCC, BLOCK_M, BLOCK_N, CH, DVP,
                               PREC, UPCAST)
    if not CAUSAL:
        # Right of the diagonal: the near tiles, then the tiers, most chunks first: tier t ends where
        # the block of TIERS[t - 1] ends.
        lo = m0 + BLOCK_M
        if NSUB > 0:
            acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q0, q1, q2, q3, k_base, v_base, m0, offs_m, lo, near_hi,
                                       fsize, frank, stride_kt, stride_vt, T, R, R1, DV, qk_scale, RC, SUB,
                                       NCH, True, False, CAUSAL, DEPTH_NORM, NSUB, NCC, BLOCK_M, BLOCK_N, CH, DVP,
                                       PREC, UPCAST)
            lo = tl.maximum(near_hi, lo)
        for i in tl.static_range(0, NCC - 1):
            hi = _tier_end(m0, tl.load(TIERS + NCC - 1 - i), T)
            acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q0, q1, q2, q3, k_base, v_base, m0, offs_m, lo, hi,
                                       fsize, frank, stride_kt, stride_vt, T, R, R1, DV, qk_scale, RC, SUB,
                                       NCC - i, False, False, CAUSAL, DEPTH_NORM, NSUB, NCC, BLOCK_M, BLOCK_N, CH,
                                       DVP, PREC, UPCAST)
            lo = hi
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q0, q1, q2, q3, k_base, v_base, m0, offs_m, lo, T,
                                   fsize, frank, stride_kt, stride_vt, T, R, R1, DV, qk_scale, RC, SUB,
                                   1, False, False, CAUSAL, DEPTH_NORM, NSUB, NCC, BLOCK_M, BLOCK_N, CH, DVP,
                                   PREC, UPCAST)

    acc = acc / l_i[:, None]
    o_ptr = O + b * stride_ob + h * stride_oh + (start + offs_m)[:, None] * stride_ot + dv[None, :]
    tl.store(o_ptr, acc.to(O.dtype.element_ty), mask=m_ok[:, None] & (dv < DV)[None, :])
    tl.store(LSE + (b * H + h) * TFULL + start + offs_m, m_i + tl.log2(l_i), mask=m_ok)


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------


@triton.jit
def _dkdv_tile(dk0, dk1, dk2, dk3, dv_acc, k0, k1, k2, k3, vt, q_base, do_base, lse_base, delta_base, dq_base,
               n0, offs_n, m0, depth, rank, R, stride_qt, stride_dot, T, DV, sm_scale, qk_scale, SUB,
               NC: tl.constexpr, NEAR: tl.constexpr, DIAG: tl.constexpr, CAUSAL: tl.constexpr,
               DEPTH_NORM: tl.constexpr, NSUB: tl.constexpr, NCC: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, CH: tl.constexpr, DVP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
               FUSED_DQ: tl.constexpr):
    dv = tl.arange(0, DVP)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < T
    m_last = tl.minimum(m0 + BLOCK_M, T) - 1
    n_last = tl.minimum(n0 + BLOCK_N, T) - 1
    s, shared, q0, q1, q2, q3 = _tile_scores(k0, k1, k2, k3, q_base, offs_m, m_ok, stride_qt, offs_m, offs_n, m0,
                                             m_last, n0, n_last, R, rank, SUB, NEAR, NSUB, NCC, NC, CH, False,
                                             PREC, UPCAST)
    depth = depth + shared
    # Rows past T load zeros (q, dO, lse, delta), so they add nothing below.
    lse = tl.load(lse_base + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
    p = tl.exp2(s * _depth_scale(qk_scale, depth, DEPTH_NORM) - lse[:, None])
    if DIAG:
        if CAUSAL:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
    do = tl.load(do_base + offs_m[:, None] * stride_dot + dv[None, :],
                 mask=m_ok[:, None] & (dv < DV)[None, :], other=0.0)
    dv_acc = dot_acc(tl.trans(p.to(do.dtype)), do, dv_acc, PREC, UPCAST)
    dp = dot(do, tl.trans(vt), PREC, UPCAST)
    ds = p * (dp - delta[:, None]) * _depth_scale(sm_scale, depth, DEPTH_NORM)
    if NEAR:
        dk0, dk1, dk2, dk3 = _near_grads(dk0, dk1, dk2, dk3, ds, q0, q1, q2, q3, offs_m, offs_n, m0, m_last, n0,
                                         n_last, rank, SUB, NSUB, NCC, NC, CH, False, PREC, UPCAST)
    else:
        dk0, dk1, dk2, dk3 = _prefix_grads(dk0, dk1, dk2, dk3, tl.trans(ds.to(q0.dtype)), q0, q1, q2, q3, rank, NC,
                                           CH, PREC, UPCAST)
    if FUSED_DQ:
        # The walked queries' share of dQ, the same products as the dQ kernel's, added atomically:
        # no second pass recomputing the scores and exponentials. Away from the diagonal only the
        # first NC chunks (the pair's prefix rank) receive anything.
        z = tl.zeros([BLOCK_M, CH], tl.float32)
        if NEAR:
            g0, g1, g2, g3 = _near_grads(z, z, z, z, ds, k0, k1, k2, k3, offs_m, offs_n, m0, m_last, n0, n_last,
                                         rank, SUB, NSUB, NCC, NC, CH, True, PREC, UPCAST)
        else:
            g0, g1, g2, g3 = _prefix_grads(z, z, z, z, ds.to(k0.dtype), k0, k1, k2, k3, rank, NC, CH, PREC, UPCAST)
        _add_chunks(dq_base + offs_m[:, None] * stride_qt, m_ok, R, g0, g1, g2, g3, CH, NC)
    return dk0, dk1, dk2, dk3, dv_acc


@triton.jit
def _dkdv_tiles(dk0, dk1, dk2, dk3, dv_acc, k0, k1, k2, k3, vt, q_base, do_base, lse_base, delta_base, dq_base,
                n0, offs_n, lo, hi, fsize, frank, stride_qt, stride_dot, T, R, R1, DV, sm_scale, qk_scale, RC, SUB,
                NC: tl.constexpr, NEAR: tl.constexpr, DIAG: tl.constexpr, CAUSAL: tl.constexpr,
                DEPTH_NORM: tl.constexpr, NSUB: tl.constexpr, NCC: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, CH: tl.constexpr, DVP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                FUSED_DQ: tl.constexpr):
    for m0 in tl.range(lo, hi, BLOCK_M, num_stages=1 if NEAR else None):  # near tiles: not pipelined (docstring)
        depth, rank = _depth_rank_near(m0, n0, fsize, frank, R1, RC, NEAR)
        dk0, dk1, dk2, dk3, dv_acc = _dkdv_tile(
            dk0, dk1, dk2, dk3, dv_acc, k0, k1, k2, k3, vt, q_base, do_base, lse_base, delta_base, dq_base,
            n0, offs_n, m0, depth, rank, R, stride_qt, stride_dot, T, DV, sm_scale, qk_scale, SUB,
            NC, NEAR, DIAG, CAUSAL, DEPTH_NORM, NSUB, NCC, BLOCK_M, BLOCK_N, CH, DVP, PREC, UPCAST, FUSED_DQ)
    return dk0, dk1, dk2, dk3, dv_acc


@triton.jit
def _prefix_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV_, DQ, SEG, FSIZE, FRANK, TIERS, SUB,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    H, HK, G, TFULL, R, R1, RC, SF, DV, sm_scale, qk_scale,
    CAUSAL: tl.constexpr, DEPTH_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr, NCH: tl.constexpr, NCC: tl.constexpr,
    NSUB: tl.constexpr, LP: tl.constexpr, DVP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    FUSED_DQ: tl.constexpr,
):
    # DK has k's strides and DV_ has v's strides (all contiguous, same shapes); with FUSED_DQ, DQ is
    # a float32 buffer with q's strides that the programs add the queries' gradients into.
    pid_n = tl.program_id(0)
    pid_sh = tl.program_id(1)
    b, start, T = load_segment(SEG, pid_sh // HK)
    hk = pid_sh % HK
    n0 = pid_n * BLOCK_N
    if n0 >= T:  # the grid covers the longest segment
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < T
    dv = tl.arange(0, DVP)
    lv = tl.arange(0, LP)
    fsize = tl.load(FSIZE + lv)
    frank = tl.load(FRANK + lv)
    k_off = b * stride_kb + hk * stride_kh + start * stride_kt
    k_base = K + k_off
    v_off = b * stride_vb + hk * stride_vh + start * stride_vt

    k0, k1, k2, k3 = _chunks(k_base, offs_n, n_ok, stride_kt, R, CH, NCH)
    vt = tl.load(V + v_off + offs_n[:, None] * stride_vt + dv[None, :],
                 mask=n_ok[:, None] & (dv < DV)[None, :], other=0.0)
    dk0 = tl.zeros([BLOCK_N, CH], tl.float32)
    dk1 = tl.zeros([BLOCK_N, CH], tl.float32)
    dk2 = tl.zeros([BLOCK_N, CH], tl.float32)
    dk3 = tl.zeros([BLOCK_N, CH], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, DVP], tl.float32)
    near_lo, near_hi = _near_bounds(n0, BLOCK_N, BLOCK_M, T, SF, NSUB)

    # The group's first query head; the loop steps one head at a time.
    q_group = Q + b * stride_qb + hk * G * stride_qh + start * stride_qt
    do_group = DO + b * stride_dob + hk * G * stride_doh + start * stride_dot
    row_group = (b * H + hk * G) * TFULL + start
    dq_group = DQ + b * stride_qb + hk * G * stride_qh + start * stride_qt
    for g in range(0, G):
        q_base = q_group + g * stride_qh
        do_base = do_group + g * stride_doh
        lse_base = LSE + row_group + g * TFULL
        delta_base = DELTA + row_group + g * TFULL
        dq_base = dq_group + g * stride_qh
        if not CAUSAL:
            # Query tiles above the diagonal, fewest chunks first, then the near ones.
            lo = 0
            for t in tl.static_range(1, NCC):
                hi = _tier_start(n0, tl.load(TIERS + t))
                dk0, dk1, dk2, dk3, dv_acc = _dkdv_tiles(
                    dk0, dk1, dk2, dk3, dv_acc, k0, k1, k2, k3, vt, q_base, do_base, lse_base, delta_base, dq_base,
                    n0, offs_n, lo, hi, fsize, frank, stride_qt, stride_dot, T, R, R1, DV, sm_scale, qk_scale,
                    RC, SUB, t, False, False, CAUSAL, DEPTH_NORM, NSUB, NCC, BLOCK_M, BLOCK_N, CH, DVP,
                    PREC, UPCAST, FUSED_DQ)
                lo = hi
            dk0, dk1, dk2, dk3, dv_acc = _dkdv_tiles(
                dk0, dk1, dk2, dk3, dv_acc, k0, k1, k2, k3, vt, q_base, do_base, lse_base, delta_base, dq_base,
                n0, offs_n, lo, near_lo, fsize, frank, stride_qt, stride_dot, T, R, R1, DV, sm_scale, qk_scale,
                RC, SUB, NCC, False, False, CAUSAL, DEPTH_NORM, NSUB, NCC, BLOCK_M, BLOCK_N, CH, DVP, PREC, UPCAST,
                FUSED_DQ)
            if NSUB > 0:
                dk0, dk1, dk2, dk3, dv_acc = _dkdv_tiles(
                    dk0, dk1, dk2, dk3, dv_acc, k0, k1, k2, k3, vt, q_base, do_base, lse_base, delta_base, dq_base,
                    n0, offs_n, near_lo, n0, fsize, frank, stride_qt, stride_dot, T, R, R1, DV, sm_scale, qk_scale,
                    RC, SUB, NCH, True, False, CAUSAL, DEPTH_NORM, NSUB, NCC, BLOCK_M, BLOCK_N, CH, DVP, PREC,
                    UPCAST, FUSED_DQ)
        # The diagonal, the near query tiles below it, then the tiers below, most chunks first.
        dk0, dk1, dk2, dk3, dv_acc = _dkdv_tiles(
            dk0, dk1, dk2, dk3, dv_acc, k0, k1, k2, k3, vt, q_base, do_base, lse_base, delta_base, dq_base,
            n0, offs_n, n0, tl.minimum(n0 + BLOCK_N, T), fsize, frank, stride_qt, stride_dot, T, R, R1, DV,
            sm_scale, qk_scale, RC, SUB, NCH, NSUB > 0, True, CAUSAL, DEPTH_NORM, NSUB, NCC, BLOCK_M, BLOCK_N, CH,
            DVP, PREC, UPCAST, FUSED_DQ)
        lo = n0 + BLOCK_N
        if NSUB > 0:
            dk0, dk1, dk2, dk3, dv_acc = _dkdv_tiles(
                dk0, dk1, dk2, dk3, dv_acc, k0, k1, k2, k3, vt, q_base, do_base, lse_base, delta_base, dq_base,
                n0, offs_n, lo, near_hi, fsize, frank, stride_qt, stride_dot, T, R, R1, DV, sm_scale,
                qk_scale, RC, SUB, NCH, True, False, CAUSAL, DEPTH_NORM, NSUB, NCC, BLOCK_M, BLOCK_N, CH, DVP,
                PREC, UPCAST, FUSED_DQ)
            lo = tl.maximum(near_hi, lo)
        for i in tl.static_range(0, NCC - 1):
            hi = _tier_end(n0, tl.load(TIERS + NCC - 1 - i), T)
            dk0, dk1, dk2, dk3, dv_acc = _dkdv_tiles(
                dk0, dk1, dk2, dk3, dv_acc, k0, k1, k2, k3, vt, q_base, do_base, lse_base, delta_base, dq_base,
                n0, offs_n, lo, hi, fsize, frank, stride_qt, stride_dot, T, R, R1, DV, sm_scale, qk_scale,
                RC, SUB, NCC - i, False, False, CAUSAL, DEPTH_NORM, NSUB, NCC, BLOCK_M, BLOCK_N, CH, DVP,
                PREC, UPCAST, FUSED_DQ)
            lo = hi
        dk0, dk1, dk2, dk3, dv_acc = _dkdv_tiles(
            dk0, dk1, dk2, dk3, dv_acc, k0, k1, k2, k3, vt, q_base, do_base, lse_base, delta_base, dq_base,
            n0, offs_n, lo, T, fsize, frank, stride_qt, stride_dot, T, R, R1, DV, sm_scale, qk_scale,
            RC, SUB, 1, False, False, CAUSAL, DEPTH_NORM, NSUB, NCC, BLOCK_M, BLOCK_N, CH, DVP, PREC, UPCAST,
            FUSED_DQ)

    _store_chunks(DK + k_off + offs_n[:, None] * stride_kt, n_ok, R, dk0, dk1, dk2, dk3, CH, NCH)
    tl.store(DV_ + v_off + offs_n[:, None] * stride_vt + dv[None, :], dv_acc.to(DV_.dtype.element_ty),
             mask=n_ok[:, None] & (dv < DV)[None, :])


@triton.jit
def _dq_tile(dq0, dq1, dq2, dq3, q0, q1, q2, q3, do, lse, delta, k_base, v_base, m0, offs_m, n0, depth, rank, R,
             stride_kt, stride_vt, T, DV, sm_scale, qk_scale, SUB,
             NC: tl.constexpr, NEAR: tl.constexpr, DIAG: tl.constexpr, CAUSAL: tl.constexpr,
             DEPTH_NORM: tl.constexpr, NSUB: tl.constexpr, NCC: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, CH: tl.constexpr, DVP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    dv = tl.arange(0, DVP)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < T
    m_last = tl.minimum(m0 + BLOCK_M, T) - 1
    n_last = tl.minimum(n0 + BLOCK_N, T) - 1
    s, shared, k0, k1, k2, k3 = _tile_scores(q0, q1, q2, q3, k_base, offs_n, n_ok, stride_kt, offs_m, offs_n, m0,
                                             m_last, n0, n_last, R, rank, SUB, NEAR, NSUB, NCC, NC, CH, True,
                                             PREC, UPCAST)
    depth = depth + shared
    p = tl.exp2(s * _depth_scale(qk_scale, depth, DEPTH_NORM) - lse[:, None])
    if DIAG:
        if CAUSAL:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
    if not CAUSAL:
        p = tl.where(n_ok[None, :], p, 0.0)
    vt = tl.load(v_base + offs_n[:, None] * stride_vt + dv[None, :],
                 mask=n_ok[:, None] & (dv < DV)[None, :], other=0.0)
    dp = dot(do, tl.trans(vt), PREC, UPCAST)
    ds = p * (dp - delta[:, None]) * _depth_scale(sm_scale, depth, DEPTH_NORM)
    if NEAR:
        dq0, dq1, dq2, dq3 = _near_grads(dq0, dq1, dq2, dq3, ds, k0, k1, k2, k3, offs_m, offs_n, m0, m_last, n0,
                                         n_last, rank, SUB, NSUB, NCC, NC, CH, True, PREC, UPCAST)
    else:
        dq0, dq1, dq2, dq3 = _prefix_grads(dq0, dq1, dq2, dq3, ds.to(k0.dtype), k0, k1, k2, k3, rank, NC, CH, PREC,
                                           UPCAST)
    return dq0, dq1, dq2, dq3


@triton.jit
def _dq_tiles(dq0, dq1, dq2, dq3, q0, q1, q2, q3, do, lse, delta, k_base, v_base, m0, offs_m, lo, hi,
              fsize, frank, stride_kt, stride_vt, T, R, R1, DV, sm_scale, qk_scale, RC, SUB,
              NC: tl.constexpr, NEAR: tl.constexpr, DIAG: tl.constexpr, CAUSAL: tl.constexpr,
              DEPTH_NORM: tl.constexpr, NSUB: tl.constexpr, NCC: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, CH: tl.constexpr, DVP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=1 if NEAR else None):  # near tiles: not pipelined (docstring)
        depth, rank = _depth_rank_near(m0, n0, fsize, frank, R1, RC, NEAR)
        dq0, dq1, dq2, dq3 = _dq_tile(dq0, dq1, dq2, dq3, q0, q1, q2, q3, do, lse, delta, k_base, v_base,
                                      m0, offs_m, n0, depth, rank, R, stride_kt, stride_vt, T, DV, sm_scale,
                                      qk_scale, SUB, NC, NEAR, DIAG, CAUSAL, DEPTH_NORM, NSUB, NCC, BLOCK_M,
                                      BLOCK_N, CH, DVP, PREC, UPCAST)
    return dq0, dq1, dq2, dq3


@triton.jit
def _prefix_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, SEG, FSIZE, FRANK, TIERS, SUB,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    H, G, TFULL, R, R1, RC, SF, DV, sm_scale, qk_scale,
    CAUSAL: tl.constexpr, DEPTH_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr, NCH: tl.constexpr, NCC: tl.constexpr,
    NSUB: tl.constexpr, LP: tl.constexpr, DVP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    # DQ has q's strides.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows of tiles start first
    pid_sh = tl.program_id(1)
    b, start, T = load_segment(SEG, pid_sh // H)
    h = pid_sh % H
    hk = h // G
    m0 = pid_m * BLOCK_M
    if m0 >= T:  # the grid covers the longest segment
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < T
    dv = tl.arange(0, DVP)
    lv = tl.arange(0, LP)
    fsize = tl.load(FSIZE + lv)
    frank = tl.load(FRANK + lv)
    q_off = b * stride_qb + h * stride_qh + start * stride_qt
    q_base = Q + q_off
    k_base = K + b * stride_kb + hk * stride_kh + start * stride_kt
    v_base = V + b * stride_vb + hk * stride_vh + start * stride_vt

    q0, q1, q2, q3 = _chunks(q_base, offs_m, m_ok, stride_qt, R, CH, NCH)
    do = tl.load(DO + b * stride_dob + h * stride_doh + (start + offs_m)[:, None] * stride_dot + dv[None, :],
                 mask=m_ok[:, None] & (dv < DV)[None, :], other=0.0)
    row_base = (b * H + h) * TFULL + start
    lse = tl.load(LSE + row_base + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + row_base + offs_m, mask=m_ok, other=0.0)
    dq0 = tl.zeros([BLOCK_M, CH], tl.float32)
    dq1 = tl.zeros([BLOCK_M, CH], tl.float32)
    dq2 = tl.zeros([BLOCK_M, CH], tl.float32)
    dq3 = tl.zeros([BLOCK_M, CH], tl.float32)
    near_lo, near_hi = _near_bounds(m0, BLOCK_M, BLOCK_N, T, SF, NSUB)

    lo = 0
    for t in tl.static_range(1, NCC):
        hi = _tier_start(m0, tl.load(TIERS + t))
        dq0, dq1, dq2, dq3 = _dq_tiles(dq0, dq1, dq2, dq3, q0, q1, q2, q3, do, lse, delta, k_base, v_base,
                                       m0, offs_m, lo, hi, fsize, frank, stride_kt, stride_vt, T, R, R1, DV,
                                       sm_scale, qk_scale, RC, SUB, t, False, False, CAUSAL, DEPTH_NORM, NSUB, NCC,
                                       BLOCK_M, BLOCK_N, CH, DVP, PREC, UPCAST)
        lo = hi
    dq0, dq1, dq2, dq3 = _dq_tiles(dq0, dq1, dq2, dq3, q0, q1, q2, q3, do, lse, delta, k_base, v_base,
                                   m0, offs_m, lo, near_lo, fsize, frank, stride_kt, stride_vt, T, R, R1, DV,
                                   sm_scale, qk_scale, RC, SUB, NCC, False, False, CAUSAL, DEPTH_NORM, NSUB, NCC,
                                   BLOCK_M, BLOCK_N, CH, DVP, PREC, UPCAST)
    if NSUB > 0:
        dq0, dq1, dq2, dq3 = _dq_tiles(dq0, dq1, dq2, dq3, q0, q1, q2, q3, do, lse, delta, k_base, v_base,
                                       m0, offs_m, near_lo, m0, fsize, frank, stride_kt, stride_vt, T, R, R1, DV,
                                       sm_scale, qk_scale, RC, SUB, NCH, True, False, CAUSAL, DEPTH_NORM, NSUB, NCC,
                                       BLOCK_M, BLOCK_N, CH, DVP, PREC, UPCAST)
    dq0, dq1, dq2, dq3 = _dq_tiles(dq0, dq1, dq2, dq3, q0, q1, q2, q3, do, lse, delta, k_base, v_base,
                                   m0, offs_m, m0, tl.minimum(m0 + BLOCK_M, T), fsize, frank, stride_kt,
                                   stride_vt, T, R, R1, DV, sm_scale, qk_scale, RC, SUB, NCH, NSUB > 0, True, CAUSAL,
                                   DEPTH_NORM, NSUB, NCC, BLOCK_M, BLOCK_N, CH, DVP, PREC, UPCAST)
    if not CAUSAL:
        lo = m0 + BLOCK_M
        if NSUB > 0:
            dq0, dq1, dq2, dq3 = _dq_tiles(dq0, dq1, dq2, dq3, q0, q1, q2, q3, do, lse, delta, k_base, v_base,
                                           m0, offs_m, lo, near_hi, fsize, frank, stride_kt, stride_vt, T, R,
                                           R1, DV, sm_scale, qk_scale, RC, SUB, NCH, True, False, CAUSAL, DEPTH_NORM,
                                           NSUB, NCC, BLOCK_M, BLOCK_N, CH, DVP, PREC, UPCAST)
            lo = tl.maximum(near_hi, lo)
        for i in tl.static_range(0, NCC - 1):
            hi = _tier_end(m0, tl.load(TIERS + NCC - 1 - i), T)
            dq0, dq1, dq2, dq3 = _dq_tiles(dq0, dq1, dq2, dq3, q0, q1, q2, q3, do, lse, delta, k_base,
                                           v_base, m0, offs_m, lo, hi, fsize, frank, stride_kt, stride_vt,
                                           T, R, R1, DV, sm_scale, qk_scale, RC, SUB, NCC - i, False, False, CAUSAL,
                                           DEPTH_NORM, NSUB, NCC, BLOCK_M, BLOCK_N, CH, DVP, PREC, UPCAST)
            lo = hi
        dq0, dq1, dq2, dq3 = _dq_tiles(dq0, dq1, dq2, dq3, q0, q1, q2, q3, do, lse, delta, k_base, v_base,
                                       m0, offs_m, lo, T, fsize, frank, stride_kt, stride_vt, T, R, R1, DV,
                                       sm_scale, qk_scale, RC, SUB, 1, False, False, CAUSAL, DEPTH_NORM, NSUB, NCC,
                                       BLOCK_M, BLOCK_N, CH, DVP, PREC, UPCAST)

    _store_chunks(DQ + q_off + offs_m[:, None] * stride_qt, m_ok, R, dq0, dq1, dq2, dq3, CH, NCH)


# --------------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefixTiles:
    """Tile sizes (powers of two >= 16) and launch settings of the three kernels.

    Each kernel owns tiles of one size and steps over the other axis in tiles of the other; the
    step must divide the own tile (so the diagonal is whole steps). The levels whose block sizes are
    multiples of every tile are *coarse*: each tile pair lies inside one of their blocks or in none.
    The finer ones are *sub-tile* levels, added pair by pair on the few tiles around the diagonal
    that share their blocks; they fit when the coarsest of them is smaller than twice the largest
    tile, so those tiles stay within a step or two of the diagonal.
    """

    fwd_m: int = 64  # forward: own query tile
    fwd_n: int = 64  # forward: key step
    dkdv_n: int = 64  # dK/dV: own key tile
    dkdv_m: int = 64  # dK/dV: query step
    dq_m: int = 64  # dQ: own query tile
    dq_n: int = 64  # dQ: key step
    num_warps: int = 4
    num_stages: int = 2  # software-pipeline stages of the walked tiles; 0: the launch's choice (pipeline_stages)

    @property
    def largest(self) -> int:
        return max(self.fwd_m, self.fwd_n, self.dkdv_n, self.dkdv_m, self.dq_m, self.dq_n)

    def coarse_levels(self, sizes: Sequence[int]) -> int:
        """How many leading levels every tile pair sees whole (level 1 always: its block holds the
        whole sequence); blocks are nested, so the levels after them are all sub-tile ones."""
        whole = 1
        while whole < len(sizes) and sizes[whole] % self.largest == 0:
            whole += 1
        return whole

    def sub_tile_levels(self, sizes: Sequence[int]) -> int:
        """How many levels, after the coarse ones, are added pair by pair on the near tiles."""
        return len(sizes) - self.coarse_levels(sizes)

    def fits(self, fine_sizes: Sequence[int]) -> bool:
        pairs = ((self.fwd_m, self.fwd_n), (self.dkdv_n, self.dkdv_m), (self.dq_m, self.dq_n))
        sizes = [x for pair in pairs for x in pair]
        sub_tile = [s for s in fine_sizes if s % self.largest]
        return (all(t >= 16 and t & (t - 1) == 0 for t in sizes)
                and all(own % step == 0 for own, step in pairs)
                and all(s < 2 * self.largest for s in sub_tile))


def square_tiles(fine_sizes: Sequence[int], largest: int, smallest: int, sub_tile: bool,
                 num_warps: int = 4, num_stages: int = 2) -> PrefixTiles | None:
    """Square tiles for the prefix-rank kernels: the largest, from ``largest`` down to ``smallest``
    (both powers of two >= 16), that every fine block size is a multiple of; else, with
    ``sub_tile``, tiles of ``largest`` with sub-tile levels if they fit; else None."""
    tile = largest
    while tile >= max(smallest, 16):
        if all(s % tile == 0 for s in fine_sizes):
            return PrefixTiles(*(tile,) * 6, num_warps=num_warps, num_stages=num_stages)
        tile //= 2
    tiles = PrefixTiles(*(largest,) * 6, num_warps=num_warps, num_stages=num_stages)
    return tiles if sub_tile and tiles.fits(fine_sizes) else None


# The shared memory a block of a Hopper-class GPU may take (H100, H200, B200): what the stages
# below were compiled and counted against. A100s allow 163 KiB, consumer GPUs 99.
HOPPER_SHARED_PER_BLOCK = 227 * 1024


def pipeline_stages(dtype: torch.dtype, device_type: str, head_dim: int, shared_per_block: int) -> tuple[int, int]:
    """The software-pipeline stages of the default tiles, for the forward kernel and for the
    backward's: three in half precision on a CUDA GPU whose blocks may take Hopper's shared memory
    (``shared_per_block``, bytes: at least ``HOPPER_SHARED_PER_BLOCK``), up to head dim 128 for the
    forward and 64 for the backward (``head_dim``: the wider of the queries' and the values');
    else two. With two, Triton issues a walked tile's copies into shared memory after the previous
    tile's products and waits for them at the top of the next iteration, so a program's loads never
    overlap its own arithmetic; with three the next tile's copies are in flight while one is
    scored. On Hopper their buffers fit beside the programs per multiprocessor the registers allow
    (at head dim 64: forward three, dK/dV two; at 128 two and two), except the dK/dV kernel's at
    head dim 128, whose 133 KiB would halve its programs; on GPUs with less shared memory the
    forward's 112 KiB at head dim 128 would not fit a block at all. float32 kernels are not a speed
    target and compile slowly (docs/benchmarks.md, compiled for sm_90)."""
    if device_type != "cuda" or shared_per_block < HOPPER_SHARED_PER_BLOCK or dtype == torch.float32:
        return 2, 2
    return (3 if head_dim <= 128 else 2), (3 if head_dim <= 64 else 2)


def _shared_per_block(device: torch.device) -> int:
    """The shared memory a block may take on a CUDA device, in bytes, opted in (0 elsewhere)."""
    props = cuda_properties(device)
    if props is None:
        return 0
    return getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)


def launch_warps(tiles: PrefixTiles, sizes: Sequence[int], device_type: str) -> int:
    """The warps the kernels launch with: the tiles' own, but at least eight on CUDA where the tiling
    has sub-tile levels. Those add their products level by level in a loop, as the general kernels
    do, and with four warps Triton 3.6 computed wrong half-precision results for both on an H200
    (the backend grid, docs/benchmarks.md), with eight right ones. Applied where the plan is made,
    so every caller gets it, the dispatcher and direct calls (the tuning script's) alike."""
    if device_type == "cuda" and tiles.sub_tile_levels(sizes) > 0:
        return max(tiles.num_warps, 8)
    return tiles.num_warps


def miscompiled_on_cuda(tiles: PrefixTiles, sizes: Sequence[int]) -> bool:
    """Whether the tiling has a single sub-tile level, which Triton 3.6 compiled wrong for an H200:
    64-row tiles with 8 levels of rank 8 at T = 4096 (one sub-tile level of 32-row blocks) were off
    by a relative 0.66 with four or eight warps, and right under the interpreter; two or three
    sub-tile levels (T = 2048, 1024) were right (docs/benchmarks.md). The near tiles' loops are now
    unpipelined, as they were with two levels (module docstring), but until a GPU confirms that this
    mends it the dispatcher gives these calls to the general kernels on CUDA;
    ``scripts/check_prefix_tilings.py`` checks the family's members on a GPU."""
    return tiles.sub_tile_levels(sizes) == 1


class PrefixPlan:
    """The chunking, tier sizes and level metadata of one call (made once per signature: :func:`plan_of`)."""

    def __init__(self, dtype: torch.dtype, device: torch.device, dv: int, ranks: tuple[int, ...],
                 sizes: tuple[int, ...], tiles: PrefixTiles) -> None:
        R = sum(ranks)
        self.R, self.R1 = R, ranks[0]
        self.CH = pow2(math.ceil(R / 4), 16)
        self.NCH = math.ceil(R / self.CH)
        prefix = [sum(ranks[: d + 1]) for d in range(len(ranks))]
        coarse = tiles.coarse_levels(sizes)
        # The coarse levels: their prefix, its chunks, and tiers[t - 1], the block size inside which
        # tiles need at least t chunks.
        self.RC = prefix[coarse - 1]
        self.NCC = math.ceil(self.RC / self.CH)
        tiers = [sizes[next(d for d, p in enumerate(prefix) if p > (t - 1) * self.CH)]
                 for t in range(1, self.NCC + 1)]
        fine = list(ranks[1:coarse])
        self.LP = pow2(len(fine))
        pad = self.LP - len(fine)
        self.fsize = device_table(tuple(sizes[1:coarse]) + (1,) * pad, torch.int32, device)
        self.frank = device_table(tuple(fine) + (0,) * pad, torch.int32, device)
        self.tiers = device_table(tuple(tiers) + (1,) * (4 - len(tiers)), torch.int32, device)
        # The sub-tile levels: (first column, end column, block size) each.
        sub = [(prefix[d - 1], prefix[d], sizes[d]) for d in range(coarse, len(ranks))]
        self.NSUB = len(sub)
        self.SF = sizes[coarse] if sub else 1
        self.sub = device_table(tuple(x for level in sub for x in level) or (0, 0, 1), torch.int32, device)
        self.DV = dv
        self.DVP = pow2(self.DV, 16)
        self.tiles = tiles
        self.num_warps = launch_warps(tiles, sizes, device.type)
        # the forward kernel's and the backward kernels' stages: the tiles' own, or the device's
        self.fwd_stages, self.bwd_stages = ((tiles.num_stages,) * 2 if tiles.num_stages
                                            else pipeline_stages(dtype, device.type, max(R, dv),
                                                                 _shared_per_block(device)))
        self.prec = "ieee" if dtype == torch.float32 else "tf32"
        self.upcast = INTERPRETED and dtype == torch.bfloat16
        self._constexprs: dict[tuple[bool, bool, int, int, int], dict] = {}

    def tables(self) -> tuple[torch.Tensor, ...]:
        return self.fsize, self.frank, self.tiers, self.sub

    def constexprs(self, causal: bool, depth_normalize: bool, block_m: int, block_n: int, stages: int) -> dict:
        """A kernel's compile-time arguments and launch options (made once per combination: the
        host pays for a fresh dict of them on every launch otherwise). Never modify the result."""
        key = (causal, depth_normalize, block_m, block_n, stages)
        made = self._constexprs.get(key)
        if made is None:
            made = self._constexprs[key] = dict(
                CAUSAL=causal, DEPTH_NORM=depth_normalize, BLOCK_M=block_m, BLOCK_N=block_n, CH=self.CH,
                NCH=self.NCH, NCC=self.NCC, NSUB=self.NSUB, LP=self.LP, DVP=self.DVP, PREC=self.prec,
                UPCAST=self.upcast, num_warps=self.num_warps, num_stages=stages)
        return made


@functools.lru_cache(maxsize=256)
def _plan(dtype: torch.dtype, device: torch.device, dv: int, ranks: tuple[int, ...], sizes: tuple[int, ...],
          tiles: PrefixTiles) -> PrefixPlan:
    return PrefixPlan(dtype, device, dv, ranks, sizes, tiles)


def plan_of(q: torch.Tensor, v: torch.Tensor, ranks: Sequence[int], sizes: Sequence[int],
            tiles: PrefixTiles) -> PrefixPlan:
    """The plan of a call on ``q`` and ``v``, made once per signature: the host's arithmetic and
    table look-ups are paid on every call otherwise, before the kernels can start."""
    return _plan(q.dtype, q.device, v.shape[-1], tuple(ranks), tuple(sizes), tiles)


def _forward(q, k, v, segments, max_len: int, plan: PrefixPlan, causal: bool, scale: float, depth_normalize: bool):
    B, H, T, _ = q.shape
    segments = segments_of_rows(B, T, q.device) if segments is None else segments
    tiles = plan.tiles
    o = empty_rows(q, plan.DV)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    launch(_prefix_fwd_kernel, (cdiv(max_len, tiles.fwd_m), segments.shape[0] * H),
        q, k, v, o, lse, segments, *plan.tables(),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        H, H // k.shape[1], T, plan.R, plan.R1, plan.RC, plan.SF, plan.DV, scale * _LOG2E,
        **plan.constexprs(causal, depth_normalize, tiles.fwd_m, tiles.fwd_n, plan.fwd_stages),
    )
    return o, lse


def _backward(q, k, v, o, lse, do, segments, max_len: int, plan: PrefixPlan, causal: bool, scale: float,
              depth_normalize: bool):
    B, H, T, _ = q.shape
    segments = segments_of_rows(B, T, q.device) if segments is None else segments
    Hk = k.shape[1]
    tiles = plan.tiles
    do = dense_rows(do)
    # dQ: by default added into a float32 buffer by the dK/dV kernel as it goes (atomics, so the
    # order of the additions, and dQ's last bits, vary from run to run, as in flash attention's
    # backward), zeroed by the delta's kernel; under torch.use_deterministic_algorithms(True) the
    # dQ kernel computes it instead, recomputing the scores from the queries' side.
    fused = not torch.are_deterministic_algorithms_enabled()
    dq = torch.empty_like(q, dtype=torch.float32 if fused else q.dtype)  # q's strides, as dk, dv
    delta = row_dots(do, o, dq if fused else None)  # (B, H, T)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    launch(_prefix_dkdv_kernel, (cdiv(max_len, tiles.dkdv_n), segments.shape[0] * Hk),
        q, k, v, do, lse, delta, dk, dv, dq, segments, *plan.tables(), *strides,
        H, Hk, H // Hk, T, plan.R, plan.R1, plan.RC, plan.SF, plan.DV, scale, scale * _LOG2E,
        **plan.constexprs(causal, depth_normalize, tiles.dkdv_m, tiles.dkdv_n, plan.bwd_stages), FUSED_DQ=fused,
    )
    if fused:
        return dq.to(q.dtype), dk, dv
    launch(_prefix_dq_kernel, (cdiv(max_len, tiles.dq_m), segments.shape[0] * H),
        q, k, v, do, lse, delta, dq, segments, *plan.tables(), *strides,
        H, H // Hk, T, plan.R, plan.R1, plan.RC, plan.SF, plan.DV, scale, scale * _LOG2E,
        **plan.constexprs(causal, depth_normalize, tiles.dq_m, tiles.dq_n, plan.bwd_stages),
    )
    return dq, dk, dv


_LOG2E = 1.0 / math.log(2.0)


def _tiles_from(values: list[int]) -> PrefixTiles:
    return PrefixTiles(*values)


_TILE_FIELDS = tuple(f.name for f in dataclasses.fields(PrefixTiles))


def _tiles_list(tiles: PrefixTiles) -> list[int]:
    return [int(getattr(tiles, name)) for name in _TILE_FIELDS]  # not astuple: it deep-copies each field


# ``document_ids``: packed documents ``(B, T)`` or None for whole rows; the ops read their segment
# table from them (:func:`.triton_common.segments_of_documents`), so a compiled graph holds them.
def _run_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None,
                 ranks: list[int], sizes: list[int], causal: bool, scale: float, depth_normalize: bool,
                 tiles: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    plan = plan_of(q, v, ranks, sizes, _tiles_from(tiles))
    segments, max_len = segments_of_documents(document_ids, q.shape[2], q.device)
    return _forward(q, k, v, segments, max_len, plan, causal, scale, depth_normalize)


def _forward_fake(q, k, v, document_ids, ranks, sizes, causal, scale, depth_normalize, tiles):
    B, H, T, _ = q.shape
    return empty_rows(q, v.shape[-1]), q.new_empty(B, H, T, dtype=torch.float32)


def _run_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                  lse: torch.Tensor, document_ids: torch.Tensor | None, ranks: list[int], sizes: list[int],
                  causal: bool, scale: float, depth_normalize: bool,
                  tiles: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = plan_of(q, v, ranks, sizes, _tiles_from(tiles))
    segments, max_len = segments_of_documents(document_ids, q.shape[2], q.device)
    return _backward(q, k, v, o, lse, do, segments, max_len, plan, causal, scale, depth_normalize)


def _backward_fake(do, q, k, v, o, lse, document_ids, ranks, sizes, causal, scale, depth_normalize, tiles):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_forward_call = differentiable_ops("mlr_triton_prefix", _run_forward, _forward_fake, _run_backward, _backward_fake)
# Packed documents: the same functions as ops of their own, which read the ids on the host
_varlen_call = differentiable_ops("mlr_triton_prefix_varlen", _run_forward, _forward_fake, _run_backward,
                                  _backward_fake, VARLEN_TAGS)


class PrefixCall:
    """The prefix-rank kernels' call of one signature, prepared: its plan and configuration bound
    once, so each call pays the launches and little else. The dispatcher keeps one per signature it
    has checked (``dispatch.mlr_attention``); whole rows, no documents; outside ``torch.compile``."""

    def __init__(self, q: torch.Tensor, v: torch.Tensor, ranks: tuple[int, ...], sizes: tuple[int, ...],
                 causal: bool, scale: float, depth_normalize: bool, tiles: PrefixTiles) -> None:
        self.plan = plan_of(q, v, ranks, sizes, tiles)
        self.T, self.causal, self.scale, self.depth_normalize = q.shape[2], causal, float(scale), depth_normalize

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _prepared_call(dense_rows(q), dense_rows(k), dense_rows(v), self)[0]


def _run_prepared_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          call: PrefixCall) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, None, call.T, call.plan, call.causal, call.scale, call.depth_normalize)


def _run_prepared_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                           lse: torch.Tensor, call: PrefixCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(q, k, v, o, lse, do, None, call.T, call.plan, call.causal, call.scale, call.depth_normalize)


_prepared_call = eager_autograd(_run_prepared_forward, _run_prepared_backward)


def mlr_attention_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranks: tuple[int, ...],
                         sizes: tuple[int, ...], causal: bool, scale: float, depth_normalize: bool,
                         tiles: PrefixTiles, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """MLR attention on prefix-rank tiles; arguments already checked, ``tiles.fits(sizes[1:])``.
    Packed ``document_ids``: each document a segment of the launch, scored as a sequence of its own
    (its positions start at 0, so its tile pairs keep one depth each)."""
    q, k, v = dense_rows(q), dense_rows(k), dense_rows(v)  # layers' transposed views: no copy
    call = _forward_call if document_ids is None else _varlen_call
    out, _ = call(q, k, v, document_ids, list(ranks), list(sizes), causal, float(scale), depth_normalize,
                  _tiles_list(tiles))
    return out
