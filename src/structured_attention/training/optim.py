"""AdamW parameter groups (weight decay, muP learning rates) and the learning-rate schedule."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .._checks import require
from ..matrices.base import Fan
from ..models.protocol import TrainableModel
from .config import OptimConfig

__all__ = ["build_optimizer", "lr_at", "mup_lr_multipliers", "param_groups"]


def _embedding_param_ids(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def mup_lr_multipliers(model: nn.Module, base_width: int) -> dict[str, float]:
    """Per-parameter Adam learning-rate multipliers under muP, by parameter name.

    The rule (muP for Adam, Yang et al. 2022, Table 3, applied through the model's own
    ``parameter_fans()`` declaration rather than by matching names):

    - every matrix-like parameter that ``model.parameter_fans()`` lists, except the weights of
      ``nn.Embedding`` modules, is *hidden-like* (or the untied output head): its learning rate is
      multiplied by ``base_width / fan_in``, with ``fan_in`` the declared fan-in (for a dense
      ``nn.Linear`` its ``in_features``; for a structured matrix's factor the fan-in that factor
      declares). So at ``fan_in == base_width`` the learning rate is the configured one;
    - embedding weights (token and position tables; their fan-in is the vocabulary, which does not
      grow with width) and all vector-like parameters (norm scales, biases, per-level scales: the
      ones ``parameter_fans()`` leaves out) keep multiplier 1.

    With tied embeddings the output head *is* the token embedding, which keeps multiplier 1.

    What transfers across widths is the *ratio* between widths: a dense matrix's fan-in grows in
    proportion to ``d_model``, so doubling the width halves its learning rate, as muP requires; a
    structured factor whose declared fan-in grows like ``sqrt(d_model)`` (a BTT core) gets
    ``1/sqrt(2)``. The fixed factor at the base width (e.g. ``1/mlp_ratio`` for the MLP's down
    projection, whose fan-in is ``mlp_ratio * d_model``) is part of the rule and the same at every
    width, so a learning rate tuned at one width applies at the others.
    """
    fans = _declared_fans(model)
    embeddings = _embedding_param_ids(model)
    out = {}
    for name, p in model.named_parameters():
        if name in fans and id(p) not in embeddings:
            out[name] = base_width / fans[name].fan_in
        else:
            out[name] = 1.0
    return out


def _declared_fans(model: nn.Module) -> dict[str, Fan]:
    require(isinstance(model, TrainableModel), "model", "a model with parameter_fans() (models.TrainableModel)",
            type(model).__name__)
    return model.parameter_fans()


def param_groups(model: nn.Module, config: OptimConfig) -> list[dict[str, Any]]:
    """AdamW groups: decoupled weight decay on matrix-like parameters only (those in
    ``model.parameter_fans()`` that are not embedding tables); none on norms, biases, scales and
    embeddings. Each group carries ``lr_mult`` (muP, else 1) and the sorted ``names`` it holds."""
    fans = _declared_fans(model)
    embeddings = _embedding_param_ids(model)
    mults = mup_lr_multipliers(model, config.mup_base_width) if config.mup else {}
    groups: dict[tuple[bool, float], dict[str, Any]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = name in fans and id(p) not in embeddings
        mult = mults.get(name, 1.0)
        g = groups.setdefault(
            (decay, mult),
            {"params": [], "names": [], "weight_decay": config.weight_decay if decay else 0.0, "lr_mult": mult},
        )
        g["params"].append(p)
        g["names"].append(name)
    return [groups[k] for k in sorted(groups)]


def build_optimizer(model: nn.Module, config: OptimConfig, fused: bool = False) -> torch.optim.AdamW:
    groups = param_groups(model, config)
    opt = torch.optim.AdamW(
        [{k: v for k, v in g.items() if k != "names"} for g in groups],
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        fused=fused or None,
    )
    for group, g in zip(opt.param_groups, groups):
        group["names"] = g["names"]
    return opt


def lr_at(step: int, total_steps: int, config: OptimConfig) -> float:
    """The base learning rate of optimizer step ``step`` (0-based): linear warmup from
    ``lr / warmup_steps`` to ``lr`` over ``warmup_steps`` steps, then constant or a cosine decay that
    reaches ``min_lr_ratio * lr`` at the last step."""
    if config.warmup_steps and step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return config.lr
    span = max(1, total_steps - 1 - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    ratio = config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return config.lr * ratio
