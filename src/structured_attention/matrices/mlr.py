"""Multi-Level Low-Rank (MLR) matrix."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .._checks import check_divides, check_int_list, check_positive_int, require
from ._ops import block_diag_dense, block_diag_matmul, init_factor_
from .base import Fan, StructuredMatrix


class MLR(StructuredMatrix):
    """``W = sum_l diag_k(L_{l,k} R_{l,k}^T)``: level ``l`` is block-diagonal with ``p_l`` low-rank blocks.

    Factors: ``L[l]: (p_l, out_features/p_l, r_l)`` and ``R[l]: (p_l, in_features/p_l, r_l)``
    (``nn.ParameterList``s, named ``L.<l>`` / ``R.<l>``). ``n_blocks`` defaults to ``p_l = 2^(l-1)``.

    ``n_stacks = S > 1`` stacks ``S`` independent MLR matrices of the same input, ``W = [W_1; ...;
    W_S]`` with ``W_s: (out_features/S) x in_features`` and ranks ``r_l`` each (Bilinear MLR's
    per-head key maps). Then ``R[l]: (p_l, in_features/p_l, S r_l)`` holds the ``S`` matrices'
    right factors side by side and ``L[l]: (p_l, out_features/p_l, r_l)`` their left factors, block
    ``k``'s rows ordered by matrix ``s``; the output is ordered by ``s``, then block, then row.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ranks: Sequence[int],
        n_blocks: Sequence[int] | None = None,
        n_stacks: int = 1,
    ) -> None:
        super().__init__(in_features, out_features)
        self.n_stacks: int = check_positive_int(n_stacks, "n_stacks")
        self.ranks: tuple[int, ...] = check_int_list(ranks, "ranks")
        if n_blocks is None:
            blocks = tuple(2**level for level in range(len(self.ranks)))
            require(
                in_features % blocks[-1] == 0 and out_features % blocks[-1] == 0,
                "ranks",
                f"few enough levels that the default n_blocks 2^(l-1) (up to {blocks[-1]}) divide "
                f"in_features={in_features} and out_features={out_features}",
                ranks,
            )
        else:
            blocks = check_int_list(n_blocks, "n_blocks")
            require(len(blocks) == len(self.ranks), "n_blocks", f"{len(self.ranks)} entries (one per rank)", n_blocks)
            for level, p in enumerate(blocks):
                check_divides(p, in_features, f"n_blocks[{level}]", "in_features")
                check_divides(p, out_features, f"n_blocks[{level}]", "out_features")
        for level, p in enumerate(blocks):
            check_divides(p * self.n_stacks, out_features, f"n_stacks * n_blocks[{level}]", "out_features")
        self.n_blocks: tuple[int, ...] = blocks
        self.L = nn.ParameterList(torch.empty(p, out_features // p, r) for p, r in zip(blocks, self.ranks))
        self.R = nn.ParameterList(torch.empty(p, in_features // p, self.n_stacks * r) for p, r in zip(blocks, self.ranks))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        level_gain = 1.0 / math.sqrt(len(self.ranks))
        for p, r, L, R in zip(self.n_blocks, self.ranks, self.L, self.R):
            init_factor_(R, self.in_features // p)
            init_factor_(L, r, level_gain)

    def _left(self, L: Tensor) -> Tensor:
        """``L[l]`` as ``(p_l, S, rows per block and matrix, r_l)``."""
        return L.unflatten(1, (self.n_stacks, -1))

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        out = x.new_zeros(())
        for L, R in zip(self.L, self.R):
            p, _, r = L.shape
            y = block_diag_matmul(x, R.transpose(1, 2)).unflatten(-1, (p, self.n_stacks, r))
            out = out + torch.einsum("...psr,psor->...spo", y, self._left(L)).flatten(-3)
        return out

    def to_dense(self) -> Tensor:
        def matrix(s: int) -> Tensor:
            return sum(block_diag_dense(self._left(L)[:, s] @ R.unflatten(2, (self.n_stacks, -1))[:, :, s].transpose(1, 2))
                       for L, R in zip(self.L, self.R))

        return torch.cat([matrix(s) for s in range(self.n_stacks)])

    def _macs_per_vector(self) -> int:
        return sum(self.ranks) * (self.n_stacks * self.in_features + self.out_features)

    @property
    def rank_bound(self) -> int:
        inner = self.n_stacks * sum(r * p for r, p in zip(self.ranks, self.n_blocks))
        return min(inner, self.in_features, self.out_features)

    def parameter_fans(self) -> dict[str, Fan]:
        fans = {}
        for level, (p, r) in enumerate(zip(self.n_blocks, self.ranks)):
            fans[f"L.{level}"] = Fan(r, self.out_features // (p * self.n_stacks), gain=1.0 / math.sqrt(len(self.ranks)))
            fans[f"R.{level}"] = Fan(self.in_features // p, self.n_stacks * r)
        return fans

    def extra_repr(self) -> str:
        stacks = f", n_stacks={self.n_stacks}" if self.n_stacks > 1 else ""
        return f"{super().extra_repr()}, ranks={self.ranks}, n_blocks={self.n_blocks}{stacks}"
