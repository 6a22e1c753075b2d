"""The contract of MLR attention, shared by the references, the dispatcher and every backend.

MLR attention splits each head's query and key dims by level, ``q = [q_1 | ... | q_L]`` with
ranks ``r_1 + ... + r_L = R``. Level ``l`` has block size ``s_l`` (``s_1 > ... > s_L``, each dividing
the previous one, ``s_1 >= T``), and pair ``(i, j)`` is scored by every level whose block holds both
positions::

    d(i, j) = #{l : i // s_l == j // s_l}                 (the depth, >= 1 since s_1 >= T)
    S(i, j) = scale * sum_{l <= d(i, j)} <q_l(i), k_l(j)>   (divided by d(i, j) if depth_normalize)
    out     = softmax_j(S, masked to j <= i when causal) @ V

docs/design.md explains the mathematics, the tiling the kernels use and the dispatch table.

The contract every entry point follows (one argument check, one dtype policy, one GQA policy, one
error style):

* arguments: :func:`check_mlr_arguments` (full attention, with :func:`check_document_ids` for packed
  documents) and :func:`check_mlr_cache_arguments` (new queries against a cache); each raises a
  one-line ``ValueError`` naming the parameter;
* dtypes: q, k and v share one floating dtype; scores, softmax and ``A V`` accumulate in
  :func:`compute_dtype` (float32 for float16 / bfloat16, else the input's own), and the result has
  the input's dtype;
* grouped-query attention: ``k`` and ``v`` have ``Hk`` heads with ``Hk | H``; query head ``h``
  reads kv head ``h // (H // Hk)``, as ``repeat_interleave`` gives (:func:`expand_kv`,
  :func:`grouped_matmul`).
"""

from __future__ import annotations

import functools
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..._checks import (
    check_int_list,
    check_positive_int,
    check_same_dtype_device,
    check_tensor,
    fail,
    require,
)
from ..._memo import TensorMemo

__all__ = [
    "HALF_DTYPES",
    "VARLEN_TAGS",
    "attach_backward",
    "compiled_or_eager",
    "differentiable_ops",
    "eager_autograd",
    "check_attention_inputs",
    "check_bool",
    "check_dim_order",
    "check_document_ids",
    "check_mlr_arguments",
    "check_mlr_cache_arguments",
    "check_scale",
    "compute_dtype",
    "device_table",
    "document_segments",
    "expand_kv",
    "grouped_matmul",
    "heads_inner",
    "mlr_block_sizes",
    "mlr_depth",
    "mlr_pair_counts",
    "mlr_score_flops",
]

