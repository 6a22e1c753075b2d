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
    # While torch.export traces (t symbolic where a length is dynamic): two tiles beyond t // tile, the
    # query tiles by unfold and the real rows by index, shape relations it proves for every t (at
    # least two tiles, some padding), where ceil-division, a view's split and a slice's end are guards
    # on t that fail the export. Otherwise ceil-division, the view and the slice: eagerly the traced
    # form is ~25% slower forward and backward at T = 1024 (2-core CPU; its extra tiles, its unfold's
    # and index's backward). torch.compile keeps the eager form (Dynamo shows a symbolic t as an int)
    # and traces one graph more once a batch outgrows a tile.
    symbolic = isinstance(t, torch.SymInt) or torch.compiler.is_exporting()
    n_tiles = t // tile + 2 if symbolic else -(-t // tile)
    left, right = window, (0 if causal else window)
    span = tile + left + right
    pad = n_tiles * tile - t

    def tiles(x: torch.Tensor, before: int = 0, after: int = 0, size: int = tile) -> torch.Tensor:
        # (B, H, T, E) -> (B, n_tiles, H, size, E): each tile's rows, ``before`` and ``after`` it too
        x = F.pad(x, (0, 0, before, pad + after)).unfold(2, size, tile)
        return x.permute(0, 2, 1, 4, 3)

    def flat(x: torch.Tensor) -> torch.Tensor:  # tiles join the batch: 4-D inputs keep SDPA's fused kernel
        return x.flatten(0, 1)

    tile_start = torch.arange(n_tiles, device=q.device)[:, None, None] * tile
    i = tile_start + torch.arange(tile, device=q.device).view(tile, 1)
    j = tile_start - left + torch.arange(span, device=q.device)
    allowed = (j >= 0) & (j < t) & (i - j <= left) & (j - i <= right)
    if document_ids is not None:  # (B, n_tiles, tile, span): the same document too
        ids = document_ids.long().unsqueeze(1).unsqueeze(-1)  # (B, 1, T, 1), tiled as the keys are
        q_ids = tiles(ids)[:, :, 0]
        k_ids = tiles(ids, left, right, span)[:, :, 0]
        allowed = allowed & (q_ids == k_ids.transpose(-1, -2))
    allowed = allowed | (i >= t)  # padding queries (discarded) see everything, so no row is empty
    mask = allowed.unsqueeze(-3).expand(b, n_tiles, 1, tile, span)
    q_tiles = tiles(q) if symbolic else F.pad(q, (0, 0, 0, pad)).unflatten(2, (n_tiles, tile)).transpose(1, 2)
    out = scaled_dot_product_attention(
        flat(q_tiles), flat(tiles(k, left, right, span)), flat(tiles(v, left, right, span)),
        attn_mask=flat(mask), dropout_p=dropout_p, scale=scale, enable_gqa=k.shape[1] != h,
    )
    out = out.unflatten(0, (b, n_tiles)).transpose(1, 2).flatten(2, 3)  # (B, H, n_tiles * tile, Dv)
    return out.index_select(2, torch.arange(t, device=q.device)) if symbolic else out[:, :, :t]


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
