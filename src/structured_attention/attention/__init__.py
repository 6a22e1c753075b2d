"""Attention variants behind one interface: pick one by name with :func:`build_attention`.

Each kind is a module's class with its own options (``MLRAttention.Config`` ...) over the shared
:class:`AttentionConfig`; :data:`ATTENTION_KINDS` (in :mod:`.kinds`) lists them, and spec strings
(``mlr:48|16:depth_normalize=true``) are read from their declarations."""

from .base import Attention, AttentionCost, FullScoreAttention
from .bilinear import BilinearBTTAttention, BilinearMLRAttention
from .cache import KVCache, StaticKVCache, TokenBuffer
from .config import AttentionConfig
from .kinds import (
    ATTENTION_KINDS,
    build_attention,
    build_attention_layers,
    config_from_spec,
    kind_class,
    parse_attention_pattern,
    parse_attention_spec,
)
from .mlr import MLRAttention
from .standard import GlobalSlidingWindowAttention, MultiHeadAttention, SlidingWindowAttention

__all__ = [
    "ATTENTION_KINDS",
    "Attention",
    "AttentionConfig",
    "AttentionCost",
    "BilinearBTTAttention",
    "BilinearMLRAttention",
    "FullScoreAttention",
    "GlobalSlidingWindowAttention",
    "KVCache",
    "MLRAttention",
    "MultiHeadAttention",
    "SlidingWindowAttention",
    "StaticKVCache",
    "TokenBuffer",
    "build_attention",
    "build_attention_layers",
    "config_from_spec",
    "kind_class",
    "parse_attention_pattern",
    "parse_attention_spec",
]
