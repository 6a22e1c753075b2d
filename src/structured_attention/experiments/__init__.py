"""The experiments (docs/design.md, 'Experiments'), each a
:class:`~structured_attention.training.Task` for the shared training loop plus its config and entry
points:

- :mod:`structured_attention.experiments.lm`: byte/char-level language modelling;
- :mod:`structured_attention.experiments.icl`: in-context linear regression (baselines in
  :mod:`structured_attention.experiments.icl_baselines`);
- :mod:`structured_attention.experiments.forecasting`: long-range time-series forecasting (ETT).
"""

from typing import Any

__all__ = ["checkpoint_experiment", "require_experiment"]

_NAMES = {"lm": "a language model", "icl": "an in-context regression model", "ts": "a forecaster"}


def checkpoint_experiment(state: dict[str, Any]) -> str:
    """Which experiment wrote a checkpoint (``'lm'``, ``'icl'`` or ``'ts'``), from its config's
    sections: only in-context regression has ``task``, only forecasting ``data.lookback``."""
    config = state.get("config")
    if isinstance(config, dict) and "task" in config:
        return "icl"
    if isinstance(config, dict) and "lookback" in (config.get("data") or {}):
        return "ts"
    return "lm"


def require_experiment(state: dict[str, Any], where: str, experiment: str) -> None:
    """One-line ``ValueError`` unless the checkpoint at ``where`` is ``experiment``'s."""
    found = checkpoint_experiment(state)
    if found != experiment:
        raise ValueError(f"checkpoint {where}: expected {_NAMES[experiment]}'s checkpoint, it holds {_NAMES[found]}")