HALF_DTYPES = (torch.float16, torch.bfloat16)


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
    if sizes[0] < context:  # the message made on failure alone: context may be a symbolic length
        fail("block_sizes", f"a first (coarsest) size s_1 >= context={context}, so level 1 covers the whole context",
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
    if block_sizes is None:
        return _default_block_sizes(len(ranks), context)
    return _check_block_sizes(block_sizes, context, len(ranks))


def _default_block_sizes(n_levels: int, context: int) -> tuple[int, ...]:
    """``context / 2^(l-1)`` for ``l = 1 .. n_levels``, where ``2^(n_levels-1)`` divides ``context``."""
    factor = 2 ** (n_levels - 1)
    if context % factor:
        fail("block_sizes", f"explicit block sizes: the default context / 2^(l-1) needs context divisible by "
                            f"2^(L-1)={factor} (context={context}, L={n_levels})", None)
    return tuple(context // 2**l for l in range(n_levels))


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


def check_scale(scale: object, expected: str) -> Any:
    """Check a logit scale; return it as the ops take it: a NumPy number (``np.float32(0.125)``)
    becomes a Python float, an int, float or symbolic float under ``torch.compile`` is returned as
    given (converting a symbolic one would fix its value in the graph)."""
    if isinstance(scale, numbers.Real) and not isinstance(scale, (int, float)):
        scale = float(scale)
    # Comparisons rather than math.isfinite: under torch.compile a float argument can be symbolic,
    # and the comparisons (NaN fails both) trace as guards where isfinite would break the graph.
    require(isinstance(scale, (int, float)) and not isinstance(scale, bool) and 0 < scale < math.inf,
            "scale", expected, scale)
    return scale


def check_bool(value: object, name: str) -> bool:
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
    causal = check_bool(causal, "causal")

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
# Arguments, dtypes and grouped-query attention
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=512)
def device_table(values: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-D tensor on ``device``, made once per distinct table.

    The kernels read small metadata tables (block sizes, ranks, addresses), the dispatcher a head-dim
    order; copying them to the device on every call would cost a synchronous host-to-device copy
    each (it waits for the device's queued work). Never write to the result.

    The table is made on a thread of its own. While ``torch.compile(mode="reduce-overhead")`` warms
    a CUDA graph up, every allocation of the calling thread goes to the graph's memory pool, where
    a table kept for later calls would be counted as a leak when the graph is recorded (an error)
    and its memory could be handed to the graph; the other thread allocates as usual. The copy is
    complete when the call returns (a copy from pageable memory waits for itself). A thread per
    table (about 70 us on a 2-core Xeon, once per distinct table), not a pool's: a process forked
    later would wait forever on a pool's dead thread.
    """
    made: list[torch.Tensor | BaseException] = []

    def make() -> None:
        try:
            made.append(torch.tensor(values, dtype=dtype, device=device))
        except BaseException as e:  # raised again on the calling thread
            made.append(e)

    maker = threading.Thread(target=make, name="sattn-device-table")
    maker.start()
    maker.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def heads_inner(x: torch.Tensor) -> bool:
    """Whether ``x`` ``(B, H, T, D)`` is laid out as ``(B, T, H, D)`` memory (a layer's transposed
    view of its projection), where the Triton kernels write their output in the same layout."""
    return x.shape[1] > 1 and x.shape[2] > 1 and x.stride(1) < x.stride(2)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores, softmax and ``A V`` accumulate in: float32 for half inputs, else ``dtype``."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


def expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """Key or value heads ``(B, Hk, ...)`` repeated to the ``Hk * group`` query heads (O(T) memory;
    autograd sums the group's gradients back)."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def grouped_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a: (B, H, t, n) @ b: (B, Hk, n, m)`` with query head ``h`` reading ``b``'s head ``h // (H/Hk)``,
    without copying ``b`` over the group."""
    bsz, h, t, n = a.shape
    hk = b.shape[1]
    return (a.reshape(bsz, hk, h // hk, t, n) @ b.unsqueeze(2)).reshape(bsz, h, t, b.shape[-1])


def masked_mix(scores: torch.Tensor, real: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query per row over a static cache: softmax of ``scores`` ``(B, H, 1, N)`` over the keys
    ``real`` marks ``(B, N)`` (in float32), times ``v`` ``(B, Hk, N, Dv)`` (GQA: ``Hk | H``)."""
    scores = scores.float().masked_fill(~real[:, None, None, :], float("-inf"))
    return grouped_matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def check_attention_inputs(q: object, k: object, v: object) -> tuple[int, int, int, int]:
    """The shapes every attention op here takes: ``q (B, H, T, R)``, ``k (B, Hk, T, R)`` and ``v
    (B, Hk, T, Dv)`` of one floating dtype and device, ``Hk`` dividing ``H`` and every dim at least
    1; returns ``(B, H, T, R)``. One-line ``ValueError`` naming the tensor otherwise."""
    # Every message is built only on failure (``if not ...: fail``): this runs on every call, on
    # the host, before the kernels can start.
    q = check_tensor(q, "q", 4)
    k = check_tensor(k, "k", 4)
    v = check_tensor(v, "v", 4)
    check_same_dtype_device([("q", q), ("k", k), ("v", v)])
    if not q.is_floating_point():
        fail("q.dtype", "a floating-point dtype", q.dtype)
    B, H, T, R = q.shape
    Bk, Hk, Tk, Rk = k.shape
    if T <= 0:
        fail("q", "a non-empty sequence (T >= 1) in shape (B, H, T, R)", tuple(q.shape))
    if R <= 0:
        fail("q", "a non-empty head dim (R >= 1) in shape (B, H, T, R)", tuple(q.shape))
    if H <= 0:
        fail("q", "at least one head (H >= 1) in shape (B, H, T, R)", tuple(q.shape))
    if not (Bk == B and Tk == T and Rk == R):
        fail("k", f"shape (B={B}, Hk, T={T}, R={R}) matching q", tuple(k.shape))
    if not (Hk > 0 and H % Hk == 0):
        fail("k", f"a head count Hk (dim 1) dividing q's H={H}", tuple(k.shape))
    if not (v.shape[0] == B and v.shape[1] == Hk and v.shape[2] == T and v.shape[3] > 0):
        fail("v", f"shape (B={B}, Hk={Hk}, T={T}, Dv >= 1) matching k", tuple(v.shape))
    return B, H, T, R


def check_mlr_arguments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranks: Sequence[int],
    block_sizes: Sequence[int] | None,
    causal: bool,
    scale: float | None,
    depth_normalize: bool,
    document_ids: torch.Tensor | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...], float]:
    """Validate the arguments of the MLR attention contract (shared by every path); return the
    ranks, the block sizes and the scale (default ``1/sqrt(R)``). ``document_ids`` (optional) is
    checked by :func:`check_document_ids`."""
    B, H, T, R = check_attention_inputs(q, k, v)
    ranks = check_int_list(ranks, "ranks")
    if sum(ranks) != R:
        raise ValueError(f"ranks: expected values summing to R={R} (the last dim of q and k), "
                         f"got {ranks!r} (sum {sum(ranks)})")
    sizes = _default_block_sizes(len(ranks), T) if block_sizes is None else _check_block_sizes(
        block_sizes, T, len(ranks))
    check_bool(causal, "causal")
    check_bool(depth_normalize, "depth_normalize")
    if scale is None:
        scale = 1.0 / math.sqrt(R)
    else:
        scale = check_scale(scale, "a finite positive number or None")
    check_document_ids(document_ids, B, T, q.device)

    return ranks, sizes, float(scale)


# What was made of the last ids read on the host: {(device, dtype): (table, longest)}. A model's
# layers take one ids tensor (and their backward the same one), so the ids are read once per step,
# not once per layer and pass: each read waits for the device's queued work.
_documents_read = TensorMemo()


def document_segments(document_ids: torch.Tensor, device: torch.device | None = None,
                      dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, int]:
    """The ``(S, 3)`` segments ``(row, start, length)`` of every document of every row of
    ``document_ids`` ``(B, T)``, in row order then position order, on ``device`` (default: the
    CPU) with ``dtype``, and the longest length. ``S == B`` where each row is one document.

    The ids are read on the host (a device synchronisation on an accelerator) once per tensor and
    version: the calls that follow with the same tensor, unchanged, take the table made then.
    Ids that decrease along a row raise the ``ValueError`` of :func:`check_document_ids` (a compiled
    call, whose graph leaves that check out, meets it here).
    """
    made = _documents_read.get(document_ids, (), lambda: _segment_tables(document_ids))
    key = (torch.device("cpu") if device is None else torch.device(device), dtype)
    if key not in made:
        table, longest = made[torch.device("cpu"), torch.int64]
        made[key] = table.to(device=key[0], dtype=dtype), longest
    return made[key]


def _segment_tables(document_ids: torch.Tensor) -> dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, int]]:
    ids = document_ids.cpu()
    check_document_order(ids)
    B, T = ids.shape
    new = torch.ones(B, T, dtype=torch.bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    rows, starts = new.nonzero(as_tuple=True)
    ends = torch.where(torch.cat([rows[1:] != rows[:-1], torch.tensor([True])]), T,
                       torch.cat([starts[1:], starts.new_tensor([T])]))
    table = torch.stack([rows, starts, ends - starts], dim=1)
    return {(torch.device("cpu"), torch.int64): (table, int(table[:, 2].max()) if len(table) else 0)}


def check_document_order(ids: torch.Tensor) -> None:
    """One-line ``ValueError`` unless the ids ``(B, T)`` are non-decreasing along ``T`` in every row
    (a device synchronisation when they live on an accelerator)."""
    if ids.shape[1] > 1:
        steps = ids[:, 1:] < ids[:, :-1]
        if bool(steps.any()):
            row, col = (int(x) for x in steps.nonzero()[0])
            raise ValueError(f"document_ids: expected ids non-decreasing along T in every row (each document "
                             f"one contiguous segment), got a decrease in row {row} at position {col + 1}")


def check_dim_order(dim_order: object, R: int) -> tuple[int, ...] | None:
    """Validate an order of the head dims: ``None`` (as they come), or a permutation of
    ``range(R)``, level ``l`` taking the next ``r_l`` of them. Returns it as a tuple (or ``None``)."""
    if dim_order is None:
        return None
    ok = (isinstance(dim_order, Sequence) and not isinstance(dim_order, str)
          and all(isinstance(d, int) and not isinstance(d, bool) for d in dim_order)
          and sorted(dim_order) == list(range(R)))
    require(ok, "dim_order", f"a permutation of range({R}) (the head dims of q and k)", dim_order)
    return tuple(dim_order)  # type: ignore[arg-type]


def check_document_ids(
    document_ids: object, B: int, T: int, device: torch.device | str | None = None, order: bool = True
) -> torch.Tensor | None:
    """Validate packed-document ids: ``None``, or an integer (not bool) tensor of shape ``(B, T)``,
    non-decreasing along ``T`` in every row (so each document is one contiguous segment; with
    ``order=False`` not checked, for ops that mask by equal ids alone), on ``device`` when given
    (the device of ``q``). Returns the tensor (or ``None``).

    Checking the order reads the ids on the host (a device synchronisation when they live on an
    accelerator; :func:`document_segments` keeps what it read for the kernels); under
    ``torch.compile`` only shape, dtype and device are checked here, and the order where the
    kernels read the ids.
    """
    if document_ids is None:
        return None
    require(isinstance(document_ids, torch.Tensor), "document_ids", "a torch.Tensor or None",
            type(document_ids).__name__)
    assert isinstance(document_ids, torch.Tensor)
    if tuple(document_ids.shape) != (B, T):  # the message made on failure alone, as in check_mlr_cache_arguments
        fail("document_ids", f"shape (B={B}, T={T})", tuple(document_ids.shape))
    require(not document_ids.is_floating_point() and not document_ids.is_complex()
            and document_ids.dtype != torch.bool, "document_ids",
            "an integer tensor (not bool)", document_ids.dtype)
    if device is not None:
        require(document_ids.device == torch.device(device), "document_ids",
                f"a tensor on {device} (the device of the inputs)", document_ids.device)
    if order and T > 1 and not torch.compiler.is_compiling():
        document_segments(document_ids)  # reads them on the host once for the kernels too
    return document_ids


def check_mlr_cache_arguments(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    key_starts: Sequence[int],
    v: torch.Tensor,
    ranks: Sequence[int],
    scale: float,
    depth_normalize: bool,
    block_sizes: Sequence[int] | None = None,
    one_query: bool = False,
    row_starts: torch.Tensor | None = None,
) -> tuple[tuple[int, ...], Any]:
    """Validate ``t`` new queries at positions ``[end - t, end)`` against the compressed cache.

    ``keys[l]`` holds level ``l``'s keys for positions ``[key_starts[l], end)`` and ``v`` every value
    for ``[0, end)``. One query (decoding) needs no block sizes: every key held for level ``l`` lies
    in its own level-``l`` block. Several queries (a prompt continued against a cache) need them to
    tell which held keys share each query's blocks. ``one_query`` requires ``t == 1`` (a decoding
    step). ``row_starts`` (left-padded rows) is checked by :func:`check_row_starts`. Returns the ranks
    and the scale as :func:`check_scale` returns it.
    """
    q = check_tensor(q, "q", 4)
    v = check_tensor(v, "v", 4)
    ranks = check_int_list(ranks, "ranks")
    require(isinstance(keys, Sequence) and len(keys) == len(ranks), "keys",
            f"one tensor per level ({len(ranks)})", type(keys).__name__ if not isinstance(keys, Sequence) else len(keys))
    require(isinstance(key_starts, Sequence) and len(key_starts) == len(ranks), "key_starts",
            f"one position per level ({len(ranks)})", key_starts)
    keys = [check_tensor(k, f"keys[{i}]", 4) for i, k in enumerate(keys)]
    # q may differ in dtype (under autocast the new queries are half while the cache is float32):
    # every path casts it to the cache's dtype.
    check_same_dtype_device([("v", v), *((f"keys[{i}]", k) for i, k in enumerate(keys))])
    require(q.device == v.device, "q.device", f"{v.device} (the device of v)", q.device)
    require(q.is_floating_point(), "q.dtype", "a floating-point dtype", q.dtype)
    require(v.is_floating_point(), "v.dtype", "a floating-point dtype", v.dtype)
    # The messages are made only on failure (fail): under torch.compile the cache's length may be
    # symbolic, and formatting it into a message fixes it to its value, a new graph per length.
    B, Hk, end, _ = v.shape
    t = q.shape[2]
    if not (q.shape[0] == B and 1 <= t <= end and q.shape[-1] == sum(ranks)):
        fail("q", f"shape (B={B}, H, t <= {end}, sum(ranks)={sum(ranks)})", tuple(q.shape))
    require(q.shape[1] % Hk == 0, "q", f"a head count (dim 1) that is a multiple of the {Hk} kv heads", tuple(q.shape))
    require(t == 1 or not one_query, "q", "one new query, shape (B, H, 1, sum(ranks))", tuple(q.shape))
    if not (t == 1 or block_sizes is not None):
        fail("block_sizes", f"the per-level block sizes when several queries (t={t}) meet the cache", block_sizes)
    if not (all(isinstance(s, int) and not isinstance(s, bool) for s in key_starts) and key_starts[0] == 0
            and all(0 <= s <= end - t for s in key_starts)):
        fail("key_starts", f"0 for level 1 and positions at most {end - t} (the first new query)", list(key_starts))
    for level, (k, r, start) in enumerate(zip(keys, ranks, key_starts)):
        if tuple(k.shape) != (B, Hk, end - start, r):
            fail(f"keys[{level}]", f"shape {(B, Hk, end - start, r)}", tuple(k.shape))
    scale = check_scale(scale, "a finite positive number")
    check_bool(depth_normalize, "depth_normalize")
    check_row_starts(row_starts, B, len(ranks), end, one_query, v.device)
    return ranks, scale


def check_row_starts(row_starts: object, B: int, L: int, end: int, one_query: bool, device: torch.device) -> None:
    """Validate per-row starts of a left-padded cache: ``None``, or an integer ``(B, L)`` tensor on
    the cache's device. Row ``b``'s sequence starts at slot ``row_starts[b, 0]`` (earlier slots are
    its padding; a start past the new queries means the row is all padding so far) and
    ``row_starts[b, l]`` is where the first new query's level-``l`` block starts in that row:
    non-negative, non-decreasing along ``l``, and at most ``end - 1`` for a decoding step (whose
    query must be real). The values are read only on the CPU (no device sync)."""
    if row_starts is None:
        return
    require(isinstance(row_starts, torch.Tensor), "row_starts", "a torch.Tensor or None", type(row_starts).__name__)
    assert isinstance(row_starts, torch.Tensor)
    require(tuple(row_starts.shape) == (B, L), "row_starts", f"shape (B={B}, levels={L})", tuple(row_starts.shape))
    require(row_starts.dtype in (torch.int32, torch.int64), "row_starts", "an int32 or int64 tensor", row_starts.dtype)
    require(row_starts.device == device, "row_starts", f"a tensor on {device} (the device of v)", row_starts.device)
    if row_starts.device.type == "cpu" and not torch.compiler.is_compiling():
        ok = bool((row_starts >= 0).all()) and (not one_query or bool((row_starts <= end - 1).all()))
        ok = ok and (L == 1 or bool((row_starts[:, 1:] >= row_starts[:, :-1]).all()))
        top = f"[0, {end - 1}] (a decoding step's query is real)" if one_query else ">= 0"
        require(ok, "row_starts", f"slots {top}, non-decreasing along the levels", row_starts.tolist())


def attach_backward(forward_op: torch.library.CustomOpDef, backward_op: torch.library.CustomOpDef, *,
                    eager: tuple[Callable[..., Any], Callable[..., Any]] | None = None) -> Callable[..., Any]:
    """Register ``backward_op`` as the gradient of ``forward_op`` (both ``torch.library`` custom ops),
    and return the function a backend calls for a differentiable forward.

    The convention every backend follows: ``forward_op(q, k, v, *config)`` returns ``out`` or
    ``(out, *aux)`` (aux such as the row log-sum-exp is not differentiable), and
    ``backward_op(gout, q, k, v, out, *aux, *config)`` returns ``(dq, dk, dv)``.

    ``eager``, the ops' two functions: outside ``torch.compile`` the returned function runs them
    through :func:`eager_autograd`, without the ops' dispatch, Python paid on every layer of every
    eager step (``scripts/profile_host.py`` measures it), which a GPU waits for where its kernels
    are shorter. Under ``torch.compile`` it calls the op, which a graph keeps whole. Without
    ``eager`` it returns ``forward_op``.
    """

    def save(ctx, inputs, output):  # noqa: ANN001, ANN202
        _save(ctx, *inputs[:3], inputs[3:], output)

    def gradients(ctx, gout, *_aux):  # noqa: ANN001, ANN202
        grads = (None,) * 3 if gout is None else first_order(backward_op, gout, ctx.saved_tensors, ctx.config)
        return (*grads, *([None] * len(ctx.config)))

    forward_op.register_autograd(gradients, setup_context=save)
    if eager is None:
        return forward_op
    return compiled_or_eager(forward_op, eager_autograd(*eager))


# The tags of ops that read packed documents' ids on the host (a device synchronisation): inductor
# leaves them out of the CUDA graphs it records (mode="reduce-overhead"; its graph partition splits
# a graph around them), which could not capture the synchronisation. (PyTorch before 2.8 has no
# such tag, nor custom ops' tags before 2.6: its ops go untagged.)
VARLEN_TAGS: tuple[torch.Tag, ...] = tuple(filter(None, [getattr(torch.Tag, "cudagraph_unsafe", None)]))


def differentiable_ops(name: str, forward: Callable[..., Any], forward_fake: Callable[..., Any],
                       backward: Callable[..., Any], backward_fake: Callable[..., Any],
                       tags: Sequence[torch.Tag] = ()) -> Callable[..., Any]:
    """``forward`` and ``backward`` (with the conventions of :func:`attach_backward`) as the custom
    ops ``sattn::<name>_forward`` and ``sattn::<name>_backward`` with their fake implementations
    and ``tags``; returns :func:`attach_backward`'s function, which runs the functions themselves
    outside ``torch.compile``."""
    tagged = {"tags": tuple(tags)} if tags else {}
    forward_op = torch.library.custom_op(f"sattn::{name}_forward", forward, mutates_args=(), **tagged)
    forward_op.register_fake(forward_fake)
    backward_op = torch.library.custom_op(f"sattn::{name}_backward", backward, mutates_args=(), **tagged)
    backward_op.register_fake(backward_fake)
    return attach_backward(forward_op, backward_op, eager=(forward, backward))


def _save(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: Sequence[Any], output: Any) -> None:
    """What a backward reads: the inputs, the outputs (aux ones not differentiable), the configuration.
    Gradients are not materialised: autograd would otherwise fill a zero tensor for each aux output
    (the log-sum-exp) on every backward, a kernel that nothing reads; an undefined gradient of the
    output (``gradcheck`` passes one) arrives as None and gives none."""
    outputs = output if isinstance(output, tuple) else (output,)
    ctx.save_for_backward(q, k, v, *outputs)
    ctx.config = config
    ctx.set_materialize_grads(False)
    if len(outputs) > 1:
        ctx.mark_non_differentiable(*outputs[1:])


class _SecondOrder(torch.autograd.Function):
    """The identity on a backward's gradients, whose own backward raises: what a kernel's gradients
    are wrapped in when autograd records the backward (``create_graph=True``), so that
    differentiating them again fails with one line instead of silently counting them constant."""

    @staticmethod
    def forward(ctx, *grads):  # noqa: ANN001, ANN205
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):  # noqa: ANN001, ANN205
        raise RuntimeError("mlr_attention: second-order gradients (differentiating a gradient taken with "
                           "create_graph=True) are not implemented by its kernels; mlr_attention_reference "
                           "computes them")


