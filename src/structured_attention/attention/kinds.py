"""The attention kinds by name, and the spec strings that select and configure one.

Adding a kind: its module (a subclass of :class:`~.base.Attention` with a ``kind`` name and a
nested frozen dataclass ``Config`` of its own options) and one entry in :data:`ATTENTION_KINDS`.

A spec string names a kind and its main argument, e.g. ``mha``, ``swa:128``, ``global_swa:32|32``,
``mlr:32|8|6|4|4|4|4|2``, ``bilinear_mlr:16|8|4``, ``bilinear_btt:2``; further settings follow as
``:key=value`` (``mlr:48|16:block_sizes=1024|64:depth_normalize=true``): the kind's options, read
from its ``Config`` (names, types, the positional one), and the shared settings in
:data:`~.config.SPEC_SHARED` (``mha:n_kv_heads=2:rotary=true``). Per-level values are positive
integers separated by ``|`` or ``+`` (which needs no shell quoting). A per-layer pattern is a
comma-separated list of specs repeated over the layers: ``mha,swa:128,swa:128``.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from torch import nn

from .._checks import parse_typed, require
from .base import Attention
from .bilinear import BilinearBTTAttention, BilinearMLRAttention
from .config import SPEC_SHARED, AttentionConfig, parse_levels
from .mlr import MLRAttention
from .standard import GlobalSlidingWindowAttention, MultiHeadAttention, SlidingWindowAttention

ATTENTION_KINDS: dict[str, type[Attention]] = {
    cls.kind: cls
    for cls in (MultiHeadAttention, SlidingWindowAttention, GlobalSlidingWindowAttention, MLRAttention,
                BilinearBTTAttention, BilinearMLRAttention)
}


def kind_class(kind: str) -> type[Attention]:
    """The layer class of ``kind``; a one-line ``ValueError`` naming the kinds otherwise."""
    require(kind in ATTENTION_KINDS, "kind", f"one of {sorted(ATTENTION_KINDS)}", kind)
    return ATTENTION_KINDS[kind]


def _option_fields(cls: type[Attention]) -> dict[str, dataclasses.Field]:
    """The kind's options by every name a spec may use (their own and their aliases)."""
    fields = {}
    for f in dataclasses.fields(cls.Config):
        for name in (f.name, *f.metadata.get("aliases", ())):
            fields[name] = f
    return fields


def _parse_value(key: str, text: str, hint: Any, spec: str) -> Any:
    """A spec value by its declared type: per-level integers for a tuple, else bool, int, float or str."""
    if "tuple" in str(hint):
        values = parse_levels(text)
        require(bool(values), key, f"positive integers separated by '|' or '+' (in the attention spec {spec!r})", text)
        return values
    return parse_typed(text, hint, key)


def parse_attention_spec(spec: str) -> dict[str, Any]:
    """``'mlr:48|16:depth_normalize=true'`` -> ``{'kind': 'mlr', 'ranks': (48, 16), 'depth_normalize': True}``:
    the kind, its options and any shared settings, by their declared names."""
    require(isinstance(spec, str) and spec.strip() != "", "attention spec", "a non-empty string such as 'mlr:48|16'", spec)
    kind, *args = spec.strip().split(":")
    kind = kind.strip().lower()
    cls = kind_class(kind)
    options = _option_fields(cls)
    shared_hints = typing.get_type_hints(AttentionConfig)
    option_hints = typing.get_type_hints(cls.Config)
    positional = [f for f in dataclasses.fields(cls.Config) if f.metadata.get("positional")]
    out: dict[str, Any] = {"kind": kind}
    for i, arg in enumerate(args):
        if "=" in arg:
            key, text = (part.strip() for part in arg.split("=", 1))
        elif i == 0 and positional:
            key, text = positional[0].name, arg.strip()
        else:
            raise ValueError(f"attention spec: expected key=value after the first ':' in {spec!r}, got {arg!r}")
        if key in options:
            name = options[key].name
            out[name] = _parse_value(name, text, option_hints[name], spec)
        else:
            require(key in SPEC_SHARED, "attention spec key", f"one of {sorted({*options, *SPEC_SHARED})} for {kind}",
                    key)
            out[key] = _parse_value(key, text, shared_hints[key], spec)
    return out


def parse_attention_pattern(pattern: str, n_layers: int) -> list[dict[str, Any]]:
    """A comma-separated list of specs, repeated to cover ``n_layers`` layers."""
    specs = [parse_attention_spec(s) for s in pattern.split(",")]
    return [specs[i % len(specs)] for i in range(n_layers)]


def config_from_spec(spec: str | dict[str, Any], **base: Any) -> AttentionConfig:
    """An :class:`AttentionConfig` from a spec string (or :func:`parse_attention_spec`'s dict)
    and the model's shared settings; the spec's own settings win over ``base``."""
    parsed = parse_attention_spec(spec) if isinstance(spec, str) else dict(spec)
    cls = kind_class(parsed.pop("kind"))
    names = {f.name for f in dataclasses.fields(cls.Config)}
    options = cls.Config(**{k: v for k, v in parsed.items() if k in names})
    shared = {k: v for k, v in parsed.items() if k not in names}
    return AttentionConfig(**{**base, **shared}, kind=cls.kind, options=options)


def build_attention(config: AttentionConfig | str, **base: Any) -> Attention:
    """An attention layer from a config, or from a spec string plus shared settings
    (``build_attention('mlr:48|16', d_model=512, n_heads=8, max_seq_len=1024)``)."""
    if isinstance(config, str):
        config = config_from_spec(config, **base)
    return kind_class(config.kind)(config)


def build_attention_layers(pattern: str, n_layers: int, **base: Any) -> nn.ModuleList:
    """One layer per spec of a comma-separated pattern repeated over ``n_layers`` layers, e.g. the
    per-layer mix ``'mha,swa:128,swa:128'`` gives MHA|SWA|SWA|MHA|SWA|SWA for six layers."""
    require(isinstance(n_layers, int) and n_layers > 0, "n_layers", "a positive integer", n_layers)
    return nn.ModuleList(build_attention(config_from_spec(spec, **base)) for spec in parse_attention_pattern(pattern, n_layers))


__all__ = ["ATTENTION_KINDS", "build_attention", "build_attention_layers", "config_from_spec", "kind_class",
           "parse_attention_pattern", "parse_attention_spec"]
