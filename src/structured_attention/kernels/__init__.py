"""Optional fused kernels (Triton).

Importing this package never requires Triton: :data:`HAS_TRITON` says whether it is available, and
the kernel entry points raise a clear :class:`ImportError` only when called without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:  # pragma: no cover - depends on the environment
    import triton  # noqa: F401
    import triton.language  # noqa: F401

    HAS_TRITON = True
except Exception:  # ImportError, or a broken install
    HAS_TRITON = False


def _needs_triton(name: str, instead: str) -> Callable[..., Any]:
    """A stand-in for the kernel ``name`` where Triton is not installed; it always raises."""

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"{name} needs the 'triton' package (pip install 'triton>=3.0'); it is not installed. "
                          f"Use {instead} instead.")

    stand_in.__name__ = name
    return stand_in


if HAS_TRITON:
    from structured_attention.kernels.mlr_decode_triton import mlr_decode_triton
    from structured_attention.kernels.mlr_triton import mlr_attention_triton
else:
    mlr_attention_triton = _needs_triton("mlr_attention_triton", "structured_attention.functional.mlr_attention")
    mlr_decode_triton = _needs_triton("mlr_decode_triton", "structured_attention.functional.mlr_decode")


__all__ = ["HAS_TRITON", "mlr_attention_triton", "mlr_decode_triton"]
