"""The experiments (docs/design.md, 'Experiments'), one folder each: its package holds its config,
its :class:`~structured_attention.training.Task` for the shared training loop, loading and
evaluation; its ``cli`` module its command line (``sattn train|sweep|eval|plot <name>``: the
sweep's plan, the report's tables and plots), which :data:`EXPERIMENTS` lists by name:

- :mod:`structured_attention.experiments.lm`: byte/char-level language modelling;
- :mod:`structured_attention.experiments.icl`: in-context linear regression (baselines in
  :mod:`structured_attention.experiments.icl.baselines`);
- :mod:`structured_attention.experiments.forecasting`: long-range time-series forecasting (ETT),
  ``ts`` on the command line.

An experiment's package returns a typed result from its ``train_*`` (a
:class:`~structured_attention.training.FitResult` with the experiment's own fields) and loads its
checkpoints through :func:`load_trained`. Its ``cli`` module names it (``EXPERIMENT``, the name its
checkpoints record, and ``NOUN`` for messages), declares its ``sattn eval`` flags (``EVAL_FLAGS``;
``sattn eval`` refuses another experiment's flags with one line) and provides ``add_parsers``,
``run_eval`` and ``plot``. Adding an experiment: its folder and one line in :data:`EXPERIMENTS`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from ..training.checkpoint import LoadedCheckpoint, check_compatible, load_checkpoint
from ..training.config import config_from_dict

__all__ = ["EXPERIMENTS", "checkpoint_experiment", "load_trained", "require_experiment"]

C = TypeVar("C")
M = TypeVar("M", bound=nn.Module)


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


def load_trained(path: str | Path | LoadedCheckpoint, experiment: str, config_class: type[C],
                 build: Callable[[C], M], device: str | torch.device = "cpu") -> tuple[M, C, LoadedCheckpoint]:
    """``(model in eval mode on device, config, checkpoint)``: every experiment's loading, from the
    newest valid checkpoint at ``path`` (a checkpoint folder, a ``ckpt/`` folder or a run's
    ``out_dir``) or a checkpoint already loaded, its config read as ``config_class`` and its model
    made by ``build(config)``. ``FileNotFoundError`` when there is none; ``ValueError`` (one line)
    when it is corrupt, was written by another format or experiment, or its tensors do not fit the
    architecture its config describes."""
    ckpt = path if isinstance(path, LoadedCheckpoint) else load_checkpoint(path)
    if "config" not in ckpt.state:
        raise ValueError(f"checkpoint {ckpt.path}: state.json lacks 'config'")
    require_experiment(ckpt.state, str(ckpt.path), experiment)
    try:
        config = config_from_dict(config_class, ckpt.state["config"])
    except TypeError as e:  # a section that is not a mapping, a value of the wrong shape
        raise ValueError(f"checkpoint {ckpt.path}: its config does not describe {EXPERIMENTS[experiment].NOUN}: {e}") from None
    model = build(config)
    check_compatible(model, ckpt.model_state, str(ckpt.path))
    model.load_state_dict(ckpt.model_state)
    return model.to(device).eval(), config, ckpt


# Last: each experiment's modules import the helpers above.
from .forecasting import cli as _forecasting  # noqa: E402
from .icl import cli as _icl  # noqa: E402
from .lm import cli as _lm  # noqa: E402

# Each experiment's command line by its name (checkpoints and sweep folders record it).
EXPERIMENTS = {module.EXPERIMENT: module for module in (_lm, _icl, _forecasting)}
