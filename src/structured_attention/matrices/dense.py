"""Unstructured dense matrix, the baseline."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._ops import init_factor_
from .base import Fan, StructuredMatrix


class Dense(StructuredMatrix):
    """``y = W x`` with ``weight: (out_features, in_features)``."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_factor_(self.weight, self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        return x @ self.weight.T

    def to_dense(self) -> Tensor:
        return self.weight

    def _macs_per_vector(self) -> int:
        return self.in_features * self.out_features

    @property
    def rank_bound(self) -> int:
        return min(self.in_features, self.out_features)

    def parameter_fans(self) -> dict[str, Fan]:
        return {"weight": Fan(self.in_features, self.out_features)}
