"""A fused Triton kernel for one MLR decoding step against the compressed cache.

:func:`mlr_decode_triton` has the contract of :func:`~.reference.mlr_decode_reference`; the two
launches run inside one ``torch.library`` custom op (``sattn::mlr_triton_decode``).

Design (flash-decoding): each row's held keys are cut into ``n_splits`` splits; one program per
(batch, kv head, split) scores the ``G = H / Hk`` query heads of its group against the split, tile
by tile, with an online softmax, and writes its partial ``(max, sum, weighted values)``; a second
kernel merges the splits per query head. The held ranges are nested (``start_2 <= start_3 <= ...``),
so the keys fall into regions of one depth: keys before ``start_2`` read level 1 (``r_1`` dims)
and the values only, keys in ``[start_l, start_{l+1})`` also the first ``l - 1`` finer levels. The
splits are cut so that each reads the same bytes (whole tiles), not the same number of keys, which
would leave the splits at the end of the cache, where every finer level is held, the most. Each
region is its own loop with the level count a compile-time constant, and the products run on the
matrix units (the query heads of a group padded to 16 rows). The finer levels live in separate
buffers of different shapes, so the kernel gets a table of their offsets from one base pointer
and their strides. Everything accumulates in float32. A new token needs no causal mask: every key
held is at or before it.

:func:`decode_static` runs the same kernel against a static cache (``StaticKVCache``): the buffers
span the context, the last key held is the slot read on the device, a finer level's position ``p``
sits at ``p % s_l`` of its ring, and each row's block starts follow from its first real slot, so
nothing is read on the host and a captured CUDA graph replays the step at every position.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..._checks import require
from .contract import check_mlr_cache_arguments, compiled_or_eager
from .triton_common import INTERPRETED, cdiv, cuda_properties, device_table, dot, dot_acc, launch, pow2

__all__ = ["decode", "decode_static", "mlr_decode_triton", "prepare_static"]


@triton.jit
def _program_rows(Q, K0, V, stride_qb, stride_qh, stride_k0b, stride_k0h, stride_vb, stride_vh,
                  HK: tl.constexpr, G: tl.constexpr, R0: tl.constexpr, BLOCK_G: tl.constexpr, R0P: tl.constexpr):
    """This program's (batch, kv head, split), its group's query rows (``BLOCK_G`` row starts, the
    level-1 dims loaded), and the bases of its level-1 keys (rows of ``R0``) and values."""
    pid_bk = tl.program_id(0)
    b = pid_bk // HK
    hk = pid_bk % HK
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    q_rows = Q + b * stride_qb + (hk * G + g) * stride_qh
    d0 = tl.arange(0, R0P)
    q0 = tl.load(q_rows[:, None] + d0[None, :], mask=g_ok[:, None] & (d0[None, :] < R0), other=0.0)
    return (pid_bk, tl.program_id(1), b, hk, g, g_ok, q_rows, d0, q0, K0 + b * stride_k0b + hk * stride_k0h,
            V + b * stride_vb + hk * stride_vh)


@triton.jit
def _softmax_step(s, n, n_ok, v_rows, stride_vt, dv, m_i, l_i, acc, DV: tl.constexpr, PREC: tl.constexpr,
                  UPCAST: tl.constexpr):
    """Fold one tile's scaled scores ``s`` (base 2) and its values into the online softmax."""
    s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    vt = tl.load(v_rows + n[:, None] * stride_vt + dv[None, :], mask=n_ok[:, None] & (dv[None, :] < DV), other=0.0)
    acc = dot_acc(p.to(vt.dtype), vt, acc * alpha[:, None], PREC, UPCAST)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _store_partials(ACC, M, L, pid_bk, split, N_SPLITS, g, g_ok, dv, m_i, l_i, acc, G: tl.constexpr,
                    DV: tl.constexpr):
    row = (pid_bk * G + g) * N_SPLITS + split  # partials laid out (B, H, N_SPLITS), maxima in base 2
    tl.store(M + row, m_i, mask=g_ok)
    tl.store(L + row, l_i, mask=g_ok)
    tl.store(ACC + row[:, None] * DV + dv[None, :], acc, mask=g_ok[:, None] & (dv[None, :] < DV))


