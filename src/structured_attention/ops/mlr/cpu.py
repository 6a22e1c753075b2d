"""The fused C++ MLR attention kernel for CPU (``cpu_kernel.cpp``): its custom ops and Python interface.

:func:`mlr_attention_cpu` has the contract of :func:`~.reference.mlr_attention_reference`
and is differentiable in ``q``, ``k`` and ``v``; :func:`mlr_decode_cpu` is one decoding step against
the compressed cache, with the contract of :func:`~.reference.mlr_decode_reference`. The kernel's
forward, backward and decoding step are ``torch.library`` custom ops (``sattn::mlr_cpu_*``).
:mod:`.cpu_build` builds the kernel on first use.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from ..._checks import require
from .cpu_build import BLOCK_K, BLOCK_Q, available, load
from .contract import (
    check_mlr_arguments,
    check_mlr_cache_arguments,
    check_dim_order,
    compiled_or_eager,
    compute_dtype,
    differentiable_ops,
    document_segments,
)

__all__ = ["available", "decode", "decode_static", "load", "mlr_attention_cpu", "mlr_decode_cpu"]

# The kernel's entry points as custom ops: torch.compile keeps each whole (no graph break) and
# traces shapes through the fake implementations; autograd reaches the backward through
# register_autograd. q, k and v are read in place (any strides with a contiguous last dim), their
# head dims in ``order`` (empty: as they come); outputs are (B, H, T, *) views of (B, T, H, *)
# memory. ``document_ids`` (B, T) or None: each document of a row is scored as a sequence of its
# own (packed documents, varlen); its segments are read from the ids inside the ops, so a graph
# keeps the call whole.
def _run_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None,
                 sizes: list[int], offsets: list[int], order: list[int], scale: float, causal: bool,
                 depth_normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(load().forward(q, k, v, head_segments(document_ids, q.shape[1]), sizes, offsets, order, scale,
                                causal, depth_normalize, BLOCK_Q, BLOCK_K))


def _kernel_input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the kernel reads it: in ``dtype``, any strides but a contiguous last dim (views such
    as a projection's heads or a cache's spare capacity are read in place when they can be)."""
    x = x.to(dtype)
    return x if x.stride(-1) == 1 else x.contiguous()


def _heads_view(x: torch.Tensor, dim: int) -> torch.Tensor:
    """An empty ``(B, H, T, dim)`` like ``x`` ``(B, H, T, *)``, as the kernel allocates it."""
    B, H, T, _ = x.shape
    return x.new_empty(B, T, H, dim).transpose(1, 2)


def _forward_fake(q, k, v, document_ids, sizes, offsets, order, scale, causal, depth_normalize):
    return _heads_view(q, v.shape[-1]), q.new_empty(q.shape[:3])


