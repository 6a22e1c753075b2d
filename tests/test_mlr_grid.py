"""Every MLR attention backend against the reference, on one parametrised grid (in the manner of
flash-attention's tests/test_flash_attn.py).

Two grids, each ``backend x case x mode x dtype``:

* full attention (:func:`test_attention`): the output and the gradients ``dq, dk, dv`` of the
  blocked PyTorch path (default and custom tile), the C++ kernel, the composition of fused
  softmax-attention calls (CPU, and CUDA), the Triton general and prefix-rank kernels and the
  dispatcher ``mlr_attention``, against ``mlr_attention_reference`` in float64;
* cached attention (:func:`test_cached_attention`): ``t`` new queries against the compressed cache
  (``t = 1``: a decoding step), for the references, the C++ and Triton decoding kernels and the
  dispatchers ``mlr_decode`` / ``mlr_prefill``, against the last ``t`` rows of
  ``mlr_attention_reference`` over the whole sequence and against ``mlr_prefill_reference``, both
  in float64.

The truth is always computed in float64 from the same inputs (drawn in float64 and rounded to the
dtype under test), and the tolerance comes from the per-dtype table ``mlr_cases.TOLERANCES``. What a
backend cannot run (a dtype, a case, an environment) comes from one capability table per grid
(``ATTENTION_BACKENDS``, ``CACHE_BACKENDS``) and shows as a skip with its reason.

Pruning: the Triton kernels are slow to test. Without a GPU, Triton's interpreter runs them (about
a second or more per small call, so Triton cases longer than ``MAX_INTERPRETED_T`` are skipped
there); on a GPU, every new specialisation of a kernel compiles for seconds. So of the GPU backends
(Triton and the CUDA dispatch) only a *pairwise* subset of the supported combinations is collected:
every pair of values of two axes (backend, case, causal, depth_normalize, dtype) that some supported
combination holds appears at least once (``mlr_cases.pairwise``; checked by
:func:`test_the_pruned_grid_still_covers_every_pair`). ``MLR_GRID_FULL=1`` collects the full
product. Without CUDA, each CUDA-only backend is collected once, as a skip.

Threads: every call runs on one intra-op thread (the problems are small, and OpenMP's start-up and
spinning cost far more than they save on them), except the C++ kernel's calls on the long cases,
which run on ``THREADED_THREADS`` so that its parallel split of the work is checked too, the same
split whatever the machine's cores or the test workers' share of them.

The reference itself is checked against the naive definition (one dense mask per level,
``mlr_cases.naive_mlr``) on every case by :func:`test_reference_matches_the_naive_definition`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import itertools
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import pytest
import torch

from mlr_cases import (DTYPE_IDS, assert_matches, cache_step, intra_op_threads, make_qkv, naive_mlr, pairwise,
                       value_pairs)
from structured_attention.ops.mlr import (
    mlr_attention,
    mlr_attention_reference,
    mlr_decode,
    mlr_decode_reference,
    mlr_prefill,
    mlr_prefill_reference,
)
from structured_attention.ops.mlr import cpu as mlr_cpu
from structured_attention.ops.mlr.blocked import mlr_attention_blocked
from structured_attention.ops.mlr.contract import mlr_block_sizes

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"  # where the Triton backends run (the interpreter without a GPU)
FULL = os.environ.get("MLR_GRID_FULL") == "1"  # the full product for the GPU backends too
MAX_INTERPRETED_T = 64  # the full-attention Triton kernels in the interpreter (about 1-3 s a call)
THREADED_T = 256
THREADED_THREADS = 3  # not a divisor of the tasks of most cases: uneven splits
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
HALF_AND_FLOAT32 = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One full-attention problem, plus the knobs some backends take (each case sets them
    differently, so the grid covers them along with the cases)."""

    name: str
    T: int
    ranks: tuple[int, ...]
    block_sizes: tuple[int, ...] | None = None  # None: the default T / 2^(l-1)
    B: int = 1
    H: int = 2
    Hk: int = 2
    Dv: int = 16
    scale: float | None = None
    tile: int = 5  # query rows per tile of the blocked path's custom-tile backend
    triton_tiles: tuple[int, int] = (16, 32)  # (block_m, block_n) of the general Triton kernels
    # tiles of the prefix-rank kernels, PrefixTiles' fields; None: square 16-row tiles
    prefix_tiles: tuple[int, ...] | None = None

    @property
    def sizes(self) -> tuple[int, ...]:
        return mlr_block_sizes(self.ranks, self.T, self.block_sizes)

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode()) % 2**16


