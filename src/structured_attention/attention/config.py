"""Typed configuration of an attention layer, and the spec strings that select one.

A spec string names a kind and its main argument, e.g. ``mha``, ``swa:128``, ``global_swa:32|32``,
``mlr:32|8|6|4|4|4|4|2``, ``bilinear_mlr:16|8|4``, ``bilinear_btt:2``; further settings follow as
``:key=value`` (``mlr:48|16:block_sizes=1024|64:depth_normalize=true``). A per-layer pattern is a
comma-separated list of specs repeated over the layers: ``mha,swa:128,swa:128``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass
from typing import Any

from .._checks import parse_typed, require

# The main (positional) argument of each kind's spec string.
_POSITIONAL_FIELD = {
    "swa": "window",
    "global_swa": "split",
    "mlr": "ranks",
    "bilinear_mlr": "ranks",
    "bilinear_btt": "btt_rank",
}


@dataclass(frozen=True)
class AttentionConfig:
    """Everything an attention layer needs; fields that a kind does not use are ignored by it."""

    d_model: int
    n_heads: int
    max_seq_len: int
    kind: str = "mha"
    n_kv_heads: int | None = None  # GQA; None means n_heads
    head_dim: int | None = None  # None means d_model // n_heads
    causal: bool = True
    dropout: float = 0.0
    qk_norm: bool = False
    attn_scale: str = "sp"  # "sp": 1/sqrt(d), "mup": 1/d, d = score dims per head
    bias: bool = False
    # rotary position embedding on queries and keys (kinds with query/key projections)
    rotary: bool = False
    rotary_base: float = 10000.0
    # swa, global_swa: query i sees keys i - window <= j <= i
    window: int = 128
    # global_swa: head dims split (global, windowed); None means half and half
    split: tuple[int, ...] | None = None
    # mlr: ranks per level (sum = head_dim); bilinear_mlr: rank per feature chunk and level
    ranks: tuple[int, ...] | None = None
    # mlr: block size per level, default max_seq_len / 2^(l-1)
    block_sizes: tuple[int, ...] | None = None
    depth_normalize: bool = False
    # bilinear_mlr: feature chunks per level, default 2^(l-1)
    n_blocks: tuple[int, ...] | None = None
    # bilinear_mlr: queries x and keys LN(M_h x), as bilinear_btt, instead of per-level queries and keys
    key_map: bool = False
    # bilinear_btt: TT-rank of the BTT matrix
    btt_rank: int = 1

    def __post_init__(self) -> None:
        for name in ("d_model", "n_heads", "max_seq_len"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, name, "a positive integer", value)
        require(self.attn_scale in ("sp", "mup"), "attn_scale", "'sp' (1/sqrt(d)) or 'mup' (1/d)", self.attn_scale)
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
        kv = self.kv_heads
        require(
            isinstance(kv, int) and kv > 0 and self.n_heads % kv == 0,
            "n_kv_heads",
            f"a positive divisor of n_heads={self.n_heads}",
            self.n_kv_heads,
        )

    @property
    def dim_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def replace(self, **changes: Any) -> AttentionConfig:
        return dataclasses.replace(self, **changes)


def default_scale(convention: str, dims: int) -> float:
    """Logit scale for ``dims`` score dimensions: SP ``1/sqrt(dims)`` or muP ``1/dims``."""
    return 1.0 / dims if convention == "mup" else 1.0 / math.sqrt(dims)


_TUPLE_FIELDS = {"split", "ranks", "block_sizes", "n_blocks"}
_FIELDS = {f.name for f in dataclasses.fields(AttentionConfig)}
_SHARED = ("d_model", "n_heads", "max_seq_len", "kind")  # set by the model, not by a spec


def _parse_field(key: str, text: str, spec: str) -> Any:
    """A spec value parsed by its field's declared type: positive integers separated by ``|`` or
    ``+`` (which needs no shell quoting) for the per-level fields, else bool (true/false/1/0), int,
    float or str."""
    if key in _TUPLE_FIELDS:
        values = parse_levels(text)
        require(bool(values), key, f"positive integers separated by '|' or '+' (in the attention spec {spec!r})", text)
        return values
    return parse_typed(text, typing.get_type_hints(AttentionConfig)[key], key)


def parse_levels(text: str) -> tuple[int, ...]:
    """``'16|8|4'`` or ``'16+8+4'`` -> ``(16, 8, 4)``; ``()`` unless every part is a positive integer."""
    try:
        values = tuple(int(t) for t in re.split(r"[|+]", text))
    except ValueError:
        return ()
    return values if all(v > 0 for v in values) else ()


def parse_attention_spec(spec: str) -> dict[str, Any]:
    """``'mlr:48|16:depth_normalize=true'`` -> ``{'kind': 'mlr', 'ranks': (48, 16), 'depth_normalize': True}``."""
    require(isinstance(spec, str) and spec.strip() != "", "attention spec", "a non-empty string such as 'mlr:48|16'", spec)
    kind, *args = spec.strip().split(":")
    kind = kind.strip().lower()
    out: dict[str, Any] = {"kind": kind}
    for i, arg in enumerate(args):
        if "=" in arg:
            key, text = arg.split("=", 1)
            key = key.strip()
        elif i == 0 and kind in _POSITIONAL_FIELD:
            key, text = _POSITIONAL_FIELD[kind], arg
        else:
            raise ValueError(f"attention spec: expected key=value after the first ':' in {spec!r}, got {arg!r}")
        require(key in _FIELDS and key not in _SHARED, "attention spec key", f"one of {sorted(_FIELDS - set(_SHARED))}",
                key)
        out[key] = _parse_field(key, text.strip(), spec)
    return out


def parse_attention_pattern(pattern: str, n_layers: int) -> list[dict[str, Any]]:
    """A comma-separated list of specs, repeated to cover ``n_layers`` layers."""
    specs = [parse_attention_spec(s) for s in pattern.split(",")]
    return [specs[i % len(specs)] for i in range(n_layers)]


def config_from_spec(spec: str, **base: Any) -> AttentionConfig:
    """An :class:`AttentionConfig` from a spec string and the model's shared settings."""
    return AttentionConfig(**{**base, **parse_attention_spec(spec)})


__all__ = [
    "AttentionConfig",
    "config_from_spec",
    "default_scale",
    "parse_attention_pattern",
    "parse_attention_spec",
    "parse_levels",
]
