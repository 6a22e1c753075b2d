"""PyTorch's scaled_dot_product_attention, kept on its fused CPU kernel when head dims differ."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with the same arguments.

    PyTorch's fused CPU kernel needs equal query/key and value head dims and otherwise falls back
    to materialising every score; on the CPU the narrower side is zero-padded instead, which leaves
    the scores and the output unchanged.
    """
    e, dv = q.shape[-1], v.shape[-1]
    if q.device.type != "cpu" or e == dv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    scale = 1.0 / math.sqrt(e) if scale is None else scale
    if e < dv:
        q, k = F.pad(q, (0, dv - e)), F.pad(k, (0, dv - e))
    else:
        v = F.pad(v, (0, e - dv))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                         is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return out[..., :dv]
