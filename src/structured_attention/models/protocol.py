"""What the training loop asks of a model beyond ``nn.Module``, under one name in every model."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..matrices.base import Fan

__all__ = ["TrainableModel"]


@runtime_checkable
class TrainableModel(Protocol):
    """A model :func:`~structured_attention.training.fit` can train: every model of this package
    (``GPT``, ``RegressionTransformer``, the forecasters) implements it, and so must a user's."""

    def parameter_fans(self) -> dict[str, Fan]:
        """Fan-in and fan-out of every matrix-like parameter, by name (weight decay and muP's
        learning-rate multipliers; see :func:`~structured_attention.models.parameter_fans`)."""
        ...

    def training_flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per sequence position of a ``seq_len``-position input (2 per
        multiply-add, forward and backward); ``None``: the model's own length."""
        ...
