"""Rotary position embedding over segments of the head dims.

Each segment (a whole head, the global and windowed parts of Global+SWA, or one MLR level) is
rotated on its own, pairs ``(2i, 2i+1)`` at frequency ``base^(-2i/d)`` within a segment of ``d``
dims, so every segment's score depends on positions only through ``i - j``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .._checks import require


class Rotary(nn.Module):
    def __init__(self, segments: Sequence[int], max_seq_len: int, base: float = 10000.0) -> None:
        super().__init__()
        for d in segments:
            require(d % 2 == 0, "rotary", f"even head-dim segments {tuple(segments)} (pairs of dims are rotated)", tuple(segments))
        inv_freq = torch.cat([base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d) for d in segments])
        angles = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: int | torch.Tensor = 0) -> torch.Tensor:
        """Rotate ``x: (B, H, T, dims)`` holding positions ``start + [0, T)`` (an int ``start``) or
        per token (a ``(B, T)`` tensor)."""
        if isinstance(positions, torch.Tensor):
            cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # (B, 1, T, dims / 2)
            sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        else:
            t = x.shape[-2]
            cos = self.cos[positions : positions + t].to(x.dtype)
            sin = self.sin[positions : positions + t].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
