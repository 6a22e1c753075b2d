"""Small tensor helpers shared by the structured matrices."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .._checks import check_int_list, require


def block_diag_matmul(x: Tensor, blocks: Tensor) -> Tensor:
    """Apply ``diag(blocks[0], ..., blocks[p-1])`` to the last axis of ``x``.

    ``blocks`` has shape ``(p, n_out, n_in)``; ``x`` has shape ``(..., p * n_in)``; the result has
    shape ``(..., p * n_out)``. Costs ``p * n_out * n_in`` multiply-adds per vector.
    """
    p, _, n_in = blocks.shape
    return torch.einsum("...pi,poi->...po", x.unflatten(-1, (p, n_in)), blocks).flatten(-2)


def block_diag_dense(blocks: Tensor) -> Tensor:
    """The dense ``(p * n_out, p * n_in)`` matrix ``diag(blocks[0], ..., blocks[p-1])``."""
    return torch.block_diag(*blocks.unbind(0))


def init_factor_(weight: Tensor, fan_in: int, gain: float = 1.0) -> None:
    """Fill ``weight`` with ``N(0, gain^2 / fan_in)`` in place."""
    nn.init.normal_(weight, std=gain / math.sqrt(fan_in))


def balanced_split(n: int) -> tuple[int, int]:
    """``(u, v)`` with ``u * v == n`` and ``u`` the largest divisor of ``n`` not above ``sqrt(n)``."""
    u = math.isqrt(n)
    while n % u:
        u -= 1
    return u, n // u


def resolve_shape(shape: Sequence[int] | None, features: int, name: str, features_name: str) -> tuple[int, int]:
    """A two-factor split of ``features``: ``shape`` validated, or ``balanced_split`` when ``None``."""
    if shape is None:
        return balanced_split(features)
    pair = check_int_list(shape, name)
    require(
        len(pair) == 2 and pair[0] * pair[1] == features,
        name,
        f"two positive integers whose product is {features_name}={features}",
        shape,
    )
    return pair[0], pair[1]
