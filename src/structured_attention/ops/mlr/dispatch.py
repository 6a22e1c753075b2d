"""Which backend runs an MLR attention call: the dispatch table of docs/design.md, in code.

============================  =====================================  ==================================
call                          CUDA tensors (Triton installed)        CPU tensors
============================  =====================================  ==================================
:func:`mlr_attention`         Triton: prefix-rank kernels when every  C++ kernel (built on first use);
                              fine block is a multiple of the tile   the blocked PyTorch path where it
                              or smaller than two tiles, else the    cannot be built
                              general kernel (also where the tiling
                              has a single sub-tile level)
... with ``document_ids``     the same Triton kernels, documents as  C++ kernel, documents as segments
                              segments (varlen)                      (varlen); else one call each
:func:`mlr_decode`            Triton split-key decoding kernel       C++ decoding kernel, else the
(``row_starts`` too)                                                 reference
:func:`mlr_prefill`           the reference                          the reference
============================  =====================================  ==================================

Anything else (float64 on CUDA, other devices, Triton missing) runs the exact reference. Decoding
steps that need gradients take the reference too: the decoding kernels have no backward.

Every call is checked against the contract first, so a bad argument raises the same one-line
``ValueError`` on every path, inside ``torch.compile`` as outside; a CUDA call whose signature
passed the checks before (everything they read) goes straight to the route prepared for it. The backends are
``torch.library`` custom ops, so a compiled graph holds them whole, with no graph break.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..._autocast import autocast_inputs
from ..._compiler import assume_constant_result
from . import blocked, cpu
from .contract import (check_dim_order, check_mlr_arguments, check_mlr_cache_arguments, device_table,
                       document_segments, heads_inner)
from .reference import mlr_attention_reference, mlr_decode_reference, mlr_prefill_reference

__all__ = ["has_triton", "mlr_attention", "mlr_decode", "mlr_prefill"]

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


_has_triton: bool | None = None


@assume_constant_result  # a constant under torch.compile, like cpu.available()
def has_triton() -> bool:
    """Whether Triton imports here (asked once; the Triton backends are imported only when used)."""
    global _has_triton
    if _has_triton is None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _has_triton = True
        except Exception:  # ImportError, or a broken install
            _has_triton = False
    return _has_triton


def on_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in _TRITON_DTYPES and has_triton()


# The Triton calls already checked, by signature: a call whose signature passed the checks before
# passes them again, so it goes straight to its prepared route (triton_general.mlr_attention_route),
# without the checks, the dispatch and the tile and plan look-ups, which the host pays on every
# layer of every step before the kernels can start (scripts/profile_host.py). Bounded: emptied when
# full.
_ROUTES: dict[tuple[Any, ...], Callable[..., torch.Tensor]] = {}
_MAX_ROUTES = 256


def _signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranks: object, block_sizes: object, causal: object,
               scale: object, depth_normalize: object) -> tuple[Any, ...] | None:
    """What the checks and the route of a call without documents depend on, hashable; None where
    it cannot be read without consuming or converting an argument (the full path then checks it).
    The types are part of it: ``True == 1`` and ``8 == 8.0``, but the checks tell them apart."""
    if type(ranks) not in (tuple, list) or not (block_sizes is None or type(block_sizes) in (tuple, list)):
        return None
    signature = (type(q), type(k), type(v), q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device,
                 k.device, v.device, tuple(ranks), tuple(map(type, ranks)),
                 block_sizes if block_sizes is None else tuple(block_sizes),
                 None if block_sizes is None else tuple(map(type, block_sizes)), causal, type(causal), scale,
                 type(scale), depth_normalize, type(depth_normalize))
    try:
        hash(signature)
    except TypeError:
        return None
    return signature


def _gather_dims(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[..., index]`` in ``x``'s layout: a layer's ``(B, H, T, D)`` view of ``(B, T, H, D)``
    memory (a Hugging Face model's queries and keys) stays one, so the Triton kernels' output takes
    that layout too and the heads merge without a copy (``index_select`` makes a contiguous
    result; indexing keeps the layout, but its backward is an accumulating ``index_put``, on CUDA a
    sort)."""
    if heads_inner(x):
        return x.transpose(1, 2).index_select(-1, index).transpose(1, 2)
    return x.index_select(-1, index)