def _run_backward(gout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, document_ids: torch.Tensor | None, sizes: list[int], offsets: list[int],
                  order: list[int], scale: float, causal: bool, depth_normalize: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = load().backward(q, k, v, out, _kernel_input(gout, gout.dtype), lse,
                                 head_segments(document_ids, q.shape[1]), sizes, offsets, order, scale, causal,
                                 depth_normalize, BLOCK_Q, BLOCK_K)
    return dq, _group_sum(dk, k.shape[1]), _group_sum(dv, k.shape[1])


def _group_sum(x: torch.Tensor, heads: int) -> torch.Tensor:
    """The kernel's key or value gradient per query head summed over each key head's group (GQA)."""
    return x if x.shape[1] == heads else x.unflatten(1, (heads, x.shape[1] // heads)).sum(2)


def _backward_fake(gout, q, k, v, out, lse, document_ids, sizes, offsets, order, scale, causal, depth_normalize):
    return (_heads_view(q, q.shape[-1]), _group_sum(_heads_view(q, k.shape[-1]), k.shape[1]),
            _group_sum(_heads_view(q, v.shape[-1]), k.shape[1]))


_forward_call = differentiable_ops("mlr_cpu", _run_forward, _forward_fake, _run_backward, _backward_fake)


def _run_decode(q: torch.Tensor, keys: list[torch.Tensor], key_starts: list[int], v: torch.Tensor, scale: float,
                depth_normalize: bool, row_starts: torch.Tensor | None) -> torch.Tensor:
    starts = torch.empty(0, dtype=torch.long) if row_starts is None else row_starts.long().contiguous()
    return load().decode(q, keys, key_starts, v, scale, depth_normalize, starts)


_decode_op = torch.library.custom_op("sattn::mlr_cpu_decode", _run_decode, mutates_args=())
_decode_call = compiled_or_eager(_decode_op, _run_decode)


@_decode_op.register_fake
def _(q, keys, key_starts, v, scale, depth_normalize, row_starts):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


def _run_decode_static(q: torch.Tensor, keys: list[torch.Tensor], v: torch.Tensor, slot: torch.Tensor,
                       row_starts: torch.Tensor, rings: list[int], scale: float, depth_normalize: bool) -> torch.Tensor:
    return load().decode_static(q, keys, v, slot, row_starts, rings, scale, depth_normalize)


_decode_static_op = torch.library.custom_op("sattn::mlr_cpu_decode_static", _run_decode_static, mutates_args=())
_decode_static_call = compiled_or_eager(_decode_static_op, _run_decode_static)


@_decode_static_op.register_fake
def _(q, keys, v, slot, row_starts, rings, scale, depth_normalize):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


def decode_static(q: torch.Tensor, keys: Sequence[torch.Tensor], v: torch.Tensor, slot: torch.Tensor,
                  row_starts: torch.Tensor, rings: Sequence[int], scale: float, depth_normalize: bool) -> torch.Tensor:
    """One decoding step against a static cache (see :mod:`.static`) through the C++ kernel:
    ``q (B, H, 1, R)``, level 1's keys and ``v`` at their slots, level ``l``'s keys in a ring of
    ``rings[l]`` slots (0 for level 1), the new token at ``slot``; ``row_starts`` ``(B, L)`` each
    row's first slot per level. float32 or float64 buffers."""
    out = _decode_static_call(q[:, :, 0], list(keys), v, slot, row_starts.contiguous(), list(rings), float(scale),
                              depth_normalize)
    return out.unsqueeze(2)


def mlr_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranks: Sequence[int],
    block_sizes: Sequence[int] | None = None,
    causal: bool = True,
    scale: float | None = None,
    depth_normalize: bool = False,
    document_ids: torch.Tensor | None = None,
    dim_order: Sequence[int] | None = None,
) -> torch.Tensor:
    """MLR attention through the fused C++ kernel; same contract as
    :func:`~.reference.mlr_attention_reference`, packed ``document_ids`` included: the kernel
    takes each document as a segment of its own (varlen), so packing costs no padded work.
    ``dim_order`` (see :func:`~.dispatch.mlr_attention`) is applied as the kernel reads q and k,
    which it reads in place (any strides with a contiguous last dim). Raises ``RuntimeError`` if
    the kernel is not available (see :func:`available`)."""
    ranks, sizes, scale = check_mlr_arguments(q, k, v, ranks, block_sizes, causal, scale, depth_normalize,
                                              document_ids)
    order = check_dim_order(dim_order, q.shape[-1])
    require(q.device.type == "cpu", "q.device", "a CPU tensor", q.device)
    if not available():
        raise RuntimeError("the C++ MLR attention kernel is not available here (see the warning when it was built)")
    dtype = compute_dtype(q.dtype)
    out, _ = _forward_call(_kernel_input(q, dtype), _kernel_input(k, dtype), _kernel_input(v, dtype),
                           document_ids, list(sizes),
                           list(itertools.accumulate(ranks, initial=0)), [] if order is None else list(order),
                           float(scale), causal, depth_normalize)
    return out.to(q.dtype)


def head_segments(document_ids: torch.Tensor | None, heads: int) -> torch.Tensor:
    """The kernel's ``(S, 3)`` segments ``(row b * heads + h, start, length)`` of every document
    of every row and head; ``(0, 3)`` (whole rows) without documents or when each row is one."""
    if document_ids is None:
        return torch.empty(0, 3, dtype=torch.long)
    table, _ = document_segments(document_ids)
    if len(table) == document_ids.shape[0]:
        return table[:0]
    n = (table[:, :1] * heads + torch.arange(heads)).reshape(-1)
    return torch.stack([n, *table[:, 1:].repeat_interleave(heads, dim=0).unbind(1)], dim=1)


def mlr_decode_cpu(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    key_starts: Sequence[int],
    v: torch.Tensor,
    ranks: Sequence[int],
    scale: float,
    depth_normalize: bool = False,
    row_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """One MLR decoding step through the C++ kernel, one task per (sequence, query head); same
    contract as :func:`~.reference.mlr_decode_reference` (not differentiable). Raises
    ``RuntimeError`` if the kernel is not available."""
    _, scale = check_mlr_cache_arguments(q, keys, key_starts, v, ranks, scale, depth_normalize, one_query=True,
                                         row_starts=row_starts)
    return decode(q, keys, key_starts, v, scale, depth_normalize, row_starts)


def decode(
    q: torch.Tensor, keys: Sequence[torch.Tensor], key_starts: Sequence[int], v: torch.Tensor, scale: float,
    depth_normalize: bool, row_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`mlr_decode_cpu` on arguments already checked against the contract (the dispatcher's
    entry: a decoding step is checked once)."""
    if not available():
        raise RuntimeError("the C++ MLR attention kernel is not available here (see the warning when it was built)")
    dtype = compute_dtype(v.dtype)
    out = _decode_call(_kernel_input(q, dtype)[:, :, 0], [_kernel_input(k, dtype) for k in keys], list(key_starts),
                       _kernel_input(v, dtype), float(scale), depth_normalize, row_starts)
    return out.unsqueeze(2).to(v.dtype)
