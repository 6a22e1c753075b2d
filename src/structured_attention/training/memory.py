"""Memory a training run will hold, bounded from below before anything is allocated.

A run whose lower bound exceeds what it may use (``run.max_memory``, else the memory available on
the device: the machine's on the CPU, the GPU's free memory on CUDA) stops with one line naming the settings behind the
largest term and the bytes they imply, instead of an allocator traceback or a swap storm minutes
later. The bounds count only what is certain:

- 16 bytes per parameter (the float32 weight, its gradient and AdamW's two moments) and 4 per
  buffer element, counted on a model built on the meta device (nothing allocated); sizes so large
  that the blocks' MLP weights alone exceed the limit are refused before building anything;
- 4 bytes per float that every block keeps for the backward pass, per position of a micro-batch
  (the block's input and its MLP's hidden layer).

Kernels' workspaces, the logits and the allocator's slack come on top, so a run that passes can
still run out of memory; one that fails cannot fit.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

__all__ = ["available_memory", "check_training_memory", "format_bytes", "parse_memory"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str) -> int | None:
    """``'auto'`` -> None (the device's memory); ``'16GB'``, ``'512MiB'``, ``'1.5TB'`` or a byte
    count -> bytes. ``ValueError`` naming ``run.max_memory`` otherwise."""
    if text.strip().lower() == "auto":
        return None
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"run.max_memory: expected 'auto' or a size such as '16GB' or '512MiB', got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def available_memory(device: torch.device) -> int:
    """Bytes free for this run now: the GPU's free memory on CUDA; the machine's available memory
    otherwise (``MemAvailable`` of ``/proc/meminfo``, else its physical memory)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): no limit known
        return 2**63 - 1


def format_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{int(n)} B"


def check_training_memory(task: Any, batch_size: int, max_memory: str, device: torch.device,
                          activation_checkpointing: bool = False) -> None:
    """Raise a one-line ``ValueError`` when ``task``'s model and micro-batch cannot fit.

    ``task`` gives ``backbone_config()`` (a ``TransformerConfig``: ``parameter_lower_bound()``,
    ``saved_floats_per_position()``; ``None`` skips the check), ``tokens_per_batch()`` and
    ``build_model()``.
    """
    limit = parse_memory(max_memory)
    where = f"run.max_memory={max_memory}" if limit is not None else f"the memory available on the {device.type} device"
    limit = available_memory(device) if limit is None else limit
    backbone = task.backbone_config()
    if backbone is None:
        return
    positions = task.tokens_per_batch()
    activations = 4 * positions * backbone.saved_floats_per_position(activation_checkpointing)
    weights = 16 * backbone.parameter_lower_bound()
    if activations + weights <= limit:  # plausible sizes: count the real model's parameters
        with torch.device("meta"):
            model = task.build_model()
        weights = (16 * sum(p.numel() for p in model.parameters())
                   + 4 * sum(b.numel() for b in model.buffers()))
    sizes = f"model.d_model={backbone.d_model}, model.n_layers={backbone.n_layers}, model.mlp_ratio={backbone.mlp_ratio}"
    terms = [
        (weights, f"{sizes}, model.max_seq_len={backbone.max_seq_len}, model.attention={backbone.attention!r}: "
                  f"the weights, gradients and AdamW state"),
        (activations, f"run.batch_size={batch_size} ({positions:,} positions per micro-batch) with {sizes}"
                      f"{', run.activation_checkpointing=true' if activation_checkpointing else ''}: "
                      f"the activations kept for the backward pass"),
    ]
    total = sum(size for size, _ in terms)
    if total > limit:
        size, what = max(terms)
        raise ValueError(f"{what} take at least {format_bytes(size)} (the run at least {format_bytes(total)}), more "
                         f"than {where} ({format_bytes(limit)})")
