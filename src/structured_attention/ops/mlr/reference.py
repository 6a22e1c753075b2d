"""Exact references for MLR attention: the definitions written out in plain PyTorch.

* :func:`mlr_attention_reference`: full attention over a sequence, one dense ``(T, T)`` score built
  level by level (level 1 everywhere, each finer level on its diagonal blocks); with packed
  ``document_ids``, level by level under dense per-level masks of local positions;
* :func:`mlr_prefill_reference`: ``t`` new queries, at the end of a sequence, against the
  compressed cache, which holds level 1's keys for every position but level ``l``'s keys only from
  the start of the first new query's level-``l`` block;
* :func:`mlr_decode_reference`: the one-query case of it (no masks are needed: every key held for
  level ``l`` lies in the query's own level-``l`` block).

Every backend is tested against these; they are also the dispatcher's last resort.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .contract import check_mlr_arguments, check_mlr_cache_arguments, compute_dtype, grouped_matmul

__all__ = ["mlr_attention_reference", "mlr_decode_reference", "mlr_prefill_reference"]


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
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact MLR attention, the definition written out densely.

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
        document_ids: optional ``(B, T)`` integer ids of packed documents, non-decreasing along
            ``T``. A token then attends only to its own document (same id in the same row), and
            positions and block membership count from the document's first token, so each
            document is scored exactly as if it ran alone as its own sequence, with the call's
            block sizes (fixed by ``T``, not by the document's length).

    Returns:
        ``(B, H, T, Dv)`` in ``q``'s dtype. Scores, softmax and ``A V`` are computed in ``q``'s dtype,
        or in float32 for float16 / bfloat16 inputs.

    Raises:
        ValueError: naming the offending parameter.
    """
    ranks, sizes, scale = check_mlr_arguments(
        q, k, v, ranks, block_sizes, causal, scale, depth_normalize, document_ids)
    B, H, T, R = q.shape
    Hk = k.shape[1]

    acc = compute_dtype(q.dtype)
    G = H // Hk
    # GQA without copying k/v: group the query heads that share a kv head, (B, Hk, G, T, R).
    qg = (q.to(acc) * scale).reshape(B, Hk, G, T, R)
    kc = k.to(acc)
    vc = v.to(acc)
    q_levels = qg.split(ranks, dim=-1)
    k_levels = kc.split(ranks, dim=-1)
    if document_ids is not None:
        S, depth, masked = _document_scores(q_levels, k_levels, sizes, causal, depth_normalize, document_ids)
        return _attend(S, depth, masked, vc).reshape(B, H, T, v.shape[-1]).to(q.dtype)

    # Level 1 covers the whole context (s_1 >= T): one dense score, (B, Hk, G, T, T).
    # einsum folds g into the matmul rows, so k is never expanded over the group.
    S = torch.einsum("bhgir,bhjr->bhgij", q_levels[0], k_levels[0])
    depth = torch.ones(T, T, dtype=acc, device=q.device) if depth_normalize else None

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

    masked = torch.ones(T, T, dtype=torch.bool, device=q.device).triu_(1) if causal else None
    return _attend(S, depth, masked, vc).reshape(B, H, T, v.shape[-1]).to(q.dtype)


def _attend(S: torch.Tensor, depth: torch.Tensor | None, masked: torch.Tensor | None,
            vc: torch.Tensor) -> torch.Tensor:
    """The shared tail: ``softmax(S / depth, masked to -inf) @ V``.

    ``S`` is ``(B, Hk, G, T, T)``; ``depth`` and ``masked`` broadcast against it; ``vc`` is
    ``(B, Hk, T, Dv)``. Returns ``(B, Hk, G, T, Dv)``.
    """
    if depth is not None:
        S = S / depth
    if masked is not None:
        S = S.masked_fill(masked, float("-inf"))
    A = torch.softmax(S, dim=-1)
    return torch.einsum("bhgij,bhjd->bhgid", A, vc)


