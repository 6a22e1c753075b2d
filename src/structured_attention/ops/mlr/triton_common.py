"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRETED", "cdiv", "device_table", "dot", "dot_acc", "pow2"]


@triton.jit
def dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot`` (2-D or batched 3-D) with a float32 result.

    ``UPCAST`` (interpreter only) multiplies in float32: Triton's CPU interpreter mishandles
    bfloat16 ``tl.dot`` operands. bf16 products are exact in float32, so the result matches the GPU.
    """
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PREC)
    return out


@triton.jit
def dot_acc(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` as one ``tl.dot`` that accumulates in place (the matrix units add into ``acc``)."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc, input_precision=PREC)
    return out


# Triton's interpreter (TRITON_INTERPRET=1 when triton.jit ran) swaps kernels for interpreted ones.
INTERPRETED = "interpret" in type(dot).__name__.lower()


# Host-side arithmetic in plain Python: Triton's own cdiv and next_power_of_2 are constexpr
# functions whose call wrapper costs microseconds, paid on every decoding step.
def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-a // b)


def pow2(n: int, floor: int = 1) -> int:
    """The smallest power of two >= ``n`` and >= ``floor`` (``tl.dot`` wants dims of 16 or more)."""
    return max(floor, 1 << (max(int(n), 1) - 1).bit_length())


@functools.lru_cache(maxsize=512)
def device_table(values: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-D tensor on ``device``, made once per distinct table.

    The kernels read small metadata tables (block sizes, ranks, addresses); copying them to the
    device on every call would cost a synchronous host-to-device copy each. Never write to the result.
    """
    return torch.tensor(values, dtype=dtype, device=device)
