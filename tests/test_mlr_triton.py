"""Tests for the Triton MLR attention kernels (structured_attention.ops.mlr.triton_general and
triton_prefix) beyond their agreement with the reference on the shared grid (tests/test_mlr_grid.py,
backends ``triton_general`` and ``triton_prefix``): which tiles fit the prefix-rank kernels, device
tables made once, the dispatcher's route per checked signature, launches past Triton's per-call
binding, a causal prefix scored as inside the whole sequence, argument validation, and a clean
import without Triton.

Without a CUDA device the kernels run on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, set before Triton is imported).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install 'triton>=3.0')")

from mlr_cases import make_qkv  # noqa: E402
from structured_attention.ops.mlr.contract import mlr_block_sizes  # noqa: E402
from structured_attention.ops.mlr.triton_common import device_table  # noqa: E402
from structured_attention.ops.mlr.triton_general import mlr_attention_triton  # noqa: E402
from structured_attention.ops.mlr.triton_prefix import PrefixTiles, square_tiles  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[1]

if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)


def test_prefix_tiles_rule():
    # tiles that every fine block is a multiple of, the largest first
    assert square_tiles((32, 16), 64, 16, sub_tile=False) == PrefixTiles(16, 16, 16, 16, 16, 16)
    assert square_tiles((96, 48), 64, 16, sub_tile=False).fwd_m == 16
    assert square_tiles((24, 12), 64, 16, sub_tile=False) is None
    assert square_tiles((32, 16), 64, 32, sub_tile=False) is None  # 16-row tiles: below the smallest
    # else the largest tiles, with the levels finer than them added around the diagonal
    assert square_tiles((24, 12), 64, 32, sub_tile=True) == PrefixTiles()
    assert square_tiles((192, 96, 48), 64, 32, sub_tile=True) == PrefixTiles()
    assert PrefixTiles().coarse_levels((8192, 4096, 64, 32, 16)) == 3
    assert PrefixTiles().coarse_levels((1000, 500)) == 1  # level 1 holds the whole sequence
    # unless the sub-tile blocks reach further than a step from the diagonal
    assert square_tiles((320, 160, 80), 64, 32, sub_tile=True) is None
    assert not PrefixTiles(fwd_m=16, fwd_n=32).fits((64,))  # the step must divide the own tile


@pytest.mark.parametrize("sizes,tiles,kernels", [((64, 32), {}, "triton_prefix"),
                                                   ((64, 8), {"block_m": 16, "block_n": 32}, "triton_general")],
                         ids=["prefix-rank", "general"])
def test_a_repeated_call_reuses_its_plan_and_tables(sizes, tiles, kernels):
    # The host's work before the kernels start (tile choice, chunking, the level tables copied to
    # the device) is done once per signature: a training step pays it on every layer otherwise.
    from structured_attention.ops.mlr import triton_general

    plan_of = getattr(importlib.import_module(f"structured_attention.ops.mlr.{kernels}"), "_plan")
    q, k, v = make_qkv(1, 2, 2, 64, 16, 8, torch.float32, device=DEVICE)
    mlr_attention_triton(q, k, v, (8, 8), sizes, **tiles)
    tables, plans = device_table.cache_info(), plan_of.cache_info()
    tile_choices = triton_general._prefix_tiles.cache_info()
    mlr_attention_triton(q, k, v, (8, 8), sizes, **tiles)
    assert device_table.cache_info().misses == tables.misses
    assert plan_of.cache_info().misses == plans.misses and plan_of.cache_info().hits > plans.hits
    assert triton_general._prefix_tiles.cache_info().misses == tile_choices.misses


def test_a_kernel_is_launched_through_triton_once_per_specialisation_then_directly(monkeypatch):
    """triton_common.launch: the first launch of a key goes through Triton (``kernel[grid](...)``),
    which returns the compiled kernel; later launches with the same key call its launcher bound to
    the grid, with the compile-time parameters in the kernel's order (defaults applied) and the
    current stream. A changed scalar, a tensor's dtype or its 16-byte alignment, a compile-time
    argument or the grid is a new key. (The path Triton's own launches take on a GPU; this checks
    its bookkeeping with a stand-in kernel, the GPU suite the real one.)"""
    from types import SimpleNamespace

    from structured_attention.ops.mlr import triton_common

    monkeypatch.setattr(triton_common, "_FAST_LAUNCH", True)
    monkeypatch.setattr(triton_common, "_launchers", {})
    monkeypatch.setattr(triton_common, "_raw_stream", lambda device: 100 + device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    through_triton, direct = [], []

    class Compiled:
        def __getitem__(self, grid):
            return lambda *args, stream: direct.append((grid, args, stream))

    class Kernel:
        arg_names = ["X", "n", "scale", "BLOCK", "EVEN"]
        params = [SimpleNamespace(name=n, default=d) for n, d in
                  [("X", None), ("n", None), ("scale", None), ("BLOCK", None), ("EVEN", True)]]

        def __getitem__(self, grid):
            return lambda *args, **kwargs: through_triton.append((grid, args, kwargs)) or Compiled()

    kernel, x = Kernel(), torch.zeros(64)
    calls = [((4,), x, 64, 0.5, {"BLOCK": 16, "num_warps": 4}),
             ((4,), x, 64, 0.5, {"BLOCK": 16, "num_warps": 4}),  # the same key: direct
             ((4,), x.clone(), 64, 0.5, {"BLOCK": 16, "num_warps": 4}),  # another aligned tensor: direct
             ((4,), x, 65, 0.5, {"BLOCK": 16, "num_warps": 4}),  # a scalar
             ((4,), x[1:], 64, 0.5, {"BLOCK": 16, "num_warps": 4}),  # not 16-byte aligned
             ((4,), x.double(), 64, 0.5, {"BLOCK": 16, "num_warps": 4}),  # a dtype
             ((4,), x, 64, 0.5, {"BLOCK": 32, "num_warps": 4}),  # a compile-time argument
             ((4, 2), x, 64, 0.5, {"BLOCK": 16, "num_warps": 4}),  # the grid
             ((4,), x, 64, 0.5, {"BLOCK": 16, "num_warps": 4})]  # the first key again: direct
    for grid, t, n, scale, kwargs in calls:
        triton_common.launch(kernel, grid, t, n, scale, **kwargs)
    assert len(through_triton) == 6 and len(direct) == 3
    assert direct[0] == ((4, 1, 1), (x, 64, 0.5, 16, True), 100)
    assert direct[1][1][0] is not x and direct[2][1][0] is x


def test_launch_hands_the_compiled_kernels_what_tritons_own_launch_does():
    """With the real kernels compiled for sm_90 (no GPU: the driver stood in for, the launchers
    recording), a forward, a backward and a decoding step launched through Triton, then through the
    launchers launch() keeps, give every launcher the same arguments (scripts/launch_cost.py --check)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, str(ROOT / "scripts/launch_cost.py"), "--check", "--seq-len", "1024"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0 and "the same" in res.stdout, res.stdout + res.stderr[-2000:]


