"""Sliding-window attention that never forms the ``T x T`` score matrix.

Query ``i`` sees keys ``i - window <= j <= i`` (``|i - j| <= window`` when bidirectional). On
CUDA the pattern goes to FlexAttention with a block mask, which skips the blocks outside the band
(where its fused kernel takes the inputs: 16- or 32-bit floats, head dims of at least 16);
elsewhere queries are cut into tiles of ``tile`` rows, each scored against the ``tile + window``
keys (``+ window`` more when bidirectional) around it, so memory grows as ``T * (tile + window)``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from .._autocast import autocast_inputs
from .._checks import require
from .._compiler import memoized
from ..ops.mlr.contract import check_attention_inputs, check_bool, check_document_ids, check_scale
from .sdpa import scaled_dot_product_attention


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    causal: bool = True,
    scale: float | None = None,
    dropout_p: float = 0.0,
    tile: int = 64,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Banded softmax attention. ``q: (B, H, T, E)``, ``k: (B, Hk, T, E)``, ``v: (B, Hk, T, Dv)``,
    ``Hk`` dividing ``H`` (GQA); returns ``(B, H, T, Dv)``. With ``document_ids`` ``(B, T)``
    (integers), a query sees only keys with its own id. Inside ``torch.autocast`` the
    inputs are cast to autocast's dtype first, as PyTorch's own attention's are."""
    q, k, v = autocast_inputs(q, k, v)  # returns non-tensors as given, for the checks to name
    B, _, T, E = check_attention_inputs(q, k, v)
    require(isinstance(window, int) and not isinstance(window, bool) and window >= 0, "window",
            "a non-negative integer", window)
    require(isinstance(tile, int) and not isinstance(tile, bool) and tile > 0, "tile", "a positive integer", tile)
    check_bool(causal, "causal")
    require(isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0, "dropout_p", "a probability in [0, 1)",
            dropout_p)
    if scale is not None:
        scale = check_scale(scale, "a finite positive number or None")
    check_document_ids(document_ids, B, T, q.device, order=False)  # masked by equal ids: no host read
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    if q.is_cuda and dropout_p == 0.0 and _flex_fits(q, v):
        return _flex_window(q, k, v, window, causal, scale, document_ids)
    return _tiled_window(q, k, v, window, causal, scale, dropout_p, tile, document_ids)


# What FlexAttention's fused CUDA kernel compiles for; float64 or a head dim under 16 fails inside
# inductor's lowering, so those inputs take the tiled band instead.
_FLEX_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _flex_fits(q: torch.Tensor, v: torch.Tensor) -> bool:
    return q.dtype in _FLEX_DTYPES and min(q.shape[-1], v.shape[-1]) >= 16


def _tiled_window(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, causal: bool, scale: float,
    dropout_p: float, tile: int, document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    b, h, t, _ = q.shape
    n_tiles = -(-t // tile)
    left, right = window, (0 if causal else window)
    span = tile + left + right
    pad = n_tiles * tile - t

    def key_tiles(x: torch.Tensor) -> torch.Tensor:
        # (B, Hk, T, E) -> (B, n_tiles, Hk, span, E): the keys around each query tile.
        x = F.pad(x, (0, 0, left, pad + right)).unfold(2, span, tile)
        return x.permute(0, 2, 1, 4, 3)

    def flat(x: torch.Tensor) -> torch.Tensor:  # tiles join the batch: 4-D inputs keep SDPA's fused kernel
        return x.reshape(b * n_tiles, *x.shape[2:])

    q_tiles = F.pad(q, (0, 0, 0, pad)).view(b, h, n_tiles, tile, -1).transpose(1, 2)
    i = torch.arange(n_tiles * tile, device=q.device).view(n_tiles, tile, 1)
    j = (torch.arange(n_tiles, device=q.device) * tile - left).view(n_tiles, 1, 1) + torch.arange(span, device=q.device)
    allowed = (j >= 0) & (j < t) & (i - j <= left) & (j - i <= right)
    if document_ids is not None:  # (B, n_tiles, tile, span): the same document too
        ids = document_ids.long()
        q_ids = F.pad(ids, (0, pad)).view(b, n_tiles, tile, 1)
        k_ids = F.pad(ids, (left, pad + right)).unfold(1, span, tile).unsqueeze(2)  # (B, n_tiles, 1, span)
        allowed = allowed & (q_ids == k_ids)
    allowed = allowed | (i >= t)  # padding queries (discarded) see everything, so no row is empty
    mask = allowed.unsqueeze(-3).expand(b, n_tiles, 1, tile, span)
    out = scaled_dot_product_attention(
        flat(q_tiles), flat(key_tiles(k)), flat(key_tiles(v)), attn_mask=flat(mask), dropout_p=dropout_p,
        scale=scale, enable_gqa=k.shape[1] != h,
    )
    return out.view(b, n_tiles, h, tile, -1).transpose(1, 2).reshape(b, h, n_tiles * tile, -1)[:, :, :t]


@memoized(maxsize=32)
def _window_block_mask(t: int, window: int, causal: bool, device: str) -> object:
    from torch.nn.attention.flex_attention import create_block_mask

    right = 0 if causal else window

    def in_band(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return (i - j <= window) & (j - i <= right)

    return create_block_mask(in_band, None, None, t, t, device=device)


def _document_window_block_mask(document_ids: torch.Tensor, window: int, causal: bool) -> object:
    """The band of :func:`_window_block_mask` within each row's documents (built per call: the ids change)."""
    from torch.nn.attention.flex_attention import create_block_mask

    right = 0 if causal else window
    ids = document_ids.long()

    def in_band(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return (i - j <= window) & (j - i <= right) & (ids[b, i] == ids[b, j])

    t = ids.shape[1]
    return create_block_mask(in_band, ids.shape[0], None, t, t, device=str(ids.device))


@memoized(maxsize=1)
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, causal: bool, scale: float,
                 document_ids: torch.Tensor | None = None) -> torch.Tensor:
    if document_ids is None:
        mask = _window_block_mask(q.shape[2], window, causal, str(q.device))
    else:
        mask = _document_window_block_mask(document_ids, window, causal)
    flex = _compiled_flex() if q.is_cuda else _eager_flex()
    return flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def _eager_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention
