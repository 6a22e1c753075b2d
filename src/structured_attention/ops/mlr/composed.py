"""MLR attention composed of the vendors' fused softmax-attention kernels, merged by log-sum-exp.

The keys a query scores at depth exactly ``d`` are one contiguous range or two: the part of its
level-``d`` block outside its level-``(d+1)`` block (before it when causal, before and after it
when not); at the finest depth ``L``, its level-``L`` block (up to itself when causal). Each of
those ranges has the same shape for the same child of every level-``d`` block, so depth ``d`` is a
few *batched rectangular* attentions over the first ``R_d = r_1 + ... + r_d`` head dims
(the level-``d`` blocks as a batch dimension, no mask), and depth ``L`` one batched causal attention
over all ``R`` dims. Every pair of positions falls in exactly one call, so the calls' outputs
``O_c`` and row log-sum-exps ``lse_c`` merge exactly::

    lse = log sum_c exp(lse_c),   O = sum_c exp(lse_c - lse) O_c.

The backward runs each call's fused backward with the *merged* ``O`` and ``lse`` (as ring attention
does): a call's probabilities ``exp(S_c - lse)`` are then the rows' true probabilities and its
``rowsum(dO * O)`` the true one, so the calls' gradients sum to the exact gradient.

What this buys is each vendor kernel's speed on every GPU generation; what it costs is a pass over
the queries, keys and values per call, a merge per call, and, where the kernel needs equal query and
value head dims (FlashAttention, PyTorch's CPU flash kernel), the prefix ``R_d`` padded with zeros to
the value dim (the scores are unchanged; the padded products are wasted). The call is
:func:`mlr_attention_composed`; :mod:`.dispatch` does not pick it (the fused kernels are the default
where they win; docs/benchmarks.md has the measurements).

A level-``d`` block of length ``S`` that the sequence cuts short (the last one, when ``T`` is not a
multiple of ``S``; level 1 whenever ``s_1 > T``) runs as calls of its own with its real lengths, so
no call ever sees a padded position.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..._checks import require
from .contract import check_mlr_arguments, expand_kv

__all__ = ["mlr_attention_composed"]


@dataclass(frozen=True)
class _Span:
    """Rows ``[start + b * size + offset, ... + length)`` for ``b < count`` of a ``(N, T, D)`` tensor:
    the same rows of ``count`` consecutive blocks of ``size``, as a ``(N, count, length, D)`` view
    (the blocks as the kernel's head axis)."""

    start: int
    size: int
    count: int
    offset: int
    length: int

    def of(self, x: torch.Tensor) -> torch.Tensor:
        blocks = x.narrow(1, self.start, self.count * self.size).unflatten(1, (self.count, self.size))
        return blocks.narrow(2, self.offset, self.length)


@dataclass(frozen=True)
class _Call:
    """One fused attention: queries ``rows`` against keys ``keys`` over the first ``dims`` head dims,
    scores multiplied by ``scale``, causal within the (square) block if ``causal``."""

    rows: _Span
    keys: _Span
    dims: int
    scale: float
    causal: bool


def _calls(T: int, ranks: Sequence[int], sizes: Sequence[int], causal: bool, scale: float,
           depth_normalize: bool) -> Iterator[_Call]:
    """The calls that cover every scored pair once (see the module docstring)."""
    L = len(ranks)
    for d in range(1, L + 1):
        dims = sum(ranks[:d])
        level_scale = scale / d if depth_normalize else scale
        S = sizes[d - 1]
        full = T // S
        blocks = [(0, full, S)] if full else []  # (first row, how many, length) of level-d blocks
        if T % S:
            blocks.append((full * S, 1, T % S))
        for first, count, length in blocks:
            if d == L:  # the finest depth: the whole block
                block = _Span(first, length, count, 0, length)
                yield _Call(block, block, dims, level_scale, causal)
                continue
            s = sizes[d]
            for c in range(math.ceil(length / s)):
                rows = _Span(first, length, count, c * s, min(s, length - c * s))
                if c:  # the children before this one
                    yield _Call(rows, _Span(first, length, count, 0, c * s), dims, level_scale, False)
                after = length - (c + 1) * s
                if not causal and after > 0:  # and after it
                    yield _Call(rows, _Span(first, length, count, (c + 1) * s, after), dims, level_scale, False)


def _padded(x: torch.Tensor, dims: int) -> torch.Tensor:
    return x if x.shape[-1] == dims else F.pad(x, (0, dims - x.shape[-1]))


def _width(call: _Call, v: torch.Tensor) -> int:
    """The head dim of a call's kernel: query, key and value dims equal, a multiple of 8."""
    return -(-max(call.dims, v.shape[-1]) // 8) * 8


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: _Call) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """One fused attention: ``(out, lse, state)``, out in v's head dim; ``state`` is what the CUDA
    kernel's backward needs of its forward (sequence offsets, lengths, random state), empty on the CPU."""
    width = _width(call, v)
    q, k, vp = _padded(q, width), _padded(k, width), _padded(v, width)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, vp, 0.0, call.causal, scale=call.scale)
        return out[..., :v.shape[-1]], lse, ()
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, vp, 0.0, call.causal, scale=call.scale)
    return out[..., :v.shape[-1]], lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _attend_backward(gout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, call: _Call, state: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One fused attention's backward against the merged ``out`` and ``lse`` of its rows, with its
    forward's ``state``."""
    width = _width(call, v)
    q, k, vp, out, gout = (_padded(x, width) for x in (q, k, v, out, gout))
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            gout, q, k, vp, out, lse, 0.0, call.causal, scale=call.scale)
    else:
        cum_q, cum_k, max_q, max_k, seed, offset = state
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            gout, q, k, vp, out, lse, cum_q, cum_k, max_q, max_k, 0.0, call.causal, seed, offset, scale=call.scale)
    return dq[..., :call.dims], dk[..., :call.dims], dv[..., :v.shape[-1]]


