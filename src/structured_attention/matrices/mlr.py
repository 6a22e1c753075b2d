"""Multi-Level Low-Rank (MLR) matrix."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .._checks import check_divides, check_int_list, require
from ._ops import block_diag_dense, block_diag_matmul, init_factor_
from .base import Fan, StructuredMatrix


class MLR(StructuredMatrix):
    """``W = sum_l diag_k(L_{l,k} R_{l,k}^T)``: level ``l`` is block-diagonal with ``p_l`` low-rank blocks.

    Factors: ``L[l]: (p_l, out_features/p_l, r_l)`` and ``R[l]: (p_l, in_features/p_l, r_l)``
    (``nn.ParameterList``s, named ``L.<l>`` / ``R.<l>``). ``n_blocks`` defaults to ``p_l = 2^(l-1)``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ranks: Sequence[int],
        n_blocks: Sequence[int] | None = None,
    ) -> None:
        super().__init__(in_features, out_features)
        self.ranks: tuple[int, ...] = check_int_list(ranks, "ranks")
        if n_blocks is None:
            blocks = tuple(2**level for level in range(len(self.ranks)))
            require(
                in_features % blocks[-1] == 0 and out_features % blocks[-1] == 0,
                "ranks",
                f"few enough levels that the default n_blocks 2^(l-1) (up to {blocks[-1]}) divide "
                f"in_features={in_features} and out_features={out_features}",
                ranks,
            )
        else:
            blocks = check_int_list(n_blocks, "n_blocks")
            require(len(blocks) == len(self.ranks), "n_blocks", f"{len(self.ranks)} entries (one per rank)", n_blocks)
            for level, p in enumerate(blocks):
                check_divides(p, in_features, f"n_blocks[{level}]", "in_features")
                check_divides(p, out_features, f"n_blocks[{level}]", "out_features")
        self.n_blocks: tuple[int, ...] = blocks
        self.L = nn.ParameterList(torch.empty(p, out_features // p, r) for p, r in zip(blocks, self.ranks))
        self.R = nn.ParameterList(torch.empty(p, in_features // p, r) for p, r in zip(blocks, self.ranks))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        level_gain = 1.0 / math.sqrt(len(self.ranks))
        for p, r, L, R in zip(self.n_blocks, self.ranks, self.L, self.R):
            init_factor_(R, self.in_features // p)
            init_factor_(L, r, level_gain)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        return sum(block_diag_matmul(block_diag_matmul(x, R.transpose(1, 2)), L) for L, R in zip(self.L, self.R))

    def to_dense(self) -> Tensor:
        return sum(block_diag_dense(L @ R.transpose(1, 2)) for L, R in zip(self.L, self.R))

    def _macs_per_vector(self) -> int:
        return sum(self.ranks) * (self.in_features + self.out_features)

    @property
    def rank_bound(self) -> int:
        inner = sum(r * p for r, p in zip(self.ranks, self.n_blocks))
        return min(inner, self.in_features, self.out_features)

    def parameter_fans(self) -> dict[str, Fan]:
        fans = {}
        for level, (p, r) in enumerate(zip(self.n_blocks, self.ranks)):
            fans[f"L.{level}"] = Fan(r, self.out_features // p)
            fans[f"R.{level}"] = Fan(self.in_features // p, r)
        return fans

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, ranks={self.ranks}, n_blocks={self.n_blocks}"
