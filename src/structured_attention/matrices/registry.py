"""Construct structured matrices by name."""

from __future__ import annotations

from typing import Any

from .._checks import require
from .base import StructuredMatrix
from .block_diag import BlockDiag
from .btt import BTT, Monarch
from .dense import Dense
from .kronecker import Kronecker
from .low_rank import LowRank
from .mlbtc import MLBTC
from .mlr import MLR

STRUCTURES: dict[str, type[StructuredMatrix]] = {
    "dense": Dense,
    "low_rank": LowRank,
    "block_diag": BlockDiag,
    "mlr": MLR,
    "btt": BTT,
    "monarch": Monarch,
    "kronecker": Kronecker,
    "mlbtc": MLBTC,
}


def structured_linear(kind: str, in_features: int, out_features: int, **kwargs: Any) -> StructuredMatrix:
    """``STRUCTURES[kind.lower()](in_features, out_features, **kwargs)``.

    Example: ``structured_linear("btt", 64, 64, tt_rank=2)``.
    """
    require(isinstance(kind, str) and kind.lower() in STRUCTURES, "kind", f"one of {sorted(STRUCTURES)}", kind)
    return STRUCTURES[kind.lower()](in_features, out_features, **kwargs)
