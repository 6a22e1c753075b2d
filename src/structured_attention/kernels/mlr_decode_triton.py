"""A fused Triton kernel for one MLR decoding step against the compressed cache.

:func:`mlr_decode_triton` has the contract of
:func:`structured_attention.functional.mlr_decode.mlr_decode_reference`.

Design (flash-decoding): the keys ``[0, end)`` are cut into ``n_splits`` chunks; one program per
(batch, kv head, chunk) scores the ``G = H / Hk`` query heads of its group against the chunk, tile
by tile, with an online softmax, and writes its partial ``(max, sum, weighted values)``; a second
kernel merges the chunks per query head. The held ranges are nested (``start_2 <= start_3 <= ...``),
so the keys fall into regions of one depth: keys before ``start_2`` read level 1 (``r_1`` dims)
and the values only, keys in ``[start_l, start_{l+1})`` also the first ``l - 1`` finer levels. Each
region is its own loop with the level count a compile-time constant, and the products run on the
matrix units (the query heads of a group padded to 16 rows). The finer levels live in separate
buffers of different shapes, so the kernel gets a table of their addresses and strides.
Everything accumulates in float32. A new token needs no causal mask: every key held is at or
before it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from structured_attention.functional.mlr_decode import check_mlr_decode_arguments
from structured_attention.kernels.triton_common import INTERPRETED, device_table, dot, dot_acc, pow2

__all__ = ["mlr_decode_triton"]


@triton.jit
def _pick(vec, lv, i):
    """Entry ``i`` of a small vector held in registers (loop-invariant, so hoisted out of loops)."""
    return tl.sum(tl.where(lv == i, vec, 0), axis=0)


@triton.jit
def _mlr_decode_split_kernel(
    Q, K0, V, FINE_PTRS, FINE_STRIDES, FINE_STARTS, FINE_QOFF, FINE_RANK, ACC, M, L,
    end, chunk, qk_scale, N_SPLITS,
    stride_qb, stride_qh, stride_k0b, stride_k0h, stride_k0t, stride_vb, stride_vh, stride_vt,
    HK: tl.constexpr, G: tl.constexpr,
    R0: tl.constexpr, DV: tl.constexpr, N_FINE: tl.constexpr, DEPTH_NORMALIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, R0P: tl.constexpr, RFP: tl.constexpr, DVP: tl.constexpr, BLOCK_N: tl.constexpr,
    NFP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_bk = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bk // HK
    hk = pid_bk % HK
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    q_rows = Q + b * stride_qb + (hk * G + g) * stride_qh  # (BLOCK_G,) row starts
    d0 = tl.arange(0, R0P)
    q0 = tl.load(q_rows[:, None] + d0[None, :], mask=g_ok[:, None] & (d0[None, :] < R0), other=0.0)
    dv = tl.arange(0, DVP)
    df = tl.arange(0, RFP)
    lv = tl.arange(0, NFP)
    lv_ok = lv < N_FINE
    starts = tl.load(FINE_STARTS + lv, mask=lv_ok, other=0)
    ptrs = tl.load(FINE_PTRS + lv, mask=lv_ok, other=0)
    sbs = tl.load(FINE_STRIDES + 3 * lv, mask=lv_ok, other=0)
    shs = tl.load(FINE_STRIDES + 3 * lv + 1, mask=lv_ok, other=0)
    sts = tl.load(FINE_STRIDES + 3 * lv + 2, mask=lv_ok, other=0)
    qoffs = tl.load(FINE_QOFF + lv, mask=lv_ok, other=0)
    ranks = tl.load(FINE_RANK + lv, mask=lv_ok, other=0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, DVP], tl.float32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, end)
    # The held ranges are nested (start_2 <= start_3 <= ...), so the keys fall into regions of one
    # depth: region j, [start of fine level j - 1, start of fine level j), reads level 1 and the
    # first j fine levels, with no per-key test.
    for j in tl.static_range(N_FINE + 1):
        r_lo = lo
        r_hi = hi
        if j > 0:
            r_lo = tl.maximum(lo, _pick(starts, lv, j - 1))
        if j < N_FINE:
            r_hi = tl.minimum(hi, _pick(starts, lv, j))
        for n0 in range(r_lo, r_hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < r_hi
            k0 = tl.load(K0 + b * stride_k0b + hk * stride_k0h + n[:, None] * stride_k0t + d0[None, :],
                         mask=n_ok[:, None] & (d0[None, :] < R0), other=0.0)
            s = dot(q0, tl.trans(k0), PREC, UPCAST)  # (BLOCK_G, BLOCK_N)
            for i in tl.static_range(j):
                ptr = _pick(ptrs, lv, i).to(tl.pointer_type(K0.dtype.element_ty))
                rank = _pick(ranks, lv, i)
                kl = tl.load(ptr + b * _pick(sbs, lv, i) + hk * _pick(shs, lv, i)
                             + (n - _pick(starts, lv, i))[:, None] * _pick(sts, lv, i) + df[None, :],
                             mask=n_ok[:, None] & (df[None, :] < rank), other=0.0)
                ql = tl.load(q_rows[:, None] + _pick(qoffs, lv, i) + df[None, :],
                             mask=g_ok[:, None] & (df[None, :] < rank), other=0.0)
                s = dot_acc(ql, tl.trans(kl), s, PREC, UPCAST)
            if DEPTH_NORMALIZE:
                s = s * (qk_scale / (j + 1))
            else:
                s = s * qk_scale
            s = tl.where(n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            vt = tl.load(V + b * stride_vb + hk * stride_vh + n[:, None] * stride_vt + dv[None, :],
                         mask=n_ok[:, None] & (dv[None, :] < DV), other=0.0)
            acc = dot_acc(p.to(vt.dtype), vt, acc * alpha[:, None], PREC, UPCAST)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
    row = (pid_bk * G + g) * N_SPLITS + split  # partials laid out (B, H, N_SPLITS), maxima in base 2
    tl.store(M + row, m_i, mask=g_ok)
    tl.store(L + row, l_i, mask=g_ok)
    tl.store(ACC + row[:, None] * DV + dv[None, :], acc, mask=g_ok[:, None] & (dv[None, :] < DV))


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


def mlr_decode_triton(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    key_starts: Sequence[int],
    v: torch.Tensor,
    ranks: Sequence[int],
    scale: float,
    depth_normalize: bool = False,
    *,
    chunk: int | None = None,
    block_n: int = 128,
    num_warps: int = 4,
) -> torch.Tensor:
    """One new query against the compressed MLR cache in two kernel launches; same arguments and
    result as :func:`~structured_attention.functional.mlr_decode.mlr_decode_reference`. ``chunk``
    (keys per program, a multiple of ``block_n``) defaults to enough programs to fill the device."""
    check_mlr_decode_arguments(q, keys, key_starts, v, ranks)
    q = q.to(v.dtype)  # under autocast the new query can be bfloat16 while the cache is float32
    tensors = [("v", v), *((f"keys[{i}]", k) for i, k in enumerate(keys))]
    for name, x in tensors:
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or x.dtype != v.dtype:
            raise ValueError(f"{name}: expected float32, float16 or bfloat16 like v ({v.dtype}), got {x.dtype}")
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dim, got strides {tuple(x.stride())}")
    B, H = q.shape[:2]
    Hk, end, Dv = v.shape[1], v.shape[2], v.shape[3]
    device = q.device
    if chunk is None:  # about four programs per multiprocessor, each over whole tiles
        per = triton.cdiv(end, max(1, 4 * _multiprocessors(device) // (B * Hk)))
        chunk = triton.cdiv(per, block_n) * block_n
    if chunk <= 0 or chunk % block_n:
        raise ValueError(f"chunk: expected a positive multiple of block_n={block_n}, got {chunk}")
    n_splits = triton.cdiv(end, chunk)
    fine = list(zip(keys[1:], key_starts[1:], ranks[1:]))
    offsets = tuple(sum(ranks[:i]) for i in range(1, len(ranks)))
    # The table changes only when a level's block ends or a buffer grows.
    ptrs = device_table(tuple(k.data_ptr() for k, _, _ in fine) or (0,), torch.int64, device)
    strides = device_table(tuple(s for k, _, _ in fine for s in k.stride()[:3]) or (0, 0, 0), torch.int64, device)
    starts = device_table(tuple(s for _, s, _ in fine) or (0,), torch.int32, device)
    qoff = device_table(offsets or (0,), torch.int32, device)
    rank = device_table(tuple(r for _, _, r in fine) or (0,), torch.int32, device)
    part_acc = torch.empty(B, H, n_splits, Dv, dtype=torch.float32, device=device)
    part_m = torch.empty(B, H, n_splits, dtype=torch.float32, device=device)
    part_l = torch.empty_like(part_m)
    k0 = keys[0]
    G = H // Hk
    _mlr_decode_split_kernel[(B * Hk, n_splits)](
        q, k0, v, ptrs, strides, starts, qoff, rank, part_acc, part_m, part_l,
        end, chunk, float(scale) / math.log(2.0), n_splits,
        q.stride(0), q.stride(1), k0.stride(0), k0.stride(1), k0.stride(2), v.stride(0), v.stride(1), v.stride(2),
        HK=Hk, G=G, R0=ranks[0], DV=Dv, N_FINE=len(fine), DEPTH_NORMALIZE=depth_normalize,
        BLOCK_G=pow2(G, 16), R0P=pow2(ranks[0], 16), RFP=pow2(max(ranks[1:], default=1), 16),
        DVP=pow2(Dv, 16), BLOCK_N=block_n, NFP=pow2(len(fine)),
        PREC="ieee" if v.dtype == torch.float32 else "tf32", UPCAST=INTERPRETED and v.dtype == torch.bfloat16,
        num_warps=num_warps,
    )
    out = torch.empty(B, H, 1, Dv, dtype=v.dtype, device=device)
    _mlr_decode_merge_kernel[(B * H,)](part_acc, part_m, part_l, out, n_splits, SP=pow2(n_splits),
                                       DV=Dv, DVP=pow2(Dv))
    return out
