"""Kronecker product ``A ⊗ B``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ._ops import init_factor_, resolve_shape
from .base import Fan, StructuredMatrix


class Kronecker(StructuredMatrix):
    """``W = A ⊗ B`` with ``A: (a1, a2)``, ``B: (b1, b2)``; ``in_shape = (a2, b2)``, ``out_shape = (a1, b1)``.

    ``forward`` reshapes ``x`` to ``X: (a2, b2)`` and returns ``A X B^T`` flattened, contracting in
    whichever order needs fewer multiply-adds. Shapes default to the most square factorisations.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        in_shape: Sequence[int] | None = None,
        out_shape: Sequence[int] | None = None,
    ) -> None:
        super().__init__(in_features, out_features)
        self.in_shape: tuple[int, int] = resolve_shape(in_shape, in_features, "in_shape", "in_features")
        self.out_shape: tuple[int, int] = resolve_shape(out_shape, out_features, "out_shape", "out_features")
        (a2, b2), (a1, b1) = self.in_shape, self.out_shape
        self.A = nn.Parameter(torch.empty(a1, a2))
        self.B = nn.Parameter(torch.empty(b1, b2))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_factor_(self.A, self.in_shape[0])
        init_factor_(self.B, self.in_shape[1])

    def _order_macs(self) -> tuple[int, int]:
        """Multiply-adds of ``A (X B^T)`` and of ``(A X) B^T``."""
        (a2, b2), (a1, b1) = self.in_shape, self.out_shape
        return a2 * b2 * b1 + a1 * a2 * b1, a1 * a2 * b2 + a1 * b2 * b1

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        X = x.unflatten(-1, self.in_shape)
        b_first, a_first = self._order_macs()
        if b_first <= a_first:
            y = self.A @ (X @ self.B.T)
        else:
            y = (self.A @ X) @ self.B.T
        return y.flatten(-2)

    def to_dense(self) -> Tensor:
        return torch.kron(self.A, self.B)

    def _macs_per_vector(self) -> int:
        return min(self._order_macs())

    @property
    def rank_bound(self) -> int:
        (a2, b2), (a1, b1) = self.in_shape, self.out_shape
        return min(a1, a2) * min(b1, b2)

    def parameter_fans(self) -> dict[str, Fan]:
        (a2, b2), (a1, b1) = self.in_shape, self.out_shape
        return {"A": Fan(a2, a1), "B": Fan(b2, b1)}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, in_shape={self.in_shape}, out_shape={self.out_shape}"
