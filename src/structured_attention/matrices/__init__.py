"""Structured matrices of the MLBTC family (docs/design.md, 'Structured matrices (the MLBTC
family)').

Every class is a ``StructuredMatrix``: an ``nn.Module`` mapping ``(..., in_features) ->
(..., out_features)`` with ``to_dense()``, ``num_params``, ``flops(batch)``, ``rank_bound``,
``parameter_fans()`` and ``reset_parameters()``.
"""

from .base import Fan, StructuredMatrix
from .block_diag import BlockDiag
from .btt import BTT, Monarch
from .dense import Dense
from .kronecker import Kronecker
from .low_rank import LowRank
from .mlbtc import MLBTC, LevelSpec, MLBTCLevel
from .mlr import MLR
from .registry import STRUCTURES, structured_linear

__all__ = [
    "BTT",
    "MLBTC",
    "MLR",
    "STRUCTURES",
    "BlockDiag",
    "Dense",
    "Fan",
    "Kronecker",
    "LevelSpec",
    "LowRank",
    "MLBTCLevel",
    "Monarch",
    "StructuredMatrix",
    "structured_linear",
]
