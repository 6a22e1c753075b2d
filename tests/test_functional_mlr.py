"""Tests for the MLR attention reference and contract (docs/design.md, "MLR attention").

The reference's agreement with the naive definition (one full ``T x T`` block mask per level,
explicit ``repeat_interleave`` for GQA, explicit causal mask: ``mlr_cases.naive_mlr``), outputs and
gradients, on every case, and its dtype policy (float32, bfloat16, float16 against float64) are on
the shared grid, tests/test_mlr_grid.py. Here: GQA's head mapping, non-contiguous inputs, random
nested configurations, structural properties, the depth / pair-count / block-size helpers, gradcheck,
validation and the CPU dispatch.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mlr_cases import make_qkv, naive_mlr
from structured_attention.functional import (
    mlr_attention_reference,
    mlr_block_sizes,
    mlr_depth,
    mlr_pair_counts,
)
from structured_attention.functional import mlr_attention as dispatched_mlr_attention
from structured_attention.ops.mlr.contract import mlr_score_flops

# These tests pin down the exact reference; the fast paths are checked against it on the grid.
mlr_attention = mlr_attention_reference


def test_gqa_head_mapping_is_repeat_interleave():
    # Query head h must read kv head h // (H // Hk): compare with explicitly repeated k, v.
    q, k, v = make_qkv(1, 6, 2, 10, 4, 2, seed=3)
    out = mlr_attention(q, k, v, (3, 1), (16, 4))
    full = mlr_attention(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), (3, 1), (16, 4))
    torch.testing.assert_close(out, full, rtol=0, atol=1e-12)
    # ...and not the tiled (repeat) mapping.
    tiled = mlr_attention(q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1), (3, 1), (16, 4))
    assert not torch.allclose(out, tiled)


def test_non_contiguous_inputs():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 9, 4, 6, generator=g, dtype=torch.float64).transpose(1, 2)  # (B, H, T, R)
    k = torch.randn(2, 9, 2, 6, generator=g, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(2, 2, 3, 9, generator=g, dtype=torch.float64).transpose(-1, -2)  # (B, Hk, T, Dv)
    out = mlr_attention(q, k, v, (4, 2), (16, 2))
    ref = naive_mlr(q, k, v, (4, 2), (16, 2))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


@st.composite
def nested_config(draw):
    L = draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, 4))]
    for _ in range(L - 1):
        sizes.append(sizes[-1] * draw(st.integers(2, 3)))
    sizes = tuple(reversed(sizes))
    T = draw(st.integers(1, min(sizes[0], 40)))
    ranks = tuple(draw(st.integers(1, 3)) for _ in range(L))
    Hk = draw(st.sampled_from([1, 2]))
    G = draw(st.sampled_from([1, 2]))
    causal = draw(st.booleans())
    depth_normalize = draw(st.booleans())
    return T, ranks, sizes, Hk, G, causal, depth_normalize


@settings(max_examples=40, deadline=None)
@given(nested_config(), st.integers(0, 2**16))
def test_random_nested_configs(config, seed):
    T, ranks, sizes, Hk, G, causal, depth_normalize = config
    q, k, v = make_qkv(1, Hk * G, Hk, T, sum(ranks), 2, seed=seed)
    out = mlr_attention(q, k, v, ranks, sizes, causal=causal, depth_normalize=depth_normalize)
    ref = naive_mlr(q, k, v, ranks, sizes, causal=causal, depth_normalize=depth_normalize)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


# --------------------------------------------------------------------------------------------------
# Structural properties
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth_normalize", [False, True])
def test_causal_prefix_property(depth_normalize):
    ranks, sizes = (5, 2, 1), (64, 16, 4)
    q, k, v = make_qkv(2, 4, 2, 45, 8, 3, seed=11)
    full = mlr_attention(q, k, v, ranks, sizes, causal=True, depth_normalize=depth_normalize)
    for t in (1, 3, 4, 16, 17, 31, 44):
        prefix = mlr_attention(
            q[:, :, :t], k[:, :, :t], v[:, :, :t], ranks, sizes, causal=True, depth_normalize=depth_normalize
        )
        torch.testing.assert_close(full[:, :, :t], prefix, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,sizes", [(16, None), (16, (16,)), (11, (32,))])
@pytest.mark.parametrize("H,Hk", [(2, 2), (4, 2)])
def test_single_level_is_plain_softmax_attention(causal, T, sizes, H, Hk):
    q, k, v = make_qkv(2, H, Hk, T, 6, 5, seed=T)
    out = mlr_attention(q, k, v, (6,), sizes, causal=causal)
    group = H // Hk
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), is_causal=causal
    )
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


def test_finer_levels_only_act_inside_their_blocks():
    # Changing the level-2 part of a key in block 1 must not change rows of block 0 (bidirectional).
    ranks, sizes = (3, 2), (16, 8)
    q, k, v = make_qkv(1, 1, 1, 16, 5, 2, seed=2)
    out = mlr_attention(q, k, v, ranks, sizes, causal=False)
    k2 = k.clone()
    k2[..., 8:, 3:] += 10.0
    out2 = mlr_attention(q, k2, v, ranks, sizes, causal=False)
    torch.testing.assert_close(out[..., :8, :], out2[..., :8, :], rtol=0, atol=1e-12)
    assert not torch.allclose(out[..., 8:, :], out2[..., 8:, :])


# --------------------------------------------------------------------------------------------------
# Depth, pair counts, block sizes
# --------------------------------------------------------------------------------------------------

DEPTH_CASES = [(1, (1,)), (13, (16, 8, 2)), (16, (16, 8, 4, 2, 1)), (20, (27, 9, 3)), (9, (9, 3)), (5, (5,))]


@pytest.mark.parametrize("T,sizes", DEPTH_CASES)
def test_mlr_depth_brute_force(T, sizes):
    d = mlr_depth(T, sizes)
    assert d.dtype == torch.long and d.shape == (T, T)
    for i in range(T):
        for j in range(T):
            expected = sum(1 for s in sizes if i // s == j // s)
            assert d[i, j].item() == expected
    assert d.min().item() >= 1


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,sizes", DEPTH_CASES + [(33, (64, 16, 4)), (7, (8, 4, 2))])
def test_pair_counts_match_depth(T, sizes, causal):
    d = mlr_depth(T, sizes)
    if causal:
        d = d.tril()
    expected = tuple(int((d >= level).sum()) for level in range(1, len(sizes) + 1))
    assert mlr_pair_counts(T, sizes, causal) == expected


def test_score_flops():
    ranks, sizes = (5, 2, 1), (64, 16, 4)
    counts = mlr_pair_counts(33, sizes, True)
    assert mlr_score_flops(33, ranks, sizes, True) == 5 * counts[0] + 2 * counts[1] + 1 * counts[2]
    # 8 equal levels, default sizes, bidirectional: T^2 * sum_l r / 2^(l-1) exactly.
    T, r = 256, 4
    sizes8 = mlr_block_sizes((r,) * 8, T)
    assert mlr_score_flops(T, (r,) * 8, sizes8, False) == sum(T * T * r // 2**l for l in range(8))


def test_block_sizes_defaults_and_passthrough():
    assert mlr_block_sizes((1, 1, 1), 24) == (24, 12, 6)
    assert mlr_block_sizes((4,), 7) == (7,)
    assert mlr_block_sizes((1, 1), 7, [16, 4]) == (16, 4)
    assert mlr_block_sizes((1, 1, 1), 9, (27, 9, 3)) == (27, 9, 3)


@pytest.mark.parametrize(
    "args,name",
    [
        (((1, 1, 1), 6, None), "block_sizes"),  # 4 does not divide 6
        (((1, 1), 8, (8,)), "block_sizes"),  # wrong length
        (((1, 1), 8, (8, 8)), "block_sizes"),  # not strictly decreasing
        (((1, 1), 8, (4, 8)), "block_sizes"),  # increasing
        (((1, 1), 8, (8, 3)), "block_sizes"),  # not nested
        (((1, 1), 8, (4, 2)), "block_sizes"),  # s_1 < context
        (((1, 1), 8, (8.0, 4)), "block_sizes"),  # not ints
        (((1, 1), 8, (8, 0)), "block_sizes"),
        (((1, 1), 0, None), "context"),
        (((1, 1), 8.0, None), "context"),
        (((), 8, None), "ranks"),
        (((1, 0), 8, None), "ranks"),
    ],
)
def test_block_sizes_errors(args, name):
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}:"):
        mlr_block_sizes(*args)


def test_default_block_sizes_error_mentions_context():
    with pytest.raises(ValueError, match=r"^block_sizes:.*context=6"):
        mlr_block_sizes((1, 1, 1), 6)
    q, k, v = make_qkv(1, 1, 1, 6, 3, 2)
    with pytest.raises(ValueError, match=r"^block_sizes:.*context=6"):
        mlr_attention(q, k, v, (1, 1, 1))


@pytest.mark.parametrize(
    "fn,args,name",
    [
        (mlr_depth, (0, (4,)), "T"),
        (mlr_depth, (8, (4, 2)), "block_sizes"),
        (mlr_pair_counts, (8, (8, 3), True), "block_sizes"),
        (mlr_pair_counts, (8, (8, 4), "yes"), "causal"),
        (mlr_pair_counts, (-1, (8, 4), True), "T"),
        (mlr_score_flops, (8, (1, 1), (8,), True), "block_sizes"),
        (mlr_score_flops, (8, (1, -1), (8, 4), True), "ranks"),
    ],
)
def test_helper_errors(fn, args, name):
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}:"):
        fn(*args)


# --------------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("depth_normalize", [False, True])
def test_gradcheck(causal, depth_normalize):
    q, k, v = make_qkv(1, 2, 1, 7, 3, 2, seed=7)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def fn(q, k, v):
        return mlr_attention(q, k, v, (2, 1), (8, 2), causal=causal, depth_normalize=depth_normalize)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def _base():
    q, k, v = make_qkv(2, 4, 2, 8, 4, 3)
    return dict(q=q, k=k, v=v, ranks=(3, 1), block_sizes=None, causal=True, scale=None, depth_normalize=False)


def _t(*shape, dtype=torch.float64, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


BAD = [
    # tensor ranks
    ("q", dict(q=_t(2, 8, 4)), "q"),
    ("k", dict(k=_t(2, 2, 8, 4, 1)), "k"),
    ("v", dict(v=_t(8, 3)), "v"),
    ("q-not-tensor", dict(q=[[1.0]]), "q"),
    # shapes
    ("k-batch", dict(k=_t(3, 2, 8, 4)), "k"),
    ("k-T", dict(k=_t(2, 2, 7, 4)), "k"),
    ("k-R", dict(k=_t(2, 2, 8, 5)), "k"),
    ("k-heads", dict(k=_t(2, 3, 8, 4), v=_t(2, 3, 8, 3)), "k"),
    ("v-batch", dict(v=_t(1, 2, 8, 3)), "v"),
    ("v-T", dict(v=_t(2, 2, 9, 3)), "v"),
    ("v-heads", dict(v=_t(2, 4, 8, 3)), "v"),
    ("q-empty", dict(q=_t(2, 4, 0, 4), k=_t(2, 2, 0, 4), v=_t(2, 2, 0, 3)), "q"),
    ("q-no-heads", dict(q=_t(2, 0, 8, 4), k=_t(2, 0, 8, 4), v=_t(2, 0, 8, 3)), "q"),
    ("v-no-dims", dict(v=_t(2, 2, 8, 0)), "v"),  # the C++ kernel failed to allocate (std::bad_alloc)
    # ranks
    ("ranks-sum", dict(ranks=(2, 1)), "ranks"),
    ("ranks-zero", dict(ranks=(4, 0)), "ranks"),
    ("ranks-negative", dict(ranks=(5, -1)), "ranks"),
    ("ranks-empty", dict(ranks=()), "ranks"),
    ("ranks-str", dict(ranks="31"), "ranks"),
    # block sizes
    ("bs-default-T", dict(ranks=(2, 1, 1), q=_t(2, 4, 6, 4), k=_t(2, 2, 6, 4), v=_t(2, 2, 6, 3)), "block_sizes"),
    ("bs-len", dict(block_sizes=(8,)), "block_sizes"),
    ("bs-order", dict(block_sizes=(4, 8)), "block_sizes"),
    ("bs-equal", dict(block_sizes=(8, 8)), "block_sizes"),
    ("bs-nested", dict(block_sizes=(8, 3)), "block_sizes"),
    ("bs-short", dict(block_sizes=(4, 2)), "block_sizes"),
    ("bs-zero", dict(block_sizes=(8, 0)), "block_sizes"),
    ("bs-float", dict(block_sizes=(8, 4.0)), "block_sizes"),
    # dtype / device
    ("k-dtype", dict(k=_t(2, 2, 8, 4, dtype=torch.float32)), "k.dtype"),
    ("v-dtype", dict(v=_t(2, 2, 8, 3, dtype=torch.float32)), "v.dtype"),
    ("v-device", dict(v=_t(2, 2, 8, 3, device="meta")), "v.device"),
    ("int-dtype", dict(q=_t(2, 4, 8, 4, dtype=torch.long), k=_t(2, 2, 8, 4, dtype=torch.long),
                       v=_t(2, 2, 8, 3, dtype=torch.long)), "q.dtype"),
    # scale and flags
    ("scale-zero", dict(scale=0.0), "scale"),
    ("scale-negative", dict(scale=-1.0), "scale"),
    ("scale-nan", dict(scale=float("nan")), "scale"),
    ("scale-inf", dict(scale=float("inf")), "scale"),
    ("scale-str", dict(scale="1"), "scale"),
    ("scale-bool", dict(scale=True), "scale"),
    ("causal", dict(causal="yes"), "causal"),
    ("depth_normalize", dict(depth_normalize=1), "depth_normalize"),
]


@pytest.mark.parametrize("label,override,name", BAD, ids=[b[0] for b in BAD])
def test_validation_errors(label, override, name):
    kwargs = _base()
    kwargs.update(override)
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}:") as info:
        mlr_attention(**kwargs)
    assert "\n" not in str(info.value)


def test_ranks_sum_message_shows_sum_and_R():
    kwargs = _base()
    kwargs["ranks"] = (2, 1)
    with pytest.raises(ValueError, match=r"^ranks:.*R=4.*sum 3"):
        mlr_attention(**kwargs)


def test_valid_base_call_runs():
    # Guards the validation table: the unmodified base call must succeed.
    out = mlr_attention(**_base())
    assert out.shape == (2, 4, 8, 3)


@pytest.mark.parametrize("kernel", [True, False])
def test_dispatch_on_cpu(monkeypatch, kernel):
    """CPU tensors go to the C++ kernel where it is available, else to the blocked PyTorch path."""
    calls = []
    import structured_attention.ops.mlr.blocked as blocked
    from structured_attention.ops.mlr import cpu as mlr_cpu

    def spy(fn):
        def wrapped(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(blocked, "mlr_attention_blocked", spy(blocked.mlr_attention_blocked))
    monkeypatch.setattr(mlr_cpu, "mlr_attention_cpu", spy(mlr_cpu.mlr_attention_cpu))
    if not kernel:
        monkeypatch.setattr(mlr_cpu, "available", lambda: False)
    elif not mlr_cpu.available():
        pytest.skip("the C++ kernel cannot be built here (no compiler or ninja)")
    q = torch.randn(1, 2, 16, 4, dtype=torch.float64)
    out = dispatched_mlr_attention(q, q, q, (2, 2))
    assert calls == ["mlr_attention_cpu" if kernel else "mlr_attention_blocked"]
    torch.testing.assert_close(out, mlr_attention_reference(q, q, q, (2, 2)), rtol=1e-10, atol=1e-10)


def test_numpy_scales_give_the_float_scales_result():
    """A NumPy number (``np.float32(0.3)``, a config value read with NumPy) is taken as the Python
    float it equals, by every op that takes a scale; it was refused as not a number."""
    np = pytest.importorskip("numpy")
    from structured_attention.functional import mlr_decode, sliding_window_attention

    kwargs = _base()
    for scale in (np.float32(0.3), np.float64(0.3), np.int64(2)):
        kwargs["scale"] = scale
        torch.testing.assert_close(mlr_attention(**kwargs), mlr_attention(**{**kwargs, "scale": float(scale)}),
                                   rtol=0, atol=0)
    q, k, v = kwargs["q"], kwargs["k"], kwargs["v"]
    torch.testing.assert_close(sliding_window_attention(q, k, v, 3, scale=np.float32(0.3)),
                               sliding_window_attention(q, k, v, 3, scale=float(np.float32(0.3))), rtol=0, atol=0)
    keys = [k[:, :, :, :3], k[:, :, 4:, 3:]]  # 8 cached tokens, blocks (8, 4): level 2 holds 4..7
    one = q[:, :, -1:]
    torch.testing.assert_close(mlr_decode(one, keys, [0, 4], v, (3, 1), np.float32(0.3)),
                               mlr_decode(one, keys, [0, 4], v, (3, 1), float(np.float32(0.3))), rtol=0, atol=0)