CASES = [
    # s_1 > T everywhere; T = 1 (the first causal row alone) and T = 7 (not a multiple of any block)
    Case("T1-4|4", 1, (4, 4), (8, 2), Dv=5, tile=1),
    Case("T7-5|2|1-s1>T-mha4", 7, (5, 2, 1), (8, 4, 2), B=2, H=4, Hk=4, Dv=3, tile=4),
    # default halving blocks (24, 12, 6); ratio-4 nesting with a large scale (sharp softmax)
    Case("T24-5|2|1-default-gqa", 24, (5, 2, 1), None, B=2, H=4, Hk=2, Dv=3, tile=24),
    Case("T24-5|2|1-ratio4-mqa-scale3", 24, (5, 2, 1), (48, 12, 4), B=2, H=4, Hk=1, Dv=3, scale=3.0),
    # a partial trailing block on every fine level
    Case("T33-5|2|1-gqa", 33, (5, 2, 1), (64, 16, 4), B=2, H=4, Hk=2, Dv=4, tile=16),
    # eight levels down to blocks of one position
    Case("T33-8-levels", 33, (8, 2, 2, 1, 1, 1, 1, 1), (128, 64, 32, 16, 8, 4, 2, 1), H=4, Hk=4, Dv=3),
    # ratio-3 nesting, uneven ranks 6|2, T a multiple of the finest block, custom scale
    Case("T33-6|2-ratio3-scale0.7", 33, (6, 2), (33, 11), Dv=7, scale=0.7, tile=8, triton_tiles=(32, 16)),
    # uneven ranks, a finest block of 2 and T odd; MQA
    Case("T37-6|3|3-mqa", 37, (6, 3, 3), (40, 8, 2), Hk=1, Dv=5),
    # GQA with a finest block (4) smaller than a tile: square 16-row tiles take the general kernels
    Case("T40-16|8|8-gqa-B2", 40, (16, 8, 8), (64, 16, 4), B=2, H=4, Hk=2, Dv=5, tile=24,
         triton_tiles=(16, 16)),
    # blocks of 40/20/10/5 (the level-1 block is T itself); four levels of uneven ranks
    Case("T40-8|4|2|2-blocks40-gqa", 40, (8, 4, 2, 2), (40, 20, 10, 5), H=4, Hk=2, tile=16),
    Case("T45-8|4|2|2-mqa", 45, (8, 4, 2, 2), (64, 16, 8, 2), H=4, Hk=1),
    # non-power-of-two ranks, blocks not aligned with tiles, rectangular general tiles
    Case("T45-12|6|3-tiles32x16", 45, (12, 6, 3), (48, 12, 3), Hk=1, Dv=8, triton_tiles=(32, 16)),
    # default blocks of four levels (32, 16, 8, 4), batch 2, Dv 12, custom scale
    Case("T32-8|8|8|8-default-scale0.3", 32, (8, 8, 8, 8), None, B=2, Hk=1, Dv=12, scale=0.3, tile=4),
    # one level (plain softmax attention) with s_1 > T, non-power-of-two R (prefix-rank: one chunk)
    Case("T48-single-level-R12-s1>T", 48, (12,), (128,), B=2, Dv=20, tile=16),
    # prefix-rank tiles: every fine block a multiple of 16
    Case("T64-8|4|4-default", 64, (8, 4, 4), None, tile=128),
    Case("T40-16|8|8-ratios2,4-gqa-prefix", 40, (16, 8, 8), (128, 64, 16), H=4, Hk=2, tile=8),  # s_1 > T
    Case("T50-12|6|3-Dv12-prefix", 50, (12, 6, 3), (64, 32, 16), Hk=1, Dv=12, tile=24),  # level 1 spans 2 chunks
    Case("T48-24|24|16-prefix", 48, (24, 24, 16), (64, 32, 16)),
    Case("T48-40|30|30-R100-prefix", 48, (40, 30, 30), (96, 32, 16), Hk=1, tile=32),  # chunks of 32 columns
    # finest block (32) larger than a tile: most tiles skip the fine levels; rectangular prefix tiles
    # (own tiles of 32 stepping over 16: the diagonal spans two steps)
    Case("T64-8|8-blocks64,32-rect-prefix", 64, (8, 8), (64, 32), H=1, Hk=1, tile=32,
         prefix_tiles=(32, 16, 32, 16, 32, 16)),
    # longer sequences (the C++ kernel's key pieces, many blocked tiles)
    Case("T96-4|2|2-ratio4,8", 96, (4, 2, 2), (96, 24, 3), B=2, Dv=5, tile=24),
    Case("T96-1|2|3|2-ratio4", 96, (1, 2, 3, 2), (256, 64, 16, 4), H=4, Hk=2, Dv=5, tile=16),
    Case("T100-5|3-ratio16-gqa3", 100, (5, 3), (128, 8), H=6, Hk=3, tile=7),
    Case("T200-single-level-R8", 200, (8,), None, H=1, Hk=1, tile=64),
    Case("T256-4|4|4|4-default", 256, (4, 4, 4, 4), None, Dv=8, tile=48),
    Case("T700-8|4|4", 700, (8, 4, 4), (1024, 128, 32), Dv=8, tile=100),
    Case("T640-8x8-default", 640, (8,) * 8, None, Dv=64, tile=64),  # 8 prefix widths, 3 key pieces
]
assert len({c.name for c in CASES}) == len(CASES)


@dataclass(frozen=True)
class CacheCase:
    """``t`` new queries at the end of a ``T``-token sequence against the compressed cache (each
    level a view into a buffer with ``capacity`` spare slots, as the layer's ``TokenBuffer``)."""

    name: str
    T: int
    t: int
    ranks: tuple[int, ...]
    block_sizes: tuple[int, ...] | None = None
    B: int = 1
    H: int = 2
    Hk: int = 2
    Dv: int = 16
    scale: float = 0.37
    capacity: int = 3

    @property
    def sizes(self) -> tuple[int, ...]:
        return mlr_block_sizes(self.ranks, self.T, self.block_sizes)

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode()) % 2**16


CACHE_CASES = [
    # one query: a decoding step
    CacheCase("T37-8|4|4", 37, 1, (8, 4, 4), (64, 16, 4)),
    CacheCase("T104-4|2|1|1-default-gqa3-Dv12", 104, 1, (4, 2, 1, 1), None, B=2, H=6, Hk=2, Dv=12),
    CacheCase("T64-8|8-mqa-block-boundary", 64, 1, (8, 8), (64, 32), H=4, Hk=1, Dv=8),
    CacheCase("T65-8|8-first-token-of-a-block", 65, 1, (8, 8), (128, 32), Hk=1, Dv=8),
    CacheCase("T50-single-level", 50, 1, (12,), None, Dv=20),
    CacheCase("T93-12|6|3-Dv5", 93, 1, (12, 6, 3), (96, 24, 6), Dv=5),
    # the value dims of real models: the C++ kernel's vectorised weighted sum of the values
    CacheCase("T130-8|8-Dv64", 130, 1, (8, 8), (256, 32), Dv=64),
    CacheCase("T77-16|8-gqa-Dv48", 77, 1, (16, 8), (128, 16), H=4, Hk=2, Dv=48),
    # several queries (a prompt continued against the cache)
    CacheCase("T40-t7-8|4|2|2-gqa", 40, 7, (8, 4, 2, 2), (64, 16, 8, 2), H=4, Hk=2),
    CacheCase("T64-t20-6|2-mqa-B2", 64, 20, (6, 2), (64, 16), B=2, H=4, Hk=1, Dv=8),  # crosses 48
    CacheCase("T50-t3-8|8-crosses-48", 50, 3, (8, 8), (64, 4)),
    CacheCase("T30-t30-4|2|2-whole-prompt", 30, 30, (4, 2, 2), (32, 8, 4), capacity=0),
]
assert len({c.name for c in CACHE_CASES}) == len(CACHE_CASES)


# --------------------------------------------------------------------------------------------------
# Backend capabilities
# --------------------------------------------------------------------------------------------------


def _no_cpu_kernel() -> str | None:
    return None if mlr_cpu.available() else "the C++ kernel cannot be built here (no compiler or ninja)"


def _no_triton() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'triton>=3.0')"
    if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA device and TRITON_INTERPRET is not 1 (tests/conftest.py sets it before triton is imported)"
    return None


