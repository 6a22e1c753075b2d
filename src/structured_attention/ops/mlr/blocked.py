"""Tiled (memory-bounded) MLR attention for CPU, forward and backward.

Same contract as :func:`~structured_attention.ops.mlr.reference.mlr_attention_reference`, but the ``(T, T)`` score matrix is never built. Queries are processed in
tiles of ``tile`` rows (default: the largest block size ``<= 64``); a tile holds its *complete*
score rows (``tile x T`` per head, so memory is ``O(T * tile)``), assembled from rectangles:

* *uniform rectangles*: contiguous key ranges whose depth ``d`` is the same for every row (the
  earlier -- and, when bidirectional, later -- siblings of the enclosing blocks). Their score is one
  matmul over the *prefix* ``q[:, :R_d] @ k[seg, :R_d]^T`` (``R_d = r_1 + ... + r_d``; the
  prefix-rank fact of docs/design.md), written by BLAS straight into a column slice of the row buffer;
* a small *self region* per sub-tile (the keys of the sub-tile's own block of >= 32 rows, or of the
  tile's block), scored as the common prefix plus masked finer levels and the causal mask.

Because rows are complete, the softmax is ATen's fused one (in place, no online rescaling, no
log-sum-exp to carry), and the backward simply recomputes the tile's scores and softmax: only q, k,
v and the output are saved. The backward uses ``dS = P * (dO V^T - rowsum(dO * O))`` (the
subtraction folded into the matmul by augmenting ``[dO, -delta] @ [V, 1]^T``) and accumulates dq and
dk transposed, ``(R, T)``, so the narrow prefix-rank updates are wide BLAS calls.

Threading: the many medium-sized ATen calls scale badly with intra-op OpenMP threads (each opens a
parallel region; on small VMs the cost is large and erratic), so the heads are split over
``torch.get_num_threads()`` Python threads that each run single-threaded ATen/BLAS (the GIL is
released inside ops). ``torch.set_num_threads`` is set to 1 for the duration of the call and
restored afterwards (process-global, like any ATen thread setting). Short sequences
(``T < _THREADED_MIN_T``), or ``_THREADED = False``, use plain intra-op threading instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import torch

from ..._checks import require
from .contract import attach_backward, check_mlr_arguments, compute_dtype, expand_kv

__all__ = ["mlr_attention_blocked", "DEFAULT_TILE"]

DEFAULT_TILE = 64


# --------------------------------------------------------------------------------------------------
# Tiling plan (pure integer bookkeeping, cached per configuration)
# --------------------------------------------------------------------------------------------------


class _TilePlan:
    """Work of one query tile ``[a, b)``: ``n`` score columns (keys ``[0, n)``) and ``rects``.

    Each rect ``(r0, r1, c0, c1, p, masked, inv_depth, causal_mask)`` covers tile rows ``[r0, r1)``
    (relative to ``a``) and keys ``[c0, c1)``; its score is ``scale * q[:, :R_p] @ k[:, :R_p]^T``
    plus, for each ``(level_index, mask)`` in ``masked``, that level's product restricted to the
    0/1 ``mask``; then times ``inv_depth`` (``1/d``, depth_normalize on a non-uniform rect) and
    ``-inf`` where ``causal_mask`` (``j > i``). Uniform rects (the common case) have no masks and,
    for depth_normalize, use ``scale / p``; ``p=None`` marks keys in the future of all its rows
    (causal; filled with ``-inf``). The rects of a tile partition its score rows.
    """

    __slots__ = ("a", "b", "n", "rects")

    def __init__(self, a, b, n, rects):
        self.a, self.b, self.n, self.rects = a, b, n, rects


_MIN_SUBTILE = 32  # below this many rows, finer levels are handled with masks rather than rects


def _masked_region(a, b, c, e, g, sizes, causal, depth_normalize, cache):
    """Depth structure of rows ``[a, b)`` x keys ``[c, e)``, all inside one level-``g`` block."""
    key = (a - c, b - a, e - c, g)  # c starts a level-g block, so finer blocks align with it
    if key not in cache:
        i = torch.arange(a, b)[:, None]
        j = torch.arange(c, e)[None, :]
        depth = torch.zeros(b - a, e - c, dtype=torch.long)
        for s in sizes:
            depth += (i // s == j // s).long()
        valid = (j <= i) if causal else torch.ones_like(depth, dtype=torch.bool)
        dmin = int(depth[valid].min())
        dmax = int(depth[valid].max())
        masked = tuple((l, (depth >= l + 1).double()) for l in range(dmin, dmax))
        inv_depth = (1.0 / depth.double()) if (depth_normalize and dmax > dmin) else None
        causal_mask = (j > i) if causal and bool((j > i).any()) else None
        cache[key] = (dmin, masked, inv_depth, causal_mask)
    return cache[key]


@lru_cache(maxsize=64)
def _plan(T: int, sizes: tuple[int, ...], tile: int, causal: bool, depth_normalize: bool):
    L = len(sizes)
    tiles = []
    region_cache: dict = {}

    def block(x, l):
        st = (x // sizes[l]) * sizes[l]
        return st, min(st + sizes[l], T)

    for a in range(0, T, tile):
        b = min(a + tile, T)
        # Deepest level (0-based) whose block contains the whole tile.
        m = max(l for l in range(L) if a // sizes[l] == (b - 1) // sizes[l])
        rects = []

        def uniform(r0, r1, x, lo, hi):
            # keys of depth exactly l+1 for l in [lo, hi): inside x's level-l block, outside level-(l+1)
            for l in range(lo, hi):
                (s0, e0), (s1, e1) = block(x, l), block(x, l + 1)
                if s1 > s0:
                    rects.append((r0, r1, s0, s1, l + 1, (), None, None))
                if not causal and e0 > e1:
                    rects.append((r0, r1, e1, e0, l + 1, (), None, None))

        uniform(0, b - a, a, 0, m)
        # Split the tile into sub-tiles along level g blocks (the finest one of >= _MIN_SUBTILE rows),
        # so that only the small self-region of each sub-tile needs masks.
        g = max([l for l in range(m, L) if sizes[l] >= _MIN_SUBTILE] or [m])
        a2 = a
        while a2 < b:
            sg, eg = block(a2, g)
            b2 = min(b, eg)
            uniform(a2 - a, b2 - a, a2, m, g)
            c2, e2 = sg, (b2 if causal else eg)
            p, masked, inv_depth, cmask = _masked_region(a2, b2, c2, e2, g, sizes, causal,
                                                         depth_normalize, region_cache)
            rects.append((a2 - a, b2 - a, c2, e2, p, masked, inv_depth, cmask))
            if causal and b2 < b:  # future keys of the tile's later sub-tiles: masked out
                rects.append((a2 - a, b2 - a, b2, b, None, (), None, None))
            a2 = b2
        tiles.append(_TilePlan(a, b, b if causal else T, tuple(rects)))
    return tuple(tiles)


# --------------------------------------------------------------------------------------------------
# Kernels on flattened heads: q (N, T, R), k (N, T, R), v (N, T, Dv), all contiguous, same dtype
# --------------------------------------------------------------------------------------------------


def _scores(S, qt, k, plan, offsets, scale, dn, cache):
    """Fill the tile's score rows ``S`` (N, tq, n) in place."""
    for r0, r1, c0, c1, p, masked, inv_depth, causal_mask in plan.rects:
        Sv = S[:, r0:r1, c0:c1]
        if p is None:
            Sv.fill_(float("-inf"))
            continue
        Rp = offsets[p]
        qr = qt[:, r0:r1]
        alpha = scale / p if (dn and inv_depth is None) else scale
        torch.baddbmm(Sv, qr[:, :, :Rp], k[:, c0:c1, :Rp].transpose(1, 2), beta=0, alpha=alpha,
                      out=Sv)
        for lvl, mask in masked:
            l0, l1 = offsets[lvl], offsets[lvl + 1]
            part = torch.bmm(qr[:, :, l0:l1], k[:, c0:c1, l0:l1].transpose(1, 2))
            Sv.addcmul_(part, cache(mask), value=scale)
        if inv_depth is not None:
            Sv.mul_(cache(inv_depth))
        if causal_mask is not None:
            Sv.masked_fill_(cache(causal_mask), float("-inf"))