@pytest.fixture
def routed(monkeypatch):
    """The dispatcher's Triton route for this device's tensors (CPU ones under the interpreter), with
    an empty table of prepared routes that the test's calls fill and that goes with the test, and a
    count of the argument checks it runs."""
    from structured_attention.ops.mlr import dispatch

    monkeypatch.setattr(dispatch, "on_triton", lambda x: x.dtype in (torch.float32, torch.float16, torch.bfloat16))
    monkeypatch.setattr(dispatch, "_ROUTES", {})
    checks = []
    check = dispatch.check_mlr_arguments
    monkeypatch.setattr(dispatch, "check_mlr_arguments", lambda *a: checks.append(1) or check(*a))
    return dispatch, checks


@pytest.mark.parametrize("ranks,sizes,Hk,route", [((4, 2, 2), None, 2, "PrefixCall"), ((8, 8), (64, 32), 1, "PrefixCall"),
                                                  ((4, 4), (80, 40), 2, "partial")],
                         ids=["prefix", "prefix-gqa", "general"])
def test_a_checked_signature_goes_straight_to_its_prepared_route(routed, ranks, sizes, Hk, route):
    """The dispatcher checks a signature once: its next calls skip the checks (counted) and run the
    route prepared for it, with the first call's output and gradients, which are the reference's."""
    from structured_attention.ops.mlr import mlr_attention
    from structured_attention.ops.mlr.reference import mlr_attention_reference

    dispatch, checks = routed
    T = 80 if sizes == (80, 40) else 64
    q, k, v, do = make_qkv(2, 2, Hk, T, sum(ranks), 8, torch.float32, requires_grad=True, dout=True, device=DEVICE)
    runs = []
    for _ in range(2):
        out = mlr_attention(q, k, v, list(ranks), sizes)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    assert len(checks) == 1 and [type(r).__name__ for r in dispatch._ROUTES.values()] == [route]
    for got, again in zip(*runs):
        assert torch.equal(got, again)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = mlr_attention_reference(q64, k64, v64, ranks, sizes)
    for got, w in zip(runs[0], (want, *torch.autograd.grad(want, (q64, k64, v64), do.double()))):
        torch.testing.assert_close(got.double(), w, atol=1e-4, rtol=1e-4)