def _no_cuda() -> str | None:
    return None if ON_GPU else "no CUDA device (the dispatcher sends CUDA tensors to the Triton kernels)"


def _prefix_misfit(case: Case) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None  # the backend's environment check skips it
    from structured_attention.ops.mlr.triton_prefix import PrefixTiles

    tiles = PrefixTiles(*(case.prefix_tiles or (16,) * 6))
    if tiles.fits(case.sizes[1:]):
        return None
    return (f"fine block sizes {case.sizes[1:]}: the ones that are not multiples of the tiles "
            f"{sorted(set(dataclasses.astuple(tiles)[:6]))} reach more than a tile from the diagonal")


def _one_query(case: CacheCase) -> str | None:
    return None if case.t == 1 else f"a decoding kernel takes one new query (t={case.t})"


@dataclass(frozen=True)
class Backend:
    """What one backend runs on and can run: the grid's capability table is a list of these."""

    name: str
    run: Callable
    dtypes: tuple[torch.dtype, ...] = DTYPES
    no_dtype: str = ""  # why the dtypes it lacks are out
    device: str = "cpu"  # "cpu"; "triton": CUDA, else CPU tensors in Triton's interpreter; "cuda"
    # computes half inputs in float32 and rounds once (the contract's dtype policy): the tight column
    rounded_once: bool = False
    needs: Callable[[], str | None] = lambda: None  # the environment it needs (checked when run)
    accepts: Callable[[object], str | None] = lambda case: None  # why a case is out
    max_interpreted_T: int | None = None  # the longest case it runs in Triton's interpreter
    # runs the long cases (T >= THREADED_T) on THREADED_THREADS intra-op threads, so that the
    # kernel's parallel split of the work is checked too; everything else runs on one thread
    threaded: bool = False

    @property
    def slow_here(self) -> bool:
        """Collected as a pairwise subset: a GPU backend (unless MLR_GRID_FULL=1)."""
        return self.device != "cpu" and not FULL

    @property
    def where(self) -> str:
        return DEVICE if self.device == "triton" else self.device

    def hole(self, case, dtype) -> str | None:
        """Why ``(case, dtype)`` is out for this backend, or None."""
        if dtype not in self.dtypes:
            return f"{self.name} has no {DTYPE_IDS[dtype]}: {self.no_dtype}"
        if self.max_interpreted_T is not None and not ON_GPU and case.T > self.max_interpreted_T:
            return f"T={case.T}: too long for the Triton interpreter (T <= {self.max_interpreted_T}; a GPU runs it)"
        return self.accepts(case)

    def require(self) -> None:
        reason = self.needs()
        if reason:
            pytest.skip(reason)

    def threads(self, case) -> contextlib.AbstractContextManager:
        """One intra-op thread (tens of times faster than two on these small problems on a small,
        busy machine), except where the backend's long cases should run threaded."""
        return intra_op_threads(THREADED_THREADS if self.threaded and case.T >= THREADED_T else 1)


def _blocked(q, k, v, c, causal, dn):
    return mlr_attention_blocked(q, k, v, c.ranks, c.block_sizes, causal, c.scale, dn)


def _blocked_tile(q, k, v, c, causal, dn):
    return mlr_attention_blocked(q, k, v, c.ranks, c.block_sizes, causal, c.scale, dn, tile=c.tile)


def _cpu(q, k, v, c, causal, dn):
    return mlr_cpu.mlr_attention_cpu(q, k, v, c.ranks, c.block_sizes, causal, c.scale, dn)


def _reference(q, k, v, c, causal, dn):
    return mlr_attention_reference(q, k, v, c.ranks, c.block_sizes, causal, c.scale, dn)


def _dispatch(q, k, v, c, causal, dn):
    return mlr_attention(q, k, v, c.ranks, c.block_sizes, causal, c.scale, dn)


def _triton_general(q, k, v, c, causal, dn):
    from structured_attention.ops.mlr import triton_general

    # explicit tiles that no prefix-rank tiling fits; the prefix kernels would fail the test
    took_prefix = AssertionError(f"tiles {c.triton_tiles} took the prefix-rank kernels")
    with mock.patch.object(triton_general, "mlr_attention_prefix", side_effect=took_prefix):
        return triton_general.mlr_attention_triton(q, k, v, c.ranks, c.block_sizes, causal, c.scale, dn,
                                                   block_m=c.triton_tiles[0], block_n=c.triton_tiles[1])


