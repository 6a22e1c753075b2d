"""One query per row against every slot of a static cache (``StaticKVCache``), as a custom op, so
that ``torch.compile`` keeps it whole: the products over the cache stay ATen's matrix products
instead of generated loops."""

from __future__ import annotations

import torch

from structured_attention.ops.mlr.contract import grouped_matmul, masked_mix

__all__ = ["masked_decode"]


@torch.library.custom_op("sattn::masked_decode", mutates_args=())
def masked_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of ``q (B, H, 1, D)`` over the slots of ``k (B, Hk, N, D)`` that ``real``
    ``(B, N)`` marks, times ``v (B, Hk, N, Dv)``; returns ``(B, H, 1, Dv)``."""
    return masked_mix(grouped_matmul(q, k.transpose(-1, -2)) * scale, real, v)


@masked_decode.register_fake
def _(q, k, v, real, scale):
    return q.new_empty(*q.shape[:3], v.shape[-1])
