"""The interface every structured matrix implements, and the ``Fan`` record used for muP."""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

from torch import Tensor, nn

from .._checks import check_positive_int, check_tensor, require


@dataclass(frozen=True)
class Fan:
    """A parameter seen as a stack of linear maps, each from ``fan_in`` to ``fan_out`` features,
    initialised with standard deviation ``gain / sqrt(fan_in)`` (:attr:`init_std`)."""

    fan_in: int
    fan_out: int
    gain: float = 1.0

    @property
    def init_std(self) -> float:
        return self.gain / math.sqrt(self.fan_in)


class StructuredMatrix(nn.Module, abc.ABC):
    """A linear map ``(..., in_features) -> (..., out_features)`` stored as structured factors.

    Subclasses implement ``forward`` with factor contractions only (the dense matrix is never
    formed), ``to_dense`` directly from the factors, and the bookkeeping used by experiments:
    ``flops``, ``rank_bound``, ``parameter_fans`` and ``reset_parameters`` (unit output variance for
    unit-variance Gaussian input).
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features: int = check_positive_int(in_features, "in_features")
        self.out_features: int = check_positive_int(out_features, "out_features")

    @abc.abstractmethod
    def forward(self, x: Tensor) -> Tensor:
        """Apply the matrix to the last axis of ``x``: ``(..., in_features) -> (..., out_features)``."""

    @abc.abstractmethod
    def to_dense(self) -> Tensor:
        """The matrix as a dense ``(out_features, in_features)`` tensor, so ``forward(x) == x @ to_dense().T``."""

    @abc.abstractmethod
    def _macs_per_vector(self) -> int:
        """Multiply-adds of the factor contractions ``forward`` performs on one input vector."""

    @property
    @abc.abstractmethod
    def rank_bound(self) -> int:
        """An upper bound on the rank of the matrix, at most ``min(in_features, out_features)``."""

    @abc.abstractmethod
    def parameter_fans(self) -> dict[str, Fan]:
        """``Fan`` of every parameter, keyed by its name in ``named_parameters()``; its ``init_std``
        is the standard deviation ``reset_parameters`` draws it with."""

    @abc.abstractmethod
    def reset_parameters(self) -> None:
        """Gaussian init giving roughly unit output variance for unit-variance Gaussian input."""

    @property
    def num_params(self) -> int:
        """Total number of trainable scalars."""
        return sum(p.numel() for p in self.parameters())

    def flops(self, batch: int = 1) -> int:
        """Multiply-adds of one ``forward`` on ``batch`` vectors (factor contractions only; the
        elementwise level sums, scalings and permutations are not counted)."""
        return check_positive_int(batch, "batch") * self._macs_per_vector()

    def _check_input(self, x: Tensor) -> None:
        check_tensor(x, "x")
        require(
            x.dim() >= 1 and x.shape[-1] == self.in_features,
            "x",
            f"a tensor of shape (..., in_features={self.in_features})",
            tuple(x.shape),
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
