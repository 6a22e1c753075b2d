"""One decoding step of MLR attention against a static cache (``StaticKVCache``), as a custom op.

The cache's level-1 keys and values sit at their slots of buffers as long as the context; each
finer level's keys in a ring of its block size (slot ``p`` at ``p % s_l``). The step scores level 1
over every slot and adds each finer level's scores from its ring where the ring's slot lies in the
row's current block (rows are left-padded: row ``b``'s blocks count from ``offsets[b]``), the
depth likewise for ``depth_normalize``. On the CPU (float32, float64) the C++ decoding kernel reads
the rings in place (``cpu.decode_static``), on CUDA the Triton decoding kernel does
(``triton_decode.decode_static``); elsewhere ATen ops do. A custom op so that
``torch.compile`` keeps it whole: a compiled step calls the kernel, or ATen's matrix products,
instead of generated loops.
"""

from __future__ import annotations

import torch

from . import cpu
from .contract import grouped_matmul, masked_mix
from .dispatch import on_triton

__all__ = ["mlr_decode_static", "one_allocation", "prepare_static"]


@torch.library.custom_op("sattn::mlr_decode_static", mutates_args=())
def mlr_decode_static(q: torch.Tensor, keys: list[torch.Tensor], v: torch.Tensor, slot: torch.Tensor,
                      offsets: torch.Tensor, ranks: list[int], block_sizes: list[int], scale: float,
                      depth_normalize: bool) -> torch.Tensor:
    """``q (B, H, 1, R)`` (the token at ``slot``, already written into the buffers) against
    ``keys`` (level 1 ``(B, Hk, C, r_1)``, level ``l > 1`` a ring ``(B, Hk, s_l, r_l)``) and ``v``
    ``(B, Hk, C, Dv)``; ``slot`` a 0-d int64 tensor, ``offsets`` ``(B,)`` each row's first real slot.
    Returns ``(B, H, 1, Dv)``."""
    if on_triton(v):
        from . import triton_decode

        return triton_decode.decode_static(q, keys, v, slot, offsets, ranks, block_sizes, scale, depth_normalize)
    if q.device.type == "cpu" and v.dtype in (torch.float32, torch.float64) and q.dtype == v.dtype and cpu.available():
        # each row's first slot per level: its padding for level 1, its current block's start after
        blocks = torch.tensor(block_sizes[1:], dtype=torch.long, device=slot.device)  # empty with one level
        starts = offsets[:, None] + torch.div(slot - offsets[:, None], blocks, rounding_mode="floor") * blocks
        return cpu.decode_static(q, keys, v, slot, torch.cat([offsets[:, None], starts], dim=1), [0, *block_sizes[1:]],
                                 scale, depth_normalize)
    q_levels = q.split(ranks, dim=-1)
    scores = grouped_matmul(q_levels[0], keys[0].transpose(-1, -2)).float()
    depth = torch.ones_like(scores) if depth_normalize else None
    for level, s in enumerate(block_sizes[1:], start=1):
        held = slot - torch.remainder(slot - torch.arange(s, device=slot.device), s)  # each ring slot's position
        block_start = offsets + torch.div(slot - offsets, s, rounding_mode="floor") * s
        current = (held[None] >= block_start[:, None])[:, None, None, :]  # (B, 1, 1, s); held <= slot
        at = held.clamp_min(0).expand(*scores.shape[:3], s)
        level_scores = grouped_matmul(q_levels[level], keys[level].transpose(-1, -2)).float()
        scores.scatter_add_(-1, at, level_scores.masked_fill(~current, 0.0))
        if depth is not None:
            depth.scatter_add_(-1, at, current.expand_as(level_scores).float())
    scores = scores * scale
    if depth is not None:
        scores = scores / depth
    slots = torch.arange(v.shape[2], device=v.device)
    real = (slots[None] >= offsets[:, None]) & (slots[None] <= slot)
    return masked_mix(scores, real, v)


def one_allocation(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors``' contents copied into one allocation, as views of their shapes, in order: how a
    static cache holds its finer levels' rings, which the Triton kernel then addresses from the
    first by offsets that depend on their shapes alone (a copied cache reads the same tables)."""
    flat, at, views = torch.cat([t.flatten() for t in tensors]) if tensors else None, 0, []
    for t in tensors:
        views.append(flat[at:at + t.numel()].view_as(t))
        at += t.numel()
    return views


def prepare_static(keys: list[torch.Tensor], v: torch.Tensor, ranks: list[int], block_sizes: list[int]) -> None:
    """Ready what the step will read of these static buffers, eagerly and outside any captured
    graph: on CUDA, the Triton kernel's device tables (made while a graph is captured, their copy
    to the device would run during the capture, which CUDA refuses where the capture is global)."""
    if on_triton(v):
        from . import triton_decode

        triton_decode.prepare_static(keys, ranks, block_sizes)


@mlr_decode_static.register_fake
def _(q, keys, v, slot, offsets, ranks, block_sizes, scale, depth_normalize):
    return q.new_empty(*q.shape[:3], v.shape[-1])