def _triton_prefix(q, k, v, c, causal, dn):
    from structured_attention.ops.mlr.triton_prefix import PrefixTiles, mlr_attention_prefix

    tiles = PrefixTiles(*(c.prefix_tiles or (16,) * 6))
    assert tiles.fits(c.sizes[1:])
    scale = c.scale if c.scale is not None else sum(c.ranks) ** -0.5
    return mlr_attention_prefix(q, k, v, c.ranks, c.sizes, causal, scale, dn, tiles)


_NO_FLOAT64_IN_TRITON = "the Triton kernels run float32, float16 and bfloat16 (tl.dot has no float64)"

ATTENTION_BACKENDS = {b.name: b for b in [
    # float64 is the truth itself; the lower dtypes check the reference's dtype policy
    Backend("reference", _reference, HALF_AND_FLOAT32, "the float64 reference is the truth of the grid",
            rounded_once=True),
    Backend("blocked", _blocked, rounded_once=True),
    Backend("blocked_tile", _blocked_tile, rounded_once=True),
    Backend("cpu", _cpu, rounded_once=True, needs=_no_cpu_kernel, threaded=True),
    Backend("dispatch", _dispatch, rounded_once=True, threaded=True),  # CPU tensors: the C++ kernel, else blocked
    Backend("dispatch_cuda", _dispatch, device="cuda", needs=_no_cuda),  # Triton (float64: the reference)
    Backend("triton_general", _triton_general, HALF_AND_FLOAT32, _NO_FLOAT64_IN_TRITON, device="triton",
            needs=_no_triton, max_interpreted_T=MAX_INTERPRETED_T),
    Backend("triton_prefix", _triton_prefix, HALF_AND_FLOAT32, _NO_FLOAT64_IN_TRITON, device="triton",
            needs=_no_triton, accepts=_prefix_misfit, max_interpreted_T=MAX_INTERPRETED_T),
]}


def _cache_reference(q, keys, starts, v, c, dn):
    if c.t == 1:
        return mlr_decode_reference(q, keys, starts, v, c.ranks, c.scale, dn)
    return mlr_prefill_reference(q, keys, starts, v, c.ranks, c.scale, dn, c.sizes)


def _cache_prefill(q, keys, starts, v, c, dn):
    return mlr_prefill(q, keys, starts, v, c.ranks, c.scale, dn, c.sizes)


def _cache_decode(q, keys, starts, v, c, dn):
    return mlr_decode(q, keys, starts, v, c.ranks, c.scale, dn)


def _cpu_decode(q, keys, starts, v, c, dn):
    return mlr_cpu.mlr_decode_cpu(q, keys, starts, v, c.ranks, c.scale, dn)


def _triton_decode(q, keys, starts, v, c, dn):
    from structured_attention.ops.mlr.triton_decode import mlr_decode_triton

    # chunks of 32 keys in tiles of 16: several splits to merge and a ragged last tile
    return mlr_decode_triton(q, keys, starts, v, c.ranks, c.scale, dn, chunk=32, block_n=16)


CACHE_BACKENDS = {b.name: b for b in [
    Backend("reference", _cache_reference, rounded_once=True),  # decode / prefill reference
    Backend("mlr_prefill", _cache_prefill, rounded_once=True),
    Backend("mlr_decode", _cache_decode, rounded_once=True, accepts=_one_query, threaded=True),  # CPU: C++ kernel
    Backend("cpu_decode", _cpu_decode, rounded_once=True, needs=_no_cpu_kernel, accepts=_one_query, threaded=True),
    Backend("triton_decode", _triton_decode, HALF_AND_FLOAT32, _NO_FLOAT64_IN_TRITON, device="triton",
            needs=_no_triton, accepts=_one_query),
    Backend("mlr_decode_cuda", _cache_decode, device="cuda", needs=_no_cuda, accepts=_one_query),
]}


# --------------------------------------------------------------------------------------------------
# The grids
# --------------------------------------------------------------------------------------------------


def _flag(name):
    return lambda on: name if on else f"no_{name}"


