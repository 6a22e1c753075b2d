"""Forecasters over the shared :class:`Transformer` backbone (docs/design.md, 'Long-range
time-series forecasting').

Both map a lookback window ``x: (B, L, C)`` to a forecast ``(B, H, C)``, with a bidirectional
encoder whose attention kind (``mha``, ``swa:<w>``, ``mlr:<ranks>``, ``bilinear_mlr:<ranks>``,
``bilinear_btt:<rank>``, per layer if wanted) comes from the config:

- ``family='point'`` (:class:`PointForecaster`, the authors' setting): one token per time step
  (all channels of that step embedded together), 2 layers of width 512 with 8 heads by default;
  a linear map over time (``L -> H`` tokens) and one over features (``D -> C``) read the forecast
  off the encoder's features.
- ``family='patch'`` (:class:`PatchForecaster`, PatchTST-style): channel-independent -- every
  channel is its own sequence of patches (``patch_len`` steps every ``stride`` steps, the end
  padded with ``stride`` copies of the last value, so ``N = (L - patch_len) / stride + 2``
  tokens), so MLR attention's levels are nested groups of patches; a flatten head maps the
  ``N x D`` features of a channel to its ``H`` values. With ``linear_skip`` a linear map over time
  (``L -> H``, shared by the channels) of the normalised series is added to the head's output
  (RLinear-style), and the encoder starts from zero and learns what the linear map misses.

Neither family has a LayerNorm after the encoder by default (``final_norm=False``): the head
reads the residual stream, so the model always holds a linear forecaster (embedding -> head) to
which attention and the MLPs add; a final LayerNorm would normalise every token and lose it.

Reversible instance normalisation (:class:`RevIN`, on by default in both) takes each window's
per-channel mean and standard deviation out before the model and puts them back after, so the
model sees level- and scale-free inputs (the distribution shift between ETT's splits is large).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._checks import check_positive_int, require
from ..matrices.base import Fan
from .transformer import Transformer, TransformerConfig, init_gpt2_, parameter_fans

__all__ = [
    "ForecasterConfig",
    "PatchForecaster",
    "PointForecaster",
    "RevIN",
    "build_forecaster",
    "n_patches",
    "patchify",
]


def n_patches(lookback: int, patch_len: int, stride: int) -> int:
    """Patches of a ``lookback``-step series padded at the end with ``stride`` copies of its last value."""
    return (lookback + stride - patch_len) // stride + 1


def patchify(x: torch.Tensor, patch_len: int, stride: int) -> torch.Tensor:
    """``(..., L) -> (..., N, patch_len)``: patch ``n`` is ``x_pad[n * stride : n * stride + patch_len]``
    where ``x_pad`` is ``x`` followed by ``stride`` copies of its last value (PatchTST's end padding)."""
    x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], stride)], dim=-1)
    return x.unfold(-1, patch_len, stride)