def test_a_changed_argument_is_checked_again(routed):
    """Everything the checks read is part of the signature, types included (``True == 1`` and
    ``8 == 8.0``, but the checks refuse the int and the float), so a call that differs from a
    checked one in any of them is checked, and a bad one still raises its one line."""
    from structured_attention.ops.mlr import mlr_attention

    dispatch, checks = routed
    q, k, v = make_qkv(1, 2, 2, 64, 8, 8, torch.float32, device=DEVICE)
    mlr_attention(q, k, v, (4, 2, 2))
    mlr_attention(q, k, v, [4, 2, 2])  # a list of the same ranks: the same signature
    assert len(checks) == 1
    for kwargs, needle in [({"causal": 1}, "causal"), ({"depth_normalize": 0}, "depth_normalize"),
                           ({"ranks": (4.0, 2, 2)}, "ranks"), ({"scale": float("nan")}, "scale"),
                           ({"block_sizes": (64, 32, 15)}, "block_sizes")]:
        with pytest.raises(ValueError, match=f"^{needle}"):
            mlr_attention(q, k, v, **{"ranks": (4, 2, 2), **kwargs})
    mlr_attention(q, k, v, (4, 2, 2), (64, 16, 8))
    mlr_attention(q, k, v, (4, 2, 2), scale=0.5)
    mlr_attention(q, k[:, :1], v[:, :1], (4, 2, 2))
    mlr_attention(q.half(), k.half(), v.half(), (4, 2, 2))
    with pytest.raises(ValueError, match="^q: expected a torch.Tensor"):
        mlr_attention(q.tolist(), k, v, (4, 2, 2))
    assert len(checks) == 1 + 5 + 4 + 1 and len(dispatch._ROUTES) == 5


