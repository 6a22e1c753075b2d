"""The experiments (docs/design.md, 'Experiments'), one folder each: its package holds its config,
its :class:`~structured_attention.training.Task` for the shared training loop, loading and
evaluation; its ``cli`` module its command line (``sattn train|sweep|eval|plot <name>``: the
sweep's plan, the report's tables and plots), which :data:`EXPERIMENTS` lists by name:

- :mod:`structured_attention.experiments.lm`: byte/char-level language modelling;
- :mod:`structured_attention.experiments.icl`: in-context linear regression (baselines in
  :mod:`structured_attention.experiments.icl.baselines`);
- :mod:`structured_attention.experiments.forecasting`: long-range time-series forecasting (ETT),
  ``ts`` on the command line.

Adding an experiment: its folder (its ``cli`` module names it: ``EXPERIMENT``, and ``NOUN`` for
messages) and one line in :data:`EXPERIMENTS`.
"""

import warnings
from typing import Any

__all__ = ["EXPERIMENTS", "checkpoint_experiment", "require_experiment"]


def checkpoint_experiment(state: dict[str, Any], where: str = "a checkpoint") -> str:
    """Which experiment wrote a checkpoint (``'lm'``, ``'icl'`` or ``'ts'``): the name it records
    (``state['experiment']``, the task's :attr:`~structured_attention.training.Task.experiment`);
    a checkpoint from before names were recorded has it inferred from its config's sections (only
    in-context regression has ``task``, only forecasting ``data.lookback``), with a warning."""
    recorded = state.get("experiment")
    if recorded is not None:
        if recorded not in EXPERIMENTS:
            raise ValueError(f"checkpoint {where}: expected an experiment among {sorted(EXPERIMENTS)}, it records "
                             f"{recorded!r}")
        return recorded
    config = state.get("config")
    if isinstance(config, dict) and "task" in config:
        found = "icl"
    elif isinstance(config, dict) and "lookback" in (config.get("data") or {}):
        found = "ts"
    else:
        found = "lm"
    warnings.warn(f"checkpoint {where} records no experiment (written before names were): taken as {found!r} "
                  f"from its config", stacklevel=2)
    return found


def require_experiment(state: dict[str, Any], where: str, experiment: str) -> None:
    """One-line ``ValueError`` unless the checkpoint at ``where`` is ``experiment``'s."""
    found = checkpoint_experiment(state, where)
    if found != experiment:
        raise ValueError(f"checkpoint {where}: expected {EXPERIMENTS[experiment].NOUN}'s checkpoint, it holds "
                         f"{EXPERIMENTS[found].NOUN}")


# Last: each experiment's modules import the helpers above.
from .forecasting import cli as _forecasting  # noqa: E402
from .icl import cli as _icl  # noqa: E402
from .lm import cli as _lm  # noqa: E402

# Each experiment's command line by its name (checkpoints and sweep folders record it).
EXPERIMENTS = {module.EXPERIMENT: module for module in (_lm, _icl, _forecasting)}
