"""Which tokens of a batch belong to one sequence: padding masks and packed documents.

A batch row may hold one sequence padded on the left or the right (``attention_mask``, 1 or True
for real tokens, the Hugging Face convention) or several packed documents (``document_ids``,
non-decreasing integers). Both reduce to *segments*: maximal runs of tokens with the same document
id and the same mask value. A token attends only within its segment, and its position (for learned
and rotary embeddings, and for MLR's block membership) counts from the segment's first token, so
every sequence is computed exactly as if it ran alone. A run of padding is a segment of its own: it
attends among itself, which keeps every softmax row non-empty (finite outputs, no NaN), and the
layers zero the outputs at padding, so padding sends no gradient anywhere.

A KV cache holds left-padded rows (:class:`CachePadding`): row ``b``'s sequence starts at slot
``offsets[b]``, and slot ``j`` is its position ``j - offsets[b]``.

The value checks (0/1 masks, contiguous real tokens, ids in order) read the tensors on the host;
under ``torch.compile`` they are left out, and only shapes and dtypes are checked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .._checks import fail, require
from ..ops.mlr.contract import check_document_ids, check_document_order

__all__ = ["CachePadding", "Segments", "build_segments", "left_padding", "position_mask"]


def position_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """Boolean ``(t_q, t_k)`` mask of the pairs a query may attend to."""
    diff = q_pos[:, None] - k_pos[None, :]
    keep = diff >= 0 if causal else torch.ones_like(diff, dtype=torch.bool)
    if window is not None:
        keep &= diff.abs() <= window
    return keep


@dataclass(frozen=True)
class Segments:
    """Per token of a ``(B, T)`` batch: its segment id (non-decreasing along ``T``), its position
    in the segment, and whether it is real (``None``: every token is)."""

    ids: torch.Tensor
    positions: torch.Tensor
    real: torch.Tensor | None
    # When every row is one sequence with padding before or after it (no packed documents): the
    # leading padding tokens of each row, (B,); see trailing_padding.
    leading: torch.Tensor | None = None
    # attention biases made from these segments, shared by every layer (see attention_bias)
    _biases: dict[tuple, tuple[Segments, torch.Tensor]] = field(default_factory=dict, repr=False, compare=False)

    def zero_padding(self, x: torch.Tensor) -> torch.Tensor:
        """``x: (B, T, ...)`` with the rows of padding tokens set to zero."""
        if self.real is None:
            return x
        return x * self.real.view(*self.real.shape, *(1,) * (x.dim() - 2)).to(x.dtype)

    def trailing_padding(self, x: torch.Tensor, undo: bool = False) -> torch.Tensor:
        """``x: (B, H, T, d)`` with each row rolled so that its padding trails its sequence (or
        back, with ``undo``). Causal attention over the rolled rows keeps every sequence from its
        padding with no mask at all, so the fused causal kernel applies (padding then sees the
        sequence, which is harmless: outputs at padding are zeroed)."""
        assert self.leading is not None
        b, h, t, d = x.shape
        shift = -self.leading if undo else self.leading
        index = (torch.arange(t, device=x.device)[None, :] + shift[:, None]) % t
        if x.transpose(1, 2).is_contiguous():  # heads split from a (B, T, H * d) projection: move whole rows
            rows = (index + torch.arange(b, device=x.device)[:, None] * t).reshape(-1)
            return x.transpose(1, 2).reshape(b * t, h * d).index_select(0, rows).view(b, t, h, d).transpose(1, 2)
        return x.gather(2, index[:, None, :, None].expand(b, h, t, d))

    def attention_bias(
        self, keys: Segments, q_start: int, k_start: int, causal: bool, window: int | None, dtype: torch.dtype,
    ) -> torch.Tensor:
        """The additive ``(B, 1, t_q, t_k)`` mask of these tokens as queries (at slots ``q_start +
        [0, t_q)``) over ``keys`` (at ``k_start + [0, t_k)``): 0 where the pair shares a segment
        and passes the causal and window tests (in slots, which within a segment are positions),
        ``-inf`` elsewhere. Made once and shared by every layer that asks for the same one."""

        def make() -> torch.Tensor:
            device = self.ids.device
            q_pos = torch.arange(q_start, q_start + self.ids.shape[1], device=device)
            k_pos = torch.arange(k_start, k_start + keys.ids.shape[1], device=device)
            keep = position_mask(q_pos, k_pos, causal, window) & (self.ids[:, :, None] == keys.ids[:, None, :])
            return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, float("-inf")).unsqueeze(1)

        if torch.compiler.is_compiling():
            return make()
        key = (id(keys), q_start, k_start, causal, window, dtype)
        if key not in self._biases:  # the entry holds `keys`, so its id is not reused while it lives
            self._biases[key] = (keys, make())
        return self._biases[key][1]


def _checking() -> bool:
    return not torch.compiler.is_compiling()


def _check_mask(
    attention_mask: object, batch: int, seq_len: int, device: torch.device, padding_rows: bool = False,
) -> torch.Tensor:
    """The mask as bool; ``padding_rows`` allows rows that are all padding (so far, in a cache)."""
    require(isinstance(attention_mask, torch.Tensor), "attention_mask", "a torch.Tensor or None",
            type(attention_mask).__name__)
    assert isinstance(attention_mask, torch.Tensor)
    # messages made on failure alone: formatting a symbolic length fixes it (a graph per length)
    if tuple(attention_mask.shape) != (batch, seq_len):
        fail("attention_mask", f"shape (batch={batch}, seq_len={seq_len})", tuple(attention_mask.shape))
    require(attention_mask.dtype == torch.bool or not (attention_mask.is_floating_point() or attention_mask.is_complex()),
            "attention_mask", "a bool or integer tensor (1 or True for real tokens)", attention_mask.dtype)
    require(attention_mask.device == device, "attention_mask", f"a tensor on {device} (the device of the inputs)",
            attention_mask.device)
    if _checking():
        if attention_mask.dtype != torch.bool:
            bad = (attention_mask != 0) & (attention_mask != 1)
            if bool(bad.any()):
                raise ValueError(f"attention_mask: expected 0 or 1 everywhere, got {attention_mask[bad][0].item()}")
        real = attention_mask.bool()
        empty = ~real.any(dim=1)
        if not padding_rows and bool(empty.any()):
            raise ValueError(f"attention_mask: expected at least one real token in every row, got an all-padding "
                             f"row {int(empty.nonzero()[0])}")
        # Real tokens contiguous: at most one rise (0 -> 1) and one fall (1 -> 0) per row, the rise first.
        step = real.long().diff(dim=1, prepend=torch.zeros(batch, 1, dtype=torch.long, device=device))
        gaps = (step == 1).sum(dim=1) > 1
        if bool(gaps.any()):
            raise ValueError(f"attention_mask: expected left or right padding (each row's real tokens contiguous; "
                             f"generation appends to each row's end, so its prompts are left-padded), got a gap in row "
                             f"{int(gaps.nonzero()[0])}")
    return attention_mask.bool()


def build_segments(
    attention_mask: torch.Tensor | None,
    document_ids: torch.Tensor | None,
    batch: int,
    seq_len: int,
    device: torch.device,
) -> Segments | None:
    """Check ``attention_mask`` and ``document_ids`` (either may be ``None``) for a ``(batch,
    seq_len)`` batch and return its segments, or ``None`` when the whole row is one real sequence
    (the plain, unmasked computation)."""
    real = None if attention_mask is None else _check_mask(attention_mask, batch, seq_len, device)
    ids = check_document_ids(document_ids, batch, seq_len, device, order=False)
    if ids is not None and _checking():
        check_document_order(ids)  # the order alone: the kernels read the ids derived below, not these
    if real is None and ids is None:
        return None
    # whether each token starts a segment after the first (differences rather than slices [1:], whose
    # length torch.export cannot tell from 1 where seq_len is dynamic)
    new = torch.zeros(batch, seq_len, dtype=torch.bool, device=device)
    if ids is not None:
        new |= ids.diff(dim=1, prepend=ids[:, :1]) != 0
    if real is not None:
        new |= real.diff(dim=1, prepend=real[:, :1])  # a bool tensor's diff: where it changes
    if _checking() and not bool(new.any()) and (real is None or bool(real.all())):
        return None
    pos = torch.arange(seq_len, device=device).expand(batch, seq_len)
    first = new | (pos == 0)
    start = torch.where(first, pos, torch.zeros_like(pos)).cummax(dim=1).values
    leading = None
    if ids is None and real is not None:  # one sequence per row (the mask's real tokens are contiguous)
        leading = real.long().argmax(dim=1)
    return Segments(new.long().cumsum(dim=1), pos - start, real, leading)


def left_padding(attention_mask: object, batch: int, seq_len: int, device: torch.device) -> list[int]:
    """The number of leading padding tokens of each row of a left-padded ``attention_mask`` (what
    a KV cache holds): every row's real tokens run to its end, or the row is all padding so far
    (a prompt prefilled in chunks may not have reached it yet)."""
    real = _check_mask(attention_mask, batch, seq_len, device, padding_rows=True)
    if _checking():
        ends_padded = ~real[:, -1] & real.any(dim=1)
        if bool(ends_padded.any()):
            raise ValueError("attention_mask: expected left padding with a cache (every row's last token real; a "
                             "cached sequence continues at its end), got padding at the end of row "
                             f"{int(ends_padded.nonzero()[0])}")
    return (seq_len - real.sum(dim=1)).tolist()


class CachePadding:
    """Left padding of the rows of a KV cache: row ``b``'s sequence starts at slot ``offsets[b]``;
    the slots before it are padding (a segment of their own) and slot ``j >= offsets[b]`` holds
    position ``j - offsets[b]``.

    One object serves every layer's cache of a model, so what a decoding step derives from the
    offsets (segments, block starts) is made once per step, not once per layer.
    """

    def __init__(self, offsets: Sequence[int], device: torch.device | str | None) -> None:
        self.offsets = tuple(int(o) for o in offsets)
        self.offset_tensor = torch.tensor(self.offsets, dtype=torch.long, device=device)
        self._end = -1  # the step (end slot) the memo below belongs to
        self._memo: dict[object, object] = {}

    def _remember(self, end: int, key: object, make: Callable[[], object]) -> object:
        if end != self._end:
            self._end, self._memo = end, {}
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def padded(self, lo: int) -> bool:
        """Whether any row is still padding at slot ``lo`` (later slots of a row are real once it starts)."""
        return max(self.offsets) > lo

    def segments(self, lo: int, hi: int) -> Segments:
        """Segments of the slots ``[lo, hi)`` (segment 0: padding, 1: the sequence)."""

        def make() -> Segments:
            slot = torch.arange(lo, hi, device=self.offset_tensor.device)[None, :]
            off = self.offset_tensor[:, None]
            real = slot >= off
            leading = self.offset_tensor.clamp(max=hi - 1) if lo == 0 else None
            return Segments(real.long(), torch.where(real, slot - off, slot), real, leading)

        return self._remember(hi, ("segments", lo), make)  # type: ignore[return-value]

    def block_starts(self, slot: int, sizes: Sequence[int]) -> list[list[int]]:
        """Per row and size ``s``: the first slot of the size-``s`` block (counted in the row's own
        positions) that holds ``slot``; ``offsets[b]`` where ``slot`` is still padding."""
        return [[o + (slot - o) // s * s if slot >= o else o for s in sizes] for o in self.offsets]

    def block_start_table(self, slot: int, end: int, sizes: Sequence[int]) -> torch.Tensor:
        """:meth:`block_starts` as a ``(B, len(sizes))`` tensor on the cache's device, for the
        step that ends at ``end``."""

        def make() -> torch.Tensor:
            return torch.tensor(self.block_starts(slot, sizes), dtype=torch.long, device=self.offset_tensor.device)

        return self._remember(end, ("block_starts", slot, tuple(sizes)), make)  # type: ignore[return-value]

    def first_block_start(self, slot: int, size: int) -> int:
        """The earliest of the rows' size-``size`` block starts at ``slot`` (what a level must keep)."""
        return min(row[0] for row in self.block_starts(slot, [size]))