def test_device_tables_are_made_off_the_calling_thread_and_errors_reach_the_caller(monkeypatch):
    # While torch.compile's CUDA graphs warm up, the calling thread's allocations go to the graph's
    # memory pool; a table kept across calls must be allocated elsewhere (the CUDA training test
    # under mode="reduce-overhead" in test_compile.py checks the pool itself).
    made_on = []
    tensor = torch.tensor

    def recorded(*args, **kwargs):
        made_on.append(threading.current_thread())
        return tensor(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", recorded)
    values = (3, 1, 4, 1, 5, 9, 2, 6, 5, 3)  # a table no other test makes (not cached yet)
    table = device_table(values, torch.int32, torch.device(DEVICE))
    assert table.tolist() == list(values) and table.dtype == torch.int32
    assert len(made_on) == 1 and made_on[0] is not threading.current_thread()
    with pytest.raises(RuntimeError, match="overflow"):
        device_table((2 ** 40,), torch.int32, torch.device(DEVICE))


def test_sub_tile_levels_launch_with_eight_warps_on_cuda():
    # With four warps Triton 3.6 computed wrong half-precision results for kernels that add levels
    # one by one in a loop (the sub-tile levels here) on an H200; coarse-only tilings keep their
    # warps. The rule holds wherever the plan is made: explicit tiles of four warps get eight too.
    from structured_attention.ops.mlr.triton_general import _prefix_tiles
    from structured_attention.ops.mlr.triton_prefix import launch_warps

    sizes = (4096, 2048, 32, 16)
    sub_tile = _prefix_tiles(sizes, torch.bfloat16, "cuda", 64, 64, False)
    assert sub_tile is not None and sub_tile.coarse_levels(sizes) == 2
    assert launch_warps(sub_tile, sizes, "cuda") == 8 and launch_warps(PrefixTiles(num_warps=4), sizes, "cuda") == 8
    assert launch_warps(PrefixTiles(num_warps=4), sizes, "cpu") == 4  # the interpreter: as given
    coarse = _prefix_tiles((8192, 4096, 64), torch.bfloat16, "cuda", 64, 64, False)
    assert launch_warps(coarse, (8192, 4096, 64), "cuda") == 4
    # float32: eight anyway
    assert _prefix_tiles((4096, 2048, 16, 8), torch.float32, "cuda", 64, 64, False).num_warps == 8


def test_default_tiles_take_the_launchs_pipeline_stages_three_on_hopper():
    # Two stages leave a program's loads waited for before its own arithmetic (docs/benchmarks.md);
    # three fit Hopper's shared memory without fewer programs per multiprocessor for the forward up
    # to head dim 128 and the backward up to 64. The default tiles leave the choice to the launch.
    from structured_attention.ops.mlr.triton_general import _prefix_tiles
    from structured_attention.ops.mlr.triton_prefix import HOPPER_SHARED_PER_BLOCK, pipeline_stages, plan_of

    hopper, a100, consumer = HOPPER_SHARED_PER_BLOCK, 163 * 1024, 99 * 1024
    for dtype in (torch.bfloat16, torch.float16):
        assert pipeline_stages(dtype, "cuda", 64, hopper) == (3, 3)
        assert pipeline_stages(dtype, "cuda", 128, hopper) == (3, 2)
        assert pipeline_stages(dtype, "cuda", 256, hopper) == (2, 2)
        for less in (a100, consumer):  # not counted there; the forward's 112 KiB at 128 would not fit 99
            assert pipeline_stages(dtype, "cuda", 64, less) == pipeline_stages(dtype, "cuda", 128, less) == (2, 2)
    assert pipeline_stages(torch.float32, "cuda", 64, hopper) == (2, 2)
    assert pipeline_stages(torch.bfloat16, "cpu", 64, 0) == (2, 2)
    sizes = (8192, 4096, 2048, 1024, 512, 256, 128, 64)
    assert _prefix_tiles(sizes, torch.bfloat16, "cuda", 64, 64, False).num_stages == 0  # the launch's
    assert _prefix_tiles(sizes, torch.bfloat16, "cuda", 64, 64, True).num_stages == 2  # explicit: as given
    q, v = torch.empty(1, 1, 16, 64, dtype=torch.bfloat16), torch.empty(1, 1, 16, 64, dtype=torch.bfloat16)
    plan = plan_of(q, v, (8,) * 8, sizes, PrefixTiles(num_stages=0))
    assert (plan.fwd_stages, plan.bwd_stages) == (2, 2)  # the interpreter's
    plan = plan_of(q, v, (8,) * 8, sizes, PrefixTiles(num_stages=3))
    assert (plan.fwd_stages, plan.bwd_stages) == (3, 3)
    assert plan.constexprs(True, False, 64, 64, 3)["num_stages"] == 3


def test_cuda_calls_avoid_the_sub_tile_tilings_triton_compiled_wrong():
    # On an H200 (Triton 3.6) 64-row tiles with a single sub-tile level gave wrong values, with
    # four warps or eight; on CUDA the dispatcher gives such calls to the general kernels. The
    # interpreter keeps them.
    from structured_attention.ops.mlr.triton_general import _prefix_tiles
    from structured_attention.ops.mlr.triton_prefix import miscompiled_on_cuda

    eight = (8,) * 8
    # 8 levels at 4096, the failing case's blocks: 32-row tiles divide every one, no sub-tile level
    assert _prefix_tiles(mlr_block_sizes(eight, 4096), torch.bfloat16, "cuda", 64, 64, False).fwd_m == 32
    one_level = (4096, 2048, 1024, 512, 256, 128, 64, 16)  # 64-row tiles, one sub-tile level (16)
    assert miscompiled_on_cuda(PrefixTiles(), one_level)
    assert _prefix_tiles(one_level, torch.bfloat16, "cuda", 64, 64, False) is None
    assert _prefix_tiles(one_level, torch.bfloat16, "cpu", 64, 64, False) == PrefixTiles(num_stages=0)
    # two sub-tile levels (32 and 16), right on the H200: kept
    assert _prefix_tiles(mlr_block_sizes(eight, 2048), torch.bfloat16, "cuda", 64, 64, False) == PrefixTiles(
        num_stages=0)
    # float32 takes 32-row tiles: 8 levels at 2048 have one sub-tile level (16)
    assert _prefix_tiles(mlr_block_sizes(eight, 2048), torch.float32, "cuda", 64, 64, False) is None
    assert not miscompiled_on_cuda(PrefixTiles(), mlr_block_sizes(eight, 8192))  # no sub-tile level


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "dq-kernel"])
def test_backward_adds_dq_atomically_unless_deterministic(deterministic, monkeypatch):
    # By default the dK/dV kernel adds each query tile's dQ as it goes (float32 atomics); under
    # torch.use_deterministic_algorithms(True) the dQ kernel computes it in a fixed order. Both
    # equal the float64 reference (GQA, and sub-tile levels, whose near tiles add level by level).
    from structured_attention.ops.mlr import triton_prefix
    from structured_attention.ops.mlr.reference import mlr_attention_reference

    launches = []
    kernel = triton_prefix._prefix_dq_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_prefix, "_prefix_dq_kernel", Counted())
    ranks, sizes = (8, 4, 4), (64, 32, 16)
    q, k, v, do = make_qkv(1, 4, 2, 48, 16, 8, torch.float32, requires_grad=True, dout=True, device=DEVICE)
    tiles = PrefixTiles(32, 32, 32, 32, 32, 32)  # the 16-blocks are a sub-tile level
    assert tiles.coarse_levels(sizes) == 2
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        out = triton_prefix.mlr_attention_prefix(q, k, v, ranks, sizes, True, 0.25, False, tiles)
        grads = torch.autograd.grad(out, (q, k, v), do)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert len(launches) == int(deterministic)
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(mlr_attention_reference(*exact, ranks, sizes, True, 0.25), exact, do.double())
    for got, w in zip(grads, want):
        torch.testing.assert_close(got.double(), w, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(DEVICE != "cuda", reason="a host synchronisation is a CUDA device's")
@pytest.mark.parametrize("ranks,T", [((16, 16, 16, 16), 2048), ((8,) * 8, 1024), ((8,) * 8, 640)],
                         ids=["prefix", "prefix-sub-tile", "general"])
def test_a_training_call_never_waits_for_the_gpu(ranks, T):
    """Forward and backward through the dispatcher, once the signature's plan and tables exist,
    make no synchronising CUDA call (torch.cuda.set_sync_debug_mode raises on one): the host
    queues the backward's kernels while the forward's run, so a whole call costs its kernels and
    not the host's time on top."""
    from structured_attention.functional import mlr_attention

    q, k, v, do = make_qkv(1, 8, 8, T, sum(ranks), 64, torch.bfloat16, requires_grad=True, dout=True, device=DEVICE)
    torch.autograd.grad(mlr_attention(q, k, v, ranks).float(), (q, k, v), do.float())  # plans, tables, compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = torch.autograd.grad(mlr_attention(q, k, v, ranks).float(), (q, k, v), do.float())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(g.shape == x.shape for g, x in zip(grads, (q, k, v)))


def test_a_dim_order_keeps_a_layers_layout_and_equals_the_gathered_call(monkeypatch):
    """On the Triton route a dim_order gathers the head dims of a layer's (B, T, H, D) projections
    in their layout, so the output is a view of (B, T, H, Dv) memory (the heads merge without a
    copy); output and gradients equal the call on the gathered dims."""
    from structured_attention.ops.mlr import dispatch, mlr_attention

    if DEVICE == "cpu":
        monkeypatch.setattr(dispatch, "on_triton", lambda x: True)
        monkeypatch.setattr(dispatch.cpu, "available", lambda: False)
    g = torch.Generator().manual_seed(5)
    B, T, H, D = 1, 48, 2, 16
    qp, kp, vp = (torch.randn(B, T, H, D, generator=g).to(DEVICE) for _ in range(3))
    q, k, v = (x.transpose(1, 2).requires_grad_() for x in (qp, kp, vp))
    order = [1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14]
    do = torch.randn(B, H, T, D, generator=g).to(DEVICE)
    out = mlr_attention(q, k, v, (8, 4, 4), (64, 16, 8), dim_order=order)
    assert out.transpose(1, 2).is_contiguous()
    grads = torch.autograd.grad(out, (q, k, v), do)
    gathered = [x.detach()[..., order].contiguous().requires_grad_() for x in (q, k)]
    want = mlr_attention(*gathered, v.detach().contiguous().requires_grad_(), (8, 4, 4), (64, 16, 8))
    want_q, want_k = torch.autograd.grad(want, gathered, do)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    inverse = [order.index(i) for i in range(D)]
    torch.testing.assert_close(grads[0], want_q[..., inverse], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], want_k[..., inverse], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(DEVICE != "cuda", reason="a host synchronisation is a CUDA device's")
def test_a_call_with_a_dim_order_never_waits_for_the_gpu():
    """The head dims' order a Hugging Face model's MLR attention passes (rotary pairs): its index is
    made on the device once, not copied from the host on every call (a copy that waits for the GPU)."""
    from structured_attention.integrations.transformers import level_permutation
    from structured_attention.ops.mlr import mlr_attention

    ranks = (16, 16, 16, 16)
    q, k, v, do = make_qkv(1, 8, 8, 1024, 64, 64, torch.bfloat16, requires_grad=True, dout=True, device=DEVICE)
    order = level_permutation(64)
    torch.autograd.grad(mlr_attention(q, k, v, ranks, dim_order=order), (q, k, v), do)  # plans, tables, index
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = mlr_attention(q, k, v, ranks, dim_order=order)
        grads = torch.autograd.grad(out, (q, k, v), do)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = mlr_attention(q[..., list(order)], k[..., list(order)], v, ranks)
    torch.testing.assert_close(out, want)
    assert all(g.shape == x.shape for g, x in zip(grads, (q, k, v)))


@pytest.mark.parametrize("kernel", ["prefix", "general"])
def test_transposed_views_are_read_in_place_and_give_the_contiguous_results(kernel):
    # A layer's heads are a transposed view of its projection, (B, T, H, D) -> (B, H, T, D): the
    # kernels read it through its strides (no copy), and write the gradients with the same strides,
    # the output in the same layout (its heads merge without a copy), whose gradient, in that
    # layout too, the backward reads in place.
    from structured_attention.ops.mlr.triton_common import dense_rows

    g = torch.Generator().manual_seed(0)
    B, T, H, Hk, R, Dv = 2, 24, 4, 2, 16, 8
    qp, kp, vp = (torch.randn(B, T, h, d, generator=g).to(DEVICE) for h, d in ((H, R), (Hk, R), (Hk, Dv)))
    views = [x.transpose(1, 2).requires_grad_() for x in (qp, kp, vp)]
    assert all(dense_rows(x) is x and not x.is_contiguous() for x in views)
    assert not dense_rows(views[0][:, :, :23]).data_ptr() == views[0].data_ptr()  # not dense: copied
    copies = [x.detach().contiguous().requires_grad_() for x in views]
    tiles = {"block_m": 16, "block_n": 32} if kernel == "general" else {}
    do = torch.randn(B, H, T, Dv, generator=g).to(DEVICE)
    results = []
    for xs, gout in ((views, do.transpose(1, 2).contiguous().transpose(1, 2)), (copies, do)):
        out = mlr_attention_triton(*xs, (8, 4, 4), (64, 16, 8), **tiles)
        results.append((out, torch.autograd.grad(out, xs, gout)))
    (out_v, grads_v), (out_c, grads_c) = results
    assert out_v.transpose(1, 2).is_contiguous() and out_c.is_contiguous()
    torch.testing.assert_close(out_v, out_c, atol=1e-6, rtol=1e-6)
    for got, want, x in zip(grads_v, grads_c, views):
        assert got.stride() == x.stride()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(2, 3, 37, 64), (1, 1, 5, 12), (1, 2, 300, 100)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zeroed_dim", [None, 8, 48, 100])
def test_row_dots_equal_the_float64_rowsum(shape, dtype, zeroed_dim):
    # the backward's delta = rowsum(dO * O): rows not a multiple of a program's, dims not a power of
    # two; and the float32 buffer it zeroes on the way (dQ's, q's layout: a transposed view here),
    # whatever its last dim against the operands'
    from structured_attention.ops.mlr.triton_common import row_dots

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    want = (a.double() * b.double()).sum(-1)
    zeroed = None
    if zeroed_dim is not None:
        B, H, T, _ = shape
        zeroed = torch.full((B, T, H, zeroed_dim), float("nan"), device=DEVICE).transpose(1, 2)
    got = row_dots(a.to(DEVICE), b.to(DEVICE).transpose(-2, -1).contiguous().transpose(-2, -1), zeroed)  # strided b
    assert got.dtype == torch.float32 and got.shape == shape[:-1]
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=1e-5)
    assert zeroed is None or bool((zeroed == 0).all())
    # a layer's output and its gradient: (B, T, H, D) memory read as (B, H, T, D), beside a contiguous one
    heads_inner = a.to(DEVICE).transpose(1, 2).contiguous().transpose(1, 2)
    for x, y in ((heads_inner, heads_inner.clone()), (heads_inner, b.to(DEVICE))):
        got = row_dots(x, y)
        torch.testing.assert_close(got.double().cpu(), (x.double() * y.double()).sum(-1).cpu(), atol=1e-5, rtol=1e-5)


