"""Bilinear scoring with a structured, high-rank matrix per head: ``score_h(i, j) = x_i^T M_h x_j``.

Standard attention's ``W_Q W_K^T`` has rank at most ``head_dim``; these kinds replace it by a
BTT or MLR matrix whose rank can reach ``d_model`` at a fraction of a dense matrix's cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import require
from ..matrices import BTT, MLR, BlockDiag, StructuredMatrix
from .base import FullScoreAttention
from .config import AttentionConfig, default_scale, positional


def _project(layer: FullScoreAttention, matrix: StructuredMatrix, x: torch.Tensor) -> torch.Tensor:
    """``matrix(x)``; with the layer's ``weight_cap`` each weight ``W`` enters as
    ``W / max(1, RMS(W) / init_std)`` (the paper authors' cap: a weight may shrink but never grow
    past its initial scale in the forward pass; the optimiser still updates ``W`` itself)."""
    if not layer.options.weight_cap:
        return matrix(x)
    fans = matrix.parameter_fans()
    capped = {name: w / torch.clamp_min(w.square().mean().sqrt() / fans[name].init_std, 1.0)
              for name, w in matrix.named_parameters()}
    return torch.func.functional_call(matrix, capped, (x,))


def _inputs_as_queries(layer: FullScoreAttention, config: AttentionConfig, key_map: StructuredMatrix,
                       key_norm: str = "head") -> None:
    """Set up ``score_h(i, j) = x_i^T M_h x_j / tau`` with ``key_map`` stacking every head's ``M_h``
    (``d -> n_heads * d``): queries ``x_i``, keys ``LN(M_h x_j)``, the LayerNorm per head with a
    learned gain per head and dim (``key_norm="head"``), or one ``LayerNorm(d)`` with its gain and
    bias shared by every head (``"shared"``, the paper authors' code)."""
    require(layer.n_kv_heads == config.n_heads, "n_kv_heads",
            f"n_heads={config.n_heads} (GQA does not apply: every head's query is x itself)", config.n_kv_heads)
    require(key_norm in ("head", "shared"), "key_norm", "'head' or 'shared'", key_norm)
    d = config.d_model
    layer.key_map = key_map
    if key_norm == "head":
        layer.key_gain = nn.Parameter(torch.ones(layer.n_heads * d))
    else:
        layer.key_norm = nn.LayerNorm(d)
    layer.q_norm = nn.LayerNorm(d) if config.qk_norm else nn.Identity()
    layer.score_dims = d
    layer.scale = default_scale(config.attn_scale, d)


def _inputs_as_queries_qk(layer: FullScoreAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, t, d = x.shape
    q = layer.q_norm(x).unsqueeze(1).expand(b, layer.n_heads, t, d)
    keys = layer.split_heads(_project(layer, layer.key_map, x), layer.n_heads)
    if hasattr(layer, "key_norm"):
        return q, layer.key_norm(keys)
    return q, F.layer_norm(keys, (d,)) * layer.key_gain.view(layer.n_heads, 1, d)


class BilinearBTTAttention(FullScoreAttention):
    """``score_h(i, j) = x_i^T M_h x_j / tau`` with ``M_h`` a (full-rank) BTT matrix, computed as
    queries ``x_i`` and keys ``LN(M_h x_j)``; a learned gain per head and dim follows the LayerNorm."""

    kind = "bilinear_btt"
    examples = {"bilinear_btt": "bilinear_btt:2",
                "bilinear_btt_paper": "bilinear_btt:1:key_norm=shared:weight_cap=true:attn_scale=mup8"}

    @dataclass(frozen=True)
    class Config:
        btt_rank: int = positional(1)  # TT-rank of the BTT matrix
        # the keys' LayerNorm: per head with a gain per head and dim ("head"), or one LayerNorm of
        # width d_model with its gain and bias shared by every head ("shared", the paper authors')
        key_norm: str = "head"
        weight_cap: bool = False  # each weight used as W / max(1, RMS(W) / its init std) (the authors')

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__(config)
        require(not config.rotary, "rotary", "False: bilinear_btt's queries are the inputs themselves (use learned positions)", config.rotary)
        _inputs_as_queries(self, config,
                           BTT(config.d_model, self.n_heads * config.d_model, tt_rank=self.options.btt_rank),
                           self.options.key_norm)

    def qk(self, x: torch.Tensor, positions: int | torch.Tensor = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return _inputs_as_queries_qk(self, x)

    def _structured_projection_flops(self) -> int:
        return self.key_map.flops(1)


class BilinearMLRAttention(FullScoreAttention):
    """``M_h`` multi-level low-rank over the feature axis: level ``l`` splits ``x`` into ``p_l``
    chunks and projects each to ``r_l`` dims for queries and for keys; each level's features get
    a LayerNorm and a learned scale. Per-head score dims: ``sum_l p_l r_l``.

    With ``key_map=True`` the scores are formed as Bilinear BTT's: queries ``x_i``, keys
    ``LN(M_h x_j)`` with a gain per head and dim, ``M_h`` the same MLR matrix (``d`` score dims,
    the same projection FLOPs); the LayerNorm then sees the whole ``M_h x`` rather than each level."""

    kind = "bilinear_mlr"
    examples = {"bilinear_mlr": "bilinear_mlr:4|2|1", "bilinear_mlr_gqa": "bilinear_mlr:4|2:n_kv_heads=2",
                "bilinear_mlr_key_map": "bilinear_mlr:4|2|1:n_blocks=1|2|8:key_map=true",
                "bilinear_mlr_paper": "bilinear_mlr:4|2|1:level_scale=inverse_sqrt_dims:weight_cap=true"}

    @dataclass(frozen=True)
    class Config:
        # rank of each feature chunk, per level (spec: the positional argument, or ranks=)
        feature_ranks: tuple[int, ...] | None = positional(None, aliases=("ranks",))
        n_blocks: tuple[int, ...] | None = None  # feature chunks per level; None: 2^(l-1)
        key_map: bool = False  # queries x and keys LN(M_h x), as bilinear_btt
        # per-level score scales: "learned" gains starting at 1 under the global scale
        # (1/sqrt(sum_l p_l r_l) with attn_scale=sp); "inverse_sqrt_dims" a fixed 1/sqrt(p_l r_l)
        # per level and no global scale (the paper authors')
        level_scale: str = "learned"
        weight_cap: bool = False  # each weight used as W / max(1, RMS(W) / its init std) (the authors')

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__(config)
        require(not config.rotary, "rotary", "False: bilinear_mlr scores features, not rotated positions (use learned positions)", config.rotary)
        d = config.d_model
        ranks = self.options.feature_ranks or (max(self.head_dim // 2, 1), max(self.head_dim // 4, 1),
                                               max(self.head_dim // 8, 1))
        n_blocks = self.options.n_blocks or tuple(2**level for level in range(len(ranks)))
        require(all(isinstance(r, int) and r > 0 for r in ranks), "feature_ranks", "positive integers", ranks)
        require(len(n_blocks) == len(ranks), "n_blocks", f"one chunk count per level ({len(ranks)} levels)", n_blocks)
        for p in n_blocks:
            require(isinstance(p, int) and p > 0 and d % p == 0, "n_blocks", f"positive divisors of d_model={d}", n_blocks)
        self.ranks, self.n_blocks = tuple(ranks), tuple(n_blocks)
        if self.options.key_map:
            require(self.options.level_scale == "learned", "level_scale",
                    "'learned' with key_map=true (the keys' LayerNorm sees the whole M_h x, not levels)",
                    self.options.level_scale)
            _inputs_as_queries(self, config, MLR(d, self.n_heads * d, ranks, n_blocks, n_stacks=self.n_heads))
            return
        self.q_maps = nn.ModuleList(BlockDiag(d, p * self.n_heads * r, n_blocks=p) for p, r in zip(n_blocks, ranks))
        self.k_maps = nn.ModuleList(BlockDiag(d, p * self.n_kv_heads * r, n_blocks=p) for p, r in zip(n_blocks, ranks))
        self.score_dims = sum(p * r for p, r in zip(n_blocks, ranks))
        level_scale = self.options.level_scale
        require(level_scale in ("learned", "inverse_sqrt_dims"), "level_scale", "'learned' or 'inverse_sqrt_dims'", level_scale)
        # Each level's features are LayerNormed, so 1/sqrt(p_l r_l) gives every level unit-scale
        # logits; the default's learned gains start at 1 under the whole head's 1/sqrt(sum p_l r_l).
        if level_scale == "learned":
            self.level_scale = nn.Parameter(torch.ones(len(ranks)))
            self.scale = default_scale(config.attn_scale, self.score_dims)
        else:
            self.register_buffer("level_scale", torch.tensor([(p * r) ** -0.5 for p, r in zip(n_blocks, ranks)]),
                                 persistent=False)
            self.scale = 1.0

    def _levels(self, maps: nn.ModuleList, x: torch.Tensor, heads: int) -> list[torch.Tensor]:
        b, t, _ = x.shape
        out = []
        for m, p, r in zip(maps, self.n_blocks, self.ranks):
            y = _project(self, m, x).view(b, t, p, heads, r).permute(0, 3, 1, 2, 4).reshape(b, heads, t, p * r)
            out.append(F.layer_norm(y, (p * r,)))
        return out

    def qk(self, x: torch.Tensor, positions: int | torch.Tensor = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if self.options.key_map:
            return _inputs_as_queries_qk(self, x)
        q_levels = self._levels(self.q_maps, x, self.n_heads)
        q = torch.cat([g * ql for g, ql in zip(self.level_scale, q_levels)], dim=-1)
        k = torch.cat(self._levels(self.k_maps, x, self.n_kv_heads), dim=-1)
        return q, k

    def _structured_projection_flops(self) -> int:
        if self.options.key_map:
            return self.key_map.flops(1)
        return sum(m.flops(1) for m in (*self.q_maps, *self.k_maps))