def build_grid(backends: dict[str, Backend], cases, modes: list[tuple[str, tuple, Callable]]) -> list:
    """``backend x case x modes x dtype`` as pytest params, in truth-sharing order (the backends
    innermost); holes of the capability table as skips; off a GPU, the supported combinations of
    the GPU backends cut to a pairwise subset, one per device kind (see the module docstring)."""
    combos = [(b, case, *mode, dtype) for case in cases for mode in itertools.product(*(v for _, v, _ in modes))
              for dtype in DTYPES for b in backends]
    keep = set()
    for combos_of_kind in _slow_combos(backends, combos).values():
        keep.update(pairwise(combos_of_kind))
    params, skipped = [], set()
    for b, case, *rest in combos:
        backend, dtype = backends[b], rest[-1]
        mode_ids = [idf(x) for (_, _, idf), x in zip(modes, rest[:-1])]
        reason = backend.hole(case, dtype)
        if backend.device == "cuda" and not ON_GPU:  # no CUDA here: one skip says so
            reason, once, mode_ids = backend.needs(), b, ["any"]
        elif reason is not None:  # a hole depends on (case, dtype), never on the modes: one skip
            once, mode_ids = (b, case.name, dtype), ["any"]
        elif backend.slow_here and (b, case.name, *rest) not in keep:
            continue  # pruned: not collected
        else:
            once = None
        if once is not None:
            if once in skipped:
                continue
            skipped.add(once)
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        params.append(pytest.param(b, case, *rest, id="-".join([b, case.name, *mode_ids, DTYPE_IDS[dtype]]),
                                   marks=marks))
    return params


def _slow_combos(backends: dict[str, Backend], combos) -> dict[str, list[tuple]]:
    """Per device kind, the supported combinations of the backends that are slow here, with cases
    by name: the combinations whose pairs the collected subset must cover."""
    kinds: dict[str, list[tuple]] = {}
    for b, case, *rest in combos:
        if backends[b].slow_here and backends[b].hole(case, rest[-1]) is None:
            kinds.setdefault(backends[b].device, []).append((b, case.name, *rest))
    return kinds


_CAUSAL = ("causal", (True, False), lambda on: "causal" if on else "bidir")
_DEPTH_NORMALIZE = ("depth_normalize", (False, True), _flag("dn"))
ATTENTION_GRID = build_grid(ATTENTION_BACKENDS, CASES, [_CAUSAL, _DEPTH_NORMALIZE])
CACHE_GRID = build_grid(CACHE_BACKENDS, CACHE_CASES, [_DEPTH_NORMALIZE])  # the cache is causal


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def _attention_truth(case: Case, causal: bool, dn: bool, dtype: torch.dtype):
    """The inputs in ``dtype`` (q, k, v, dout) and the float64 reference's output and gradients."""
    inputs = make_qkv(case.B, case.H, case.Hk, case.T, sum(case.ranks), case.Dv, dtype, case.seed, dout=True)
    x64 = [x.double().requires_grad_() for x in inputs[:3]]
    out = mlr_attention_reference(*x64, case.ranks, case.block_sizes, causal, case.scale, dn)
    grads = torch.autograd.grad(out, x64, inputs[3].double())
    return inputs, (out.detach(), *grads)


@pytest.mark.parametrize("backend,case,causal,depth_normalize,dtype", ATTENTION_GRID)
def test_attention(backend, case, causal, depth_normalize, dtype):
    """A backend's output and gradients (for one random output gradient) against the float64
    reference's, for inputs rounded to ``dtype``: the result and gradients have that dtype."""
    b = ATTENTION_BACKENDS[backend]
    b.require()
    with intra_op_threads(1):
        inputs, want = _attention_truth(case, causal, depth_normalize, dtype)
    q, k, v = (x.detach().to(b.where).requires_grad_() for x in inputs[:3])
    with b.threads(case):
        out = b.run(q, k, v, case, causal, depth_normalize)
        grads = torch.autograd.grad(out, (q, k, v), inputs[3].to(b.where))
    for name, got, exp in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
        assert got.device.type == q.device.type, name
        assert_matches(got, exp, dtype, name, b.rounded_once)


