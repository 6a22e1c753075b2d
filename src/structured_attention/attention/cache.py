"""KV caches for incremental decoding.

A :class:`TokenBuffer` holds per-token vectors for a contiguous range of positions
``[start, end)``. After each step a layer keeps only what the next token can attend to: every
key and value (full attention), the last ``window`` (sliding window), or the current block of a
level (MLR keys above level 1). It trims after computing the step's output, since the tensor
returned by :meth:`TokenBuffer.append` is a view that trimming overwrites.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from .._checks import require
from .segments import CachePadding


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

    def _reserve(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Make room for ``t`` more positions; return their slot and the view of everything held."""
        held = len(self)
        needed = held + t
        if needed > self.data.shape[2]:
            grown = self.data.new_empty(*self.data.shape[:2], max(needed, 2 * self.data.shape[2]), self.data.shape[3])
            grown[:, :, :held] = self.data[:, :, :held]
            self.data = grown
        self.end += t
        return self.data.narrow(2, held, t), self.data.narrow(2, 0, needed)

    def append(self, x: torch.Tensor) -> torch.Tensor:
        """Add ``x: (batch, heads, t, dim)`` at positions ``[end, end + t)``; return all vectors held."""
        slot, held = self._reserve(x.shape[2])
        slot.copy_(x)
        return held


def append_all(buffers: Sequence[TokenBuffer], xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """:meth:`TokenBuffer.append` of ``xs[i]`` to ``buffers[i]`` for every ``i`` in one multi-tensor
    copy, which a GPU runs as one kernel rather than one per buffer (MLR appends a key per level)."""
    slots, held = zip(*(buffer._reserve(x.shape[2]) for buffer, x in zip(buffers, xs, strict=True)))
    torch._foreach_copy_(list(slots), list(xs))
    return list(held)


class KVCache:
    """The named buffers of one attention layer and the number of slots it has filled.

    Rows of different lengths are left-padded (``padding``, set from the ``attention_mask`` of the
    first call): row ``b`` holds its sequence from slot ``padding.offsets[b]``, so every row
    advances by one slot per decoding step while keeping its own positions.
    """

    def __init__(self, buffers: dict[str, TokenBuffer], owner: object = None) -> None:
        self.buffers = buffers
        self.length = 0
        self.padding: CachePadding | None = None
        # The layer that made it: another layer's buffers have other names and shapes, which
        # would otherwise surface as a KeyError or a reshape error deep inside the layer.
        self._owner = None if owner is None else weakref.ref(owner)

    @property
    def batch_size(self) -> int:
        return next(iter(self.buffers.values())).data.shape[0]

    def check_use(self, layer: object, batch: int) -> None:
        """One-line ``ValueError`` unless ``layer`` made this cache and ``batch`` rows feed it."""
        require(self._owner is not None and self._owner() is layer, "cache",
                "the cache this layer's new_cache() made (a model's new_caches() for a model)", "another layer's")
        require(batch == self.batch_size, "cache", f"a batch of {self.batch_size} rows (the batch it was made for)",
                batch)

    @property
    def lengths(self) -> list[int]:
        """Tokens of each row's own sequence held so far (``length`` minus its padding)."""
        if self.padding is None:
            return [self.length] * self.batch_size
        return [max(self.length - o, 0) for o in self.padding.offsets]

    def __getitem__(self, name: str) -> TokenBuffer:
        return self.buffers[name]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())
