"""Typed configuration of an attention layer: the settings every kind shares, and the helpers
with which each kind declares its own options (its ``Config``; see :mod:`.kinds` for the spec
strings read from those declarations)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from .._checks import fail, require


@dataclass(frozen=True)
class AttentionConfig:
    """What every attention kind shares (the layer's shape, norms, scale, dropout, positions), the
    kind's name, and ``options``: an instance of the kind's own ``Config`` (``MLRAttention.Config``
    and so on; ``None``: its defaults), which holds only that kind's settings."""

    d_model: int
    n_heads: int
    max_seq_len: int
    kind: str = "mha"
    n_kv_heads: int | None = None  # GQA; None means n_heads
    head_dim: int | None = None  # None means d_model // n_heads
    causal: bool = True
    dropout: float = 0.0
    qk_norm: bool = False
    # "sp": 1/sqrt(d), "mup": 1/d, "mup8": 8/d (the paper authors' muP logits), d = score dims per head
    attn_scale: str = "sp"
    bias: bool = False
    # rotary position embedding on queries and keys (kinds with query/key projections)
    rotary: bool = False
    rotary_base: float = 10000.0
    options: Any = None

    def __post_init__(self) -> None:
        for name in ("d_model", "n_heads", "max_seq_len"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value > 0, name, "a positive integer",
                    value)
        check_flags(self)
        require(self.attn_scale in ("sp", "mup", "mup8"), "attn_scale", "'sp' (1/sqrt(d)), 'mup' (1/d) or 'mup8' (8/d)",
                self.attn_scale)
        require(0.0 <= self.dropout < 1.0, "dropout", "a probability in [0, 1)", self.dropout)
        require(math.isfinite(self.rotary_base) and self.rotary_base > 1, "rotary_base",
                "a finite number above 1 (the rotary frequencies are its powers)", self.rotary_base)
        if self.head_dim is None:
            require(
                self.d_model % self.n_heads == 0,
                "n_heads",
                f"a divisor of d_model={self.d_model} (or set head_dim)",
                self.n_heads,
            )
        else:
            require(self.head_dim > 0, "head_dim", "a positive integer", self.head_dim)
        kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        require(
            isinstance(kv, int) and kv > 0 and self.n_heads % kv == 0,
            "n_kv_heads",
            f"a positive divisor of n_heads={self.n_heads}",
            self.n_kv_heads,
        )

    def replace(self, **changes: Any) -> AttentionConfig:
        return dataclasses.replace(self, **changes)


def check_flags(config: Any) -> None:
    """One-line ``ValueError`` naming the first field of dataclass ``config`` declared ``bool`` whose
    value is not a bool: ``causal="false"`` is a true string, and a layer would silently run causal."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.type in ("bool", bool) and not isinstance(value, bool):
            fail(f.name, "True or False", value)


def positional(default: Any, aliases: tuple[str, ...] = ()) -> Any:
    """Declare a kind's option that is also its spec string's first, unnamed argument
    (``swa:128`` sets ``window``); ``aliases``: other names the spec may give it."""
    return dataclasses.field(default=default, metadata={"positional": True, "aliases": aliases})


# The settings of AttentionConfig that a spec string may set (the rest the model sets).
SPEC_SHARED = ("n_kv_heads", "head_dim", "causal", "dropout", "qk_norm", "attn_scale", "bias", "rotary",
               "rotary_base")


def default_scale(convention: str, dims: int) -> float:
    """Logit scale for ``dims`` score dimensions: SP ``1/sqrt(dims)``, muP ``1/dims``, or the paper
    authors' muP ``8/dims`` (equal to SP's at 64 dims)."""
    if convention == "sp":
        return 1.0 / math.sqrt(dims)
    return (8.0 if convention == "mup8" else 1.0) / dims


def parse_levels(text: str) -> tuple[int, ...]:
    """``'16|8|4'`` or ``'16+8+4'`` -> ``(16, 8, 4)``; ``()`` unless every part is a positive integer."""
    try:
        values = tuple(int(t) for t in re.split(r"[|+]", text))
    except ValueError:
        return ()
    return values if all(v > 0 for v in values) else ()


__all__ = ["AttentionConfig", "SPEC_SHARED", "default_scale", "parse_levels", "positional"]
