"""One query per row against the slots of a static cache (``StaticKVCache``), as custom ops, so
that ``torch.compile`` keeps them whole: the read stays PyTorch's fused attention kernel (with the
slots as a boolean mask) instead of generated loops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["decode_full_slots", "masked_decode", "prefix_decode", "real_slots"]


def real_slots(positions: torch.Tensor, offsets: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``(B, N)``: which of the slots holding ``positions`` ``(N,)`` hold a real token of each row,
    from the row's first real position ``offsets[b]`` (left padding before it) to the current
    one, ``slot``."""
    return (positions[None] >= offsets[:, None]) & (positions[None] <= slot)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    # The cache's dtype decides, autocast or not (a bfloat16 query from autocast's projections
    # reads a float32 cache in float32), so eager and compiled steps compute the same thing: a
    # compiled graph runs its custom ops outside autocast.
    with torch.autocast(q.device.type, enabled=False):
        return F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])


@torch.library.custom_op("sattn::masked_decode", mutates_args=())
def masked_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of ``q (B, H, 1, D)`` over the slots of ``k (B, Hk, N, D)`` that ``real``
    ``(B, N)`` marks, times ``v (B, Hk, N, Dv)``; returns ``(B, H, 1, Dv)`` in the cache's dtype."""
    mask: torch.Tensor | None = real[:, None, None, :]
    if q.device.type == "cpu":
        # Here the op may read the mask (no device to wait for, no graph to keep fixed): it reads
        # the slots up to the last real one only, so that a static cache early in its context costs
        # what a growing one does, and no mask where every row's slots up to there are real.
        n = real.shape[1] - int(real.any(0).flip(0).to(torch.uint8).argmax())  # no real slot: all of them
        k, v, real = k[:, :, :n], v[:, :, :n], real[:, :n]
        mask = None if int(real.sum()) == real.numel() else real[:, None, None, :]
    return _attend(q, k, v, mask, scale)


@masked_decode.register_fake
def _(q, k, v, real, scale):
    return v.new_empty(*q.shape[:3], v.shape[-1])


@torch.library.custom_op("sattn::prefix_decode", mutates_args=(), device_types="cpu")
def prefix_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, slot: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """:func:`masked_decode` over a full buffer's slots ``0..slot`` (slot ``j`` holds position
    ``j``), row ``b``'s real ones from ``offsets[b]`` on, on the CPU: it reads ``slot`` and
    ``offsets`` on the host and builds a mask only where a row is left-padded, of the slots up to
    ``slot``. (Built in a compiled step instead, inductor's loop for the ``(B, N)`` mask over the
    whole context cost more than the step's other element-wise work: :func:`decode_full_slots`.)"""
    n = int(slot) + 1
    mask = None
    if int(offsets.max()) > 0:
        mask = real_slots(torch.arange(n, device=offsets.device), offsets, slot)[:, None, None, :]
    return _attend(q, k[:, :, :n], v[:, :, :n], mask, scale)


@prefix_decode.register_fake
def _(q, k, v, offsets, slot, scale):
    return v.new_empty(*q.shape[:3], v.shape[-1])


def decode_full_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, slot: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """:func:`masked_decode` over a static cache's full buffers ``k``, ``v`` (slot ``j`` holds
    position ``j``), with the cache's ``offsets`` and current ``slot``.

    On the CPU :func:`prefix_decode`, which needs no ``(B, N)`` mask: inductor's CPU loop for it
    took 0.67 ms a layer at batch 16 and a 16k context (ATen's comparisons 0.1 ms), more than the
    step's other element-wise work together. Elsewhere the mask is built here, in the caller's
    graph, where a compiler fuses it with the step's other element-wise work: inside the op it
    would be four kernel launches of its own in a GPU's captured step."""
    if k.device.type == "cpu":
        return prefix_decode(q, k, v, offsets, slot, scale)
    return masked_decode(q, k, v, real_slots(torch.arange(k.shape[2], device=k.device), offsets, slot), scale)
