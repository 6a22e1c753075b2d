"""The package's ops inside ``torch.autocast``.

Autocast casts the inputs of PyTorch's own attention (``scaled_dot_product_attention``) and
matmuls to its lower-precision dtype, but not those of this package's ops, which check that
``q``, ``k`` and ``v`` share one dtype. Inside autocast they do not: the projections come out in
bfloat16 while LayerNorm's outputs, float32 per-level scales and float32 caches stay float32. The
ops' public entries therefore apply autocast's rule themselves.
"""

from __future__ import annotations

import torch


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` in autocast's dtype where autocast is on for their device, else as given; like
    autocast itself, only float32, float16 and bfloat16 tensors are cast (float64 stays)."""
    try:
        device = tensors[0].device.type
    except AttributeError:
        return tensors  # not a tensor: the caller's checks name it
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in tensors)