def first_order(backward: Callable[..., Any], gout: torch.Tensor, saved: Sequence[torch.Tensor],
                config: Sequence[Any]) -> tuple[torch.Tensor, ...]:
    """``backward(gout, *saved, *config)``: a kernel's ``(dq, dk, dv)``. Kernels' gradients are
    first-order only; where autograd records this backward (``create_graph=True``) and the gradients
    depend on tensors that need gradients, they come wrapped in :class:`_SecondOrder`, so that
    differentiating them raises where it would otherwise give zero."""
    if not torch.is_grad_enabled():  # the usual backward: nothing records it
        return backward(gout, *saved, *config)
    with torch.no_grad():
        grads = backward(gout, *saved, *config)
    if not any(t.requires_grad for t in (gout, *saved[:3])):
        return grads
    return _SecondOrder.apply(*(g.detach().requires_grad_() for g in grads))


def eager_autograd(forward_fn: Callable[..., Any], backward_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``forward_fn(q, k, v, *config)`` (returning ``out`` or ``(out, *aux)``, aux not
    differentiable) made differentiable in ``q``, ``k`` and ``v`` by ``backward_fn(gout, q, k, v,
    out, *aux, *config) -> (dq, dk, dv)`` in an ``autograd.Function``; where no input needs a
    gradient (inference, prefill), the forward function alone, with no autograd node. The
    configuration travels as one argument of the Function: each argument of its ``apply`` costs the
    host about 0.2 us (``scripts/profile_host.py``)."""

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, config):  # noqa: ANN001, ANN205
            output = forward_fn(q, k, v, *config)
            _save(ctx, q, k, v, config, output)
            return output

        @staticmethod
        def backward(ctx, gout, *_aux):  # noqa: ANN001, ANN205
            if gout is None:
                return None, None, None, None
            return (*first_order(backward_fn, gout, ctx.saved_tensors, ctx.config), None)

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *config: Any) -> Any:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return Eager.apply(q, k, v, config)
        return forward_fn(q, k, v, *config)

    return call


def compiled_or_eager(op: Callable[..., Any], function: Callable[..., Any]) -> Callable[..., Any]:
    """``op`` inside ``torch.compile``, which keeps a custom op whole in its graph; ``function``
    (the same computation without the op's dispatch, which costs the host tens of microseconds of
    Python a call) outside it."""

    def call(*args: Any) -> Any:
        return op(*args) if torch.compiler.is_compiling() else function(*args)

    return call
