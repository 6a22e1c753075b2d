"""The transformer backbone every model here shares: positions, pre-LN (or post-norm) blocks, a final norm.

A :class:`Transformer` maps embeddings ``(B, T, D)`` to features ``(B, T, D)``. Its attention comes
from the config, per layer if wanted (``attention="mha,swa:128,swa:128"``), causal for decoders
and bidirectional for encoders. The language model, the in-context regression model and the
forecasters wrap it with their own input and output layers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .._checks import require
from ..attention import (Attention, AttentionConfig, KVCache, StaticKVCache, build_attention, config_from_spec,
                         parse_attention_pattern)
from ..attention.base import bind_padding
from ..attention.segments import Segments, build_segments
from ..matrices.base import Fan, StructuredMatrix

__all__ = ["Block", "MLP", "TokenBatchNorm", "Transformer", "TransformerConfig", "build_norm", "init_gpt2_", "mup_init_",
           "parameter_fans"]


# Attention layers up to this many parameters (64 MB of float32) are built on the CPU by
# TransformerConfig.check_attention; larger ones only on the meta device.
_CPU_CHECK_PARAMETERS = 2**24


@dataclass(frozen=True)
class TransformerConfig:
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    max_seq_len: int = 256
    # an attention spec, or a comma-separated per-layer pattern ("mha,swa:128,swa:128")
    attention: str = "mha"
    n_kv_heads: int | None = None
    positions: str = "learned"  # "learned", "rotary" or "none"
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    # dropout inside attention (on the probabilities for dense kinds, on the output for MLR,
    # whose flash-style paths never hold the probabilities); None: the same as ``dropout``
    attn_dropout: float | None = None
    qk_norm: bool = False
    attn_scale: str = "sp"
    bias: bool = False
    causal: bool = True
    # a LayerNorm on the output; without it the residual stream reaches the head unnormalised, so
    # a linear path runs from the input embeddings to the output (forecasters want that)
    final_norm: bool = True
    # "layer" (LayerNorm) or "batch" (BatchNorm over batch and positions, PatchTST's choice for
    # time series; encoders only: its batch statistics would mix a causal model's future into its past)
    norm: str = "layer"
    # True: x + f(norm(x)) (pre-LN, GPT-2); False: norm(x + f(x)) (post-LN, the original transformer)
    prenorm: bool = True
    # std of every structured-matrix factor at init (the bilinear kinds' score maps), as for the dense
    # weights; None keeps each matrix's own variance-preserving init (see init_gpt2_)
    structured_std: float | None = 0.02
    # muP's initialisation and read-out (see mup_init_) relative to a model of this width; the
    # learning rates are optim.mup's. None: the standard parametrisation
    mup_base_width: int | None = None

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "max_seq_len"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, name, "a positive integer", value)
        require(self.norm in ("layer", "batch"), "norm", "'layer' or 'batch'", self.norm)
        require(self.norm == "layer" or not self.causal, "norm", "'layer' for a causal model", self.norm)
        require(self.positions in ("learned", "rotary", "none"), "positions", "'learned', 'rotary' or 'none'", self.positions)
        require(self.mlp_ratio > 0, "mlp_ratio", "a positive number", self.mlp_ratio)
        require(self.structured_std is None or self.structured_std > 0, "structured_std", "None or a positive number",
                self.structured_std)
        if self.mup_base_width is not None:
            head_dim = self.d_model // self.n_heads
            require(isinstance(self.mup_base_width, int) and self.mup_base_width > 0 and self.mup_base_width % head_dim == 0,
                    "mup_base_width", f"None or a positive multiple of the head dim {head_dim} (the base model keeps it)",
                    self.mup_base_width)

    def at_width(self, d_model: int) -> TransformerConfig:
        """This config at width ``d_model``, as muP widens a model: the head dim kept (heads, and
        key/value heads, in proportion), no muP of its own (the base model of :func:`mup_init_`)."""
        heads = d_model // (self.d_model // self.n_heads)
        kv = None if self.n_kv_heads is None else max(1, self.n_kv_heads * heads // self.n_heads)
        return dataclasses.replace(self, d_model=d_model, n_heads=heads, n_kv_heads=kv, mup_base_width=None)

    def attention_configs(self, distinct: bool = False) -> list[AttentionConfig]:
        """One validated :class:`AttentionConfig` per layer (``distinct``: one per entry of the
        pattern, however many layers repeat it)."""
        shared = dict(
            d_model=self.d_model, n_heads=self.n_heads, max_seq_len=self.max_seq_len, n_kv_heads=self.n_kv_heads,
            dropout=self.dropout if self.attn_dropout is None else self.attn_dropout, qk_norm=self.qk_norm, attn_scale=self.attn_scale, bias=self.bias,
            rotary=self.positions == "rotary", causal=self.causal,
        )
        n = min(self.n_layers, len(self.attention.split(","))) if distinct else self.n_layers
        return [config_from_spec(spec, **shared) for spec in parse_attention_pattern(self.attention, n)]

    def check_attention(self) -> None:
        """Raise ``ValueError("model.attention=...: <the layer's one-line message>")`` for an
        unknown kind, a malformed spec or ranks that do not fit the head dimension: each distinct
        layer configuration is built once on the meta device (nothing allocated, whatever the
        sizes), and once more on the CPU when it is small (see the comment there)."""
        seen: list[AttentionConfig] = []
        try:
            for attention in self.attention_configs(distinct=True):
                if attention not in seen:
                    seen.append(attention)
                    try:
                        with torch.device("meta"):
                            size = sum(p.numel() for p in build_attention(attention).parameters())
                    except RuntimeError as e:  # sizes whose byte counts overflow even on the meta device
                        raise ValueError(f"a layer of d_model={self.d_model}, n_heads={self.n_heads}, max_seq_len="
                                         f"{self.max_seq_len} is too large to build ({str(e).splitlines()[0]})") from None
                    # Small layers are built again on the CPU, drawing their random weights: the
                    # experiments rebuild their config after seeding (the vocabulary or channels
                    # come from the data), so these draws are part of every seeded run's stream,
                    # and the runs in docs/ were made with them.
                    if size <= _CPU_CHECK_PARAMETERS:
                        build_attention(attention)
        except ValueError as e:
            raise ValueError(f"model.attention={self.attention!r}: {e}") from None

    def parameter_lower_bound(self) -> int:
        """A lower bound on the parameters this config builds, from the sizes alone: the MLPs'
        weights and the learned positions (what a memory check can refuse before building anything)."""
        hidden = int(self.mlp_ratio * self.d_model)
        positions = self.max_seq_len * self.d_model if self.positions == "learned" else 0
        return self.n_layers * 2 * self.d_model * hidden + positions

    def saved_floats_per_position(self, activation_checkpointing: bool = False) -> int:
        """A lower bound on the floats the backward pass keeps per position: each block's input
        and its MLP's hidden layer; with ``activation_checkpointing``, each block's input and one
        block's hidden layer, recomputed in its turn."""
        hidden = int(self.mlp_ratio * self.d_model)
        if activation_checkpointing:
            return self.n_layers * self.d_model + self.d_model + hidden
        return self.n_layers * (self.d_model + hidden)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class MLP(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        hidden = int(config.mlp_ratio * config.d_model)
        self.up = nn.Linear(config.d_model, hidden, bias=config.bias)
        self.down = nn.Linear(hidden, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class TokenBatchNorm(nn.BatchNorm1d):
    """BatchNorm1d over the features of ``(B, T, D)`` tokens: statistics over batch and positions."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


def build_norm(config: TransformerConfig) -> nn.Module:
    return TokenBatchNorm(config.d_model) if config.norm == "batch" else nn.LayerNorm(config.d_model)


class Block(nn.Module):
    def __init__(self, config: TransformerConfig, attention: AttentionConfig) -> None:
        super().__init__()
        self.prenorm = config.prenorm
        self.ln_attn = build_norm(config)
        self.attn: Attention = build_attention(attention)
        self.ln_mlp = build_norm(config)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, segments: Segments | None = None) -> torch.Tensor:
        if self.prenorm:
            x = x + self.drop(self.attn(self.ln_attn(x), cache, segments=segments))
            return x + self.drop(self.mlp(self.ln_mlp(x)))
        x = self.ln_attn(x + self.drop(self.attn(x, cache, segments=segments)))
        return self.ln_mlp(x + self.drop(self.mlp(x)))


class Transformer(nn.Module):
    """Learned positions (if configured), the blocks and a final LayerNorm (unless
    ``final_norm=False``): ``(B, T, D) -> (B, T, D)``.

    ``activation_checkpointing = True`` (``run.activation_checkpointing`` in training) keeps only
    each block's input for the backward pass and computes the block again there: the activations
    of one block at a time instead of all of them, for one more forward pass of compute. It applies
    where gradients are recorded and no cache is filled."""

    activation_checkpointing: bool = False

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model) if config.positions == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, a) for a in config.attention_configs())
        self.ln_f = build_norm(config) if config.final_norm else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        caches: list[KVCache] | None = None,
        attention_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Features of embeddings ``x: (B, T, D)``; with ``caches`` they continue the cached sequence.

        ``attention_mask`` ``(B, T)`` (1 or True for real tokens, left or right padding) and
        ``document_ids`` ``(B, T)`` (packed documents, non-decreasing) make each sequence of a row
        computed exactly as if it ran alone: it attends only within itself and its positions start
        at its first token. Features at padding are zero. With ``caches``, ``attention_mask``
        covers the cached and the new tokens ``(B, cached + T)``, left-padded; the first call
        fixes the padding and later calls may leave it out.
        """
        require(x.dim() == 3 and x.shape[-1] == self.config.d_model, "x",
                f"a (batch, seq_len, d_model={self.config.d_model}) tensor", tuple(x.shape))
        if caches is not None:
            n = len(self.blocks)
            require(isinstance(caches, (list, tuple)) and len(caches) == n, "caches",
                    f"a list of {n} caches (one per layer, from new_caches())",
                    len(caches) if isinstance(caches, (list, tuple)) else type(caches).__name__)
            if isinstance(caches[0], StaticKVCache):
                return self._forward_static(x, caches, attention_mask, document_ids)
        start = caches[0].length if caches else 0
        b, t = x.shape[:2]
        require(start + t <= self.config.max_seq_len, "seq_len",
                f"cached + new positions <= max_seq_len={self.config.max_seq_len}", start + t)
        segments = None
        if caches:
            require(document_ids is None, "document_ids",
                    "None with caches (a cache holds one sequence per row; pad rows with attention_mask)", "ids")
            if attention_mask is not None:
                bind_padding(caches, attention_mask, b, start + t, x.device)
            padding = caches[0].padding
            if padding is not None:
                segments = padding.segments(start, start + t)
            positions = torch.arange(start, start + t, device=x.device) if segments is None else segments.positions
        else:
            segments = build_segments(attention_mask, document_ids, b, t, x.device)
            positions = torch.arange(t, device=x.device) if segments is None else segments.positions
        require(segments is None or self.config.norm == "layer", "attention_mask",
                "None with norm='batch' (batch statistics mix the tokens of every sequence in the batch)", "a mask")
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)
        x = self.drop(x)
        recompute = self.activation_checkpointing and not caches and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            if recompute:  # dropout draws the same masks again: checkpoint restores the RNG state
                x = checkpoint(block, x, None, segments, use_reentrant=False)
            else:
                x = block(x, caches[i] if caches else None, None if caches else segments)
        x = self.ln_f(x)
        if segments is None or (caches and not caches[0].padding.padded(start)):
            return x
        return segments.zero_padding(x)

    def _forward_static(self, x: torch.Tensor, caches: list[StaticKVCache], attention_mask: torch.Tensor | None,
                        document_ids: torch.Tensor | None) -> torch.Tensor:
        """:meth:`forward` with static caches: the prompt through their growing caches, which each
        layer then moves into its static buffers; after it, one token per row, its position read
        on the device (one graph for every step)."""
        require(all(isinstance(c, StaticKVCache) for c in caches), "caches", "all static or all growing", "a mix")
        if not caches[0].prefilled:
            out = self.forward(x, [c.growing for c in caches], attention_mask, document_ids)
            for block, cache in zip(self.blocks, caches):
                block.attn.fill_static(cache)
            return out
        require(x.shape[1] == 1 and attention_mask is None and document_ids is None, "x",
                "one token per row after the prompt, with no mask (static caches decode token by token)",
                tuple(x.shape))
        if self.pos_emb is not None:
            x = x + self.pos_emb((caches[0].slot - caches[0].offsets)[:, None])
        x = self.drop(x)
        for block, cache in zip(self.blocks, caches):
            x = block(x, cache)
        return self.ln_f(x)

    def new_caches(self, batch_size: int, static: bool = False) -> list[KVCache] | list[StaticKVCache]:
        """One cache per layer; ``static``: :class:`StaticKVCache` (see :meth:`Attention.new_cache`)."""
        return [block.attn.new_cache(batch_size, static=static) for block in self.blocks]

    def forward_flops_per_position(self, seq_len: int | None = None) -> float:
        """Multiply-adds per position of one forward over a ``seq_len``-long sequence: every
        attention layer's own cost (projections, scores of the pairs it attends, mixing values)
        and the MLPs. Position look-ups, norms and softmax are not counted."""
        t = seq_len or self.config.max_seq_len
        attention = sum(block.attn.cost(t).total_flops for block in self.blocks) / t
        mlp = sum(block.mlp.up.weight.numel() + block.mlp.down.weight.numel() for block in self.blocks)
        return attention + mlp


def init_gpt2_(model: nn.Module, config: TransformerConfig) -> None:
    """GPT-2 init: N(0, 0.02) for embeddings and dense weights, residual outputs (attention output
    and MLP down projections) scaled by ``1/sqrt(2 n_layers)``.

    Structured-matrix factors get N(0, ``config.structured_std``) too. In the bilinear kinds a
    LayerNorm follows every structured map, so the map's scale does not change the forward pass;
    it sets how far an Adam step turns it (about ``lr`` per entry), and at the matrices' own
    variance-preserving init (entries 0.35-0.7 at small widths) their score maps moved 20-30x
    more slowly than the dense 0.02 projections of standard attention (docs/results/icl.md).
    ``structured_std=None`` keeps that own init.
    """
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02
            if name.endswith(("out_proj", "mlp.down")):
                std /= math.sqrt(2 * config.n_layers)
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, StructuredMatrix) and config.structured_std is not None:
            for factor in module.parameter_fans():
                nn.init.normal_(module.get_parameter(factor), std=config.structured_std)


