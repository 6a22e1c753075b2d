"""Tests for the tiled CPU fast path structured_attention.ops.mlr.blocked beyond its agreement with
the reference on the shared grid (tests/test_mlr_grid.py, backends ``blocked`` and ``blocked_tile``):
the heads-over-Python-threads path, argument validation, and a clock-free memory check via the
profiler's allocation records.
"""

from __future__ import annotations

import functools

import pytest
import torch

import structured_attention.ops.mlr.blocked as mb
from mlr_cases import check_against_reference, make_qkv
from structured_attention.ops.mlr.blocked import mlr_attention_blocked


@pytest.mark.parametrize("causal", [True, False])
def test_head_threads_path(monkeypatch, causal):
    """The heads-over-Python-threads path (normally only for T >= 2048) forced on at small T."""
    monkeypatch.setattr(mb, "_THREADED_MIN_T", 1)
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_against_reference(functools.partial(mlr_attention_blocked, tile=16), 1, 5, 5, 64, (2, 3, 1), 4,
                                seed=1, block_sizes=(64, 32, 8), causal=causal)
        check_against_reference(mlr_attention_blocked, 2, 4, 2, 40, (2, 2), 3, seed=2, block_sizes=(64, 16),
                                causal=causal, depth_normalize=True)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(prev)


def test_float32_matches_and_threads_restored(monkeypatch):
    monkeypatch.setattr(mb, "_THREADED_MIN_T", 1)
    before = torch.get_num_threads()
    check_against_reference(functools.partial(mlr_attention_blocked, tile=32), 1, 4, 4, 256, (4, 4, 4, 4), 16,
                            torch.float32)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ranks=(4, 3)), "ranks"),
        (dict(ranks=(4, 4), block_sizes=(16, 6)), "block_sizes"),
        (dict(ranks=(4, 4), block_sizes=(8, 4)), "block_sizes"),  # s_1 < T
        (dict(ranks=(4, 4), tile=0), "tile"),
        (dict(ranks=(4, 4), scale=-1.0), "scale"),
        (dict(ranks=(4, 4), causal=1), "causal"),
    ],
)
def test_validation(kwargs, match):
    q, k, v = make_qkv(1, 2, 2, 16, 8, 4)
    with pytest.raises(ValueError, match=match):
        mlr_attention_blocked(q, k, v, **kwargs)


def test_default_blocks_need_divisible_T():
    q, k, v = make_qkv(1, 1, 1, 6, 8, 4)
    with pytest.raises(ValueError, match="block_sizes"):
        mlr_attention_blocked(q, k, v, (2, 2, 2, 2))


def test_memory_is_linear_in_T():
    """No allocation of T x T size, forward or backward (the reference makes several)."""
    from torch.profiler import profile

    T, R = 2048, 16
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # single thread: every allocation is recorded on this thread
    try:
        q, k, v = make_qkv(1, 2, 2, T, R, 16, torch.float32, requires_grad=True)
        with profile(profile_memory=True) as prof:
            mlr_attention_blocked(q, k, v, (4, 4, 4, 4), tile=64).sum().backward()
    finally:
        torch.set_num_threads(prev)
    biggest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < biggest <= 2 * 64 * T * 4 * 2  # O(heads * tile * T), far below one T x T matrix
    assert biggest < T * T * 4 / 4
