"""Tests for structured_attention.matrices (docs/design.md, 'Structured matrices (the MLBTC
family)'), in float64."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from structured_attention.matrices import (
    BTT,
    MLBTC,
    MLR,
    STRUCTURES,
    BlockDiag,
    Dense,
    Fan,
    Kronecker,
    LevelSpec,
    LowRank,
    Monarch,
    StructuredMatrix,
    structured_linear,
)

DTYPE = torch.float64
ATOL = 1e-10

MLBTC_LEVELS = [
    LevelSpec(inner=6, right_blocks=3, left_blocks=2, inner_perm=[5, 2, 0, 4, 1, 3], out_perm=[7, 0, 6, 1, 5, 2, 4, 3]),
    LevelSpec(inner=4),
]

# (factory, params from docs/design.md's table, multiply-adds per vector from the analytic formula)
CASES: dict[str, tuple[Callable[[], StructuredMatrix], int, int]] = {
    "dense-8x12": (lambda: Dense(8, 12), 8 * 12, 8 * 12),
    "dense-12x8": (lambda: Dense(12, 8), 12 * 8, 12 * 8),
    "lowrank-12x8": (lambda: LowRank(12, 8, rank=3), 3 * (12 + 8), 3 * (12 + 8)),
    "lowrank-16": (lambda: LowRank(16, 16, rank=4), 2 * 16 * 4, 2 * 16 * 4),
    "blockdiag-12x8": (lambda: BlockDiag(12, 8, n_blocks=4), 12 * 8 // 4, 12 * 8 // 4),
    "blockdiag-16": (lambda: BlockDiag(16, 16, n_blocks=2), 16 * 16 // 2, 16 * 16 // 2),
    "mlr-16x24": (lambda: MLR(16, 24, ranks=(2, 3, 2)), (2 + 3 + 2) * (16 + 24), (2 + 3 + 2) * (16 + 24)),
    "mlr-12x8-blocks": (lambda: MLR(12, 8, ranks=(2, 2), n_blocks=(2, 4)), 4 * (12 + 8), 4 * (12 + 8)),
    # three stacked 12 -> 8 MLRs: each level's ranks for every matrix
    "mlr-12x24-stacks": (lambda: MLR(12, 24, ranks=(2, 2), n_blocks=(1, 2), n_stacks=3), 3 * 4 * (12 + 8), 3 * 4 * (12 + 8)),
    # BTT s(cdb + bca); 12 -> (c, d) = (3, 4), 20 -> (a, b) = (4, 5)
    "btt-12x20": (lambda: BTT(12, 20, tt_rank=2), 2 * (3 * 4 * 5 + 5 * 3 * 4), 2 * (3 * 4 * 5 + 5 * 3 * 4)),
    "btt-16-shapes": (
        lambda: BTT(16, 16, tt_rank=4, in_shape=(2, 8), out_shape=(8, 2)),
        4 * (2 * 8 * 2 + 2 * 2 * 8),
        4 * (2 * 8 * 2 + 2 * 2 * 8),
    ),
    "monarch-16": (lambda: Monarch(16, 16), 2 * 16**1.5, 2 * 16**1.5),
    "monarch-12x18": (lambda: Monarch(12, 18), 3 * 4 * 6 + 6 * 3 * 3, 3 * 4 * 6 + 6 * 3 * 3),
    # Kronecker: A (a1, a2), B (b1, b2); cost min(a2 b2 b1 + a1 a2 b1, a1 a2 b2 + a1 b2 b1)
    "kronecker-12x20": (lambda: Kronecker(12, 20), 4 * 3 + 5 * 4, min(3 * 4 * 5 + 4 * 3 * 5, 4 * 3 * 4 + 4 * 4 * 5)),
    "kronecker-6x8": (
        lambda: Kronecker(6, 8, in_shape=(3, 2), out_shape=(2, 4)),
        2 * 3 + 4 * 2,
        min(3 * 2 * 4 + 2 * 3 * 4, 2 * 3 * 2 + 2 * 2 * 4),
    ),
    # MLBTC: sum over levels of in*m/p_R + m*out/p_L
    "mlbtc-12x8": (lambda: MLBTC(12, 8, MLBTC_LEVELS), 12 * 6 // 3 + 6 * 8 // 2 + 12 * 4 + 4 * 8, 128),
}


def make(name: str) -> StructuredMatrix:
    torch.manual_seed(0)
    return CASES[name][0]().to(DTYPE)


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> tuple[StructuredMatrix, int, int]:
    _, params, macs = CASES[request.param]
    return make(request.param), int(params), int(macs)


def test_forward_matches_dense(case: tuple[StructuredMatrix, int, int]) -> None:
    m, _, _ = case
    x = torch.randn(3, 5, m.in_features, dtype=DTYPE)
    y = m(x)
    dense = m.to_dense()
    assert dense.shape == (m.out_features, m.in_features)
    assert y.shape == (3, 5, m.out_features)
    torch.testing.assert_close(y, x @ dense.T, atol=ATOL, rtol=0)


def test_num_params_matches_formula(case: tuple[StructuredMatrix, int, int]) -> None:
    m, params, _ = case
    assert m.num_params == params


def test_flops_match_formula_and_forward(case: tuple[StructuredMatrix, int, int]) -> None:
    m, _, macs = case
    assert m.flops() == macs
    assert m.flops(batch=7) == 7 * macs
    x = torch.randn(7, m.in_features, dtype=DTYPE)
    with FlopCounterMode(display=False) as counter:
        m(x)
    # FlopCounterMode counts 2 per multiply-add of matmuls (the cases avoid size-1 contractions,
    # which einsum performs as elementwise products that it does not count)
    assert counter.get_total_flops() == 2 * m.flops(batch=7)


def test_rank_bound_holds(case: tuple[StructuredMatrix, int, int]) -> None:
    m, _, _ = case
    assert isinstance(m.rank_bound, int)
    assert m.rank_bound <= min(m.in_features, m.out_features)
    assert torch.linalg.matrix_rank(m.to_dense()).item() <= m.rank_bound


@pytest.mark.parametrize(
    ("factory", "rank"),
    [
        (lambda: BTT(16, 16, tt_rank=4), 16),
        (lambda: Monarch(16, 16), 16),
        (lambda: LowRank(16, 12, rank=4), 4),
        (lambda: MLR(16, 16, ranks=(1, 1, 1)), 1 + 2 + 4),
        (lambda: Kronecker(6, 8, in_shape=(3, 2), out_shape=(2, 4)), 2 * 2),
    ],
)
def test_rank_bound_is_attained_by_random_instances(factory: Callable[[], StructuredMatrix], rank: int) -> None:
    torch.manual_seed(1)
    m = factory().to(DTYPE)
    assert m.rank_bound == rank
    assert torch.linalg.matrix_rank(m.to_dense()).item() == rank


def test_gradients_reach_every_parameter(case: tuple[StructuredMatrix, int, int]) -> None:
    m, _, _ = case
    m(torch.randn(4, m.in_features, dtype=DTYPE)).square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None, name
        assert p.grad.abs().sum() > 0, name


def test_parameter_fans_cover_every_parameter(case: tuple[StructuredMatrix, int, int]) -> None:
    m, _, _ = case
    fans = m.parameter_fans()
    params = dict(m.named_parameters())
    assert set(fans) == set(params)
    for name, fan in fans.items():
        assert isinstance(fan, Fan)
        assert isinstance(fan.fan_in, int) and fan.fan_in > 0
        assert isinstance(fan.fan_out, int) and fan.fan_out > 0
        # every parameter is a stack of (fan_out x fan_in) maps
        assert params[name].numel() % (fan.fan_in * fan.fan_out) == 0, name


WIDTH = 256
INIT_KWARGS: dict[str, dict] = {
    "dense": {},
    "low_rank": {"rank": 32},
    "block_diag": {"n_blocks": 4},
    "mlr": {"ranks": (16, 16, 16, 16)},
    "btt": {"tt_rank": 2},
    "monarch": {},
    "kronecker": {},
    "mlbtc": {
        "levels": [
            LevelSpec(inner=512, right_blocks=16, left_blocks=16, inner_perm=torch.randperm(512).tolist()),
            LevelSpec(inner=32),
        ]
    },
}


@pytest.mark.parametrize("kind", sorted(STRUCTURES))
def test_init_gives_unit_output_variance(kind: str) -> None:
    torch.manual_seed(2)
    m = structured_linear(kind, WIDTH, WIDTH, **INIT_KWARGS[kind])
    with torch.no_grad():
        var = m(torch.randn(2048, WIDTH)).var().item()
    assert 0.5 < var < 2.0, var


@pytest.mark.parametrize("kind", sorted(STRUCTURES))
def test_each_parameter_is_drawn_with_its_declared_init_std(kind: str) -> None:
    """``parameter_fans()[name].init_std`` is what ``reset_parameters`` draws (the RMS weight cap
    and muP's initialisation read it): the sample RMS of every parameter is within 10 %."""
    torch.manual_seed(4)
    m = structured_linear(kind, WIDTH, WIDTH, **INIT_KWARGS[kind])
    params = dict(m.named_parameters())
    for name, fan in m.parameter_fans().items():
        rms = params[name].detach().square().mean().sqrt().item()
        assert rms == pytest.approx(fan.init_std, rel=0.1), name


def test_stacked_mlr_is_independent_mlrs_one_above_the_other() -> None:
    torch.manual_seed(3)
    parts = [MLR(12, 8, ranks=(2, 1, 2), n_blocks=(1, 2, 4)).to(DTYPE) for _ in range(3)]
    stacked = MLR(12, 24, ranks=(2, 1, 2), n_blocks=(1, 2, 4), n_stacks=3).to(DTYPE)
    with torch.no_grad():
        for level, r in enumerate(stacked.ranks):
            stacked.R[level].copy_(torch.cat([m.R[level] for m in parts], dim=2))  # each block: matrices side by side
            stacked.L[level].copy_(torch.cat([m.L[level] for m in parts], dim=1))  # each block: matrices' rows in turn
    x = torch.randn(5, 12, dtype=DTYPE)
    torch.testing.assert_close(stacked(x), torch.cat([m(x) for m in parts], dim=-1))
    torch.testing.assert_close(stacked.to_dense(), torch.cat([m.to_dense() for m in parts]))


@pytest.mark.parametrize(
    ("source", "reduce"),
    [
        (lambda: MLR(16, 24, ranks=(2, 3, 1)), MLBTC.from_mlr),
        (lambda: MLR(12, 8, ranks=(2, 2), n_blocks=(2, 4)), MLBTC.from_mlr),
        (lambda: MLR(12, 24, ranks=(2, 1), n_blocks=(1, 2), n_stacks=3), MLBTC.from_mlr),
        (lambda: BTT(12, 20, tt_rank=2), MLBTC.from_btt),
        (lambda: BTT(16, 16, tt_rank=4, in_shape=(2, 8), out_shape=(8, 2)), MLBTC.from_btt),
        (lambda: Monarch(12, 18), MLBTC.from_btt),
        (lambda: Kronecker(12, 20), MLBTC.from_kronecker),
        (lambda: Kronecker(6, 8, in_shape=(3, 2), out_shape=(2, 4)), MLBTC.from_kronecker),
        (lambda: LowRank(12, 8, rank=3), MLBTC.from_low_rank),
    ],
)
def test_mlbtc_reduces_to(source: Callable[[], StructuredMatrix], reduce: Callable[[StructuredMatrix], MLBTC]) -> None:
    torch.manual_seed(3)
    m = source().to(DTYPE)
    mb = reduce(m)
    assert isinstance(mb, MLBTC)
    assert (mb.in_features, mb.out_features) == (m.in_features, m.out_features)
    torch.testing.assert_close(mb.to_dense(), m.to_dense(), atol=ATOL, rtol=0)
    x = torch.randn(3, 5, m.in_features, dtype=DTYPE)
    torch.testing.assert_close(mb(x), m(x), atol=ATOL, rtol=0)
    assert mb.rank_bound >= torch.linalg.matrix_rank(m.to_dense()).item()
    # the copy owns its factors
    before = m.to_dense().clone()
    with torch.no_grad():
        for p in mb.parameters():
            p.add_(1.0)
    torch.testing.assert_close(m.to_dense(), before, atol=0, rtol=0)


def test_mlbtc_reductions_keep_the_cost() -> None:
    for m, reduce in [
        (MLR(16, 24, ranks=(2, 3, 1)), MLBTC.from_mlr),
        (BTT(12, 20, tt_rank=2), MLBTC.from_btt),
        (LowRank(12, 8, rank=3), MLBTC.from_low_rank),
    ]:
        mb = reduce(m)
        assert (mb.num_params, mb.flops(3)) == (m.num_params, m.flops(3))
    # Kronecker: the a2 tied copies of B and b1 tied copies of A become independent blocks
    mb = MLBTC.from_kronecker(Kronecker(6, 8, in_shape=(3, 2), out_shape=(2, 4)))
    assert mb.num_params == 3 * (2 * 4) + 4 * (2 * 3)


def test_mlbtc_dense_matches_the_definition() -> None:
    """W = sum_l alpha_l P_L diag(L_l) P_R diag(R_l^T), with P = identity rows reordered by the perm."""
    m = make("mlbtc-12x8")
    expected = torch.zeros(8, 12, dtype=DTYPE)
    for spec, level in zip(MLBTC_LEVELS, m.levels):
        inner_perm = spec.inner_perm or list(range(spec.inner))
        out_perm = spec.out_perm or list(range(8))
        P_R = torch.eye(spec.inner, dtype=DTYPE)[inner_perm]
        P_L = torch.eye(8, dtype=DTYPE)[out_perm]
        right = torch.block_diag(*[block.T for block in level.R])
        left = torch.block_diag(*level.L)
        expected += P_L @ left @ P_R @ right / math.sqrt(len(MLBTC_LEVELS))
    torch.testing.assert_close(m.to_dense(), expected, atol=ATOL, rtol=0)
    assert [name for name, _ in m.named_buffers()].count("levels.0.alpha") == 1
    assert all("alpha" not in name for name, _ in m.named_parameters())


def test_btt_matches_the_spec_definition() -> None:
    """Core 1 maps row i by R_i: d -> b*s; core 2 maps, per j, the c*s values gathered at j by L_j: c*s -> a."""
    torch.manual_seed(4)
    (c, d), (a, b), s = (3, 4), (2, 5), 2
    m = BTT(c * d, a * b, tt_rank=s, in_shape=(c, d), out_shape=(a, b)).to(DTYPE)
    x = torch.randn(c * d, dtype=DTYPE)
    X = x.view(c, d)
    Z = torch.stack([X[i] @ m.R[i] for i in range(c)]).view(c, b, s)
    Y = torch.stack([Z[:, j, :].reshape(c * s) @ m.L[j] for j in range(b)], dim=1)  # (a, b)
    torch.testing.assert_close(m(x), Y.reshape(a * b), atol=ATOL, rtol=0)
    assert Monarch(12, 10).tt_rank == 1


@settings(max_examples=25, deadline=None)
@given(
    c=st.integers(1, 4),
    d=st.integers(1, 4),
    a=st.integers(1, 4),
    b=st.integers(1, 4),
    s=st.integers(1, 3),
    ranks=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    k_in=st.integers(1, 3),
    k_out=st.integers(1, 3),
)
def test_random_shapes_forward_matches_dense(c, d, a, b, s, ranks, k_in, k_out) -> None:
    blocks = 2 ** (len(ranks) - 1)
    for m in [
        BTT(c * d, a * b, tt_rank=s, in_shape=(c, d), out_shape=(a, b)),
        Kronecker(c * d, a * b, in_shape=(c, d), out_shape=(a, b)),
        MLR(blocks * k_in, blocks * k_out, ranks=ranks),
    ]:
        m = m.to(DTYPE)
        x = torch.randn(2, m.in_features, dtype=DTYPE)
        torch.testing.assert_close(m(x), x @ m.to_dense().T, atol=ATOL, rtol=0)
        assert torch.linalg.matrix_rank(m.to_dense()).item() <= m.rank_bound


def test_structured_linear_builds_every_kind() -> None:
    assert set(STRUCTURES) == {"dense", "low_rank", "block_diag", "mlr", "btt", "monarch", "kronecker", "mlbtc"}
    for kind, cls in STRUCTURES.items():
        m = structured_linear(kind, WIDTH, WIDTH, **INIT_KWARGS[kind])
        assert type(m) is cls and (m.in_features, m.out_features) == (WIDTH, WIDTH)
    assert isinstance(structured_linear("BTT", 16, 16, tt_rank=2), BTT)


@pytest.mark.parametrize(
    ("build", "param"),
    [
        (lambda: BlockDiag(12, 8, n_blocks=3), "n_blocks"),
        (lambda: BlockDiag(12, 8, n_blocks=0), "n_blocks"),
        (lambda: MLR(16, 16, ranks=()), "ranks"),
        (lambda: MLR(16, 16, ranks=(2, 0)), "ranks"),
        (lambda: MLR(16, 16, ranks=(2, -1)), "ranks"),
        (lambda: MLR(12, 12, ranks=(1, 1, 1, 1)), "ranks"),  # default n_blocks 8 does not divide 12
        (lambda: MLR(16, 16, ranks=(2, 2), n_blocks=(1, 3)), "n_blocks"),
        (lambda: MLR(16, 16, ranks=(2, 2), n_blocks=(1,)), "n_blocks"),
        (lambda: MLR(16, 16, ranks=(2, 2), n_stacks=0), "n_stacks"),
        (lambda: MLR(16, 12, ranks=(2, 2), n_stacks=4), "n_stacks"),
        (lambda: LowRank(16, 16, rank=0), "rank"),
        (lambda: Dense(0, 4), "in_features"),
        (lambda: BTT(12, 12, tt_rank=0), "tt_rank"),
        (lambda: BTT(12, 12, in_shape=(2, 5)), "in_shape"),
        (lambda: BTT(12, 12, out_shape=(2, 2, 3)), "out_shape"),
        (lambda: Monarch(12, 12, in_shape=(5, 2)), "in_shape"),
        (lambda: Kronecker(6, 8, in_shape=(4, 2)), "in_shape"),
        (lambda: Kronecker(6, 8, out_shape=(3, 3)), "out_shape"),
        (lambda: MLBTC(12, 8, []), "levels"),
        (lambda: MLBTC(12, 8, [LevelSpec(inner=6, right_blocks=5)]), "right_blocks"),
        (lambda: MLBTC(12, 8, [LevelSpec(inner=6, left_blocks=4)]), "left_blocks"),
        (lambda: MLBTC(12, 8, [LevelSpec(inner=3, inner_perm=[0, 1, 1])]), "inner_perm"),
        (lambda: MLBTC(12, 8, [LevelSpec(inner=3, out_perm=[0, 1, 2])]), "out_perm"),
        (lambda: MLBTC.from_mlr(LowRank(4, 4, 1)), "m"),
        (lambda: structured_linear("toeplitz", 4, 4), "kind"),
        (lambda: Dense(4, 4).flops(batch=0), "batch"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_parameter(build: Callable[[], object], param: str) -> None:
    with pytest.raises(ValueError, match=rf"^{param}\b|^levels\[0\]\.{param}\b"):
        build()


@pytest.mark.parametrize("name", sorted(CASES))
def test_wrong_input_width_raises(name: str) -> None:
    m = make(name)
    with pytest.raises(ValueError, match=r"^x: .*in_features"):
        m(torch.randn(2, m.in_features + 1, dtype=DTYPE))
    with pytest.raises(ValueError, match=r"^x: "):
        m([1.0] * m.in_features)  # type: ignore[arg-type]
