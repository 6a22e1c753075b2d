"""Functional (stateless) attention primitives."""

from structured_attention.functional.mlr import (
    mlr_attention,
    mlr_attention_reference,
    mlr_block_sizes,
    mlr_depth,
    mlr_pair_counts,
    mlr_score_flops,
)
from structured_attention.functional.mlr_blocked import mlr_attention_blocked
from structured_attention.functional.mlr_decode import mlr_decode, mlr_decode_reference
from structured_attention.functional.sdpa import scaled_dot_product_attention
from structured_attention.functional.windowed import sliding_window_attention

__all__ = [
    "mlr_attention",
    "mlr_attention_reference",
    "mlr_attention_blocked",
    "mlr_block_sizes",
    "mlr_decode",
    "mlr_decode_reference",
    "mlr_depth",
    "mlr_pair_counts",
    "mlr_score_flops",
    "scaled_dot_product_attention",
    "sliding_window_attention",
]