def mup_init_(model: nn.Module, config: TransformerConfig, build: Callable[[TransformerConfig], nn.Module],
              readout: str | None = None) -> None:
    """muP's initialisation (Yang et al. 2022, Tensor Programs V, Table 3), in place, relative to
    ``build(config.at_width(config.mup_base_width))``, the same model at the base width (built on
    the meta device: only its fans are read):
    each matrix-like parameter's standard deviation is multiplied by ``sqrt(base fan_in / fan_in)``
    (variance proportional to ``1/fan_in``: hidden weights, whose fan-in grows with the width;
    input weights and embeddings, whose fan-in does not, are unchanged), and the ``readout``
    parameter's (an untied output layer) by ``base fan_in / fan_in`` (variance proportional to
    ``1/fan_in^2``). At the base width every factor is 1: the model is the standard one. A tied
    read-out is the embedding (unchanged); its logits take the output multiplier instead
    (``GPT.forward``)."""
    assert config.mup_base_width is not None
    with torch.device("meta"):
        base = build(config.at_width(config.mup_base_width))
    fans, base_fans = parameter_fans(model), parameter_fans(base)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in fans:
                ratio = base_fans[name].fan_in / fans[name].fan_in
                p.mul_(ratio if name == readout else math.sqrt(ratio))


def parameter_fans(model: nn.Module) -> dict[str, Fan]:
    """Fan-in/fan-out of every matrix-like parameter of ``model`` (for muP), by full parameter
    name: dense layers from their shape, structured matrices from their own declaration,
    embeddings as maps from their table size. Vector-like parameters (norms, biases, scales) are
    absent."""
    fans: dict[str, Fan] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, StructuredMatrix):
            fans.update({prefix + k: f for k, f in module.parameter_fans().items()})
        elif isinstance(module, nn.Linear):
            fans[prefix + "weight"] = Fan(module.in_features, module.out_features)
        elif isinstance(module, nn.Embedding):
            fans[prefix + "weight"] = Fan(module.num_embeddings, module.embedding_dim)
    names = {n for n, _ in model.named_parameters()}
    return {k: v for k, v in fans.items() if k in names}