def _buffers(N, tile, T, dtype, device, count):
    return [torch.empty(N * tile * T, dtype=dtype, device=device) for _ in range(count)]


def _view(buf, N, tq, n):
    return buf[: N * tq * n].view(N, tq, n)


def _make_cache(dtype, device):
    store: dict = {}

    def get(t):
        key = id(t)
        hit = store.get(key)
        if hit is None:
            hit = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
            store[key] = hit
        return hit

    return get


def _forward_range(q, k, v, out, plans, offsets, scale, dn, tile):
    N, T, _ = q.shape
    (bufS,) = _buffers(N, min(tile, T), T, q.dtype, q.device, 1)
    cache = _make_cache(q.dtype, q.device)
    for plan in plans:
        a, b, n = plan.a, plan.b, plan.n
        tq = b - a
        S = _view(bufS, N, tq, n)
        _scores(S, q[:, a:b], k, plan, offsets, scale, dn, cache)
        P = torch.ops.aten._softmax.out(S, -1, False, out=S)  # in place, see _softmax_note
        torch.bmm(P, v[:, :n], out=out[:, a:b])


def _backward_range(gout, q, k, v, out, dqT, dkT, dv, plans, offsets, scale, dn, tile):
    N, T, _ = q.shape
    # dP - delta in one matmul: [dO, -delta] @ [V, 1]^T (delta = rowsum(dO * O)).
    gaug = torch.cat([gout, -(gout * out).sum(-1, keepdim=True)], dim=-1)  # (N, T, Dv + 1)
    vaug = torch.cat([v, v.new_ones(N, T, 1)], dim=-1)  # (N, T, Dv + 1)
    qT = q.transpose(1, 2)
    kT = k.transpose(1, 2)
    bufS, bufD = _buffers(N, min(tile, T), T, q.dtype, q.device, 2)
    cache = _make_cache(q.dtype, q.device)
    for plan in plans:
        a, b, n = plan.a, plan.b, plan.n
        tq = b - a
        qt = q[:, a:b]
        got = gout[:, a:b]
        S = _view(bufS, N, tq, n)
        _scores(S, qt, k, plan, offsets, scale, dn, cache)
        P = torch.ops.aten._softmax.out(S, -1, False, out=S)  # in place
        dv[:, :n].baddbmm_(P.transpose(1, 2), got)
        dS = _view(bufD, N, tq, n)
        # dS = P * (dO V^T - delta)
        torch.bmm(gaug[:, a:b], vaug[:, :n].transpose(1, 2), out=dS)
        dS.mul_(P)
        # dq and dk are accumulated transposed, (N, R, T): the prefix-rank updates are then wide
        # (R_d x keys) instead of narrow (keys x R_d) matrices, several times faster in BLAS.
        for r0, r1, c0, c1, p, masked, inv_depth, causal_mask in plan.rects:
            if p is None:
                continue
            g = dS[:, r0:r1, c0:c1]
            if inv_depth is not None:
                g = g * cache(inv_depth)
                alpha = scale
            else:
                alpha = scale / p if dn else scale
            Rp = offsets[p]
            i0, i1 = a + r0, a + r1
            dqT[:, :Rp, i0:i1].baddbmm_(kT[:, :Rp, c0:c1], g.transpose(1, 2), alpha=alpha)
            dkT[:, :Rp, c0:c1].baddbmm_(qT[:, :Rp, i0:i1], g, alpha=alpha)
            for lvl, mask in masked:
                l0, l1 = offsets[lvl], offsets[lvl + 1]
                gl = g * cache(mask)
                dqT[:, l0:l1, i0:i1].baddbmm_(kT[:, l0:l1, c0:c1], gl.transpose(1, 2), alpha=scale)
                dkT[:, l0:l1, c0:c1].baddbmm_(qT[:, l0:l1, i0:i1], gl, alpha=scale)