@triton.jit
def _row_start(ROW_STARTS, FINE_RING, b, level, last, N_FINE: tl.constexpr, RINGS: tl.constexpr):
    """Row ``b``'s first key at ``level`` (0: level 1): read from ``ROW_STARTS`` ``(B, N_FINE + 1)``;
    for a static cache (``RINGS``) derived from its first real slot ``ROW_STARTS[b]`` and the slot
    ``last``: the start of its current block of the level's size."""
    if RINGS:
        first = tl.load(ROW_STARTS + b).to(tl.int32)
        if level > 0:
            size = tl.load(FINE_RING + (level - 1))
            first = first + (last - first) // size * size
        return first
    return tl.load(ROW_STARTS + b * (N_FINE + 1) + level).to(tl.int32)


@triton.jit
def _region_start(j: tl.constexpr, b, last, FINE_STARTS, ROW_STARTS, FINE_RING, N_FINE: tl.constexpr,
                  HAS_ROW_STARTS: tl.constexpr, RINGS: tl.constexpr):
    """Row ``b``'s first key of depth ``j + 1``: its first key (0 unless the row starts later) for
    ``j = 0``, the first key fine level ``j`` holds for the row after it."""
    if j == 0:
        start = 0
        if HAS_ROW_STARTS:
            start = _row_start(ROW_STARTS, FINE_RING, b, 0, last, N_FINE, RINGS)
    else:
        start = tl.load(FINE_STARTS + (j - 1)).to(tl.int32)
        if HAS_ROW_STARTS:
            start = tl.maximum(start, _row_start(ROW_STARTS, FINE_RING, b, j, last, N_FINE, RINGS))
    return start


@triton.jit
def _region(j: tl.constexpr, first, held_end, b, last, FINE_STARTS, ROW_STARTS, FINE_RING, FINE_RANK,
            R0: tl.constexpr, DV: tl.constexpr, RF: tl.constexpr, N_FINE: tl.constexpr,
            HAS_ROW_STARTS: tl.constexpr, RINGS: tl.constexpr):
    """Row ``b``'s held keys of depth ``j + 1``, ``[lo, hi)`` within ``[first, held_end)``, and the
    numbers each of them reads: ``R0 + DV`` and the ranks of the ``j`` finer levels it holds."""
    lo = _region_start(j, b, last, FINE_STARTS, ROW_STARTS, FINE_RING, N_FINE, HAS_ROW_STARTS, RINGS)
    hi = held_end
    if j < N_FINE:
        hi = _region_start(j + 1, b, last, FINE_STARTS, ROW_STARTS, FINE_RING, N_FINE, HAS_ROW_STARTS, RINGS)
    lo = tl.minimum(tl.maximum(lo, first), held_end)
    hi = tl.minimum(tl.maximum(hi, lo), held_end)
    if RF > 0:
        weight = R0 + DV + j * RF
    else:
        weight = R0 + DV
        for i in tl.static_range(j):
            weight += tl.load(FINE_RANK + i)
    return lo, hi, weight


