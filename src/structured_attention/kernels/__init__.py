"""Optional fused kernels (Triton).

Importing this package never requires Triton: :data:`HAS_TRITON` says whether it is available, and
the kernel entry points raise a clear :class:`ImportError` only when called without it.
"""

from __future__ import annotations

try:  # pragma: no cover - depends on the environment
    import triton  # noqa: F401
    import triton.language  # noqa: F401

    HAS_TRITON = True
except Exception:  # ImportError, or a broken install
    HAS_TRITON = False

if HAS_TRITON:
    from structured_attention.kernels.mlr_decode_triton import mlr_decode_triton
    from structured_attention.kernels.mlr_triton import mlr_attention_triton
else:

    def mlr_attention_triton(*args, **kwargs):  # type: ignore[no-redef]
        """Stand-in used when Triton is not installed; always raises."""
        raise ImportError(
            "mlr_attention_triton needs the 'triton' package (pip install 'triton>=3.0'); "
            "it is not installed. Use structured_attention.functional.mlr_attention instead."
        )

    def mlr_decode_triton(*args, **kwargs):  # type: ignore[no-redef]
        """Stand-in used when Triton is not installed; always raises."""
        raise ImportError(
            "mlr_decode_triton needs the 'triton' package (pip install 'triton>=3.0'); "
            "it is not installed. Use structured_attention.functional.mlr_decode instead."
        )


__all__ = ["HAS_TRITON", "mlr_attention_triton", "mlr_decode_triton"]
