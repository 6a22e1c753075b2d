"""KV caches for incremental decoding.

A :class:`TokenBuffer` holds per-token vectors for a contiguous range of positions
``[start, end)``. After each step a layer keeps only what the next token can attend to: every
key and value (full attention), the last ``window`` (sliding window), or the current block of a
level (MLR keys above level 1). It trims after computing the step's output, since the tensor
returned by :meth:`TokenBuffer.append` is a view that trimming overwrites.
"""

from __future__ import annotations

import torch


class TokenBuffer:
    """Vectors of shape ``(batch, heads, dim)`` for positions ``[start, end)``, stored contiguously."""

    def __init__(
        self,
        batch: int,
        heads: int,
        dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        self.data = torch.empty(batch, heads, max(capacity, 1), dim, dtype=dtype, device=device)
        self.start = 0
        self.end = 0

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        """Bytes of the vectors held (not of the spare capacity)."""
        b, h, _, d = self.data.shape
        return len(self) * b * h * d * self.data.element_size()

    def drop_before(self, position: int) -> None:
        """Forget the vectors of positions before ``position``."""
        if position <= self.start:
            return
        keep = max(self.end - position, 0)
        if keep:
            offset = position - self.start
            self.data[:, :, :keep] = self.data[:, :, offset : offset + keep].clone()
        self.start = min(position, self.end)

    def append(self, x: torch.Tensor) -> torch.Tensor:
        """Add ``x: (batch, heads, t, dim)`` at positions ``[end, end + t)``; return all vectors held."""
        t = x.shape[2]
        needed = len(self) + t
        if needed > self.data.shape[2]:
            grown = self.data.new_empty(*self.data.shape[:2], max(needed, 2 * self.data.shape[2]), self.data.shape[3])
            grown[:, :, : len(self)] = self.data[:, :, : len(self)]
            self.data = grown
        self.data[:, :, len(self) : needed] = x
        self.end += t
        return self.data[:, :, :needed]


class KVCache:
    """The named buffers of one attention layer and the number of tokens it has seen."""

    def __init__(self, buffers: dict[str, TokenBuffer]) -> None:
        self.buffers = buffers
        self.length = 0

    def __getitem__(self, name: str) -> TokenBuffer:
        return self.buffers[name]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())