_POOL: ThreadPoolExecutor | None = None


def _parallel_over_heads(fn, N: int, T: int, *tensors) -> None:
    """Run ``fn(*[t[lo:hi] for t in tensors])`` on contiguous chunks of the flattened heads.

    With W = torch.get_num_threads() > 1 and N >= 2, the chunks run in W Python threads with ATen
    and BLAS single-threaded (torch ops release the GIL). Many small ATen ops each opening an
    OpenMP parallel region scale very badly (and erratically, in VMs) on few cores; splitting the
    independent heads over threads instead gives one long, synchronisation-free stream per core.
    The global thread count is restored afterwards.
    """
    global _POOL
    W = min(torch.get_num_threads(), N)
    if W <= 1 or not _THREADED or T < _THREADED_MIN_T:
        fn(*tensors)
        return
    bounds = [N * w // W for w in range(W + 1)]
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if _POOL is None or _POOL._max_workers < W:  # noqa: SLF001
            _POOL = ThreadPoolExecutor(max_workers=W, thread_name_prefix="mlr_blocked")
        futs = [_POOL.submit(_single_threaded, fn, *[t[lo:hi] for t in tensors])
                for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]
        for f in futs:
            f.result()
    finally:
        torch.set_num_threads(prev)


def _single_threaded(fn, *args):
    torch.set_num_threads(1)
    with torch.no_grad():  # grad mode is thread-local; the kernels write into out= buffers
        return fn(*args)


_THREADED = True
# Below this T the per-op Python cost dominates and two Python threads contend for the GIL; plain
# intra-op threading was faster there (measured on a 2-core VM: T=1024 ~42 ms vs ~53 ms fwd+bwd).
_THREADED_MIN_T = 2048
# _softmax_note: the softmax runs in place (out=S). ATen's last-dim CPU softmax reads a row for its
# max, then writes exp and sums, then rescales, row by row, so aliasing is safe; it keeps one tile
# buffer fewer in cache. The tests (float64 and float32, against the reference) cover it.


def _forward(q, k, v, plans, offsets, scale, dn, tile):
    N, T, _ = q.shape
    out = torch.empty(N, T, v.shape[-1], dtype=q.dtype, device=q.device)
    _parallel_over_heads(
        lambda q_, k_, v_, o_: _forward_range(q_, k_, v_, o_, plans, offsets, scale, dn, tile),
        N, T, q, k, v, out)
    return out


def _backward(gout, q, k, v, out, plans, offsets, scale, dn, tile):
    N, T, R = q.shape
    dqT = q.new_zeros(N, R, T)
    dkT = k.new_zeros(N, R, T)
    dv = torch.zeros_like(v)
    _parallel_over_heads(
        lambda *t: _backward_range(*t, plans, offsets, scale, dn, tile),
        N, T, gout, q, k, v, out, dqT, dkT, dv)
    return dqT.transpose(1, 2), dkT.transpose(1, 2), dv


# The forward and backward are custom ops, so torch.compile keeps each call whole (the thread pool and
# the tiling plan are invisible to it) and autograd reaches the backward through register_autograd.
@torch.library.custom_op("sattn::mlr_blocked_forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sizes: list[int], offsets: list[int],
                causal: bool, scale: float, depth_normalize: bool, tile: int) -> torch.Tensor:
    plans = _plan(q.shape[1], tuple(sizes), tile, causal, depth_normalize)
    return _forward(q, k, v, plans, tuple(offsets), scale, depth_normalize, tile)


@_forward_op.register_fake
def _(q, k, v, sizes, offsets, causal, scale, depth_normalize, tile):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


@torch.library.custom_op("sattn::mlr_blocked_backward", mutates_args=())
def _backward_op(gout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 sizes: list[int], offsets: list[int], causal: bool, scale: float, depth_normalize: bool,
                 tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plans = _plan(q.shape[1], tuple(sizes), tile, causal, depth_normalize)
    dq, dk, dv = _backward(gout.contiguous(), q, k, v, out, plans, tuple(offsets), scale, depth_normalize, tile)
    return dq.contiguous(), dk.contiguous(), dv


@_backward_op.register_fake
def _(gout, q, k, v, out, sizes, offsets, causal, scale, depth_normalize, tile):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


attach_backward(_forward_op, _backward_op)


# --------------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------------


def _default_tile(sizes: tuple[int, ...], T: int) -> int:
    """The largest block size <= DEFAULT_TILE (so tiles align with blocks), else DEFAULT_TILE."""
    fits = [s for s in sizes if s <= DEFAULT_TILE]
    return max(fits) if fits else DEFAULT_TILE


def mlr_attention_blocked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranks: Sequence[int],
    block_sizes: Sequence[int] | None = None,
    causal: bool = True,
    scale: float | None = None,
    depth_normalize: bool = False,
    tile: int | None = None,
) -> torch.Tensor:
    """MLR attention with ``O(T * tile)`` memory, forward and backward; same contract as
    :func:`~structured_attention.ops.mlr.reference.mlr_attention_reference` (see its docstring).

    Args:
        tile: query rows per tile; ``None`` picks the largest block size ``<= 64`` (or 64).
            Any positive int is correct; tiles aligned with a block size are fastest.
    """
    ranks, sizes, scale = check_mlr_arguments(q, k, v, ranks, block_sizes, causal, scale, depth_normalize)
    B, H, T, R = q.shape
    Hk = k.shape[1]
    if tile is None:
        tile = _default_tile(tuple(sizes), T)
    require(isinstance(tile, int) and not isinstance(tile, bool) and tile > 0, "tile",
            "a positive int or None", tile)

    dtype = compute_dtype(q.dtype)
    G = H // Hk
    Dv = v.shape[-1]
    qc = q.to(dtype).reshape(B * H, T, R).contiguous()
    kc = expand_kv(k.to(dtype), G).reshape(B * H, T, R).contiguous()
    vc = expand_kv(v.to(dtype), G).reshape(B * H, T, Dv).contiguous()
    offsets = [0, *itertools.accumulate(ranks)]  # R_d = offsets[d]
    out = _forward_op(qc, kc, vc, list(sizes), offsets, causal, scale, depth_normalize, tile)
    return out.reshape(B, H, T, Dv).to(q.dtype)
