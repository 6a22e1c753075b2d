"""One query per row against the slots of a static cache (``StaticKVCache``), as a custom op, so
that ``torch.compile`` keeps it whole: the read stays PyTorch's fused attention kernel (with the
slots as a boolean mask) instead of generated loops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["masked_decode"]


@torch.library.custom_op("sattn::masked_decode", mutates_args=())
def masked_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of ``q (B, H, 1, D)`` over the slots of ``k (B, Hk, N, D)`` that ``real``
    ``(B, N)`` marks, times ``v (B, Hk, N, Dv)``; returns ``(B, H, 1, Dv)`` in the cache's dtype.

    The cache's dtype decides, autocast or not (a bfloat16 query from autocast's projections reads
    a float32 cache in float32), so eager and compiled steps compute the same thing: a compiled
    graph runs its custom ops outside autocast."""
    mask: torch.Tensor | None = real[:, None, None, :]
    if q.device.type == "cpu":
        # Here the op may read the mask (no device to wait for, no graph to keep fixed): it reads
        # the slots up to the last real one only, so that a static cache early in its context costs
        # what a growing one does, and no mask where every row's slots up to there are real.
        n = real.shape[1] - int(real.any(0).flip(0).to(torch.uint8).argmax())  # no real slot: all of them
        k, v, real = k[:, :, :n], v[:, :, :n], real[:, :n]
        mask = None if int(real.sum()) == real.numel() else real[:, None, None, :]
    with torch.autocast(q.device.type, enabled=False):
        return F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])


@masked_decode.register_fake
def _(q, k, v, real, scale):
    return v.new_empty(*q.shape[:3], v.shape[-1])
