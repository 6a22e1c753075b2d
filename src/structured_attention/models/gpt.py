"""A GPT-style decoder whose attention comes from the config, per layer if wanted.

Pre-LayerNorm blocks (attention, then a GELU MLP), learned or rotary positions, optional tied
input/output embeddings, and KV-cache generation through the attention layers' own caches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import require
from ..attention import Attention, AttentionConfig, KVCache, parse_attention_pattern
from ..attention.base import build_attention
from ..matrices.base import Fan, StructuredMatrix


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    max_seq_len: int = 256
    # an attention spec, or a comma-separated per-layer pattern ("mha,swa:128,swa:128")
    attention: str = "mha"
    n_kv_heads: int | None = None
    positions: str = "learned"  # "learned", "rotary" or "none"
    tie_embeddings: bool = True
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    qk_norm: bool = False
    attn_scale: str = "sp"
    bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "max_seq_len"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, name, "a positive integer", value)
        require(self.positions in ("learned", "rotary", "none"), "positions", "'learned', 'rotary' or 'none'", self.positions)
        require(self.mlp_ratio > 0, "mlp_ratio", "a positive number", self.mlp_ratio)

    def attention_configs(self) -> list[AttentionConfig]:
        """One validated :class:`AttentionConfig` per layer."""
        shared = dict(
            d_model=self.d_model, n_heads=self.n_heads, max_seq_len=self.max_seq_len, n_kv_heads=self.n_kv_heads,
            dropout=self.dropout, qk_norm=self.qk_norm, attn_scale=self.attn_scale, bias=self.bias,
            rotary=self.positions == "rotary",
        )
        return [AttentionConfig(**{**shared, **spec}) for spec in parse_attention_pattern(self.attention, self.n_layers)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = int(config.mlp_ratio * config.d_model)
        self.up = nn.Linear(config.d_model, hidden, bias=config.bias)
        self.down = nn.Linear(hidden, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, attention: AttentionConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn: Attention = build_attention(attention)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_attn(x), cache))
        return x + self.drop(self.mlp(self.ln_mlp(x)))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model) if config.positions == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, a) for a in config.attention_configs())
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()
        if config.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) for embeddings and dense weights, residual outputs scaled by
        1/sqrt(2 n_layers); structured matrices keep their own variance-preserving init."""
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = 0.02
                if name.endswith(("out_proj", "mlp.down")):
                    std /= math.sqrt(2 * self.config.n_layers)
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, caches: list[KVCache] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(B, T, vocab)`` of tokens ``idx: (B, T)`` and, given ``targets``, the mean
        cross-entropy in nats. With ``caches`` the tokens continue the cached sequence."""
        require(idx.dim() == 2 and not idx.is_floating_point(), "idx", "a (batch, seq_len) integer tensor", tuple(idx.shape))
        start = caches[0].length if caches else 0
        t = idx.shape[1]
        require(start + t <= self.config.max_seq_len, "seq_len", f"cached + new tokens <= max_seq_len={self.config.max_seq_len}", start + t)
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(start, start + t, device=idx.device))
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            x = block(x, caches[i] if caches else None)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss

    def new_caches(self, batch_size: int) -> list[KVCache]:
        return [block.attn.new_cache(batch_size) for block in self.blocks]

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        on_token: Callable[[torch.Tensor], None] | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` after the prompt ``idx: (B, T)`` with KV-cache decoding;
        ``temperature`` 0 is greedy; ``on_token`` gets each new ``(B,)`` token (for streaming)."""
        require(idx.dim() == 2 and idx.shape[1] >= 1, "prompt", "at least one token", tuple(idx.shape))
        room = self.config.max_seq_len - idx.shape[1]
        require(0 <= max_new_tokens <= room, "max_new_tokens", f"0..{room} (max_seq_len minus the prompt)", max_new_tokens)
        require(temperature >= 0, "temperature", "a non-negative number", temperature)
        require(top_k is None or top_k > 0, "top_k", "a positive integer or None", top_k)
        was_training = self.training
        self.eval()
        caches = self.new_caches(idx.shape[0])
        logits, _ = self(idx, caches=caches)
        out = [idx]
        for _ in range(max_new_tokens):
            step = logits[:, -1].float()
            if temperature == 0:
                token = step.argmax(-1)
            else:
                step = step / temperature
                if top_k is not None:
                    kth = torch.topk(step, min(top_k, step.shape[-1])).values[:, -1:]
                    step = step.masked_fill(step < kth, float("-inf"))
                token = torch.multinomial(torch.softmax(step, -1), 1, generator=generator)[:, 0]
            out.append(token[:, None])
            if on_token is not None:
                on_token(token)
            if len(out) - 1 < max_new_tokens:
                logits, _ = self(token[:, None], caches=caches)
        self.train(was_training)
        return torch.cat(out, dim=1)

    # -- accounting ----------------------------------------------------------------------------
    def forward_flops_per_token(self, seq_len: int | None = None) -> float:
        """Multiply-adds of one forward pass per token of a ``seq_len``-token sequence: every
        attention layer's own cost (projections, scores of the pairs it attends, mixing values),
        the MLPs and the output head. Embedding look-ups, norms and softmax are not counted."""
        t = seq_len or self.config.max_seq_len
        attention = sum(block.attn.cost(t).total_flops for block in self.blocks) / t
        mlp = sum(block.mlp.up.weight.numel() + block.mlp.down.weight.numel() for block in self.blocks)
        return attention + mlp + self.head.weight.numel()

    def training_flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 2 FLOPs per multiply-add, times 3 for forward and backward."""
        return 6 * self.forward_flops_per_token(seq_len)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel() if not self.config.tie_embeddings else 0
            n -= self.pos_emb.weight.numel() if self.pos_emb is not None else 0
        return n

    def parameter_fans(self) -> dict[str, Fan]:
        """Fan-in/fan-out of every matrix-like parameter (for muP), by full parameter name:
        dense layers from their shape, structured matrices from their own declaration, embeddings
        as maps from the vocabulary. Vector-like parameters (norms, biases, scales) are absent."""
        fans: dict[str, Fan] = {}
        for name, module in self.named_modules():
            prefix = f"{name}." if name else ""
            if isinstance(module, StructuredMatrix):
                fans.update({prefix + k: f for k, f in module.parameter_fans().items()})
            elif isinstance(module, nn.Linear):
                fans[prefix + "weight"] = Fan(module.in_features, module.out_features)
            elif isinstance(module, nn.Embedding):
                fans[prefix + "weight"] = Fan(module.num_embeddings, module.embedding_dim)
        names = {n for n, _ in self.named_parameters()}
        return {k: v for k, v in fans.items() if k in names}
