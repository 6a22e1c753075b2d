"""KV caches for incremental decoding.

A :class:`TokenBuffer` holds per-token vectors for a contiguous range of positions
``[start, end)``. After each step a layer keeps only what the next token can attend to: every
key and value (full attention), the last ``window`` (sliding window), or the current block of a
level (MLR keys above level 1). It trims after computing the step's output, since the tensor
returned by :meth:`TokenBuffer.append` is a view that trimming overwrites.

A :class:`StaticKVCache` is the same content in buffers that never change shape, for decoding
steps that are compiled or captured once and replayed: a full buffer per kept quantity,
preallocated to the context, or a ring of ``size`` slots where only the last ``size`` tokens are
kept (slot ``p`` at ``p % size``), and the slot of the next token as a device tensor. A prompt
fills the growing cache first (any length, padding and all); the first one-token step moves it
into the static buffers.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from .._checks import require
from ..functional.decode import real_slots
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


def store(buffer: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write ``x (batch, heads, len(slots), dim)`` at ``slots`` of a static ``buffer``, in the buffer's
    dtype (inside autocast the new keys and values are bfloat16, the buffers the model's dtype)."""
    buffer.index_copy_(2, slots, x.to(buffer.dtype))


def full_slots(buffer: TokenBuffer, capacity: int) -> torch.Tensor:
    """``buffer``'s vectors at their slots of a ``(batch, heads, capacity, dim)`` buffer (zeros elsewhere)."""
    b, h, _, d = buffer.data.shape
    out = buffer.data.new_zeros(b, h, capacity, d)
    out[:, :, buffer.start:buffer.end] = buffer.data[:, :, :len(buffer)]
    return out


def ring_slots(buffer: TokenBuffer, size: int) -> torch.Tensor:
    """The last ``size`` slots of ``buffer`` in a ring ``(batch, heads, size, dim)``, slot ``p`` at ``p % size``."""
    b, h, _, d = buffer.data.shape
    out = buffer.data.new_zeros(b, h, size, d)
    first = max(buffer.start, buffer.end - size)
    slots = torch.arange(first, buffer.end, device=out.device)
    out.index_copy_(2, slots % size, buffer.data[:, :, first - buffer.start:len(buffer)])
    return out


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
    def dtype(self) -> torch.dtype:
        return next(iter(self.buffers.values())).data.dtype

    @property
    def lengths(self) -> list[int]:
        """Tokens of each row's own sequence held so far (``length`` minus its padding)."""
        if self.padding is None:
            return [self.length] * self.batch_size
        return [max(self.length - o, 0) for o in self.padding.offsets]

    def __getitem__(self, name: str) -> TokenBuffer:
        return self.buffers[name]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep rows ``rows`` of every buffer and of the padding, in that order (beam search's
        reordering: a row may be taken twice, or not at all)."""
        for buffer in self.buffers.values():
            buffer.data = buffer.data.index_select(0, rows.to(buffer.data.device))
        if self.padding is not None:
            self.padding = CachePadding([self.padding.offsets[r] for r in rows.tolist()],
                                        self.padding.offset_tensor.device)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())


class StaticKVCache:
    """One attention layer's cache for compiled or graph-captured decoding (see the module docstring).

    Until the first one-token step it holds the growing :class:`KVCache` the prompt fills
    (``growing``); that step's layer moves it into ``buffers`` (its kind's :meth:`_static_buffers`)
    and from then on each step writes its token at ``slot`` and advances it on the device: no
    shape changes and no host synchronisation, so one captured step serves every position. Rows
    are left-padded as in the growing cache; ``offsets`` holds each row's first real slot.
    Writing past the context raises (an index error, a device assert on CUDA).
    """

    def __init__(self, growing: KVCache) -> None:
        self.growing: KVCache | None = growing
        self.buffers: dict[str, torch.Tensor] = {}
        self.slot = torch.zeros((), dtype=torch.long)
        self.offsets = torch.zeros(growing.batch_size, dtype=torch.long)
        self._owner, self._batch = growing._owner, growing.batch_size

    @property
    def prefilled(self) -> bool:
        """Whether the static buffers hold the prompt (the growing cache is gone)."""
        return self.growing is None

    def load(self, buffers: dict[str, torch.Tensor]) -> None:
        """Take ``buffers`` (the growing cache's content at static slots) and its slot and padding."""
        growing = self.growing
        device = next(iter(buffers.values())).device
        self.buffers = buffers
        self.slot = torch.tensor(growing.length, dtype=torch.long, device=device)
        offsets = growing.padding.offsets if growing.padding is not None else [0] * self._batch
        self.offsets = torch.tensor(offsets, dtype=torch.long, device=device)
        self.growing = None
        # Fixed addresses: a captured graph (CUDA graphs, torch.compile's "reduce-overhead") then
        # reads and writes these tensors in place instead of copying them in at every replay.
        for tensor in (*buffers.values(), self.slot, self.offsets):
            torch._dynamo.mark_static_address(tensor)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a step reads or writes, by name: the static buffers, ``slot`` and ``offsets``."""
        return {**self.buffers, "slot": self.slot, "offsets": self.offsets}

    def bind(self, tensors: dict[str, torch.Tensor]) -> None:
        """Read and write ``tensors`` (named as :meth:`tensors` names them) instead of this cache's own."""
        self.buffers = {name: tensors[name] for name in self.buffers}
        self.slot, self.offsets = tensors["slot"], tensors["offsets"]

    def copy_(self, other: StaticKVCache) -> StaticKVCache:
        """Take ``other``'s content (a prefilled static cache of the same layer and batch) in place:
        a step compiled or graph-captured on this cache replays on the new content, where a new
        cache's tensors would have new addresses (a graph recorded again). Returns this cache."""
        shapes = {name: t.shape for name, t in self.buffers.items()}
        require(self.prefilled and other.prefilled and shapes == {n: t.shape for n, t in other.buffers.items()},
                "other", "a prefilled static cache of the same layer and batch as this prefilled one",
                "another cache")
        for name, tensor in self.buffers.items():
            tensor.copy_(other.buffers[name])
        self.slot.copy_(other.slot)
        self.offsets.copy_(other.offsets)
        return self

    def check_use(self, layer: object, batch: int) -> None:
        """One-line ``ValueError`` unless ``layer`` made this cache and ``batch`` rows feed it."""
        require(self._owner is not None and self._owner() is layer, "cache",
                "the cache this layer's new_cache() made (a model's new_caches() for a model)", "another layer's")
        require(batch == self._batch, "cache", f"a batch of {self._batch} rows (the batch it was made for)", batch)

    @property
    def dtype(self) -> torch.dtype:
        return self.growing.dtype if self.growing is not None else next(iter(self.buffers.values())).dtype

    def ring_positions(self, size: int) -> torch.Tensor:
        """The position each slot of a ring of ``size`` holds once the token at ``slot`` is written
        (negative: never written)."""
        j = torch.arange(size, device=self.slot.device)
        return self.slot - torch.remainder(self.slot - j, size)

    def real(self, positions: torch.Tensor) -> torch.Tensor:
        """``(batch, n)``: which of the slots ``positions`` ``(n,)`` hold a real token of each row up
        to the current one."""
        return real_slots(positions, self.offsets, self.slot)

    @property
    def nbytes(self) -> int:
        """Bytes of the static buffers (all preallocated slots); 0 before the first step."""
        return sum(x.numel() * x.element_size() for x in self.buffers.values())