@triton.jit
def _split_by_bytes(split, n_splits, b, last, held_end, FINE_STARTS, ROW_STARTS, FINE_RING, FINE_RANK,
                    R0: tl.constexpr, DV: tl.constexpr, RF: tl.constexpr, N_FINE: tl.constexpr,
                    HAS_ROW_STARTS: tl.constexpr, RINGS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keys ``[lo, hi)`` of split ``split`` of ``n_splits``: the row's held keys cut into ranges
    that read equal bytes (see :func:`_region`), the inner boundaries rounded down to whole tiles.
    Keys cut into equal counts would leave the splits at the end of the cache, where every finer
    level is held, with the most bytes."""
    first = _region_start(0, b, last, FINE_STARTS, ROW_STARTS, FINE_RING, N_FINE, HAS_ROW_STARTS, RINGS)
    total = tl.zeros([], tl.int64)
    for j in tl.static_range(N_FINE + 1):
        lo_j, hi_j, weight = _region(j, first, held_end, b, last, FINE_STARTS, ROW_STARTS, FINE_RING, FINE_RANK, R0,
                                     DV, RF, N_FINE, HAS_ROW_STARTS, RINGS)
        total += (hi_j - lo_j).to(tl.int64) * weight
    lo_bytes = total * split // n_splits
    hi_bytes = total * (split + 1) // n_splits
    lo = first
    hi = first
    done = tl.zeros([], tl.int64)
    for j in tl.static_range(N_FINE + 1):  # the key at which each boundary's bytes are reached
        lo_j, hi_j, weight = _region(j, first, held_end, b, last, FINE_STARTS, ROW_STARTS, FINE_RING, FINE_RANK, R0,
                                     DV, RF, N_FINE, HAS_ROW_STARTS, RINGS)
        keys = (hi_j - lo_j).to(tl.int64)
        lo = tl.where(lo_bytes >= done, lo_j + tl.minimum((lo_bytes - done) // weight, keys), lo)
        hi = tl.where(hi_bytes >= done, lo_j + tl.minimum((hi_bytes - done) // weight, keys), hi)
        done += keys * weight
    lo = tl.where(lo_bytes >= total, held_end, tl.maximum(first, lo // BLOCK_N * BLOCK_N)).to(tl.int32)
    hi = tl.where(hi_bytes >= total, held_end, tl.maximum(first, hi // BLOCK_N * BLOCK_N)).to(tl.int32)
    return lo, hi


@triton.jit
def _mlr_decode_split_kernel(
    Q, K0, KF, V, FINE_OFFS, FINE_STRIDES, FINE_STARTS, FINE_QOFF, FINE_RANK, ROW_STARTS, SLOT, FINE_RING, ACC, M, L,
    end, qk_scale, N_SPLITS,
    stride_qb, stride_qh, stride_k0b, stride_k0h, k0_rows_apart, stride_vb, stride_vh, v_rows_apart,
    HK: tl.constexpr, G: tl.constexpr,
    R0: tl.constexpr, DV: tl.constexpr, N_FINE: tl.constexpr, DEPTH_NORMALIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, R0P: tl.constexpr, RF: tl.constexpr, RFP: tl.constexpr, DVP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIGN: tl.constexpr, KV_ALIGN: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    HAS_ROW_STARTS: tl.constexpr, RINGS: tl.constexpr, POW2_RINGS: tl.constexpr,
    SHALLOW: tl.constexpr, SHALLOW_STAGES: tl.constexpr,
):
    # SHALLOW: the first regions, whose tiles are narrower, loop with SHALLOW_STAGES pipeline
    # stages, one more than the deeper ones (see _shallow_regions)
    pid_bk, split, b, hk, g, g_ok, q_rows, d0, q0, k0_rows, v_rows = _program_rows(
        Q, K0, V, stride_qb, stride_qh, stride_k0b, stride_k0h, stride_vb, stride_vh, HK, G, R0, BLOCK_G, R0P)
    dv = tl.arange(0, DVP)
    df = tl.arange(0, RFP)
    # The level-1 key and value row strides come in units of KV_ALIGN elements, which divides both:
    # multiplied by a compile-time constant, their rows are known to be aligned (a stride argument
    # that is not a multiple of 16 carries no alignment), so they load as vectors, a tile ahead,
    # whether they sit in buffers of their own or interleaved in one (a token's key and value in one row).
    stride_k0t = k0_rows_apart * KV_ALIGN
    stride_vt = v_rows_apart * KV_ALIGN

    last = 0
    held_end = end
    if RINGS:  # a static cache: the buffers span the context, the keys held end at the slot on the device
        last = tl.load(SLOT).to(tl.int32)
        held_end = last + 1
    lo, hi = _split_by_bytes(split, N_SPLITS, b, last, held_end, FINE_STARTS, ROW_STARTS, FINE_RING, FINE_RANK,
                             R0, DV, RF, N_FINE, HAS_ROW_STARTS, RINGS, BLOCK_N)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, DVP], tl.float32)
    # The held ranges are nested (start_2 <= start_3 <= ...), so the keys fall into regions of one
    # depth: region j, [start of fine level j - 1, start of fine level j), reads level 1 and the
    # first j fine levels, with no per-key test. The per-level tables are read as scalars (uniform
    # loads that stay in cache); ALIGN, which divides every fine level's offset and strides, lets
    # the compiler issue vector loads for their rows.
    # Left-padded rows (ROW_STARTS, (B, N_FINE + 1)): the row attends from its own start on and
    # its region boundaries move to its own block starts, which are nested too.
    first = _region_start(0, b, last, FINE_STARTS, ROW_STARTS, FINE_RING, N_FINE, HAS_ROW_STARTS, RINGS)
    for j in tl.static_range(N_FINE + 1):
        r_lo, r_hi, _ = _region(j, first, held_end, b, last, FINE_STARTS, ROW_STARTS, FINE_RING, FINE_RANK, R0, DV,
                                RF, N_FINE, HAS_ROW_STARTS, RINGS)
        r_lo = tl.maximum(lo, r_lo)
        r_hi = tl.minimum(hi, r_hi)
        for n0 in tl.range(r_lo, r_hi, BLOCK_N, num_stages=SHALLOW_STAGES if j < SHALLOW else None):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < r_hi
            k0 = tl.load(k0_rows + n[:, None] * stride_k0t + d0[None, :], mask=n_ok[:, None] & (d0[None, :] < R0),
                         other=0.0)
            s = dot(q0, tl.trans(k0), PREC, UPCAST)  # (BLOCK_G, BLOCK_N)
            for i in tl.static_range(j):
                # A rank known at compile time (RF: every finer level's, when they are equal) keeps
                # the load's mask constant along a row, so the rows load as vectors and the loads are
                # issued a tile ahead; a rank read from the table leaves each load to its own tile.
                if RF > 0:
                    rank = RF
                else:
                    rank = tl.load(FINE_RANK + i)
                row = tl.multiple_of(tl.load(FINE_OFFS + i) + b * tl.load(FINE_STRIDES + 3 * i)
                                     + hk * tl.load(FINE_STRIDES + 3 * i + 1), ALIGN)
                step = tl.multiple_of(tl.load(FINE_STRIDES + 3 * i + 2), ALIGN)
                if RINGS:  # position p of a finer level sits at p % (its block size)
                    if POW2_RINGS:  # a mask instead of a division per key
                        at = n & (tl.load(FINE_RING + i) - 1)
                    else:
                        at = n % tl.load(FINE_RING + i)
                else:
                    at = n - tl.load(FINE_STARTS + i)
                kl = tl.load(KF + row + at[:, None] * step + df[None, :],
                             mask=n_ok[:, None] & (df[None, :] < rank), other=0.0)
                ql = tl.load(q_rows[:, None] + tl.load(FINE_QOFF + i) + df[None, :],
                             mask=g_ok[:, None] & (df[None, :] < rank), other=0.0)
                s = dot_acc(ql, tl.trans(kl), s, PREC, UPCAST)
            if DEPTH_NORMALIZE:
                s = s * (qk_scale / (j + 1))
            else:
                s = s * qk_scale
            m_i, l_i, acc = _softmax_step(s, n, n_ok, v_rows, stride_vt, dv, m_i, l_i, acc, DV, PREC, UPCAST)
    _store_partials(ACC, M, L, pid_bk, split, N_SPLITS, g, g_ok, dv, m_i, l_i, acc, G, DV)


@triton.jit
def _mlr_decode_merge_kernel(ACC, M, L, OUT, N_SPLITS, SP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr):
    bh = tl.program_id(0)
    sp = tl.arange(0, SP)
    sp_ok = sp < N_SPLITS
    dv = tl.arange(0, DVP)
    m = tl.load(M + bh * N_SPLITS + sp, mask=sp_ok, other=float("-inf"))
    w = tl.where(sp_ok, tl.exp2(m - tl.max(m, axis=0)), 0.0)
    total = tl.sum(w * tl.load(L + bh * N_SPLITS + sp, mask=sp_ok, other=0.0), axis=0)
    acc = tl.load(ACC + (bh * N_SPLITS + sp)[:, None] * DV + dv[None, :], mask=sp_ok[:, None] & (dv[None, :] < DV),
                  other=0.0)
    out = tl.sum(w[:, None] * acc, axis=0) / total
    tl.store(OUT + bh * DV + dv, out.to(OUT.dtype.element_ty), mask=dv < DV)


# The split kernel's launch defaults (mlr_decode_triton's docstring says why), for growing and
# static caches alike.
_DEFAULT_BLOCK_N, _DEFAULT_WARPS, _DEFAULT_STAGES, _DEFAULT_MAXNREG = 64, 4, 3, 128


@functools.lru_cache(maxsize=64)
def _shallow_regions(num_stages: int, r0p: int, dvp: int, n_fine: int, rf_staged: int) -> int:
    """How many leading regions (depth 1, 2, ...) loop with one pipeline stage more than the
    kernel's ``num_stages``: those whose tiles, held ``num_stages`` times in shared memory, take no
    more of it than the deepest region's, held ``num_stages - 1`` times. Each region's loop has
    buffers of its own and the kernel's shared memory is that of its largest, so these regions
    load a further tile ahead at no cost in shared memory or programs per multiprocessor. With 8
    levels of rank 8 and 64 value dims: four regions at the default three stages, two at two
    (level 1 and the values alone, and with level 2: 70 % of the bytes a step reads at the end of a
    16k cache). ``r0p``, ``dvp``: level 1's and the values' padded widths; ``rf_staged``: the finer
    levels' rank where their tiles are staged in shared memory (all equal: ``RF``), else 0. Worked
    out once per combination: a decoding step launches the kernel in every layer."""
    rf = pow2(rf_staged, 16) if rf_staged else 0
    deepest = r0p + n_fine * rf + dvp
    shallow = 0
    while shallow < n_fine and num_stages * (r0p + shallow * rf + dvp) <= (num_stages - 1) * deepest:
        shallow += 1
    return shallow


def _multiprocessors(device: torch.device) -> int:
    props = cuda_properties(device)
    return 4 if props is None else props.multi_processor_count  # the interpreter's: any small count


class _Tables(NamedTuple):
    """Where the kernel finds each level: level 1's buffer, the finer levels' base pointer and the
    device tables of their offsets from it, strides, first held positions, query dims, ranks and
    (static caches) ring sizes; ``align``, the largest power of two (at most 16 bytes' worth)
    dividing every offset and stride, tells the compiler how wide its loads may be."""

    k0: torch.Tensor
    base: torch.Tensor
    fine: list[torch.Tensor]  # held while the kernel runs: a level copied for alignment lives here
    offsets: torch.Tensor
    strides: torch.Tensor
    starts: torch.Tensor
    query_dims: torch.Tensor
    ranks: torch.Tensor
    rings: torch.Tensor
    align: int


def _tables(keys: Sequence[torch.Tensor], key_starts: Sequence[int], ranks: Sequence[int],
            rings: Sequence[int] | None) -> _Tables:
    """The kernel's view of ``keys``. The finer levels are addressed from one pointer: level 1's
    buffer for a growing cache, the first ring for a static one, whose rings share one allocation
    (so the offsets depend on shapes alone, and a copied cache reuses the tables). The tables are
    made once per distinct content (:func:`device_table`) and change only when a level's block
    ends or a buffer grows."""
    k0 = keys[0]
    size, device = k0.element_size(), k0.device
    base = keys[1] if rings is not None and len(keys) > 1 else k0
    # a level whose address is not a whole number of elements from the base is copied
    fine = [k if (k.data_ptr() - base.data_ptr()) % size == 0 else k.contiguous() for k in keys[1:]]
    offsets = tuple((k.data_ptr() - base.data_ptr()) // size for k in fine)
    strides = tuple(s for k in fine for s in k.stride()[:3])
    query_dims = tuple(ranks[0] + sum(ranks[1:i]) for i in range(1, len(ranks)))
    starts = device_table(tuple(key_starts[1:]) or (0,), torch.int32, device)
    return _Tables(k0, base, fine, device_table(offsets or (0,), torch.int64, device),
                   device_table(strides or (0, 0, 0), torch.int64, device), starts,
                   device_table(query_dims or (0,), torch.int32, device),
                   device_table(tuple(ranks[1:]) or (0,), torch.int32, device),
                   device_table(tuple(rings) or (1,), torch.int32, device) if rings is not None else starts,
                   math.gcd(16 // size, *offsets, *strides))


def prepare_static(keys: Sequence[torch.Tensor], ranks: Sequence[int], block_sizes: Sequence[int]) -> None:
    """Make the tables :func:`decode_static` reads for these static buffers now, before any CUDA
    graph of the step is captured (see :func:`.static.prepare_static`)."""
    _tables(keys, [0] * len(keys), ranks, block_sizes[1:])


def mlr_decode_triton(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    key_starts: Sequence[int],
    v: torch.Tensor,
    ranks: Sequence[int],
    scale: float,
    depth_normalize: bool = False,
    row_starts: torch.Tensor | None = None,
    *,
    chunk: int | None = None,
    block_n: int = _DEFAULT_BLOCK_N,
    num_warps: int = _DEFAULT_WARPS,
    num_stages: int = _DEFAULT_STAGES,
    maxnreg: int | None = _DEFAULT_MAXNREG,
) -> torch.Tensor:
    """One new query against the compressed MLR cache in two kernel launches; same arguments and
    result as :func:`~.reference.mlr_decode_reference`. ``chunk`` (a multiple of ``block_n``) sets
    the number of programs per (row, key head), ``ceil(keys / chunk)``, each reading an equal share
    of the bytes; by default enough programs to fill the device. ``maxnreg`` caps the registers per
    thread, which bound how many programs a multiprocessor holds: uncapped, the kernel took 230
    registers on an H200, so a multiprocessor held two programs and the grid ran in two waves; at
    128 four, one wave, the fastest there at a 16k cache (docs/benchmarks.md). ``num_stages`` is the
    deepest regions'; the first ones take one more where their tiles fit in the same shared memory
    (:func:`_shallow_regions`). Tiles of 64 keys with three stages hold the next tile in flight in
    every region in the shared memory of one 128-key tile, with fewer instructions and no spill
    (compiled for sm_90; to be timed against 128 keys and two stages, the default before)."""
    ranks, scale = check_mlr_cache_arguments(q, keys, key_starts, v, ranks, scale, depth_normalize, one_query=True,
                                             row_starts=row_starts)
    return decode(q, keys, key_starts, v, ranks, scale, depth_normalize, row_starts=row_starts, chunk=chunk,
                  block_n=block_n, num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg)


def decode(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    key_starts: Sequence[int],
    v: torch.Tensor,
    ranks: Sequence[int],
    scale: float,
    depth_normalize: bool,
    *,
    row_starts: torch.Tensor | None = None,
    chunk: int | None = None,
    block_n: int = _DEFAULT_BLOCK_N,
    num_warps: int = _DEFAULT_WARPS,
    num_stages: int = _DEFAULT_STAGES,
    maxnreg: int | None = _DEFAULT_MAXNREG,
) -> torch.Tensor:
    """:func:`mlr_decode_triton` on arguments already checked against the contract (the
    dispatcher's entry: a decoding step is checked once); the kernel's own requirements are
    checked here."""
    require(v.dtype in (torch.float32, torch.float16, torch.bfloat16), "v.dtype", "float32, float16 or bfloat16", v.dtype)
    for name, x in [("v", v), *((f"keys[{i}]", k) for i, k in enumerate(keys))]:
        require(x.stride(-1) == 1, name, "a contiguous last dim", f"strides {tuple(x.stride())}")
    require(chunk is None or (isinstance(chunk, int) and chunk > 0 and chunk % block_n == 0), "chunk",
            f"a positive multiple of block_n={block_n} or None", chunk)
    return _decode_step(q.to(v.dtype).contiguous(), list(keys), list(key_starts), v, list(ranks), float(scale),
                        depth_normalize, row_starts, chunk, block_n, num_warps, num_stages, maxnreg)


@torch.library.custom_op("sattn::mlr_triton_decode", mutates_args=())
def _decode_op(q: torch.Tensor, keys: list[torch.Tensor], key_starts: list[int], v: torch.Tensor, ranks: list[int],
               scale: float, depth_normalize: bool, row_starts: torch.Tensor | None, chunk: int | None, block_n: int,
               num_warps: int, num_stages: int,
               maxnreg: int | None) -> torch.Tensor:
    return _launch(q, keys, key_starts, v, ranks, scale, depth_normalize, row_starts, chunk, block_n, num_warps,
                   num_stages, maxnreg)


def decode_static(q: torch.Tensor, keys: Sequence[torch.Tensor], v: torch.Tensor, slot: torch.Tensor,
                  offsets: torch.Tensor, ranks: Sequence[int], block_sizes: Sequence[int], scale: float,
                  depth_normalize: bool, *, chunk: int | None = None, block_n: int = _DEFAULT_BLOCK_N) -> torch.Tensor:
    """One decoding step against a static cache (see :mod:`.static`): the kernel above with the
    buffers spanning the context, the keys held ending at ``slot``, level ``l > 1``'s position
    ``p`` at ``p % block_sizes[l - 1]`` of its ring, and each row's block starts derived from its
    first real slot ``offsets[b]``, all read on the device: a captured graph replays it for every
    position. ``chunk`` and ``block_n`` as for :func:`mlr_decode_triton`, with the buffers' length
    (the context) setting the number of splits, which share the keys held up to the slot: early in
    the context every program still has its part."""
    require(v.dtype in (torch.float32, torch.float16, torch.bfloat16), "v.dtype", "float32, float16 or bfloat16", v.dtype)
    return _launch(q.to(v.dtype).contiguous(), list(keys), [0] * len(keys), v, list(ranks), float(scale),
                   depth_normalize, offsets, chunk, block_n, _DEFAULT_WARPS, _DEFAULT_STAGES, _DEFAULT_MAXNREG,
                   slot=slot, rings=list(block_sizes[1:]))


def _launch(q: torch.Tensor, keys: list[torch.Tensor], key_starts: list[int], v: torch.Tensor, ranks: list[int],
            scale: float, depth_normalize: bool, row_starts: torch.Tensor | None, chunk: int | None, block_n: int,
            num_warps: int, num_stages: int, maxnreg: int | None, slot: torch.Tensor | None = None,
            rings: list[int] | None = None) -> torch.Tensor:
    B, H = q.shape[:2]
    Hk, end, Dv = v.shape[1], v.shape[2], v.shape[3]
    device = q.device
    if chunk is None:  # about four programs per multiprocessor, each over whole tiles
        per = cdiv(end, max(1, 4 * _multiprocessors(device) // (B * Hk)))
        chunk = cdiv(per, block_n) * block_n
    n_splits = cdiv(end, chunk)
    t = _tables(keys, key_starts, ranks, rings)
    k0, size = t.k0, t.k0.element_size()
    part_acc = torch.empty(B, H, n_splits, Dv, dtype=torch.float32, device=device)
    part_m = torch.empty(B, H, n_splits, dtype=torch.float32, device=device)
    part_l = torch.empty_like(part_m)
    G = H // Hk
    common = dict(HK=Hk, G=G, R0=ranks[0], DV=Dv, N_FINE=len(ranks) - 1, DEPTH_NORMALIZE=depth_normalize,
                  BLOCK_G=pow2(G, 16), R0P=pow2(ranks[0], 16), DVP=pow2(Dv, 16), BLOCK_N=block_n,
                  PREC="ieee" if v.dtype == torch.float32 else "tf32",
                  UPCAST=INTERPRETED and v.dtype == torch.bfloat16,
                  num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg)
    kv_align = math.gcd(16 // size, k0.stride(2), v.stride(2))
    scalars = (end, float(scale) / math.log(2.0), n_splits, q.stride(0), q.stride(1), k0.stride(0), k0.stride(1),
               k0.stride(2) // kv_align, v.stride(0), v.stride(1), v.stride(2) // kv_align)
    rows = t.starts if row_starts is None else row_starts.contiguous()
    equal_rank = ranks[1] if len(set(ranks[1:])) == 1 else 0  # the finer levels' rank, if one
    launch(_mlr_decode_split_kernel, (B * Hk, n_splits),
        q, k0, t.base, v, t.offsets, t.strides, t.starts, t.query_dims, t.ranks, rows,
        t.starts if slot is None else slot, t.rings, part_acc, part_m, part_l, *scalars,
        RF=equal_rank, RFP=pow2(max(ranks[1:], default=1), 16), ALIGN=t.align, KV_ALIGN=kv_align,
        HAS_ROW_STARTS=row_starts is not None, RINGS=slot is not None,
        POW2_RINGS=rings is not None and all(r & (r - 1) == 0 for r in rings),
        SHALLOW=_shallow_regions(num_stages, common["R0P"], common["DVP"], common["N_FINE"], equal_rank),
        SHALLOW_STAGES=num_stages + 1, **common,
    )
    out = torch.empty(B, H, 1, Dv, dtype=v.dtype, device=device)
    launch(_mlr_decode_merge_kernel, (B * H,), part_acc, part_m, part_l, out, n_splits, SP=pow2(n_splits), DV=Dv,
           DVP=pow2(Dv))
    return out


@_decode_op.register_fake
def _(q, keys, key_starts, v, ranks, scale, depth_normalize, row_starts, chunk, block_n, num_warps, num_stages,
      maxnreg):
    return v.new_empty(q.shape[0], q.shape[1], 1, v.shape[-1])


# outside torch.compile without the op's dispatch: Python paid on every step and layer
_decode_step = compiled_or_eager(_decode_op, _launch)
