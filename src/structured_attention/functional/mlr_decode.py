"""One decoding step of MLR attention against the compressed cache (SPEC section 3).

A new token at position ``p = end - 1`` scores key ``j`` with every level whose block holds both
``p`` and ``j``. Level 1 covers the whole context, so its keys are kept for every position; level
``l > 1`` only meets keys of the token's own level-``l`` block, so the cache keeps just those,
positions ``[p - p % s_l, end)``. One token therefore reads ``end * r_1 + sum_l (p % s_l + 1) r_l``
key numbers and the ``end * Dv`` value numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_mlr_decode_arguments", "grouped_matmul", "mlr_decode", "mlr_decode_reference"]


def check_mlr_decode_arguments(
    q: torch.Tensor, keys: Sequence[torch.Tensor], key_starts: Sequence[int], v: torch.Tensor, ranks: Sequence[int],
) -> None:
    """Raise a one-line ``ValueError`` naming the argument unless the shapes fit one decoding step."""
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q: expected (batch, heads, 1, sum(ranks)), got shape {tuple(q.shape)}")
    if len(keys) != len(ranks) or len(key_starts) != len(ranks):
        raise ValueError(f"keys, key_starts: expected one per level ({len(ranks)}), "
                         f"got {len(keys)} and {len(key_starts)}")
    if q.shape[-1] != sum(ranks):
        raise ValueError(f"q: expected last dim sum(ranks)={sum(ranks)}, got {q.shape[-1]}")
    end = v.shape[2]
    if key_starts[0] != 0 or not all(0 <= s < end for s in key_starts):
        raise ValueError(f"key_starts: expected 0 for level 1 and positions below {end}, got {list(key_starts)}")
    for level, (k, r, start) in enumerate(zip(keys, ranks, key_starts)):
        if k.shape[:2] != v.shape[:2] or k.shape[2] != end - start or k.shape[3] != r:
            raise ValueError(f"keys[{level}]: expected shape {(*v.shape[:2], end - start, r)}, got {tuple(k.shape)}")
    if q.shape[1] % v.shape[1]:
        raise ValueError(f"q: expected a multiple of the {v.shape[1]} kv heads, got {q.shape[1]} heads")


def grouped_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a: (B, H, t, n) @ b: (B, Hk, n, m)`` with query head ``h`` reading ``b``'s head ``h // (H/Hk)``."""
    bsz, h, t, n = a.shape
    hk = b.shape[1]
    return (a.reshape(bsz, hk, h // hk, t, n) @ b.unsqueeze(2)).reshape(bsz, h, t, b.shape[-1])


def mlr_decode_reference(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    key_starts: Sequence[int],
    v: torch.Tensor,
    ranks: Sequence[int],
    scale: float,
    depth_normalize: bool = False,
) -> torch.Tensor:
    """One new query against the compressed MLR cache, level by level in PyTorch.

    Args:
        q: the new token's queries ``(B, H, 1, R)``, ``R = sum(ranks)``, at position ``end - 1``.
        keys: per level, the keys held ``(B, Hk, end - key_starts[l], r_l)`` for positions
            ``[key_starts[l], end)``; ``key_starts[0] == 0`` (level 1 keeps every key).
        key_starts: the first position held per level (the start of the token's level block).
        v: values ``(B, Hk, end, Dv)``; ``H`` a multiple of ``Hk`` (GQA).
        ranks: ``r_1..r_L``.
        scale: logit scale.
        depth_normalize: divide each score by the number of levels that score the pair.

    Returns:
        ``(B, H, 1, Dv)`` in ``v``'s dtype; equal to the last row of
        :func:`structured_attention.functional.mlr_attention` over the whole sequence.
    """
    check_mlr_decode_arguments(q, keys, key_starts, v, ranks)
    acc = torch.promote_types(v.dtype, torch.float32)
    end = v.shape[2]
    scores = depth = None
    for q_l, k_l, start in zip(q.split(list(ranks), dim=-1), keys, key_starts):
        part = grouped_matmul(q_l * scale, k_l.transpose(-1, -2)).to(acc)
        if scores is None:
            scores = part
            depth = torch.ones(end, dtype=acc, device=v.device) if depth_normalize else None
            continue
        scores[..., start:] += part
        if depth is not None:
            depth[start:] += 1
    assert scores is not None
    if depth is not None:
        scores = scores / depth
    return grouped_matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def mlr_decode(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    key_starts: Sequence[int],
    v: torch.Tensor,
    ranks: Sequence[int],
    scale: float,
    depth_normalize: bool = False,
) -> torch.Tensor:
    """:func:`mlr_decode_reference`'s contract on the fastest correct path: a fused Triton kernel
    (split over the keys, flash-decoding style) for CUDA tensors when Triton is installed, the C++
    kernel on the CPU when it builds, else the PyTorch reference. The kernels are not
    differentiable, so a step that needs gradients takes the reference."""
    args = (q, keys, key_starts, v, ranks, scale, depth_normalize)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, v, *keys)):
        return mlr_decode_reference(*args)
    if q.is_cuda:
        from structured_attention.kernels import HAS_TRITON, mlr_decode_triton

        if HAS_TRITON:
            return mlr_decode_triton(*args)
    elif q.device.type == "cpu":
        from structured_attention.kernels import mlr_cpu

        if mlr_cpu.available():
            return mlr_cpu.mlr_decode_cpu(*args)
    return mlr_decode_reference(*args)