def mlr_attention(
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
    """MLR attention with the contract of :func:`mlr_attention_reference`, on the fastest correct
    path for its inputs (see the table above); differentiable in ``q``, ``k`` and ``v``.

    ``dim_order`` (a permutation of the head dims; default: as they come) is the order in which
    the levels take the head dims of ``q`` and ``k``: level ``l`` takes the next ``r_l``. It is
    ``mlr_attention(q[..., order], k[..., order], ...)``; the C++ kernel applies it as it reads
    ``q`` and ``k`` (no copy), the other paths gather first.

    With ``document_ids`` (packed documents, ``(B, T)`` non-decreasing integer ids), each
    document is scored as a sequence of its own with the call's block sizes. The C++ kernel and the
    general Triton kernels take the documents as segments (varlen: no padded work, one call); the
    blocked and reference paths run each document's segment as a call of its own, a loop on the host.

    Inside ``torch.autocast``, ``q``, ``k`` and ``v`` are cast to autocast's dtype first, as
    PyTorch's own attention's are.
    """
    q, k, v = autocast_inputs(q, k, v)
    signature = None
    if (document_ids is None and dim_order is None and isinstance(q, torch.Tensor) and on_triton(q)
            and not torch.compiler.is_compiling()):
        signature = _signature(q, k, v, ranks, block_sizes, causal, scale, depth_normalize)
        route = _ROUTES.get(signature) if signature is not None else None
        if route is not None:
            return route(q, k, v)
    checked_ranks, sizes, resolved_scale = check_mlr_arguments(
        q, k, v, ranks, block_sizes, causal, scale, depth_normalize, document_ids)
    if signature is not None:
        from .triton_general import mlr_attention_route

        if len(_ROUTES) >= _MAX_ROUTES:
            _ROUTES.clear()
        route = _ROUTES[signature] = mlr_attention_route(q, v, checked_ranks, sizes, causal, resolved_scale,
                                                         depth_normalize)
        return route(q, k, v)
    order = check_dim_order(dim_order, q.shape[-1])
    if q.device.type == "cpu" and cpu.available():
        return cpu.mlr_attention_cpu(q, k, v, ranks, sizes, causal, resolved_scale, depth_normalize, document_ids,
                                     order)
    if order is not None:
        # made once per order and device: copied from the host on every call it would wait for the
        # GPU in every layer of a Hugging Face model's MLR attention
        index = (torch.tensor(order, device=q.device) if torch.compiler.is_compiling()
                 else device_table(order, torch.long, q.device))
        q, k = _gather_dims(q, index), _gather_dims(k, index)
    if document_ids is None:
        return _mlr_attention(q, k, v, ranks, sizes, causal, resolved_scale, depth_normalize)
    if on_triton(q):
        from .triton_general import mlr_attention_checked

        return mlr_attention_checked(q, k, v, ranks, sizes, causal, resolved_scale, depth_normalize, document_ids)
    # The segments are read on the host: a device synchronisation, and a graph break (data-dependent
    # shapes) under torch.compile.
    table, _ = document_segments(document_ids)
    if len(table) == q.shape[0]:  # one document per row: the plain call
        return _mlr_attention(q, k, v, ranks, sizes, causal, resolved_scale, depth_normalize)
    # Each segment is checked again as a sequence of its own; the call's sizes are valid for it
    # (s_1 >= T >= its length).
    rows: list[list[torch.Tensor]] = [[] for _ in range(q.shape[0])]
    for b, start, length in table.tolist():
        end = start + length
        rows[b].append(_mlr_attention(q[b:b + 1, :, start:end], k[b:b + 1, :, start:end], v[b:b + 1, :, start:end],
                                      ranks, sizes, causal, resolved_scale, depth_normalize))
    return torch.cat([torch.cat(segments, dim=2) for segments in rows], dim=0)


def _mlr_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranks: tuple[int, ...],
    sizes: tuple[int, ...],
    causal: bool,
    scale: float,
    depth_normalize: bool,
) -> torch.Tensor:
    """One checked call (block sizes and scale resolved), without documents, where the C++ kernel
    does not run: Triton, the blocked path or the reference, as the dispatch table picks."""
    args = (q, k, v, ranks, sizes, causal, scale, depth_normalize)
    if on_triton(q):
        from .triton_general import mlr_attention_checked

        return mlr_attention_checked(*args)
    if q.device.type == "cpu":
        return blocked.mlr_attention_blocked(*args)
    return mlr_attention_reference(*args)


def mlr_decode(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    key_starts: Sequence[int],
    v: torch.Tensor,
    ranks: Sequence[int],
    scale: float,
    depth_normalize: bool = False,
    row_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decoding step with the contract of :func:`mlr_decode_reference` (``row_starts``:
    left-padded rows), on the fastest correct path (see the table above)."""
    # Checked once here: the kernels' entries below take checked arguments (a decoding step is on
    # the host's critical path, once per layer and token).
    ranks, scale = check_mlr_cache_arguments(q, keys, key_starts, v, ranks, scale, depth_normalize, one_query=True,
                                             row_starts=row_starts)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, v, *keys)):
        return mlr_decode_reference(q, keys, key_starts, v, ranks, scale, depth_normalize, row_starts)
    if on_triton(v):
        from . import triton_decode

        return triton_decode.decode(q, keys, key_starts, v, ranks, scale, depth_normalize, row_starts=row_starts)
    if v.device.type == "cpu" and cpu.available():
        return cpu.decode(q, keys, key_starts, v, scale, depth_normalize, row_starts)
    return mlr_decode_reference(q, keys, key_starts, v, ranks, scale, depth_normalize, row_starts)


def mlr_prefill(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    key_starts: Sequence[int],
    v: torch.Tensor,
    ranks: Sequence[int],
    scale: float,
    depth_normalize: bool = False,
    block_sizes: Sequence[int] | None = None,
    row_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``t`` new queries against the compressed cache, with the contract of
    :func:`mlr_prefill_reference`; one query goes to :func:`mlr_decode`."""
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[2] == 1:
        return mlr_decode(q, keys, key_starts, v, ranks, scale, depth_normalize, row_starts)
    return mlr_prefill_reference(q, keys, key_starts, v, ranks, scale, depth_normalize, block_sizes, row_starts)
