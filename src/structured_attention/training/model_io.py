"""Rebuild a trained GPT (and its tokenizer and config) from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from ..data import Tokenizer, tokenizer_from_json
from ..models.gpt import GPT
from .checkpoint import LoadedCheckpoint, check_compatible, load_checkpoint
from .config import TrainConfig, config_from_dict

__all__ = ["load_model"]


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, Tokenizer, TrainConfig, LoadedCheckpoint]:
    """``(model in eval mode, tokenizer, config, checkpoint)`` from the newest valid checkpoint at
    ``path`` (a checkpoint folder, a ``ckpt/`` folder or a run's ``out_dir``).

    ``FileNotFoundError`` when there is none; ``ValueError`` (one line) when it is corrupt, was
    written by another format, or its tensors do not fit the architecture its config describes.
    """
    ckpt = load_checkpoint(path)
    try:
        config = config_from_dict(ckpt.state["config"])
        tokenizer = tokenizer_from_json(ckpt.state["tokenizer"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"checkpoint {ckpt.path}: state.json lacks {e}") from None
    model = GPT(config.model)
    check_compatible(model, ckpt.model_state, str(ckpt.path))
    model.load_state_dict(ckpt.model_state)
    return model.to(device).eval(), tokenizer, config, ckpt
