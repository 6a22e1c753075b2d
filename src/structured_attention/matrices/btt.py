"""Block Tensor-Train (BTT) matrices and Monarch (BTT with TT-rank 1)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .._checks import check_positive_int
from ._ops import init_factor_, resolve_shape
from .base import Fan, StructuredMatrix


class BTT(StructuredMatrix):
    """Block Tensor-Train matrix with TT-rank ``s``.

    The input is reshaped to ``(c, d)`` (``in_shape``, row-major). Core 1, ``R: (c, d, b*s)``, maps
    row ``i`` by ``R[i]: d -> b*s``, giving ``(c, b, s)``. Core 2, ``L: (b, c*s, a)``, maps for each
    ``j < b`` the ``c*s`` values gathered at ``j`` (flattened ``(c, s)``) by ``L[j]: c*s -> a``. The
    output ``(a, b)`` (``out_shape``) is flattened row-major: ``y[alpha*b + j]``.
    ``in_shape`` / ``out_shape`` default to the most square factorisations (first factor the
    largest divisor not above the square root).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tt_rank: int = 1,
        in_shape: Sequence[int] | None = None,
        out_shape: Sequence[int] | None = None,
    ) -> None:
        super().__init__(in_features, out_features)
        self.tt_rank: int = check_positive_int(tt_rank, "tt_rank")
        self.in_shape: tuple[int, int] = resolve_shape(in_shape, in_features, "in_shape", "in_features")
        self.out_shape: tuple[int, int] = resolve_shape(out_shape, out_features, "out_shape", "out_features")
        (c, d), (a, b), s = self.in_shape, self.out_shape, self.tt_rank
        self.R = nn.Parameter(torch.empty(c, d, b * s))
        self.L = nn.Parameter(torch.empty(b, c * s, a))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_factor_(self.R, self.in_shape[1])
        init_factor_(self.L, self.in_shape[0] * self.tt_rank)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        (c, d), (a, b), s = self.in_shape, self.out_shape, self.tt_rank
        z = torch.einsum("...it,itk->...ik", x.unflatten(-1, (c, d)), self.R)
        y = torch.einsum("...ijs,jisa->...aj", z.unflatten(-1, (b, s)), self.L.view(b, c, s, a))
        return y.flatten(-2)

    def to_dense(self) -> Tensor:
        (c, d), (a, b), s = self.in_shape, self.out_shape, self.tt_rank
        dense = torch.einsum("jisa,itjs->ajit", self.L.view(b, c, s, a), self.R.view(c, d, b, s))
        return dense.reshape(self.out_features, self.in_features)

    def _macs_per_vector(self) -> int:
        (c, d), (a, b), s = self.in_shape, self.out_shape, self.tt_rank
        return s * (c * d * b + b * c * a)

    @property
    def rank_bound(self) -> int:
        # W = P_L diag_j(L_j^T) P_R diag_i(R_i^T) factors through the c*b*s intermediate values.
        c, b = self.in_shape[0], self.out_shape[1]
        return min(self.in_features, self.out_features, c * b * self.tt_rank)

    def parameter_fans(self) -> dict[str, Fan]:
        (c, d), (a, b), s = self.in_shape, self.out_shape, self.tt_rank
        return {"R": Fan(d, b * s), "L": Fan(c * s, a)}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tt_rank={self.tt_rank}, in_shape={self.in_shape}, out_shape={self.out_shape}"


class Monarch(BTT):
    """Monarch matrix: a ``BTT`` with ``tt_rank = 1`` (factors ``R: (c, d, b)``, ``L: (b, c, a)``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        in_shape: Sequence[int] | None = None,
        out_shape: Sequence[int] | None = None,
    ) -> None:
        super().__init__(in_features, out_features, tt_rank=1, in_shape=in_shape, out_shape=out_shape)
