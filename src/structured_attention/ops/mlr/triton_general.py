"""Flash-style Triton kernels for exact MLR attention, the general case.

:func:`mlr_attention_triton` has the contract of :func:`~.reference.mlr_attention_reference` (same
arguments, same result up to float rounding) and is differentiable in ``q``, ``k`` and ``v``: the
forward and backward are ``torch.library`` custom ops (``sattn::mlr_triton_*``).

When every fine block size is a multiple of the tile size (on a GPU: of 32 or 64 rows), or the
blocks that are not stay within a tile or two of the diagonal, the call goes to the faster
prefix-rank kernels of :mod:`.triton_prefix`. The kernels below handle every other case (and
explicit tiles that no prefix-rank tiling fits).

Design
------
* Forward: one program per (query tile of ``BLOCK_M`` rows, batch * query head); online softmax over
  key tiles of ``BLOCK_N`` columns; with ``causal`` no key tile past the diagonal is visited. The
  row log-sum-exp is stored for the backward. Everything accumulates in float32.
* Depth: tiles are *not* tied to the block sizes. A tile's score is split into
  - level 1 (dims ``[0, r_1)``), which covers the whole context: one 2-D ``tl.dot`` per tile;
  - the finer levels ``2..L``, one after the other in a loop: level ``l``'s slice of the head dims is
    loaded (masked) into an ``RLP``-wide tile, multiplied as one 2-D ``tl.dot``, and its partial
    score added only where row and column share the level-``l`` block (``i // s_l == j // s_l``),
    which also gives the depth for ``depth_normalize``. The backward accumulates the fine levels'
    gradients in an ``(LP, tile, RLP)`` tensor, ``LP = next_pow2(L - 1)``, one level per slot.
  A level is skipped at run time when the tile pair shares none of its blocks, and then so are the
  finer ones (blocks are nested): away from the diagonal a tile costs one ``r_1``-wide matmul.
  One level at a time keeps every live tile 2-D: a batched 3-D product over all the levels would
  hold an ``(LP, tile, tile)`` score tensor, kilobytes of register spills per thread
  (``scripts/triton_resources.py`` prints each kernel's registers and spills).
  Mixed-depth tiles (straddling block boundaries, partial trailing blocks, T not a multiple of
  anything) are exact because of the per-level masks.
* Backward: the standard flash-attention backward: ``delta = rowsum(dO * O)`` (a small kernel), one kernel
  for ``dK, dV`` (one program per key tile and *kv* head, looping over the ``G`` query heads of its
  group and their query tiles, so GQA gradients are summed without atomics) and one kernel for
  ``dQ`` (looping over key tiles). Both recompute the scores with the same depth structure.
* Head dims are padded to powers of two ``>= 16`` with masked loads/stores, so the code obeys
  ``tl.dot``'s GPU shape rules; on CPU it runs under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from ..._checks import require
from ..._compiler import memoized
from .contract import VARLEN_TAGS, check_mlr_arguments, differentiable_ops
from .triton_common import (INTERPRETED, blocks_meet, cdiv, dense_rows, device_table, dot, empty_rows, launch,
                            load_segment, pow2, row_dots, segments_of_documents, segments_of_rows)
from .triton_prefix import PrefixCall, PrefixTiles, miscompiled_on_cuda, mlr_attention_prefix, square_tiles

__all__ = ["mlr_attention_checked", "mlr_attention_route", "mlr_attention_triton"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _fine_level(FOFF, FRANK, FSIZE, level, alive, m0, m_last, n0, n_last):
    """Fine level ``level``'s head-dim offset, rank and block size, and whether the tile pair
    (rows ``[m0, m_last]``, columns ``[n0, n_last]``) shares one of its blocks anywhere (``alive``
    carries the answer of the coarser levels: blocks are nested, so a level no pair shares leaves
    every finer level unshared too)."""
    size = tl.load(FSIZE + level)
    return tl.load(FOFF + level), tl.load(FRANK + level), size, alive & blocks_meet(size, m0, m_last, n0, n_last)


@triton.jit
def _fine_columns(FOFF, FRANK, LP: tl.constexpr, RLP: tl.constexpr):
    """Every fine level's head-dim columns as ``(LP, 1, RLP)`` offsets, and which of them are real."""
    lv = tl.arange(0, LP)
    dl = tl.arange(0, RLP)
    return (tl.load(FOFF + lv)[:, None, None] + dl[None, None, :],
            dl[None, None, :] < tl.load(FRANK + lv)[:, None, None])


