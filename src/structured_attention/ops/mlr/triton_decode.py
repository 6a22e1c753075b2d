"""A fused Triton kernel for one MLR decoding step against the compressed cache.

:func:`mlr_decode_triton` has the contract of :func:`~.reference.mlr_decode_reference`; the two
launches run inside one ``torch.library`` custom op (``sattn::mlr_triton_decode``).

Design (flash-decoding): the keys ``[0, end)`` are cut into ``n_splits`` chunks; one program per
(batch, kv head, chunk) scores the ``G = H / Hk`` query heads of its group against the chunk, tile
by tile, with an online softmax, and writes its partial ``(max, sum, weighted values)``; a second
kernel merges the chunks per query head. The held ranges are nested (``start_2 <= start_3 <= ...``),
so the keys fall into regions of one depth: keys before ``start_2`` read level 1 (``r_1`` dims)
and the values only, keys in ``[start_l, start_{l+1})`` also the first ``l - 1`` finer levels. Each
region is its own loop with the level count a compile-time constant, and the products run on the
matrix units (the query heads of a group padded to 16 rows). The finer levels live in separate
buffers of different shapes, so the kernel gets a table of their offsets from level 1's buffer
and their strides. Everything accumulates in float32. A new token needs no causal mask: every key held is at or
before it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..._checks import require
from .contract import check_mlr_cache_arguments
from .triton_common import INTERPRETED, cdiv, device_table, dot, dot_acc, pow2

__all__ = ["decode", "mlr_decode_triton"]


@triton.jit
def _program_rows(Q, K0, V, stride_qb, stride_qh, stride_k0b, stride_k0h, stride_vb, stride_vh,
                  HK: tl.constexpr, G: tl.constexpr, R0: tl.constexpr, BLOCK_G: tl.constexpr, R0P: tl.constexpr):
    """This program's (batch, kv head, split), its group's query rows (``BLOCK_G`` row starts, the
    level-1 dims loaded), and the bases of its level-1 keys (contiguous rows of ``R0``) and values."""
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
def _split_start(split, chunk, end, BLOCK_G: tl.constexpr, DVP: tl.constexpr):
    """The keys ``[lo, hi)`` of this split and an empty online softmax for its query rows."""
    lo = split * chunk
    return (lo, tl.minimum(lo + chunk, end), tl.full([BLOCK_G], float("-inf"), tl.float32),
            tl.zeros([BLOCK_G], tl.float32), tl.zeros([BLOCK_G, DVP], tl.float32))


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
def _mlr_decode_split_kernel(
    Q, K0, V, FINE_OFFS, FINE_STRIDES, FINE_STARTS, FINE_QOFF, FINE_RANK, ROW_STARTS, ACC, M, L,
    end, chunk, qk_scale, N_SPLITS,
    stride_qb, stride_qh, stride_k0b, stride_k0h, stride_vb, stride_vh, stride_vt,
    HK: tl.constexpr, G: tl.constexpr,
    R0: tl.constexpr, DV: tl.constexpr, N_FINE: tl.constexpr, DEPTH_NORMALIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, R0P: tl.constexpr, RFP: tl.constexpr, DVP: tl.constexpr, BLOCK_N: tl.constexpr,
    ALIGN: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, HAS_ROW_STARTS: tl.constexpr,
):
    pid_bk, split, b, hk, g, g_ok, q_rows, d0, q0, k0_rows, v_rows = _program_rows(
        Q, K0, V, stride_qb, stride_qh, stride_k0b, stride_k0h, stride_vb, stride_vh, HK, G, R0, BLOCK_G, R0P)
    dv = tl.arange(0, DVP)
    df = tl.arange(0, RFP)

    lo, hi, m_i, l_i, acc = _split_start(split, chunk, end, BLOCK_G, DVP)
    # The held ranges are nested (start_2 <= start_3 <= ...), so the keys fall into regions of one
    # depth: region j, [start of fine level j - 1, start of fine level j), reads level 1 and the
    # first j fine levels, with no per-key test. The per-level tables are read as scalars (uniform
    # loads that stay in cache); ALIGN, which divides every fine level's offset and strides, lets
    # the compiler issue vector loads for their rows.
    # Left-padded rows (ROW_STARTS, (B, N_FINE + 1)): the row attends from its own start on and
    # its region boundaries move to its own block starts, which are nested too.
    for j in tl.static_range(N_FINE + 1):
        r_lo = lo
        r_hi = hi
        if j > 0:
            bound = tl.load(FINE_STARTS + (j - 1))
            if HAS_ROW_STARTS:
                bound = tl.maximum(bound, tl.load(ROW_STARTS + b * (N_FINE + 1) + j).to(tl.int32))
            r_lo = tl.maximum(lo, bound)
        elif HAS_ROW_STARTS:
            r_lo = tl.maximum(lo, tl.load(ROW_STARTS + b * (N_FINE + 1)).to(tl.int32))
        if j < N_FINE:
            bound = tl.load(FINE_STARTS + j)
            if HAS_ROW_STARTS:
                bound = tl.maximum(bound, tl.load(ROW_STARTS + b * (N_FINE + 1) + j + 1).to(tl.int32))
            r_hi = tl.minimum(hi, bound)
        for n0 in range(r_lo, r_hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < r_hi
            k0 = tl.load(k0_rows + n[:, None] * R0 + d0[None, :], mask=n_ok[:, None] & (d0[None, :] < R0), other=0.0)
            s = dot(q0, tl.trans(k0), PREC, UPCAST)  # (BLOCK_G, BLOCK_N)
            for i in tl.static_range(j):
                rank = tl.load(FINE_RANK + i)
                row = tl.multiple_of(tl.load(FINE_OFFS + i) + b * tl.load(FINE_STRIDES + 3 * i)
                                     + hk * tl.load(FINE_STRIDES + 3 * i + 1), ALIGN)
                step = tl.multiple_of(tl.load(FINE_STRIDES + 3 * i + 2), ALIGN)
                kl = tl.load(K0 + row + (n - tl.load(FINE_STARTS + i))[:, None] * step + df[None, :],
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


@functools.lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@functools.lru_cache(maxsize=64)
def _level_tables(r0: int, fine_ranks: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per finer level: its first query dim and its rank (the per-level kernel's tables)."""
    offsets = tuple(r0 + sum(fine_ranks[:i]) for i in range(len(fine_ranks)))
    return (device_table(offsets or (0,), torch.int32, device),
            device_table(fine_ranks or (0,), torch.int32, device))


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
    block_n: int = 128,
    num_warps: int = 4,
    num_stages: int = 2,
    maxnreg: int | None = 128,
) -> torch.Tensor:
    """One new query against the compressed MLR cache in two kernel launches; same arguments and
    result as :func:`~.reference.mlr_decode_reference`. ``chunk`` (keys per program, a multiple of
    ``block_n``) defaults to enough programs to fill the device; ``maxnreg`` caps the registers per
    thread, which bound how many programs a multiprocessor holds. The defaults were the fastest on
    an H200 at a 16k cache (docs/benchmarks.md): uncapped, the kernel takes 230 registers, so a
    multiprocessor holds two programs and the grid runs in two waves; at 128 registers and two
    stages it holds four, one wave."""
    ranks = check_mlr_cache_arguments(q, keys, key_starts, v, ranks, scale, depth_normalize, one_query=True,
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
    block_n: int = 128,
    num_warps: int = 4,
    num_stages: int = 2,
    maxnreg: int | None = 128,
) -> torch.Tensor:
    """:func:`mlr_decode_triton` on arguments already checked against the contract (the
    dispatcher's entry: a decoding step is checked once); the kernel's own requirements are
    checked here."""
    require(v.dtype in (torch.float32, torch.float16, torch.bfloat16), "v.dtype", "float32, float16 or bfloat16", v.dtype)
    for name, x in [("v", v), *((f"keys[{i}]", k) for i, k in enumerate(keys))]:
        require(x.stride(-1) == 1, name, "a contiguous last dim", f"strides {tuple(x.stride())}")
    require(chunk is None or (isinstance(chunk, int) and chunk > 0 and chunk % block_n == 0), "chunk",
            f"a positive multiple of block_n={block_n} or None", chunk)
    return _decode_op(q.to(v.dtype).contiguous(), list(keys), list(key_starts), v, list(ranks), float(scale), depth_normalize,
                      row_starts, chunk, block_n, num_warps, num_stages, maxnreg)