def _document_scores(
    q_levels: Sequence[torch.Tensor],
    k_levels: Sequence[torch.Tensor],
    sizes: Sequence[int],
    causal: bool,
    depth_normalize: bool,
    document_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Scores of packed documents, level by level with dense per-level masks (O(L T^2)).

    Level ``l`` scores ``(i, j)`` when both are in one document and their local positions
    ``p = i - start(document)`` share a level-``l`` block: ``p(i) // s_l == p(j) // s_l``.
    Returns the scores ``(B, Hk, G, T, T)``, the depth ``(B, 1, 1, T, T)`` (or ``None``) and the
    mask of excluded pairs ``(B, 1, 1, T, T)`` (other documents, and ``j > i`` when causal).
    """
    T = document_ids.shape[1]
    device = document_ids.device
    ids = document_ids
    pos = torch.arange(T, device=device).expand_as(ids)
    # The ids are non-decreasing, so a document starts where the id changes; the start of i's
    # document is the last such position <= i.
    new_doc = torch.ones_like(ids, dtype=torch.bool)
    new_doc[:, 1:] = ids[:, 1:] != ids[:, :-1]
    start = torch.where(new_doc, pos, torch.zeros_like(pos)).cummax(dim=1).values
    local = pos - start  # (B, T)
    same_doc = (ids[:, :, None] == ids[:, None, :])[:, None, None]  # (B, 1, 1, T, T)

    # Level 1: s_1 >= T >= every document's length, so same_doc alone.
    shares = [same_doc]
    for s in sizes[1:]:
        blk = local // s
        shares.append(same_doc & (blk[:, :, None] == blk[:, None, :])[:, None, None])
    S = sum(torch.einsum("bhgir,bhjr->bhgij", ql, kl) * share
            for ql, kl, share in zip(q_levels, k_levels, shares))
    depth = None
    if depth_normalize:
        # Pairs of different documents have depth 0; 1 there keeps S / depth (and its gradient)
        # finite before they are masked out.
        depth = sum(share.to(S.dtype) for share in shares).clamp_min(1)
    masked = ~same_doc
    if causal:
        masked = masked | torch.ones(T, T, dtype=torch.bool, device=device).triu_(1)
    return S, depth, masked


def mlr_prefill_reference(
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
    """New queries at positions ``[end - t, end)`` against the compressed MLR cache, exactly.

    Args:
        q: the new queries ``(B, H, t, R)``, ``R = sum(ranks)``.
        keys: per level, the keys held ``(B, Hk, end - key_starts[l], r_l)`` for positions
            ``[key_starts[l], end)``, the new tokens' keys included; ``key_starts[0] == 0`` (level 1
            keeps every key) and ``key_starts[l] <= end - t``.
        key_starts: the first position held per level.
        v: every value ``(B, Hk, end, Dv)``; ``H`` a multiple of ``Hk`` (GQA).
        ranks: ``r_1..r_L``.
        scale: logit scale.
        depth_normalize: divide each score by the number of levels that score the pair.
        block_sizes: the per-level block sizes; needed when ``t > 1``, to tell which held keys share
            each query's blocks.
        row_starts: optional ``(B, L)`` integers for left-padded rows (a batch of sequences of
            different lengths): row ``b``'s sequence starts at slot ``row_starts[b, 0]``, so slot
            ``j`` is its position ``j - row_starts[b, 0]`` and the slots before are its padding (a
            sequence of their own); ``row_starts[b, l]`` is where the first new query's level-``l``
            block starts in that row. Without it every row starts at slot 0.

    Returns:
        ``(B, H, t, Dv)`` in ``v``'s dtype; equal to the last ``t`` rows of
        :func:`mlr_attention_reference` over the whole sequence (causal), row by row over each
        row's own sequence when ``row_starts`` is given.
    """
    ranks, scale = check_mlr_cache_arguments(q, keys, key_starts, v, ranks, scale, depth_normalize, block_sizes,
                                             row_starts=row_starts)
    return _cached_attention(q, keys, key_starts, v, ranks, scale, depth_normalize, block_sizes, row_starts)


def _cached_attention(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    key_starts: Sequence[int],
    v: torch.Tensor,
    ranks: Sequence[int],
    scale: float,
    depth_normalize: bool,
    block_sizes: Sequence[int] | None,
    row_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`mlr_prefill_reference` on checked arguments."""
    acc = compute_dtype(v.dtype)
    device = v.device
    B = v.shape[0]
    t, end = q.shape[2], v.shape[2]
    # Positions of the query and key slots, per row: (B, t) and (B, end); a row's padding slots
    # (before its start) form a segment of their own.
    offset = torch.zeros(B, 1, dtype=torch.long, device=device) if row_starts is None else row_starts[:, :1].long()
    q_slot = torch.arange(end - t, end, device=device).expand(B, t)
    k_slot = torch.arange(end, device=device).expand(B, end)
    q_pos, k_pos = q_slot - offset, k_slot - offset
    q = q.to(v.dtype)  # the contract's dtype policy for the cache: queries take the cache's dtype
    scores = grouped_matmul(q[..., : ranks[0]].to(acc) * scale, keys[0].to(acc).transpose(-1, -2))
    depth = torch.ones(B, 1, t, end, dtype=acc, device=device) if depth_normalize else None
    offset_dims = ranks[0]
    for level in range(1, len(ranks)):
        q_l = q[..., offset_dims : offset_dims + ranks[level]]
        offset_dims += ranks[level]
        start = key_starts[level]
        part = grouped_matmul(q_l.to(acc) * scale, keys[level].to(acc).transpose(-1, -2))
        kp = k_pos[:, start:]
        if t > 1:  # queries past a block boundary do not share the block of the keys before it
            s = block_sizes[level]
            same = (q_pos[:, :, None].div(s, rounding_mode="floor") == kp[:, None, :].div(s, rounding_mode="floor"))
        else:  # every key held is in the query's block, from the row's own block start on
            same = torch.ones(B, 1, end - start, dtype=torch.bool, device=device)
            if row_starts is not None:
                same = same & (k_slot[:, None, start:] >= row_starts[:, level, None, None])
        same = same[:, None]  # (B, 1, t, n)
        scores[..., start:] += part * same
        if depth is not None:
            depth[..., start:] += same
    if depth is not None:
        scores = scores / depth
    masked = (k_slot[:, None, :] > q_slot[:, :, None]) if t > 1 else None
    if row_starts is not None:
        other = (q_pos[:, :, None] >= 0) != (k_pos[:, None, :] >= 0)  # padding and sequence apart
        masked = other if masked is None else masked | other
    if masked is not None:
        scores = scores.masked_fill(masked[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return grouped_matmul(weights, v.to(acc)).to(v.dtype)


def mlr_decode_reference(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    key_starts: Sequence[int],
    v: torch.Tensor,
    ranks: Sequence[int],
    scale: float,
    depth_normalize: bool = False,
    row_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new query ``(B, H, 1, R)`` at position ``end - 1`` against the compressed MLR cache: the
    one-query case of :func:`mlr_prefill_reference` (same arguments, no block sizes needed).
    Returns ``(B, H, 1, Dv)`` in ``v``'s dtype, equal to the last row of
    :func:`mlr_attention_reference` over the whole sequence."""
    ranks, scale = check_mlr_cache_arguments(q, keys, key_starts, v, ranks, scale, depth_normalize, one_query=True,
                                             row_starts=row_starts)
    return _cached_attention(q, keys, key_starts, v, ranks, scale, depth_normalize, None, row_starts)
