"""Functional (stateless) attention: MLR attention (the public functions of
:mod:`structured_attention.ops.mlr`), sliding-window attention and scaled dot-product attention."""

from ..ops import mlr as _mlr
from ..ops.mlr import *  # noqa: F403  (re-exported as they are listed there)
from .sdpa import scaled_dot_product_attention
from .windowed import sliding_window_attention

__all__ = [*_mlr.__all__, "scaled_dot_product_attention", "sliding_window_attention"]
