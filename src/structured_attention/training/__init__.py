"""Language-model training: typed configs, the training loop, checkpoints and distributed set-up.

- :class:`TrainConfig` (``model: GPTConfig``, ``data: DataConfig``, ``optim: OptimConfig``,
  ``run: RunConfig``), :func:`load_config` (YAML + ``section.key=value`` overrides);
- :func:`train` -> dict (per-step losses, final validation loss and bits per byte, a sample);
- :func:`save_checkpoint` / :func:`load_checkpoint` (safetensors + JSON, checksummed, atomic);
- :func:`load_model` (a GPT and its tokenizer from a checkpoint, for evaluation and generation).
"""

from .checkpoint import LoadedCheckpoint, find_checkpoints, load_checkpoint, save_checkpoint
from .config import (
    DataConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_config,
)
from .optim import build_optimizer, lr_at, mup_lr_multipliers, param_groups
from .trainer import NonFiniteLossError, evaluate, generate_sample, train
from .model_io import load_model

__all__ = [
    "DataConfig",
    "LoadedCheckpoint",
    "NonFiniteLossError",
    "OptimConfig",
    "RunConfig",
    "TrainConfig",
    "apply_overrides",
    "build_optimizer",
    "config_from_dict",
    "config_to_dict",
    "evaluate",
    "find_checkpoints",
    "generate_sample",
    "load_checkpoint",
    "load_config",
    "load_model",
    "lr_at",
    "mup_lr_multipliers",
    "param_groups",
    "save_checkpoint",
    "train",
]