def test_forward_without_grad_and_prefix_consistency():
    # Block sizes fixed by the model: a prefix is scored exactly as inside the full sequence.
    q, k, v = make_qkv(1, 2, 2, 40, 16, 8, torch.float32, device=DEVICE)
    ranks, sizes = (8, 4, 4), (64, 16, 4)
    full = mlr_attention_triton(q, k, v, ranks, sizes)
    part = mlr_attention_triton(q[:, :, :23], k[:, :, :23], v[:, :, :23], ranks, sizes)
    torch.testing.assert_close(part, full[:, :, :23], atol=1e-5, rtol=1e-5)


def test_invalid_arguments_raise_value_error():
    q, k, v = make_qkv(1, 2, 2, 16, 16, 8, torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="ranks"):
        mlr_attention_triton(q, k, v, (8, 4))
    with pytest.raises(ValueError, match="block_sizes"):
        mlr_attention_triton(q, k, v, (8, 8), (16, 6))
    with pytest.raises(ValueError, match="k"):
        mlr_attention_triton(q, k[:, :1].expand(1, 3, 16, 16), v, (16,))
    with pytest.raises(ValueError, match="dtype"):
        mlr_attention_triton(q.double(), k.double(), v.double(), (16,))


def test_has_triton_flag_and_clean_import_without_triton():
    from structured_attention.ops.mlr.dispatch import has_triton

    assert has_triton()
    # Without Triton the package imports, reports it, and CUDA-less calls never touch it.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from structured_attention.ops.mlr import mlr_attention, mlr_attention_reference\n"
        "from structured_attention.ops.mlr.dispatch import has_triton\n"
        "assert has_triton() is False\n"
        "q = torch.randn(1, 2, 8, 4)\n"
        "assert torch.allclose(mlr_attention(q, q, q, (4,)), mlr_attention_reference(q, q, q, (4,)), atol=1e-5)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