class RevIN(nn.Module):
    """Reversible instance normalisation (Kim et al., 2022) over the time axis of ``(B, T, C)``:
    ``normalize`` returns ``(x - mean) / std * weight + bias`` and the statistics, ``denormalize``
    inverts it on the forecast. ``weight`` starts at 1 and ``bias`` at 0 (learned if ``affine``)."""

    def __init__(self, n_channels: int, affine: bool = True, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n_channels)) if affine else None
        self.bias = nn.Parameter(torch.zeros(n_channels)) if affine else None

    def normalize(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        mean = x.mean(dim=1, keepdim=True).detach()
        std = torch.sqrt(x.var(dim=1, keepdim=True, unbiased=False) + self.eps).detach()
        x = (x - mean) / std
        if self.weight is not None:
            x = x * self.weight + self.bias
        return x, (mean, std)

    def denormalize(self, y: torch.Tensor, stats: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        mean, std = stats
        if self.weight is not None:
            y = (y - self.bias) / (self.weight + self.eps**2)  # eps^2 keeps a weight near 0 finite
        return y * std + mean


def _encoder() -> TransformerConfig:
    # the encoder's own defaults (its context and causality are derived: see backbone_config)
    return TransformerConfig(n_layers=3, d_model=64, n_heads=4, dropout=0.2, final_norm=False, causal=False)


@dataclass(frozen=True)
class ForecasterConfig:
    """A forecaster: its encoder, ``backbone`` (a :class:`TransformerConfig`; its keys are also
    set flat, ``model.d_model=64``), and what is a forecaster's own. ``n_channels``, ``lookback``
    and ``horizon`` come from the data (the experiment fills them in). The encoder's context is
    the token count and it is bidirectional, so ``backbone.max_seq_len`` and ``backbone.causal``
    are derived, not set."""

    family: str = "patch"  # "point" (a token per time step) or "patch" (PatchTST-style)
    n_channels: int = 7
    lookback: int = 512
    horizon: int = 96
    # the encoder: an attention spec (or per-layer pattern), positions ("learned", "rotary" or
    # "none"; bilinear kinds need learned or none), norm "layer" or "batch" (PatchTST), prenorm
    # False for post-norm blocks (PatchTST), final_norm False so that the head sees the residual
    # stream (a linear forecaster, embedding -> head, plus what attention and the MLPs add)
    backbone: TransformerConfig = field(default_factory=_encoder)
    head_dropout: float = 0.0  # before the output head
    patch_len: int = 16  # patch family only
    stride: int = 8  # patch family only
    # patch family: add a linear map over time, Linear(L -> H) shared by the channels, of each
    # normalised channel (RLinear-style); the encoder's head starts at zero and learns the residual
    linear_skip: bool = False
    # False: the skip keeps its starting weights (the ridge fit) and only the encoder learns
    skip_trainable: bool = True
    revin: bool = True
    revin_affine: bool = True

    derived_fields = ("max_seq_len", "causal")  # of the backbone: set from the token count

    def __post_init__(self) -> None:
        require(self.family in ("point", "patch"), "model.family", "'point' or 'patch'", self.family)
        for name in ("n_channels", "lookback", "horizon", "patch_len", "stride"):
            check_positive_int(getattr(self, name), f"model.{name}")
        require(self.backbone.attn_dropout is None or 0 <= self.backbone.attn_dropout < 1, "model.attn_dropout",
                "a probability in [0, 1), or null for model.dropout", self.backbone.attn_dropout)
        require(0 <= self.head_dropout < 1, "model.head_dropout", "a probability in [0, 1)", self.head_dropout)
        require(self.backbone.mup_base_width is None, "model.mup_base_width",
                "null (muP's initialisation is for the language and regression models; a forecaster's heads "
                "read every patch, their fan-in is not the width)", self.backbone.mup_base_width)
        if self.family == "patch":
            require(self.patch_len <= self.lookback, "model.patch_len", f"at most the lookback {self.lookback}", self.patch_len)
        require(not self.linear_skip or self.family == "patch", "model.linear_skip", "false for the point family", self.linear_skip)
        require(self.skip_trainable or self.linear_skip, "model.skip_trainable", "true unless model.linear_skip is true",
                self.skip_trainable)

    @property
    def n_tokens(self) -> int:
        """The encoder's sequence length: ``lookback`` time steps, or the number of patches."""
        return self.lookback if self.family == "point" else n_patches(self.lookback, self.patch_len, self.stride)

    @property
    def tokens_per_example(self) -> int:
        """Encoder positions per lookback window: one sequence (point) or one per channel (patch)."""
        return self.n_tokens if self.family == "point" else self.n_channels * self.n_tokens

    def backbone_config(self) -> TransformerConfig:
        """The bidirectional encoder; its context is exactly the token count, so MLR attention's
        default block sizes are ``n_tokens / 2^(l-1)``."""
        return dataclasses.replace(self.backbone, max_seq_len=self.n_tokens, causal=False)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Forecaster(nn.Module, ABC):
    """What both families share: RevIN around ``_forecast``, the backbone, accounting, muP fans."""

    def __init__(self, config: ForecasterConfig) -> None:
        super().__init__()
        self.config = config
        self.revin = RevIN(config.n_channels, config.revin_affine) if config.revin else None
        self.backbone = Transformer(config.backbone_config())
        init_gpt2_(self.backbone, self.backbone.config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The forecast ``(B, H, C)`` of lookback windows ``x: (B, L, C)``."""
        c = self.config
        require(x.dim() == 3 and x.shape[1:] == (c.lookback, c.n_channels), "x",
                f"a (batch, lookback={c.lookback}, channels={c.n_channels}) tensor", tuple(x.shape))
        if self.revin is None:
            return self._forecast(x)
        x, stats = self.revin.normalize(x)
        return self.revin.denormalize(self._forecast(x), stats)

    @abstractmethod
    def _forecast(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, L, C) -> (B, H, C)`` on normalised inputs."""

    @abstractmethod
    def _io_flops_per_example(self) -> float:
        """Multiply-adds of the input embedding and the output head for one window."""

    def forward_flops_per_token(self) -> float:
        """Multiply-adds of one forward per encoder position: the backbone
        (:meth:`Transformer.forward_flops_per_position`) plus the input and output maps' share."""
        c = self.config
        return self.backbone.forward_flops_per_position(c.n_tokens) + self._io_flops_per_example() / c.tokens_per_example

    def training_flops_per_token(self, seq_len: int | None = None) -> float:
        """2 FLOPs per multiply-add, times 3 for forward and backward; the encoder's length is the
        config's (``seq_len``, if given, must equal it)."""
        n_tokens = self.config.n_tokens
        require(seq_len is None or seq_len == n_tokens, "seq_len", f"None or the encoder's {n_tokens} positions",
                seq_len)
        return 6 * self.forward_flops_per_token()

    def parameter_fans(self) -> dict[str, Fan]:
        return parameter_fans(self)


class PointForecaster(_Forecaster):
    """One token per time step: ``Linear(C -> D)``, the encoder over the ``L`` steps, then
    ``Linear(L -> H)`` over time and ``Linear(D -> C)`` over features."""

    def __init__(self, config: ForecasterConfig) -> None:
        super().__init__(config)
        self.embed = nn.Linear(config.n_channels, config.backbone.d_model)
        self.time_proj = nn.Linear(config.lookback, config.horizon)
        self.head_drop = nn.Dropout(config.head_dropout)
        self.out = nn.Linear(config.backbone.d_model, config.n_channels)

    def _forecast(self, x: torch.Tensor) -> torch.Tensor:
        h = self.backbone(self.embed(x))  # (B, L, D)
        h = self.time_proj(h.transpose(1, 2)).transpose(1, 2)  # (B, H, D)
        return self.out(self.head_drop(h))

    def _io_flops_per_example(self) -> float:
        c = self.config
        return c.lookback * c.n_channels * c.backbone.d_model + c.backbone.d_model * c.lookback * c.horizon + c.horizon * c.backbone.d_model * c.n_channels


class PatchForecaster(_Forecaster):
    """Channel-independent patches: each channel's series is cut into ``N`` patches, embedded by
    ``Linear(patch_len -> D)``, encoded on its own, and its ``N x D`` features flattened into
    ``Linear(N * D -> H)``. Nothing mixes channels, so a channel's forecast depends on its own
    history only."""

    def __init__(self, config: ForecasterConfig) -> None:
        super().__init__(config)
        self.embed = nn.Linear(config.patch_len, config.backbone.d_model)
        self.head_drop = nn.Dropout(config.head_dropout)
        self.head = nn.Linear(config.n_tokens * config.backbone.d_model, config.horizon)
        self.skip = nn.Linear(config.lookback, config.horizon) if config.linear_skip else None
        if self.skip is not None:  # start as the linear forecaster; the encoder adds to it
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)
            self.skip.requires_grad_(config.skip_trainable)

    def _forecast(self, x: torch.Tensor) -> torch.Tensor:
        b, _, ch = x.shape
        series = x.transpose(1, 2).flatten(0, 1)  # (B * C, L): one row per channel
        patches = patchify(series, self.config.patch_len, self.config.stride)  # (B * C, N, P)
        h = self.backbone(self.embed(patches))  # (B * C, N, D)
        y = self.head(self.head_drop(h.flatten(1)))  # (B * C, H)
        if self.skip is not None:
            y = y + self.skip(series)
        return y.view(b, ch, -1).transpose(1, 2)

    def _io_flops_per_example(self) -> float:
        c = self.config
        skip = c.lookback * c.horizon if c.linear_skip else 0
        return c.n_channels * (c.n_tokens * c.patch_len * c.backbone.d_model + c.n_tokens * c.backbone.d_model * c.horizon + skip)


def build_forecaster(config: ForecasterConfig) -> PointForecaster | PatchForecaster:
    return PointForecaster(config) if config.family == "point" else PatchForecaster(config)
