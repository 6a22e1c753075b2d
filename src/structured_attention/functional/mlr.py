"""MLR attention: a multi-level low-rank score matrix over positions (SPEC section 3).

Per head, queries and keys have ``R = r_1 + ... + r_L`` dims split by level, ``q = [q_1 | ... | q_L]``.
Level ``l`` has block size ``s_l`` (``s_1 > ... > s_L``, ``s_{l+1} | s_l``, ``s_1 >= T``), and
``blk_l(i) = i // s_l``. With depth ``d(i, j) = #{l : blk_l(i) == blk_l(j)}``::

    S(i, j) = scale * sum_{l <= d(i, j)} <q_l(i), k_l(j)>     (divided by d(i, j) if depth_normalize)
    out     = softmax_j(S masked to j <= i when causal) @ V

Because the blocks are nested, ``l <= d(i, j)`` is the same as "i and j share a level-``l`` block",
so ``S`` is the level-1 score ``q_1 k_1^T`` plus, for each finer level, ``q_l k_l^T`` restricted to
that level's diagonal blocks. :func:`mlr_attention_reference` is built exactly that way and is the
reference every fast path is checked against; :func:`mlr_attention` dispatches to the fastest
correct path for its inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from structured_attention._checks import (
    check_int_list,
    check_positive_int,
    check_same_dtype_device,
    check_tensor,
    require,
)

__all__ = [
    "mlr_attention",
    "mlr_attention_reference",
    "check_mlr_arguments",
    "mlr_block_sizes",
    "mlr_depth",
    "mlr_pair_counts",
    "mlr_score_flops",
]

_HALF_DTYPES = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# Block sizes, depth and cost helpers
# --------------------------------------------------------------------------------------------------


def _check_block_sizes(block_sizes: object, context: int, n_levels: int | None = None) -> tuple[int, ...]:
    """Validate explicit block sizes: positive ints, strictly decreasing, nested, ``s_1 >= context``."""
    sizes = check_int_list(block_sizes, "block_sizes")
    if n_levels is not None:
        require(
            len(sizes) == n_levels,
            "block_sizes",
            f"one block size per level, i.e. {n_levels} values (len(ranks))",
            block_sizes,
        )
    for a, b in zip(sizes, sizes[1:]):
        require(b < a and a % b == 0, "block_sizes",
                "strictly decreasing sizes, each dividing the previous one (s_{l+1} | s_l)", block_sizes)
    require(sizes[0] >= context, "block_sizes",
            f"a first (coarsest) size s_1 >= context={context}, so level 1 covers the whole context",
            block_sizes)
    return sizes


def mlr_block_sizes(ranks: Sequence[int], context: int, block_sizes: Sequence[int] | None = None) -> tuple[int, ...]:
    """Validate and return the per-level block sizes of an MLR score matrix.

    Args:
        ranks: per-level ranks ``(r_1, ..., r_L)``; only their number ``L`` matters here.
        context: the context length the blocks must cover (``max_seq_len`` for a model, ``T`` for
            the functional call).
        block_sizes: ``None`` for the default ``s_l = context / 2^(l-1)`` (which requires
            ``2^(L-1)`` to divide ``context``), or ``L`` sizes, strictly decreasing, each dividing the
            previous one, with ``s_1 >= context``.

    Returns:
        The block sizes as a tuple of ``L`` ints.

    Raises:
        ValueError: naming ``ranks``, ``context`` or ``block_sizes``.
    """
    ranks = check_int_list(ranks, "ranks")
    context = check_positive_int(context, "context")
    n_levels = len(ranks)
    if block_sizes is None:
        factor = 2 ** (n_levels - 1)
        require(
            context % factor == 0,
            "block_sizes",
            f"explicit block sizes: the default context / 2^(l-1) needs context divisible by "
            f"2^(L-1)={factor} (context={context}, L={n_levels})",
            block_sizes,
        )
        return tuple(context // 2**l for l in range(n_levels))
    return _check_block_sizes(block_sizes, context, n_levels)


def mlr_depth(T: int, block_sizes: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """The depth matrix ``d(i, j) = #{l : i // s_l == j // s_l}`` as a ``(T, T)`` LongTensor.

    O(T^2) by nature; meant for tests, documentation and plots, not for the attention itself.
    ``block_sizes`` must be valid for context ``T`` (nested, ``s_1 >= T``), so ``d >= 1``.
    """
    T = check_positive_int(T, "T")
    sizes = _check_block_sizes(block_sizes, T)
    pos = torch.arange(T, device=device)
    depth = torch.zeros(T, T, dtype=torch.long, device=device)
    for s in sizes:
        blk = pos // s
        depth += (blk[:, None] == blk[None, :]).long()
    return depth


def _check_bool(value: object, name: str) -> bool:
    require(isinstance(value, bool), name, "a bool (True or False)", value)
    return value  # type: ignore[return-value]


def mlr_pair_counts(T: int, block_sizes: Sequence[int], causal: bool) -> tuple[int, ...]:
    """Per level ``l``, the number of pairs ``(i, j)`` (with ``j <= i`` when causal) sharing a level-``l`` block.

    Closed form from the block lengths clipped to ``T``: ``T // s_l`` full blocks of length ``s_l``
    plus a trailing partial block of length ``T % s_l``; a block of length ``n`` holds ``n(n+1)/2``
    causal pairs or ``n^2`` bidirectional ones.
    """
    T = check_positive_int(T, "T")
    sizes = _check_block_sizes(block_sizes, T)
    causal = _check_bool(causal, "causal")

    def pairs(n: int) -> int:
        return n * (n + 1) // 2 if causal else n * n

    return tuple((T // s) * pairs(s) + pairs(T % s) for s in sizes)


def mlr_score_flops(T: int, ranks: Sequence[int], block_sizes: Sequence[int], causal: bool) -> int:
    """Score multiply-adds per head: ``sum_l r_l * P_l`` with ``P_l`` from :func:`mlr_pair_counts`."""
    ranks = check_int_list(ranks, "ranks")
    T = check_positive_int(T, "T")
    sizes = _check_block_sizes(block_sizes, T, len(ranks))
    return sum(r * p for r, p in zip(ranks, mlr_pair_counts(T, sizes, causal)))


# --------------------------------------------------------------------------------------------------
# The attention itself
# --------------------------------------------------------------------------------------------------


def check_mlr_arguments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranks: Sequence[int],
    block_sizes: Sequence[int] | None,
    causal: bool,
    scale: float | None,
    depth_normalize: bool,
) -> tuple[tuple[int, ...], tuple[int, ...], float]:
    """Validate the arguments of the MLR attention contract (shared by every path); return the
    ranks, the block sizes and the scale (default ``1/sqrt(R)``)."""
    q = check_tensor(q, "q", 4)
    k = check_tensor(k, "k", 4)
    v = check_tensor(v, "v", 4)
    check_same_dtype_device([("q", q), ("k", k), ("v", v)])
    require(q.is_floating_point(), "q.dtype", "a floating-point dtype", q.dtype)

    B, H, T, R = q.shape
    Bk, Hk, Tk, Rk = k.shape
    require(T > 0, "q", "a non-empty sequence (T >= 1) in shape (B, H, T, R)", tuple(q.shape))
    require(R > 0, "q", "a non-empty head dim (R >= 1) in shape (B, H, T, R)", tuple(q.shape))
    require(Bk == B and Tk == T and Rk == R, "k",
            f"shape (B={B}, Hk, T={T}, R={R}) matching q", tuple(k.shape))
    require(Hk > 0 and H % Hk == 0, "k",
            f"a head count Hk (dim 1) dividing q's H={H}", tuple(k.shape))
    require(v.shape[0] == B and v.shape[1] == Hk and v.shape[2] == T, "v",
            f"shape (B={B}, Hk={Hk}, T={T}, Dv) matching k", tuple(v.shape))

    ranks = check_int_list(ranks, "ranks")
    if sum(ranks) != R:
        raise ValueError(f"ranks: expected values summing to R={R} (the last dim of q and k), "
                         f"got {ranks!r} (sum {sum(ranks)})")
    sizes = mlr_block_sizes(ranks, T, block_sizes) if block_sizes is None else _check_block_sizes(
        block_sizes, T, len(ranks))
    _check_bool(causal, "causal")
    _check_bool(depth_normalize, "depth_normalize")
    if scale is None:
        scale = 1.0 / math.sqrt(R)
    else:
        require(isinstance(scale, (int, float)) and not isinstance(scale, bool)
                and math.isfinite(scale) and scale > 0, "scale", "a finite positive number or None", scale)

    return ranks, sizes, float(scale)


def _add_on_diagonal_blocks(S: torch.Tensor, block: torch.Tensor, s: int, n_full: int) -> None:
    """In place: ``S[..., b*s:(b+1)*s, b*s:(b+1)*s] += block[..., b, :, :]`` for ``b < n_full``.

    ``S`` is ``(..., T, T)``; ``block`` is ``(..., n_full, s, s)`` (broadcastable on the leading dims).
    The diagonal blocks are reached through a strided view, so nothing of size ``T x T`` is built.
    """
    n = n_full * s
    lead = S.shape[:-2]
    view = S[..., :n, :n].view(*lead, n_full, s, n_full, s)
    diag = torch.diagonal(view, dim1=-4, dim2=-2)  # (..., s, s, n_full)
    diag.add_(block.movedim(-3, -1))


def mlr_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranks: Sequence[int],
    block_sizes: Sequence[int] | None = None,
    causal: bool = True,
    scale: float | None = None,
    depth_normalize: bool = False,
) -> torch.Tensor:
    """Exact MLR attention (SPEC section 3, "MLR attention, exactly").

    Args:
        q: queries ``(B, H, T, R)``.
        k: keys ``(B, Hk, T, R)``; ``Hk`` divides ``H`` and query head ``h`` reads key/value head
            ``h // (H // Hk)`` (grouped-query attention, as ``repeat_interleave`` gives).
        v: values ``(B, Hk, T, Dv)``.
        ranks: per-level ranks ``(r_1, ..., r_L)``, positive, summing to ``R``; level ``l`` uses
            head dims ``[r_1 + ... + r_{l-1}, r_1 + ... + r_l)`` of ``q`` and ``k``.
        block_sizes: per-level block sizes; default ``T / 2^(l-1)`` (requires ``2^(L-1) | T``).
            Given sizes must be strictly decreasing and nested with ``s_1 >= T``; ``T`` need not be
            a multiple of the finest size (trailing blocks are then partial).
        causal: mask the scores to ``j <= i``.
        scale: score scale, default ``1 / sqrt(R)``. Per-level scales belong in ``q``.
        depth_normalize: divide each score by its depth ``d(i, j)``.

    Returns:
        ``(B, H, T, Dv)`` in ``q``'s dtype. Scores, softmax and ``A V`` are computed in ``q``'s dtype,
        or in float32 for float16 / bfloat16 inputs.

    Raises:
        ValueError: naming the offending parameter.
    """
    ranks, sizes, scale = check_mlr_arguments(q, k, v, ranks, block_sizes, causal, scale, depth_normalize)
    B, H, T, R = q.shape
    Hk = k.shape[1]

    compute_dtype = torch.float32 if q.dtype in _HALF_DTYPES else q.dtype
    G = H // Hk
    # GQA without copying k/v: group the query heads that share a kv head, (B, Hk, G, T, R).
    qg = (q.to(compute_dtype) * scale).reshape(B, Hk, G, T, R)
    kc = k.to(compute_dtype)
    vc = v.to(compute_dtype)
    q_levels = qg.split(ranks, dim=-1)
    k_levels = kc.split(ranks, dim=-1)

    # Level 1 covers the whole context (s_1 >= T): one dense score, (B, Hk, G, T, T).
    # einsum folds g into the matmul rows, so k is never expanded over the group.
    S = torch.einsum("bhgir,bhjr->bhgij", q_levels[0], k_levels[0])
    depth = torch.ones(T, T, dtype=compute_dtype, device=q.device) if depth_normalize else None

    for ql, kl, s in zip(q_levels[1:], k_levels[1:], sizes[1:]):
        n_full, rem = divmod(T, s)
        if n_full:
            n = n_full * s
            qb = ql[..., :n, :].unflatten(-2, (n_full, s))  # (B, Hk, G, nb, s, r)
            kb = kl[..., :n, :].unflatten(-2, (n_full, s))  # (B, Hk, nb, s, r)
            _add_on_diagonal_blocks(S, torch.einsum("bhgnir,bhnjr->bhgnij", qb, kb), s, n_full)
            if depth is not None:
                _add_on_diagonal_blocks(depth, depth.new_ones(n_full, s, s), s, n_full)
        if rem:  # trailing partial block: rows and columns [n_full * s, T)
            start = n_full * s
            S[..., start:, start:] += torch.einsum(
                "bhgir,bhjr->bhgij", ql[..., start:, :], kl[..., start:, :])
            if depth is not None:
                depth[start:, start:] += 1

    if depth is not None:
        S = S / depth
    if causal:
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu_(1)
        S = S.masked_fill(mask, float("-inf"))
    A = torch.softmax(S, dim=-1)
    out = torch.einsum("bhgij,bhjd->bhgid", A, vc)  # (B, Hk, G, T, Dv)
    return out.reshape(B, H, T, v.shape[-1]).to(q.dtype)


_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def mlr_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranks: Sequence[int],
    block_sizes: Sequence[int] | None = None,
    causal: bool = True,
    scale: float | None = None,
    depth_normalize: bool = False,
) -> torch.Tensor:
    """MLR attention with the contract of :func:`mlr_attention_reference`, on the fastest correct path:
    the Triton kernel for CUDA tensors when Triton is installed; on the CPU the fused C++ kernel
    (:func:`~structured_attention.kernels.mlr_cpu.mlr_attention_cpu`, built on first use) or, where
    it cannot be built, the blocked PyTorch path
    (:func:`~structured_attention.functional.mlr_blocked.mlr_attention_blocked`); the exact
    reference otherwise."""
    if isinstance(q, torch.Tensor) and q.is_cuda and q.dtype in _TRITON_DTYPES:
        from structured_attention.kernels import HAS_TRITON, mlr_attention_triton  # imports Triton lazily

        if HAS_TRITON:
            return mlr_attention_triton(q, k, v, ranks, block_sizes, causal, scale, depth_normalize)
    if isinstance(q, torch.Tensor) and q.device.type == "cpu":
        from structured_attention.kernels import mlr_cpu  # it imports this module

        if mlr_cpu.available():
            return mlr_cpu.mlr_attention_cpu(q, k, v, ranks, block_sizes, causal, scale, depth_normalize)
        from structured_attention.functional.mlr_blocked import mlr_attention_blocked

        return mlr_attention_blocked(q, k, v, ranks, block_sizes, causal, scale, depth_normalize)
    return mlr_attention_reference(q, k, v, ranks, block_sizes, causal, scale, depth_normalize)
