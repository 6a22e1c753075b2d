"""Functional (stateless) attention: MLR attention (from :mod:`structured_attention.ops.mlr`),
sliding-window attention and scaled dot-product attention."""

from structured_attention.functional.sdpa import scaled_dot_product_attention
from structured_attention.functional.windowed import sliding_window_attention
from structured_attention.ops.mlr import (
    mlr_attention,
    mlr_attention_reference,
    mlr_block_sizes,
    mlr_decode,
    mlr_decode_reference,
    mlr_depth,
    mlr_pair_counts,
    mlr_prefill,
    mlr_prefill_reference,
    mlr_score_flops,
)

__all__ = [
    "mlr_attention",
    "mlr_attention_reference",
    "mlr_block_sizes",
    "mlr_decode",
    "mlr_decode_reference",
    "mlr_depth",
    "mlr_pair_counts",
    "mlr_prefill",
    "mlr_prefill_reference",
    "mlr_score_flops",
    "scaled_dot_product_attention",
    "sliding_window_attention",
]
