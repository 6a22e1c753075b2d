"""Block-diagonal matrix."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._checks import check_divides, check_positive_int
from ._ops import block_diag_dense, block_diag_matmul, init_factor_
from .base import Fan, StructuredMatrix


class BlockDiag(StructuredMatrix):
    """``W = diag(B_1, ..., B_p)`` with ``weight: (n_blocks, out_features/p, in_features/p)``."""

    def __init__(self, in_features: int, out_features: int, n_blocks: int) -> None:
        super().__init__(in_features, out_features)
        self.n_blocks: int = check_positive_int(n_blocks, "n_blocks")
        check_divides(n_blocks, in_features, "n_blocks", "in_features")
        check_divides(n_blocks, out_features, "n_blocks", "out_features")
        self.weight = nn.Parameter(torch.empty(n_blocks, out_features // n_blocks, in_features // n_blocks))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_factor_(self.weight, self.in_features // self.n_blocks)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        return block_diag_matmul(x, self.weight)

    def to_dense(self) -> Tensor:
        return block_diag_dense(self.weight)

    def _macs_per_vector(self) -> int:
        return self.in_features * self.out_features // self.n_blocks

    @property
    def rank_bound(self) -> int:
        return min(self.in_features, self.out_features)

    def parameter_fans(self) -> dict[str, Fan]:
        return {"weight": Fan(self.in_features // self.n_blocks, self.out_features // self.n_blocks)}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, n_blocks={self.n_blocks}"