class _Composed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # noqa: ANN001
                calls: tuple[_Call, ...]) -> torch.Tensor:
        # merged in float32 (float64 for float64 inputs), the precision the kernels' lse has
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros(*q.shape[:2], v.shape[-1], dtype=acc, device=q.device)
        lse = torch.full(q.shape[:2], -math.inf, dtype=acc, device=q.device)
        states = []
        for call in calls:
            o, m, state = _attend(call.rows.of(q)[..., :call.dims], call.keys.of(k)[..., :call.dims], call.keys.of(v), call)
            rows_out, rows_lse = call.rows.of(out), call.rows.of(lse.unsqueeze(-1)).squeeze(-1)
            merged = torch.logaddexp(rows_lse, m)
            rows_out.mul_(torch.exp(rows_lse - merged).unsqueeze(-1)).add_(torch.exp(m - merged).unsqueeze(-1) * o)
            rows_lse.copy_(merged)
            states.append(state)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.calls, ctx.states = calls, states
        return out

    @staticmethod
    def backward(ctx, gout: torch.Tensor):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        gout = gout.contiguous()
        dq, dk, dv = (torch.zeros_like(x, dtype=lse.dtype) for x in (q, k, v))
        for call, state in zip(ctx.calls, ctx.states):
            rows, keys = call.rows, call.keys
            gq, gk, gv = _attend_backward(rows.of(gout), rows.of(q)[..., :call.dims], keys.of(k)[..., :call.dims],
                                          keys.of(v), rows.of(out), rows.of(lse.unsqueeze(-1)).squeeze(-1), call,
                                          state)
            rows.of(dq)[..., :call.dims].add_(gq)
            keys.of(dk)[..., :call.dims].add_(gk)
            keys.of(dv).add_(gv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def mlr_attention_composed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranks: Sequence[int],
    block_sizes: Sequence[int] | None = None,
    causal: bool = True,
    scale: float | None = None,
    depth_normalize: bool = False,
) -> torch.Tensor:
    """MLR attention as batched calls of the fused softmax-attention kernel (PyTorch's flash kernel:
    its CPU one, or FlashAttention on CUDA for float16 and bfloat16), merged by log-sum-exp; the
    contract of :func:`~.reference.mlr_attention_reference` without ``document_ids``, differentiable
    in ``q``, ``k`` and ``v``."""
    ranks, sizes, scale = check_mlr_arguments(q, k, v, ranks, block_sizes, causal, scale, depth_normalize)
    require(q.device.type == "cpu" or q.dtype in (torch.float16, torch.bfloat16), "q.dtype",
            "float16 or bfloat16 on CUDA (FlashAttention's dtypes)", q.dtype)
    B, H, T, R = q.shape
    group = H // k.shape[1]
    calls = tuple(_calls(T, ranks, sizes, causal, scale, depth_normalize))
    out = _Composed.apply(q.reshape(B * H, T, R), expand_kv(k, group).reshape(B * H, T, R),
                          expand_kv(v, group).reshape(B * H, T, v.shape[-1]), calls)
    return out.reshape(B, H, T, -1)
