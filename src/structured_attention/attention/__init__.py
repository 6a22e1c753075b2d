"""Attention variants behind one interface: pick one by name with :func:`build_attention`."""

from .base import (
    ATTENTION_KINDS,
    Attention,
    AttentionCost,
    FullScoreAttention,
    build_attention,
    build_attention_layers,
    register_attention,
)
from .bilinear import BilinearBTTAttention, BilinearMLRAttention
from .cache import KVCache, StaticKVCache, TokenBuffer
from .config import AttentionConfig, config_from_spec, parse_attention_pattern, parse_attention_spec
from .mlr import MLRAttention
from .standard import GlobalSlidingWindowAttention, MultiHeadAttention, SlidingWindowAttention

__all__ = [
    "ATTENTION_KINDS",
    "Attention",
    "AttentionConfig",
    "AttentionCost",
    "BilinearBTTAttention",
    "BilinearMLRAttention",
    "GlobalSlidingWindowAttention",
    "KVCache",
    "StaticKVCache",
    "MLRAttention",
    "MultiHeadAttention",
    "SlidingWindowAttention",
    "TokenBuffer",
    "build_attention",
    "build_attention_layers",
    "FullScoreAttention",
    "config_from_spec",
    "parse_attention_pattern",
    "parse_attention_spec",
    "register_attention",
]
