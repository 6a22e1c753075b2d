"""Low-rank matrix ``L R^T``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._checks import check_positive_int
from ._ops import init_factor_
from .base import Fan, StructuredMatrix


class LowRank(StructuredMatrix):
    """``W = L R^T`` with ``L: (out_features, rank)`` and ``R: (in_features, rank)``."""

    def __init__(self, in_features: int, out_features: int, rank: int) -> None:
        super().__init__(in_features, out_features)
        self.rank: int = check_positive_int(rank, "rank")
        self.L = nn.Parameter(torch.empty(out_features, rank))
        self.R = nn.Parameter(torch.empty(in_features, rank))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_factor_(self.R, self.in_features)
        init_factor_(self.L, self.rank)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        return (x @ self.R) @ self.L.T

    def to_dense(self) -> Tensor:
        return self.L @ self.R.T

    def _macs_per_vector(self) -> int:
        return self.rank * (self.in_features + self.out_features)

    @property
    def rank_bound(self) -> int:
        return min(self.rank, self.in_features, self.out_features)

    def parameter_fans(self) -> dict[str, Fan]:
        return {"L": Fan(self.rank, self.out_features), "R": Fan(self.in_features, self.rank)}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}"
