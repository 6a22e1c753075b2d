"""The training machinery every experiment shares.

- :func:`fit` runs a :class:`Task` (an experiment's model, batches, loss and validation metrics):
  AdamW, warmup + cosine, clipping, accumulation, autocast, muP, early stopping, metrics, exact
  ``--resume``, DDP/FSDP under ``torchrun``;
- typed configs: :class:`OptimConfig` and :class:`RunConfig` sections, :func:`load_config`
  (YAML + ``section.key=value`` overrides);
- :func:`save_checkpoint` / :func:`load_checkpoint` (safetensors + JSON, checksummed, atomic);
- :func:`~.budget.steps_for_flops`: the steps that match a training-FLOP budget (every sweep's).

The experiments themselves (language modelling, ...) live in :mod:`structured_attention.experiments`.
"""

from .checkpoint import LoadedCheckpoint, find_checkpoints, load_checkpoint, save_checkpoint
from .config import OptimConfig, RunConfig, apply_overrides, config_from_dict, config_to_dict, load_config
from .loop import FitResult, NonFiniteLossError, Task, TrainingInterrupted, TrainingStopped, fit
from .optim import build_optimizer, lr_at, mup_lr_multipliers, param_groups

__all__ = [
    "FitResult",
    "LoadedCheckpoint",
    "NonFiniteLossError",
    "OptimConfig",
    "RunConfig",
    "Task",
    "TrainingInterrupted",
    "TrainingStopped",
    "apply_overrides",
    "build_optimizer",
    "config_from_dict",
    "config_to_dict",
    "find_checkpoints",
    "fit",
    "load_checkpoint",
    "load_config",
    "lr_at",
    "mup_lr_multipliers",
    "param_groups",
    "save_checkpoint",
]
