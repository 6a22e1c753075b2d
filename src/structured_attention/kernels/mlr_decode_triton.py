"""A fused Triton kernel for one MLR decoding step against the compressed cache.

:func:`mlr_decode_triton` has the contract of
:func:`structured_attention.functional.mlr_decode.mlr_decode_reference`.

Design (flash-decoding): the keys ``[0, end)`` are cut into ``n_splits`` chunks; one program per
(batch, kv head, chunk) scores the ``G = H / Hk`` query heads of its group against the chunk, tile
by tile, with an online softmax, and writes its partial ``(max, sum, weighted values)``; a second
kernel merges the chunks per query head. A tile reads the level-1 keys (``r_1`` dims) and, for each
finer level ``l`` whose held range ``[start_l, end)`` it meets, that level's keys, masked to the
positions held; tiles before ``start_2`` read level 1 and the values only. The finer levels live in
separate buffers of different shapes, so the kernel gets a table of their addresses and strides.
Everything accumulates in float32. A new token needs no causal mask: every key held is at or
before it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from structured_attention.functional.mlr_decode import check_mlr_decode_arguments

__all__ = ["mlr_decode_triton"]


@triton.jit
def _mlr_decode_split_kernel(
    Q, K0, V, FINE_PTRS, FINE_STRIDES, FINE_STARTS, FINE_QOFF, FINE_RANK, ACC, M, L,
    end, chunk, scale, N_SPLITS,
    stride_qb, stride_qh, stride_k0b, stride_k0h, stride_k0t, stride_vb, stride_vh, stride_vt,
    HK: tl.constexpr, G: tl.constexpr,
    R0: tl.constexpr, DV: tl.constexpr, N_FINE: tl.constexpr, DEPTH_NORMALIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, R0P: tl.constexpr, RFP: tl.constexpr, DVP: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_bk = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bk // HK
    hk = pid_bk % HK
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    q_rows = Q + b * stride_qb + (hk * G + g) * stride_qh  # (BLOCK_G,) row starts
    d0 = tl.arange(0, R0P)
    q0 = tl.load(q_rows[:, None] + d0[None, :], mask=g_ok[:, None] & (d0[None, :] < R0), other=0.0).to(tl.float32)
    dv = tl.arange(0, DVP)
    df = tl.arange(0, RFP)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, DVP], tl.float32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, end)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        k0 = tl.load(K0 + b * stride_k0b + hk * stride_k0h + n[:, None] * stride_k0t + d0[None, :],
                     mask=n_ok[:, None] & (d0[None, :] < R0), other=0.0).to(tl.float32)
        s = tl.sum(q0[:, None, :] * k0[None, :, :], axis=2)  # (BLOCK_G, BLOCK_N)
        depth = tl.full([BLOCK_N], 1.0, tl.float32)
        for level in tl.static_range(N_FINE):
            start = tl.load(FINE_STARTS + level)
            if n0 + BLOCK_N > start:  # the tile meets the keys held for this level
                ptr = tl.load(FINE_PTRS + level).to(tl.pointer_type(K0.dtype.element_ty))
                sb = tl.load(FINE_STRIDES + 3 * level)
                sh = tl.load(FINE_STRIDES + 3 * level + 1)
                st = tl.load(FINE_STRIDES + 3 * level + 2)
                rank = tl.load(FINE_RANK + level)
                held = n_ok & (n >= start)
                kl = tl.load(ptr + b * sb + hk * sh + (n - start)[:, None] * st + df[None, :],
                             mask=held[:, None] & (df[None, :] < rank), other=0.0).to(tl.float32)
                ql = tl.load(q_rows[:, None] + tl.load(FINE_QOFF + level) + df[None, :],
                             mask=g_ok[:, None] & (df[None, :] < rank), other=0.0).to(tl.float32)
                s += tl.where(held[None, :], tl.sum(ql[:, None, :] * kl[None, :, :], axis=2), 0.0)
                depth += held.to(tl.float32)
        s = s * scale
        if DEPTH_NORMALIZE:
            s = s / depth[None, :]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        vt = tl.load(V + b * stride_vb + hk * stride_vh + n[:, None] * stride_vt + dv[None, :],
                     mask=n_ok[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vt[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    row = (pid_bk * G + g) * N_SPLITS + split  # partials laid out (B, H, N_SPLITS)
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
    w = tl.where(sp_ok, tl.exp(m - tl.max(m, axis=0)), 0.0)
    total = tl.sum(w * tl.load(L + bh * N_SPLITS + sp, mask=sp_ok, other=0.0), axis=0)
    acc = tl.load(ACC + (bh * N_SPLITS + sp)[:, None] * DV + dv[None, :], mask=sp_ok[:, None] & (dv[None, :] < DV),
                  other=0.0)
    out = tl.sum(w[:, None] * acc, axis=0) / total
    tl.store(OUT + bh * DV + dv, out.to(OUT.dtype.element_ty), mask=dv < DV)


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


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
    block_n: int = 64,
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
    if chunk is None:  # about 128 programs in all, each over whole tiles
        per = triton.cdiv(end, max(1, 128 // (B * Hk)))
        chunk = triton.cdiv(per, block_n) * block_n
    if chunk <= 0 or chunk % block_n:
        raise ValueError(f"chunk: expected a positive multiple of block_n={block_n}, got {chunk}")
    n_splits = triton.cdiv(end, chunk)
    device, fine = q.device, list(zip(keys[1:], key_starts[1:], ranks[1:]))
    offsets = [sum(ranks[:i]) for i in range(1, len(ranks))]
    ptrs = torch.tensor([k.data_ptr() for k, _, _ in fine] or [0], dtype=torch.int64, device=device)
    strides = torch.tensor([s for k, _, _ in fine for s in k.stride()[:3]] or [0, 0, 0], dtype=torch.int64,
                           device=device)
    starts = torch.tensor([s for _, s, _ in fine] or [0], dtype=torch.int32, device=device)
    qoff = torch.tensor(offsets or [0], dtype=torch.int32, device=device)
    rank = torch.tensor([r for _, _, r in fine] or [0], dtype=torch.int32, device=device)
    part_acc = torch.empty(B, H, n_splits, Dv, dtype=torch.float32, device=device)
    part_m = torch.empty(B, H, n_splits, dtype=torch.float32, device=device)
    part_l = torch.empty_like(part_m)
    k0 = keys[0]
    G = H // Hk
    _mlr_decode_split_kernel[(B * Hk, n_splits)](
        q, k0, v, ptrs, strides, starts, qoff, rank, part_acc, part_m, part_l,
        end, chunk, float(scale), n_splits,
        q.stride(0), q.stride(1), k0.stride(0), k0.stride(1), k0.stride(2), v.stride(0), v.stride(1), v.stride(2),
        HK=Hk, G=G, R0=ranks[0], DV=Dv, N_FINE=len(fine), DEPTH_NORMALIZE=depth_normalize,
        BLOCK_G=_pow2(G), R0P=_pow2(ranks[0]), RFP=_pow2(max(ranks[1:], default=1)), DVP=_pow2(Dv),
        BLOCK_N=block_n,
    )
    out = torch.empty(B, H, 1, Dv, dtype=v.dtype, device=device)
    _mlr_decode_merge_kernel[(B * H,)](part_acc, part_m, part_l, out, n_splits, SP=_pow2(n_splits),
                                       DV=Dv, DVP=_pow2(Dv))
    return out
