"""A value derived from one tensor, kept while the same tensor, unchanged, asks again.

A model hands the same tensors to every layer of a forward (and of its backward): the padding
mask, the position ids, packed documents' ids. What a layer reads from them on the host waits for
the device's queued work, so it is read once and kept. The tensor is held by a weak reference (the
memo keeps no memory alive) and its version counter tells an in-place change. Inference tensors
have no version counter: what is made from them is never kept.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TensorMemo"]


class TensorMemo:
    """The last value made from a tensor (or None) and other hashable arguments (``rest``)."""

    def __init__(self) -> None:
        self._held: tuple[Any, int, tuple, Any] | None = None  # (a weak reference or None, version, rest, value)

    def get(self, tensor: torch.Tensor | None, rest: tuple, make: Callable[[], Any]) -> Any:
        if tensor is not None and tensor.is_inference():
            return make()
        version = -1 if tensor is None else tensor._version
        held = self._held
        if held is not None and held[1:3] == (version, rest) and (held[0] is None if tensor is None
                                                                  else held[0]() is tensor):
            return held[3]
        value = make()
        self._held = (None if tensor is None else weakref.ref(tensor), version, rest, value)
        return value
