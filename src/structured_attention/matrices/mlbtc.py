"""MLBTC: sums of permuted products of block-diagonal factors, the umbrella of the family.

``W = sum_l alpha_l P_L (⊕_k L_{l,k}) P_R (⊕_k R_{l,k}^T)``. MLR (identity permutations), BTT and
Monarch (one level), Kronecker and LowRank are all settings of it; the ``from_*`` constructors build
the MLBTC numerically equal to a given instance of those structures.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .._checks import check_divides, check_positive_int, require
from ._ops import block_diag_dense, block_diag_matmul, init_factor_
from .base import Fan, StructuredMatrix
from .btt import BTT
from .kronecker import Kronecker
from .low_rank import LowRank
from .mlr import MLR


@dataclass(frozen=True)
class LevelSpec:
    """Shape of one MLBTC level.

    ``inner``: the intermediate dimension ``m``; ``right_blocks``: ``p_R`` blocks mapping
    ``in/p_R -> m/p_R``; ``left_blocks``: ``p_L`` blocks mapping ``m/p_L -> out/p_L``;
    ``inner_perm`` / ``out_perm``: ``P_R`` / ``P_L`` as index sequences (``z -> z[perm]``;
    ``None`` is the identity); ``alpha``: the fixed level scale (``None``: ``1/sqrt(#levels)``).
    """

    inner: int
    right_blocks: int = 1
    left_blocks: int = 1
    inner_perm: Sequence[int] | None = None
    out_perm: Sequence[int] | None = None
    alpha: float | None = None


def _perm_buffer(perm: Sequence[int] | None, n: int, name: str) -> Tensor | None:
    """``perm`` as an index tensor, or ``None`` for the identity; checks it permutes ``range(n)``."""
    if perm is None:
        return None
    ok = (
        isinstance(perm, Sequence)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in perm)
        and sorted(perm) == list(range(n))
    )
    require(ok, name, f"a permutation of range({n})", perm)
    index = torch.as_tensor(list(perm), dtype=torch.long)
    return None if torch.equal(index, torch.arange(n)) else index


class MLBTCLevel(StructuredMatrix):
    """One level ``alpha P_L (⊕_k L_k) P_R (⊕_k R_k^T)``.

    Parameters ``R: (p_R, in/p_R, m/p_R)`` and ``L: (p_L, out/p_L, m/p_L)``; buffers ``inner_perm``
    and ``out_perm`` (long index tensors, or ``None`` for identities) and ``alpha`` (a 0-dim float
    buffer: a fixed scale, not trained). ``reset_parameters`` gives unit output variance before ``alpha``.
    """

    def __init__(self, in_features: int, out_features: int, spec: LevelSpec, name: str = "level") -> None:
        super().__init__(in_features, out_features)
        m = check_positive_int(spec.inner, f"{name}.inner")
        p_r = check_positive_int(spec.right_blocks, f"{name}.right_blocks")
        p_l = check_positive_int(spec.left_blocks, f"{name}.left_blocks")
        check_divides(p_r, in_features, f"{name}.right_blocks", "in_features")
        check_divides(p_r, m, f"{name}.right_blocks", f"{name}.inner")
        check_divides(p_l, m, f"{name}.left_blocks", f"{name}.inner")
        check_divides(p_l, out_features, f"{name}.left_blocks", "out_features")
        alpha = 1.0 if spec.alpha is None else spec.alpha
        require(isinstance(alpha, (int, float)) and math.isfinite(alpha), f"{name}.alpha", "a finite number", alpha)
        self.inner, self.right_blocks, self.left_blocks = m, p_r, p_l
        self.R = nn.Parameter(torch.empty(p_r, in_features // p_r, m // p_r))
        self.L = nn.Parameter(torch.empty(p_l, out_features // p_l, m // p_l))
        self.register_buffer("inner_perm", _perm_buffer(spec.inner_perm, m, f"{name}.inner_perm"))
        self.register_buffer("out_perm", _perm_buffer(spec.out_perm, out_features, f"{name}.out_perm"))
        self.register_buffer("alpha", torch.tensor(float(alpha), dtype=torch.float64))  # exact until cast
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_factor_(self.R, self.in_features // self.right_blocks)
        init_factor_(self.L, self.inner // self.left_blocks)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        z = block_diag_matmul(x, self.R.transpose(1, 2))
        if self.inner_perm is not None:
            z = z[..., self.inner_perm]
        y = block_diag_matmul(z, self.L)
        if self.out_perm is not None:
            y = y[..., self.out_perm]
        return self.alpha * y

    def to_dense(self) -> Tensor:
        right = block_diag_dense(self.R.transpose(1, 2))  # (m, in)
        if self.inner_perm is not None:
            right = right[self.inner_perm]
        dense = block_diag_dense(self.L) @ right  # (out, in)
        if self.out_perm is not None:
            dense = dense[self.out_perm]
        return self.alpha * dense

    def _macs_per_vector(self) -> int:
        return self.R.numel() + self.L.numel()

    @property
    def rank_bound(self) -> int:
        return min(self.in_features, self.out_features, self.inner)

    def parameter_fans(self) -> dict[str, Fan]:
        return {
            "R": Fan(self.in_features // self.right_blocks, self.inner // self.right_blocks),
            "L": Fan(self.inner // self.left_blocks, self.out_features // self.left_blocks),
        }

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, inner={self.inner}, right_blocks={self.right_blocks}, "
            f"left_blocks={self.left_blocks}, alpha={float(self.alpha):g}"
        )


class MLBTC(StructuredMatrix):
    """``W = sum_l alpha_l P_L (⊕_k L_{l,k}) P_R (⊕_k R_{l,k}^T)``, one ``MLBTCLevel`` per ``LevelSpec``.

    Levels live in ``self.levels`` (an ``nn.ModuleList``); parameters are named ``levels.<l>.R`` and
    ``levels.<l>.L``. ``alpha_l`` is a buffer defaulting to ``1/sqrt(#levels)`` so a fresh instance
    has unit output variance.
    """

    def __init__(self, in_features: int, out_features: int, levels: Sequence[LevelSpec]) -> None:
        super().__init__(in_features, out_features)
        require(
            isinstance(levels, Sequence) and len(levels) > 0 and all(isinstance(s, LevelSpec) for s in levels),
            "levels",
            "a non-empty sequence of LevelSpec",
            levels,
        )
        default_alpha = 1.0 / math.sqrt(len(levels))
        self.levels = nn.ModuleList(
            MLBTCLevel(
                in_features,
                out_features,
                spec if spec.alpha is not None else dataclasses.replace(spec, alpha=default_alpha),
                name=f"levels[{i}]",
            )
            for i, spec in enumerate(levels)
        )

    def reset_parameters(self) -> None:
        for level in self.levels:
            level.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        return sum(level(x) for level in self.levels)

    def to_dense(self) -> Tensor:
        return sum(level.to_dense() for level in self.levels)

    def _macs_per_vector(self) -> int:
        return sum(level._macs_per_vector() for level in self.levels)

    @property
    def rank_bound(self) -> int:
        inner = sum(level.rank_bound for level in self.levels)
        return min(self.in_features, self.out_features, inner)

    def parameter_fans(self) -> dict[str, Fan]:
        return {
            f"levels.{i}.{name}": fan
            for i, level in enumerate(self.levels)
            for name, fan in level.parameter_fans().items()
        }

    @classmethod
    def _with_factors(
        cls, source: StructuredMatrix, specs: Sequence[LevelSpec], factors: Sequence[tuple[Tensor, Tensor]]
    ) -> MLBTC:
        """An MLBTC with ``source``'s shape, dtype and device; level ``l`` holds copies of ``factors[l] = (R, L)``."""
        ref = next(source.parameters())
        new = cls(source.in_features, source.out_features, specs).to(device=ref.device, dtype=ref.dtype)
        with torch.no_grad():
            for level, (R, L) in zip(new.levels, factors):
                level.R.copy_(R)
                level.L.copy_(L)
        return new

    @classmethod
    def from_low_rank(cls, m: LowRank) -> MLBTC:
        """One level, one block on each side, identity permutations."""
        require(isinstance(m, LowRank), "m", "a LowRank", type(m).__name__)
        return cls._with_factors(m, [LevelSpec(inner=m.rank, alpha=1.0)], [(m.R[None], m.L[None])])

    @classmethod
    def from_mlr(cls, m: MLR) -> MLBTC:
        """Level ``l``: ``p_l`` right blocks, ``p_l S`` left blocks (one per block and stacked matrix),
        ``inner = p_l S r_l``; the output permutation orders it by matrix, then block (identity when ``S = 1``)."""
        require(isinstance(m, MLR), "m", "an MLR", type(m).__name__)
        s = m.n_stacks
        specs, factors = [], []
        for p, r, R, L in zip(m.n_blocks, m.ranks, m.R, m.L):
            rows = m.out_features // (p * s)
            order = torch.arange(m.out_features).view(p, s, rows).transpose(0, 1).flatten().tolist()
            specs.append(LevelSpec(inner=p * s * r, right_blocks=p, left_blocks=p * s, out_perm=order if s > 1 else None, alpha=1.0))
            factors.append((R, L.reshape(p * s, rows, r)))
        return cls._with_factors(m, specs, factors)

    @classmethod
    def from_btt(cls, m: BTT) -> MLBTC:
        """One level: ``c`` right blocks ``R_i``, inner ``(c, b, s) -> (b, c, s)``, ``b`` left blocks ``L_j^T``,
        output ``(b, a) -> (a, b)``. Covers ``Monarch``."""
        require(isinstance(m, BTT), "m", "a BTT or Monarch", type(m).__name__)
        (c, _), (a, b), s = m.in_shape, m.out_shape, m.tt_rank
        spec = LevelSpec(
            inner=c * b * s,
            right_blocks=c,
            left_blocks=b,
            inner_perm=torch.arange(c * b * s).view(c, b, s).transpose(0, 1).flatten().tolist(),
            out_perm=torch.arange(b * a).view(b, a).T.flatten().tolist(),
            alpha=1.0,
        )
        return cls._with_factors(m, [spec], [(m.R, m.L.transpose(1, 2))])

    @classmethod
    def from_kronecker(cls, m: Kronecker) -> MLBTC:
        """One level: ``a2`` right blocks equal to ``B``, inner ``(a2, b1) -> (b1, a2)``, ``b1`` left
        blocks equal to ``A``, output ``(b1, a1) -> (a1, b1)``. The tied blocks become independent copies."""
        require(isinstance(m, Kronecker), "m", "a Kronecker", type(m).__name__)
        (a2, b2), (a1, b1) = m.in_shape, m.out_shape
        spec = LevelSpec(
            inner=a2 * b1,
            right_blocks=a2,
            left_blocks=b1,
            inner_perm=torch.arange(a2 * b1).view(a2, b1).T.flatten().tolist(),
            out_perm=torch.arange(b1 * a1).view(b1, a1).T.flatten().tolist(),
            alpha=1.0,
        )
        return cls._with_factors(m, [spec], [(m.B.T.expand(a2, b2, b1), m.A.expand(b1, a1, a2))])