@pytest.mark.parametrize("backend", [name for name in ATTENTION_BACKENDS if name != "reference"])
def test_second_order_gradients_raise_instead_of_vanishing(backend):
    """The kernels' gradients are first-order. Taken with ``create_graph=True`` (a gradient
    penalty) they equal the reference's, and differentiating them again raises one line: counted
    as constants, they would make the penalty's gradient silently zero where the reference's is not."""
    b = ATTENTION_BACKENDS[backend]
    b.require()
    dtype = torch.float32
    case = next(c for c in CASES if all(x.hole(c, dtype) is None for x in ATTENTION_BACKENDS.values()))
    with intra_op_threads(1):
        inputs, want = _attention_truth(case, True, False, dtype)
    q, k, v = (x.detach().to(b.where).requires_grad_() for x in inputs[:3])
    with b.threads(case):
        out = b.run(q, k, v, case, True, False)
        grads = torch.autograd.grad(out, (q, k, v), inputs[3].to(b.where), create_graph=True)
    for name, got, exp in zip(("dq", "dk", "dv"), grads, want[1:]):
        assert_matches(got.detach(), exp, dtype, name, b.rounded_once)
    with pytest.raises(RuntimeError, match="^mlr_attention: second-order gradients"):
        grads[0].square().sum().backward()


@pytest.mark.parametrize("backend,case,depth_normalize,dtype", CACHE_GRID)
def test_cached_attention(backend, case, depth_normalize, dtype):
    """``t`` new queries against the compressed cache (built as the layer builds it, in ``dtype``)
    against the last ``t`` rows of float64 full attention and against the float64 prefill reference."""
    b = CACHE_BACKENDS[backend]
    b.require()
    c, dn = case, depth_normalize
    step = cache_step(c.B, c.H, c.Hk, c.T, c.ranks, c.block_sizes, c.Dv, dtype, t=c.t, seed=c.seed,
                      capacity=c.capacity)
    with intra_op_threads(1):
        full = mlr_attention_reference(step.q.double(), step.k.double(), step.v.double(), c.ranks, step.sizes,
                                       causal=True, scale=c.scale, depth_normalize=dn)[:, :, -c.t:]
        prefill = mlr_prefill_reference(step.q_new.double(), [k.double() for k in step.keys], step.starts,
                                        step.v.double(), c.ranks, c.scale, dn, step.sizes)
    dev = b.where
    keys = [k.to(dev) for k in step.keys]
    with torch.no_grad(), b.threads(c):
        out = b.run(step.q_new.to(dev), keys, step.starts, step.v.to(dev), c, dn)
    assert out.device.type == torch.device(dev).type
    assert_matches(out, full, dtype, f"the last {c.t} rows of full attention", b.rounded_once)
    assert_matches(out, prefill, dtype, "mlr_prefill_reference", b.rounded_once)


@pytest.mark.parametrize("depth_normalize", [False, True], ids=["no_dn", "dn"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_the_naive_definition(case, causal, depth_normalize):
    """The grid's truth against the definition written out naively, outputs and gradients, float64."""
    q, k, v, do = make_qkv(case.B, case.H, case.Hk, case.T, sum(case.ranks), case.Dv, seed=case.seed, dout=True)
    results = []
    for fn in (mlr_attention_reference, naive_mlr):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        with intra_op_threads(1):
            out = fn(*x, case.ranks, case.block_sizes, causal=causal, scale=case.scale,
                     depth_normalize=depth_normalize)
            results.append((out, *torch.autograd.grad(out, x, do)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert_matches(a, b, torch.float64, name)


def test_the_pruned_grid_still_covers_every_pair():
    """The GPU backends' part of each grid is a pairwise subset (unless MLR_GRID_FULL=1): every pair
    of values of two axes (backend, case, modes, dtype) that a supported combination holds is
    collected, and (in the Triton interpreter) fewer combinations than the full product."""
    grids = [(ATTENTION_BACKENDS, ATTENTION_GRID, CASES, 2), (CACHE_BACKENDS, CACHE_GRID, CACHE_CASES, 1)]
    for backends, grid, cases, n_modes in grids:
        modes = list(itertools.product((True, False), repeat=n_modes))
        everything = [(b, case, *mode, dtype) for case in cases for mode in modes for dtype in DTYPES for b in backends]
        collected = {(p.values[0], p.values[1].name, *p.values[2:]) for p in grid if not p.marks}
        for kind, supported in _slow_combos(backends, everything).items():
            if kind == "cuda" and not ON_GPU:
                continue  # collected as one skip per backend
            wanted = set().union(*map(value_pairs, supported))
            got = set().union(*(value_pairs(c) for c in supported if c in collected))
            assert wanted == got, (kind, sorted(wanted - got, key=str)[:5])
            assert FULL or len(collected & set(supported)) < len(supported), kind
