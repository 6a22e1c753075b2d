"""MLR attention as one operator.

Layout: :mod:`.contract` (argument checks, dtype and GQA policy, block sizes and costs),
:mod:`.reference` (the exact definitions), :mod:`.dispatch` (which backend runs a call) and the
backends, leaves that import only the contract: :mod:`.blocked` (tiled PyTorch, CPU), :mod:`.cpu`
(fused C++ kernel, CPU), :mod:`.triton_general` and :mod:`.triton_prefix` (fused Triton kernels,
forward and backward), :mod:`.triton_decode` (a Triton decoding step);
:mod:`.static` is the decoding step against a static cache (the C++ kernel on the CPU, ATen ops
elsewhere). docs/design.md explains
the mathematics, the tiling and the dispatch table.
"""

from .contract import mlr_block_sizes, mlr_depth, mlr_pair_counts, mlr_score_flops
from .dispatch import mlr_attention, mlr_decode, mlr_prefill
from .reference import mlr_attention_reference, mlr_decode_reference, mlr_prefill_reference

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
]
