"""In-context regression prompts (Garg et al. 2022) and their curriculum (docs/design.md,
'In-context linear regression').

A prompt is ``N`` points ``(x_i, y_i)`` of one random linear function: ``x_i ~ N(0, I_d)``,
``w ~ N(0, I_d)``, ``y_i = w^T x_i`` (+ Gaussian noise in the *noisy* variant; in the *sparse*
variant only ``sparsity`` random coordinates of ``w`` are non-zero). Under the curriculum only the
first ``active_dims`` coordinates of ``x`` (and ``w``) are non-zero, as in Garg et al.

- :func:`sample_prompts` -> :class:`Prompts` (``xs (B, N, d)``, ``ys (B, N)``, ``ws (B, d)``), a
  pure function of ``(seed, index)`` so that training batches can be redrawn on ``--resume``;
- :func:`interleave`: the model's input sequence ``x_1, y_1, x_2, ..., x_N`` (``2N - 1`` tokens of
  ``d`` numbers, a ``y`` token carrying ``y`` in its first coordinate);
- :class:`Curriculum`: active dimensions and points per prompt at a training step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .._checks import check_positive_int, require

__all__ = ["Curriculum", "Prompts", "interleave", "sample_prompts"]


@dataclass(frozen=True)
class Prompts:
    xs: torch.Tensor  # (B, N, d)
    ys: torch.Tensor  # (B, N)
    ws: torch.Tensor  # (B, d)

    def to(self, device: torch.device | str) -> Prompts:
        return Prompts(self.xs.to(device), self.ys.to(device), self.ws.to(device))


def sample_prompts(
    batch_size: int,
    n_points: int,
    n_dims: int,
    *,
    seed: int,
    index: int,
    active_dims: int | None = None,
    noise_std: float = 0.0,
    sparsity: int | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> Prompts:
    """This rank's share of ``batch_size * world_size`` prompts drawn by
    ``np.random.default_rng([seed, index])``; rank ``r`` gets rows ``[r * batch_size, (r + 1) *
    batch_size)``, so the ranks' shares concatenate to the one-process batch.

    ``active_dims`` (default ``n_dims``): coordinates of ``x`` and ``w`` beyond it are zero.
    ``sparsity``: ``w`` keeps that many random active coordinates (all of them when the curriculum
    has fewer active ones). ``noise_std``: ``y`` gets ``N(0, noise_std^2)`` noise.
    """
    check_positive_int(batch_size, "batch_size")
    check_positive_int(n_points, "n_points")
    check_positive_int(n_dims, "n_dims")
    active = n_dims if active_dims is None else active_dims
    require(isinstance(active, int) and 1 <= active <= n_dims, "active_dims", f"an integer in [1, n_dims={n_dims}]", active)
    require(noise_std >= 0, "noise_std", "a non-negative number", noise_std)
    require(sparsity is None or (isinstance(sparsity, int) and 1 <= sparsity <= n_dims), "sparsity",
            f"None or an integer in [1, n_dims={n_dims}]", sparsity)
    require(isinstance(seed, int) and seed >= 0 and isinstance(index, int) and index >= 0, "seed/index",
            "non-negative integers", (seed, index))
    require(isinstance(rank, int) and 0 <= rank < world_size, "rank", f"an integer in [0, world_size={world_size})", rank)

    rng = np.random.default_rng([seed, index])
    total = batch_size * world_size
    xs = np.zeros((total, n_points, n_dims))
    ws = np.zeros((total, n_dims))
    xs[:, :, :active] = rng.standard_normal((total, n_points, active))
    ws[:, :active] = rng.standard_normal((total, active))
    if sparsity is not None and sparsity < active:
        # keep the `sparsity` active coordinates with the smallest random keys: a uniform subset per prompt
        keys = rng.random((total, active))
        drop = np.argsort(keys, axis=1)[:, sparsity:]
        np.put_along_axis(ws, drop, 0.0, axis=1)
    ys = np.einsum("bnd,bd->bn", xs, ws)
    if noise_std > 0:
        ys = ys + noise_std * rng.standard_normal(ys.shape)
    mine = slice(rank * batch_size, (rank + 1) * batch_size)
    as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a[mine], dtype=np.float32))  # noqa: E731
    return Prompts(as_tensor(xs), as_tensor(ys), as_tensor(ws))


def interleave(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """The sequence ``x_1, y_1, ..., x_{N-1}, y_{N-1}, x_N``: ``(B, 2N - 1, d)``, token ``2i`` is
    ``x_{i+1}`` and token ``2i + 1`` is ``(y_{i+1}, 0, ..., 0)``. The last ``y`` is left out: no
    prediction follows it. The prediction of ``y_{i+1}`` is read at token ``2i``, which the causal
    model computes from the ``i`` examples before it and ``x_{i+1}``."""
    b, n, d = xs.shape
    require(ys.shape == (b, n), "ys", f"shape (batch, n_points) = {(b, n)}", tuple(ys.shape))
    y_tokens = torch.zeros_like(xs)
    y_tokens[..., 0] = ys
    return torch.stack((xs, y_tokens), dim=2).reshape(b, 2 * n, d)[:, :-1]


@dataclass(frozen=True)
class Curriculum:
    """Active dimensions and points per prompt at a training step (Garg et al.'s curriculum):
    each starts at ``*_start`` and grows by ``*_inc`` every ``every`` steps up to the full task
    (``dims``, ``points``). ``every = 0`` (or starts equal to the full task): no curriculum."""

    dims: int
    points: int
    dims_start: int
    points_start: int
    dims_inc: int = 1
    points_inc: int = 2
    every: int = 0

    def __post_init__(self) -> None:
        check_positive_int(self.dims, "dims")
        check_positive_int(self.points, "points")
        require(isinstance(self.dims_start, int) and 1 <= self.dims_start <= self.dims, "curriculum dims_start",
                f"an integer in [1, n_dims={self.dims}]", self.dims_start)
        require(isinstance(self.points_start, int) and 1 <= self.points_start <= self.points, "curriculum points_start",
                f"an integer in [1, n_points={self.points}]", self.points_start)
        check_positive_int(self.dims_inc, "curriculum dims_inc")
        check_positive_int(self.points_inc, "curriculum points_inc")
        require(isinstance(self.every, int) and self.every >= 0, "curriculum every", "a non-negative integer", self.every)

    def at(self, step: int) -> tuple[int, int]:
        """``(active dims, points per prompt)`` at 0-based training step ``step``."""
        if self.every == 0:
            return self.dims, self.points
        stage = step // self.every
        return (min(self.dims, self.dims_start + stage * self.dims_inc),
                min(self.points, self.points_start + stage * self.points_inc))

    @property
    def full_at(self) -> int:
        """The first step at which the full task is used."""
        if self.every == 0:
            return 0
        stages = max(-(-(self.dims - self.dims_start) // self.dims_inc), -(-(self.points - self.points_start) // self.points_inc))
        return stages * self.every