@triton.jit
def _fine_scores(s, dep, q_base, k_base, stride_qt, stride_kt, offs_m, offs_n, m_ok, n_ok, m0, m_last, n0, n_last,
                 FOFF, FRANK, FSIZE, NF: tl.constexpr, RLP: tl.constexpr, DEPTH_NORM: tl.constexpr,
                 PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``s`` plus each fine level's partial score where row and column share the level's block, one
    2-D product per level; ``dep`` plus the number of such levels (the depth, for
    ``depth_normalize``). Levels no pair of the tile pair shares are skipped at run time."""
    dl = tl.arange(0, RLP)
    alive = n0 >= 0  # True, as a tensor: the loop carries it
    for level in range(NF):
        off, rank, size, alive = _fine_level(FOFF, FRANK, FSIZE, level, alive, m0, m_last, n0, n_last)
        if alive:
            ql = tl.load(q_base + offs_m[:, None] * stride_qt + off + dl[None, :],
                         mask=m_ok[:, None] & (dl < rank)[None, :], other=0.0)
            kl = tl.load(k_base + offs_n[:, None] * stride_kt + off + dl[None, :],
                         mask=n_ok[:, None] & (dl < rank)[None, :], other=0.0)
            shared = (offs_m[:, None] // size) == (offs_n[None, :] // size)
            s += tl.where(shared, dot(ql, tl.trans(kl), PREC, UPCAST), 0.0)
            if DEPTH_NORM:
                dep += shared.to(tl.float32)
    return s, dep


@triton.jit
def _fine_grads(acc3, ds, base, stride, offs, ok, for_keys: tl.constexpr, offs_m, offs_n, m0, m_last, n0, n_last,
                FOFF, FRANK, FSIZE, NF: tl.constexpr, LP: tl.constexpr, RLP: tl.constexpr, PREC: tl.constexpr,
                UPCAST: tl.constexpr):
    """``acc3`` ``(LP, tile, RLP)`` plus each fine level's gradient in its slot: ``ds`` (queries x
    keys) kept where row and column share the level's block, times the other side's slice of the
    level's head dims (rows ``offs`` from ``base``): ``ds^T q_l`` for the keys (``for_keys``),
    ``ds k_l`` for the queries. The level's slice is loaded again after :func:`_fine_scores` read it
    (from the cache): holding every level's slice across the softmax would bring back the register
    pressure the level loop removes."""
    dl = tl.arange(0, RLP)
    alive = n0 >= 0  # True, as a tensor: the loop carries it
    for level in range(NF):
        off, rank, size, alive = _fine_level(FOFF, FRANK, FSIZE, level, alive, m0, m_last, n0, n_last)
        if alive:
            x = tl.load(base + offs[:, None] * stride + off + dl[None, :], mask=ok[:, None] & (dl < rank)[None, :],
                        other=0.0)
            shared = tl.where((offs_m[:, None] // size) == (offs_n[None, :] // size), ds, 0.0).to(x.dtype)
            if for_keys:
                grad = dot(tl.trans(shared), x, PREC, UPCAST)
            else:
                grad = dot(shared, x, PREC, UPCAST)
            acc3 += tl.where(tl.arange(0, LP)[:, None, None] == level, grad[None, :, :], 0.0)
    return acc3


@triton.jit
def _mlr_fwd_kernel(
    Q, K, V, O, LSE, SEG, FOFF, FRANK, FSIZE,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    H, G, TFULL, R1, DV, scale,
    CAUSAL: tl.constexpr, DEPTH_NORM: tl.constexpr, NF: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    R1P: tl.constexpr, RLP: tl.constexpr, LP: tl.constexpr, DVP: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_sh = tl.program_id(1)
    b, start, T = load_segment(SEG, pid_sh // H)
    h = pid_sh % H
    hk = h // G
    m0 = pid_m * BLOCK_M
    if m0 >= T:  # the grid covers the longest segment
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < T
    m_last = tl.minimum(m0 + BLOCK_M, T) - 1
    d1 = tl.arange(0, R1P)
    dv = tl.arange(0, DVP)
    # Positions are the segment's own: its rows start at `start` in the batch row.
    q_base = Q + b * stride_qb + h * stride_qh + start * stride_qt
    k_base = K + b * stride_kb + hk * stride_kh + start * stride_kt
    v_base = V + b * stride_vb + hk * stride_vh + start * stride_vt

    q1 = tl.load(q_base + offs_m[:, None] * stride_qt + d1[None, :],
                 mask=m_ok[:, None] & (d1 < R1)[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DVP], tl.float32)

    hi = T
    if CAUSAL:
        hi = tl.minimum(m0 + BLOCK_M, T)
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < T
        k1 = tl.load(k_base + offs_n[:, None] * stride_kt + d1[None, :],
                     mask=n_ok[:, None] & (d1 < R1)[None, :], other=0.0)
        s = dot(q1, tl.trans(k1), PREC, UPCAST)
        dep = tl.full([BLOCK_M, BLOCK_N], 1.0, tl.float32)
        n_last = tl.minimum(n0 + BLOCK_N, T) - 1
        s, dep = _fine_scores(s, dep, q_base, k_base, stride_qt, stride_kt, offs_m, offs_n, m_ok, n_ok, m0, m_last,
                              n0, n_last, FOFF, FRANK, FSIZE, NF, RLP, DEPTH_NORM, PREC, UPCAST)
        ok = n_ok[None, :] & (offs_m[:, None] >= 0)
        if CAUSAL:
            ok = ok & (offs_m[:, None] >= offs_n[None, :])
        if DEPTH_NORM:
            s = s * (scale / dep)
        else:
            s = s * scale
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_base + offs_n[:, None] * stride_vt + dv[None, :],
                     mask=n_ok[:, None] & (dv < DV)[None, :], other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(vt.dtype), vt, PREC, UPCAST)
        m_i = m_new

    acc = acc / l_i[:, None]
    o_ptr = O + b * stride_ob + h * stride_oh + (start + offs_m)[:, None] * stride_ot + dv[None, :]
    tl.store(o_ptr, acc.to(O.dtype.element_ty), mask=m_ok[:, None] & (dv < DV)[None, :])
    tl.store(LSE + (b * H + h) * TFULL + start + offs_m, m_i + tl.log(l_i), mask=m_ok)


@triton.jit
def _mlr_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV_, SEG, FOFF, FRANK, FSIZE,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    H, HK, G, TFULL, R1, DV, scale,
    CAUSAL: tl.constexpr, DEPTH_NORM: tl.constexpr, NF: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    R1P: tl.constexpr, RLP: tl.constexpr, LP: tl.constexpr, DVP: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    # DK has k's strides and DV_ has v's strides (all contiguous, same shapes).
    pid_n = tl.program_id(0)
    pid_sh = tl.program_id(1)
    b, start, T = load_segment(SEG, pid_sh // HK)
    hk = pid_sh % HK
    n0 = pid_n * BLOCK_N
    if n0 >= T:  # the grid covers the longest segment
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < T
    n_last = tl.minimum(n0 + BLOCK_N, T) - 1
    d1 = tl.arange(0, R1P)
    dv = tl.arange(0, DVP)
    k_off = b * stride_kb + hk * stride_kh + start * stride_kt
    v_off = b * stride_vb + hk * stride_vh + start * stride_vt

    k1 = tl.load(K + k_off + offs_n[:, None] * stride_kt + d1[None, :],
                 mask=n_ok[:, None] & (d1 < R1)[None, :], other=0.0)
    vt = tl.load(V + v_off + offs_n[:, None] * stride_vt + dv[None, :],
                 mask=n_ok[:, None] & (dv < DV)[None, :], other=0.0)
    dk1 = tl.zeros([BLOCK_N, R1P], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, DVP], tl.float32)
    if NF > 0:  # the fine levels' key gradients, level by level along the first axis
        dk3 = tl.zeros([LP, BLOCK_N, RLP], tl.float32)

    lo = 0
    if CAUSAL:
        lo = (n0 // BLOCK_M) * BLOCK_M
    for g in range(0, G):
        h = hk * G + g
        q_base = Q + b * stride_qb + h * stride_qh + start * stride_qt
        do_base = DO + b * stride_dob + h * stride_doh + start * stride_dot
        row_base = (b * H + h) * TFULL + start
        for m0 in range(lo, T, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < T
            m_last = tl.minimum(m0 + BLOCK_M, T) - 1
            q1 = tl.load(q_base + offs_m[:, None] * stride_qt + d1[None, :],
                         mask=m_ok[:, None] & (d1 < R1)[None, :], other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_dot + dv[None, :],
                         mask=m_ok[:, None] & (dv < DV)[None, :], other=0.0)
            lse = tl.load(LSE + row_base + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(DELTA + row_base + offs_m, mask=m_ok, other=0.0)
            s = dot(q1, tl.trans(k1), PREC, UPCAST)
            dep = tl.full([BLOCK_M, BLOCK_N], 1.0, tl.float32)
            s, dep = _fine_scores(s, dep, q_base, K + k_off, stride_qt, stride_kt, offs_m, offs_n, m_ok, n_ok, m0,
                                  m_last, n0, n_last, FOFF, FRANK, FSIZE, NF, RLP, DEPTH_NORM, PREC, UPCAST)
            ok = n_ok[None, :] & m_ok[:, None]
            if CAUSAL:
                ok = ok & (offs_m[:, None] >= offs_n[None, :])
            if DEPTH_NORM:
                c = scale / dep
            else:
                c = tl.full([BLOCK_M, BLOCK_N], 1.0, tl.float32) * scale
            p = tl.where(ok, tl.exp(s * c - lse[:, None]), 0.0)
            dv_acc += dot(tl.trans(p.to(do.dtype)), do, PREC, UPCAST)
            dp = dot(do, tl.trans(vt), PREC, UPCAST)
            ds = p * (dp - delta[:, None]) * c  # gradient w.r.t. the unscaled partial-dot sum
            dk1 += dot(tl.trans(ds.to(q1.dtype)), q1, PREC, UPCAST)
            if NF > 0:
                dk3 = _fine_grads(dk3, ds, q_base, stride_qt, offs_m, m_ok, True, offs_m, offs_n, m0, m_last, n0,
                                  n_last, FOFF, FRANK, FSIZE, NF, LP, RLP, PREC, UPCAST)

    tl.store(DK + k_off + offs_n[:, None] * stride_kt + d1[None, :], dk1.to(DK.dtype.element_ty),
             mask=n_ok[:, None] & (d1 < R1)[None, :])
    tl.store(DV_ + v_off + offs_n[:, None] * stride_vt + dv[None, :], dv_acc.to(DV_.dtype.element_ty),
             mask=n_ok[:, None] & (dv < DV)[None, :])
    if NF > 0:
        fcol, fcol_ok = _fine_columns(FOFF, FRANK, LP, RLP)
        tl.store(DK + k_off + offs_n[None, :, None] * stride_kt + fcol, dk3.to(DK.dtype.element_ty),
                 mask=n_ok[None, :, None] & fcol_ok)


@triton.jit
def _mlr_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, SEG, FOFF, FRANK, FSIZE,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    H, G, TFULL, R1, DV, scale,
    CAUSAL: tl.constexpr, DEPTH_NORM: tl.constexpr, NF: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    R1P: tl.constexpr, RLP: tl.constexpr, LP: tl.constexpr, DVP: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    # DQ has q's strides.
    pid_m = tl.program_id(0)
    pid_sh = tl.program_id(1)
    b, start, T = load_segment(SEG, pid_sh // H)
    h = pid_sh % H
    hk = h // G
    m0 = pid_m * BLOCK_M
    if m0 >= T:  # the grid covers the longest segment
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < T
    m_last = tl.minimum(m0 + BLOCK_M, T) - 1
    d1 = tl.arange(0, R1P)
    dv = tl.arange(0, DVP)
    q_base = Q + b * stride_qb + h * stride_qh + start * stride_qt
    k_base = K + b * stride_kb + hk * stride_kh + start * stride_kt
    v_base = V + b * stride_vb + hk * stride_vh + start * stride_vt

    q1 = tl.load(q_base + offs_m[:, None] * stride_qt + d1[None, :],
                 mask=m_ok[:, None] & (d1 < R1)[None, :], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + (start + offs_m)[:, None] * stride_dot + dv[None, :],
                 mask=m_ok[:, None] & (dv < DV)[None, :], other=0.0)
    row_base = (b * H + h) * TFULL + start
    lse = tl.load(LSE + row_base + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + row_base + offs_m, mask=m_ok, other=0.0)
    dq1 = tl.zeros([BLOCK_M, R1P], tl.float32)
    if NF > 0:  # the fine levels' query gradients, level by level along the first axis
        dq3 = tl.zeros([LP, BLOCK_M, RLP], tl.float32)

    hi = T
    if CAUSAL:
        hi = tl.minimum(m0 + BLOCK_M, T)
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < T
        n_last = tl.minimum(n0 + BLOCK_N, T) - 1
        k1 = tl.load(k_base + offs_n[:, None] * stride_kt + d1[None, :],
                     mask=n_ok[:, None] & (d1 < R1)[None, :], other=0.0)
        vt = tl.load(v_base + offs_n[:, None] * stride_vt + dv[None, :],
                     mask=n_ok[:, None] & (dv < DV)[None, :], other=0.0)
        s = dot(q1, tl.trans(k1), PREC, UPCAST)
        dep = tl.full([BLOCK_M, BLOCK_N], 1.0, tl.float32)
        s, dep = _fine_scores(s, dep, q_base, k_base, stride_qt, stride_kt, offs_m, offs_n, m_ok, n_ok, m0, m_last,
                              n0, n_last, FOFF, FRANK, FSIZE, NF, RLP, DEPTH_NORM, PREC, UPCAST)
        ok = n_ok[None, :] & m_ok[:, None]
        if CAUSAL:
            ok = ok & (offs_m[:, None] >= offs_n[None, :])
        if DEPTH_NORM:
            c = scale / dep
        else:
            c = tl.full([BLOCK_M, BLOCK_N], 1.0, tl.float32) * scale
        p = tl.where(ok, tl.exp(s * c - lse[:, None]), 0.0)
        dp = dot(do, tl.trans(vt), PREC, UPCAST)
        ds = p * (dp - delta[:, None]) * c
        dq1 += dot(ds.to(k1.dtype), k1, PREC, UPCAST)
        if NF > 0:
            dq3 = _fine_grads(dq3, ds, k_base, stride_kt, offs_n, n_ok, False, offs_m, offs_n, m0, m_last, n0,
                              n_last, FOFF, FRANK, FSIZE, NF, LP, RLP, PREC, UPCAST)

    tl.store(DQ + b * stride_qb + h * stride_qh + (start + offs_m)[:, None] * stride_qt + d1[None, :],
             dq1.to(DQ.dtype.element_ty), mask=m_ok[:, None] & (d1 < R1)[None, :])
    if NF > 0:
        fcol, fcol_ok = _fine_columns(FOFF, FRANK, LP, RLP)
        tl.store(DQ + b * stride_qb + h * stride_qh + (start + offs_m)[None, :, None] * stride_qt + fcol,
                 dq3.to(DQ.dtype.element_ty), mask=m_ok[None, :, None] & fcol_ok)


# --------------------------------------------------------------------------------------------------
# Launch helpers
# --------------------------------------------------------------------------------------------------


class _Plan:
    """Compile-time shape parameters and the fine-level metadata of one call."""

    def __init__(self, dtype: torch.dtype, device: torch.device, dv: int, ranks: tuple[int, ...],
                 sizes: tuple[int, ...], block_m: int, block_n: int) -> None:
        L = len(ranks)
        fine = ranks[1:]
        self.n_fine = L - 1
        self.R1 = ranks[0]
        self.R1P = pow2(ranks[0], 16)
        self.RLP = pow2(max(fine), 16) if fine else 16
        self.LP = pow2(len(fine))
        self.DV = dv
        self.DVP = pow2(self.DV, 16)
        offs, acc = [], ranks[0]
        for r in fine:
            offs.append(acc)
            acc += r
        pad = self.LP - len(fine)
        self.foff = device_table(tuple(offs) + (0,) * pad, torch.int32, device)
        self.frank = device_table(tuple(fine) + (0,) * pad, torch.int32, device)
        self.fsize = device_table(tuple(sizes[1:]) + (1,) * pad, torch.int32, device)
        self.block_m = block_m
        self.block_n = block_n
        self.prec = "ieee" if dtype == torch.float32 else "tf32"
        self.upcast = INTERPRETED and dtype == torch.bfloat16

    def constexprs(self, causal: bool, depth_normalize: bool) -> dict:
        return dict(
            CAUSAL=causal, DEPTH_NORM=depth_normalize, NF=self.n_fine,
            BLOCK_M=self.block_m, BLOCK_N=self.block_n,
            R1P=self.R1P, RLP=self.RLP, LP=self.LP, DVP=self.DVP, PREC=self.prec,
            UPCAST=self.upcast,
            # Two warpgroups: with four warps, Triton 3.6 miscompiles the half-precision kernels for
            # Hopper (wrong gradients, out-of-bounds addresses; H200); with eight they are exact.
            num_warps=8,
        )


@functools.lru_cache(maxsize=256)
def _plan(dtype: torch.dtype, device: torch.device, dv: int, ranks: tuple[int, ...], sizes: tuple[int, ...],
          block_m: int, block_n: int) -> _Plan:
    """The plan of a call, made once per signature (as the prefix-rank kernels' :func:`.plan_of`)."""
    return _Plan(dtype, device, dv, ranks, sizes, block_m, block_n)


def _forward(q, k, v, segments, max_len: int, plan: _Plan, causal: bool, scale: float, depth_normalize: bool):
    B, H, T, _ = q.shape
    segments = segments_of_rows(B, T, q.device) if segments is None else segments
    Hk = k.shape[1]
    o = empty_rows(q, plan.DV)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    grid = (cdiv(max_len, plan.block_m), segments.shape[0] * H)
    launch(_mlr_fwd_kernel, grid,
        q, k, v, o, lse, segments, plan.foff, plan.frank, plan.fsize,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        H, H // Hk, T, plan.R1, plan.DV, float(scale),
        **plan.constexprs(causal, depth_normalize),
    )
    return o, lse


def _backward(q, k, v, o, lse, do, segments, max_len: int, plan: _Plan, causal: bool, scale: float,
              depth_normalize: bool):
    B, H, T, _ = q.shape
    segments = segments_of_rows(B, T, q.device) if segments is None else segments
    Hk = k.shape[1]
    G = H // Hk
    do = dense_rows(do)
    delta = row_dots(do, o)  # (B, H, T)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    common_strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    cx = plan.constexprs(causal, depth_normalize)
    n_segments = segments.shape[0]
    launch(_mlr_bwd_dkdv_kernel, (cdiv(max_len, plan.block_n), n_segments * Hk),
        q, k, v, do, lse, delta, dk, dv, segments, plan.foff, plan.frank, plan.fsize,
        *common_strides,
        H, Hk, G, T, plan.R1, plan.DV, float(scale),
        **cx,
    )
    launch(_mlr_bwd_dq_kernel, (cdiv(max_len, plan.block_m), n_segments * H),
        q, k, v, do, lse, delta, dq, segments, plan.foff, plan.frank, plan.fsize,
        *common_strides,
        H, G, T, plan.R1, plan.DV, float(scale),
        **cx,
    )
    return dq, dk, dv


# ``document_ids``: packed documents ``(B, T)``, each scored as a sequence of its own (varlen), or
# None for whole rows. The ops read their segment table from the ids themselves, so torch.compile
# never traces the host read, and a graph holds a packed batch whole.
def _run_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None,
                 ranks: list[int], sizes: list[int], causal: bool, scale: float, depth_normalize: bool, block_m: int,
                 block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    plan = _plan(q.dtype, q.device, v.shape[-1], tuple(ranks), tuple(sizes), block_m, block_n)
    segments, max_len = segments_of_documents(document_ids, q.shape[2], q.device)
    return _forward(q, k, v, segments, max_len, plan, causal, scale, depth_normalize)


def _forward_fake(q, k, v, document_ids, ranks, sizes, causal, scale, depth_normalize, block_m, block_n):
    B, H, T, _ = q.shape
    return empty_rows(q, v.shape[-1]), q.new_empty(B, H, T, dtype=torch.float32)


def _run_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                  lse: torch.Tensor, document_ids: torch.Tensor | None, ranks: list[int], sizes: list[int],
                  causal: bool, scale: float, depth_normalize: bool, block_m: int,
                  block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = _plan(q.dtype, q.device, v.shape[-1], tuple(ranks), tuple(sizes), block_m, block_n)
    segments, max_len = segments_of_documents(document_ids, q.shape[2], q.device)
    return _backward(q, k, v, o, lse, do, segments, max_len, plan, causal, scale, depth_normalize)


def _backward_fake(do, q, k, v, o, lse, document_ids, ranks, sizes, causal, scale, depth_normalize, block_m, block_n):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_forward_call = differentiable_ops("mlr_triton", _run_forward, _forward_fake, _run_backward, _backward_fake)
# Packed documents: the same functions as ops of their own, which read the ids on the host
_varlen_call = differentiable_ops("mlr_triton_varlen", _run_forward, _forward_fake, _run_backward, _backward_fake,
                                  VARLEN_TAGS)


# --------------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------------


def mlr_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranks: Sequence[int],
    block_sizes: Sequence[int] | None = None,
    causal: bool = True,
    scale: float | None = None,
    depth_normalize: bool = False,
    document_ids: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Exact MLR attention with fused Triton kernels (forward and backward).

    Same contract as :func:`~.reference.mlr_attention_reference`: ``q (B, H, T, R)``,
    ``k (B, Hk, T, R)``, ``v (B, Hk, T, Dv)`` with ``Hk | H`` (GQA: query head ``h`` reads kv head
    ``h // (H // Hk)``), ``ranks`` summing to ``R``, nested ``block_sizes`` with ``s_1 >= T`` (default
    ``T / 2^(l-1)``), ``scale`` default ``1 / sqrt(R)``, optional ``depth_normalize``, optional
    packed ``document_ids`` (each document a segment of the kernels' launch: varlen).

    Extra keyword-only arguments ``block_m`` / ``block_n`` set the query / key tile sizes (powers of
    two, ``>= 16`` for GPU ``tl.dot``; default 64 on CUDA, 16 in the interpreter); they are independent
    of the MLR block sizes.

    Supports float32, float16 and bfloat16 (accumulation in float32; the output has ``q``'s dtype).
    Tensors must be on a CUDA device, or on the CPU with ``TRITON_INTERPRET=1`` set before Triton
    was imported (the interpreter; slow, for tests).

    Raises:
        ValueError: naming the offending parameter.
    """
    ranks, sizes, scale = check_mlr_arguments(q, k, v, ranks, block_sizes, causal, scale, depth_normalize,
                                              document_ids)
    require(q.dtype in _SUPPORTED_DTYPES, "q.dtype", "float32, float16 or bfloat16", q.dtype)
    require(q.device.type == "cuda" or INTERPRETED, "q.device",
            "a CUDA device (or CPU tensors with TRITON_INTERPRET=1 set before importing triton)", q.device)
    for name, bsz in (("block_m", block_m), ("block_n", block_n)):
        require(bsz is None or (isinstance(bsz, int) and bsz >= 1 and bsz & (bsz - 1) == 0), name,
                "a power of two (>= 16 on GPU)", bsz)
    return _attention(q, k, v, ranks, sizes, causal, scale, depth_normalize, document_ids, block_m, block_n)


def mlr_attention_checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranks: tuple[int, ...],
                          sizes: tuple[int, ...], causal: bool, scale: float, depth_normalize: bool,
                          document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`mlr_attention_triton` with the default tiles, for arguments the dispatcher has already
    checked (with their block sizes and scale resolved): the checks are not paid twice per call."""
    return _attention(q, k, v, ranks, sizes, causal, scale, depth_normalize, document_ids, None, None)


def mlr_attention_route(q: torch.Tensor, v: torch.Tensor, ranks: tuple[int, ...], sizes: tuple[int, ...],
                        causal: bool, scale: float, depth_normalize: bool) -> Callable[..., torch.Tensor]:
    """What :func:`mlr_attention_checked` runs for calls of ``q``'s and ``v``'s signature without
    documents, as a function of ``(q, k, v)`` (the dispatcher keeps one per signature it has
    checked): the prefix-rank kernels' :class:`~.triton_prefix.PrefixCall`, prepared, or else the
    general kernels' call with its configuration bound."""
    tile = _default_tile(q.device.type)
    tiles = _prefix_tiles(tuple(sizes), q.dtype, q.device.type, tile, tile, False)
    if tiles is not None:
        return PrefixCall(q, v, ranks, sizes, causal, scale, depth_normalize, tiles)
    return functools.partial(mlr_attention_checked, ranks=ranks, sizes=sizes, causal=causal, scale=scale,
                             depth_normalize=depth_normalize)


def _default_tile(device_type: str) -> int:
    # Small tiles keep the interpreter fast; a GPU wants larger ones.
    return 64 if device_type == "cuda" else 16


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranks: tuple[int, ...], sizes: tuple[int, ...],
               causal: bool, scale: float, depth_normalize: bool, document_ids: torch.Tensor | None,
               block_m: int | None, block_n: int | None) -> torch.Tensor:
    default_tile = _default_tile(q.device.type)
    explicit = block_m is not None or block_n is not None
    block_m, block_n = block_m or default_tile, block_n or default_tile
    tiles = _prefix_tiles(tuple(sizes), q.dtype, q.device.type, block_m, block_n, explicit)
    if tiles is not None:
        return mlr_attention_prefix(q, k, v, ranks, sizes, causal, float(scale), depth_normalize, tiles, document_ids)

    q, k, v = dense_rows(q), dense_rows(k), dense_rows(v)  # layers' transposed views: no copy
    call = _forward_call if document_ids is None else _varlen_call
    out, _ = call(q, k, v, document_ids, list(ranks), list(sizes), causal, float(scale), depth_normalize, block_m,
                  block_n)
    return out


@memoized(maxsize=256)
def _prefix_tiles(sizes: tuple[int, ...], dtype: torch.dtype, device_type: str, block_m: int, block_n: int,
                  explicit: bool) -> PrefixTiles | None:
    """The prefix-rank kernels' tiles for a call, or None for the general kernels (chosen once per
    signature: the host pays for it before the kernels can start)."""
    # The prefix-rank kernels take the call when a tile of 32 rows or more (any in the interpreter)
    # divides every fine block, or, with the default tiles, when the blocks that are not multiples
    # of the tile are small enough to be added on the tiles around the diagonal (sub-tile levels).
    # Explicit tiles that no such tiling fits keep the general kernels (smaller than 32 rows, a tile
    # underuses the matrix units). Both read packed documents from a segment table; a document's
    # positions start at 0, so its tile pairs have the depths a whole row's would.
    if block_m != block_n:
        return None
    largest, smallest, warps = block_m, (block_m if explicit else min(block_m, 32)), 4
    # default tiles: the software-pipeline stages the launch picks for its device (pipeline_stages)
    stages = 2 if explicit else 0
    if not explicit and dtype == torch.float32 and device_type == "cuda":
        # float32 products run on the FMA units, not the matrix units: with 64-row tiles the kernels
        # spill kilobytes per thread and take up to a minute each to compile for sm_90, with 32-row
        # tiles and eight warps next to nothing and about ten seconds (docs/benchmarks.md).
        largest, smallest, warps = 32, 32, 8
    # (Sub-tile levels launch with eight warps on CUDA whatever the tiles say: launch_warps.)
    tiles = square_tiles(sizes[1:], largest, smallest, sub_tile=not explicit, num_warps=warps, num_stages=stages)
    if tiles is not None and device_type == "cuda" and miscompiled_on_cuda(tiles, sizes):
        return None
    return tiles