@torch.library.custom_op("sattn::mlr_triton_decode", mutates_args=())
def _decode_op(q: torch.Tensor, keys: list[torch.Tensor], key_starts: list[int], v: torch.Tensor, ranks: list[int],
               scale: float, depth_normalize: bool, row_starts: torch.Tensor | None, chunk: int | None, block_n: int,
               num_warps: int, num_stages: int,
               maxnreg: int | None) -> torch.Tensor:
    B, H = q.shape[:2]
    Hk, end, Dv = v.shape[1], v.shape[2], v.shape[3]
    device = q.device
    if chunk is None:  # about four programs per multiprocessor, each over whole tiles
        per = cdiv(end, max(1, 4 * _multiprocessors(device) // (B * Hk)))
        chunk = cdiv(per, block_n) * block_n
    n_splits = cdiv(end, chunk)
    k0 = keys[0]
    if end > 1 and k0.stride(2) != ranks[0]:  # the kernel steps level-1 rows by R0
        k0 = k0.contiguous()
    size = k0.element_size()
    # A view whose address is not a whole number of elements from level 1's is copied.
    fine = [(k if (k.data_ptr() - k0.data_ptr()) % size == 0 else k.contiguous(), s, r)
            for k, s, r in zip(keys[1:], key_starts[1:], ranks[1:])]
    # Offsets in elements from level 1's buffer, so that the kernel addresses every level from one
    # pointer; ALIGN, the largest power of two (at most 16 bytes' worth) dividing all of them and
    # the strides, tells the compiler how wide its loads may be.
    offs = tuple((k.data_ptr() - k0.data_ptr()) // size for k, _, _ in fine)
    strides = tuple(s for k, _, _ in fine for s in k.stride()[:3])
    # The tables change only when a level's block ends or a buffer grows.
    offs_t = device_table(offs or (0,), torch.int64, device)
    strides_t = device_table(strides or (0, 0, 0), torch.int64, device)
    starts = device_table(tuple(s for _, s, _ in fine) or (0,), torch.int32, device)
    part_acc = torch.empty(B, H, n_splits, Dv, dtype=torch.float32, device=device)
    part_m = torch.empty(B, H, n_splits, dtype=torch.float32, device=device)
    part_l = torch.empty_like(part_m)
    G = H // Hk
    common = dict(HK=Hk, G=G, R0=ranks[0], DV=Dv, N_FINE=len(fine), DEPTH_NORMALIZE=depth_normalize,
                  BLOCK_G=pow2(G, 16), R0P=pow2(ranks[0], 16), DVP=pow2(Dv, 16), BLOCK_N=block_n,
                  PREC="ieee" if v.dtype == torch.float32 else "tf32",
                  UPCAST=INTERPRETED and v.dtype == torch.bfloat16,
                  num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg)
    scalars = (end, chunk, float(scale) / math.log(2.0), n_splits,
               q.stride(0), q.stride(1), k0.stride(0), k0.stride(1), v.stride(0), v.stride(1), v.stride(2))
    fine_ranks = tuple(ranks[1:])
    qoff, rank = _level_tables(ranks[0], fine_ranks, device)
    rows = starts if row_starts is None else row_starts.contiguous()
    _mlr_decode_split_kernel[(B * Hk, n_splits)](
        q, k0, v, offs_t, strides_t, starts, qoff, rank, rows, part_acc, part_m, part_l, *scalars,
        RFP=pow2(max(fine_ranks, default=1), 16), ALIGN=math.gcd(16 // size, *offs, *strides),
        HAS_ROW_STARTS=row_starts is not None, **common,
    )
    out = torch.empty(B, H, 1, Dv, dtype=v.dtype, device=device)
    _mlr_decode_merge_kernel[(B * H,)](part_acc, part_m, part_l, out, n_splits, SP=pow2(n_splits),
                                       DV=Dv, DVP=pow2(Dv))
    return out


@_decode_op.register_fake
def _(q, keys, key_starts, v, ranks, scale, depth_normalize, row_starts, chunk, block_n, num_warps, num_stages,
      maxnreg):
    return v.new_empty(q.shape[0], q.shape[1], 1, v.shape[-1])
