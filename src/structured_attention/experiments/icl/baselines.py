"""Classical in-context regression baselines, computed on the same prompts as the model.

Each takes ``xs: (B, N, d)`` and ``ys: (B, N)`` and returns predictions ``(B, N)`` where entry
``i`` uses only the ``i`` examples ``(x_j, y_j), j < i`` and the query ``x_i`` (entry 0, with no
examples, predicts 0). Computed in float64.
"""

from __future__ import annotations

import torch

from ..._checks import check_positive_int, require

__all__ = ["BASELINES", "averaging", "baseline_predictions", "best_gradient_descent", "gradient_step", "least_squares", "nearest_neighbours", "ridge"]


def _check(xs: torch.Tensor, ys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    require(xs.dim() == 3 and ys.shape == xs.shape[:2], "xs/ys", "shapes (B, N, d) and (B, N)",
            (tuple(xs.shape), tuple(ys.shape)))
    return xs.double(), ys.double()


def least_squares(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """The minimum-norm least-squares fit of the examples (the pseudo-inverse), which interpolates
    them while there are fewer than ``d``."""
    xs, ys = _check(xs, ys)
    out = torch.zeros_like(ys)
    for i in range(1, xs.shape[1]):
        w = torch.linalg.pinv(xs[:, :i]) @ ys[:, :i, None]  # (B, d, 1)
        out[:, i] = (xs[:, i, None] @ w)[:, 0, 0]
    return out


def ridge(xs: torch.Tensor, ys: torch.Tensor, lam: float) -> torch.Tensor:
    """``w = (X^T X + lam I)^{-1} X^T y`` on the examples; with noise variance ``lam`` and
    ``w ~ N(0, I)`` this is the Bayes-optimal (posterior-mean) predictor."""
    require(lam > 0, "ridge lambda", "a positive number", lam)
    xs, ys = _check(xs, ys)
    eye = torch.eye(xs.shape[-1], dtype=xs.dtype)
    out = torch.zeros_like(ys)
    for i in range(1, xs.shape[1]):
        x, y = xs[:, :i], ys[:, :i, None]
        w = torch.linalg.solve(x.transpose(1, 2) @ x + lam * eye, x.transpose(1, 2) @ y)
        out[:, i] = (xs[:, i, None] @ w)[:, 0, 0]
    return out


def nearest_neighbours(xs: torch.Tensor, ys: torch.Tensor, k: int = 3) -> torch.Tensor:
    """The mean ``y`` of the ``k`` examples nearest to the query in Euclidean distance (of all of
    them while there are fewer than ``k``)."""
    check_positive_int(k, "k")
    xs, ys = _check(xs, ys)
    dist = torch.cdist(xs, xs)  # (B, N, N): row i holds the query's distance to every example
    out = torch.zeros_like(ys)
    for i in range(1, xs.shape[1]):
        idx = dist[:, i, :i].topk(min(k, i), dim=1, largest=False).indices
        out[:, i] = ys[:, :i].gather(1, idx).mean(1)
    return out


def _one_gradient_step(xs: torch.Tensor, ys: torch.Tensor, step_sizes: torch.Tensor) -> torch.Tensor:
    """``x_i . (c_i sum_{j<i} y_j x_j)``: one gradient step on the squared loss from ``w = 0``, with
    the step ``c_i`` for ``i`` examples."""
    sums = torch.cumsum(ys[..., None] * xs, dim=1) - ys[..., None] * xs  # the examples strictly before each query
    return (sums * xs).sum(-1) * step_sizes


def averaging(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """``w = mean_j y_j x_j`` (one gradient step from zero, as in Garg et al.)."""
    xs, ys = _check(xs, ys)
    return _one_gradient_step(xs, ys, 1 / torch.arange(xs.shape[1], dtype=xs.dtype).clamp(min=1))


def gradient_step(xs: torch.Tensor, ys: torch.Tensor, noise_to_signal: float = 0.0) -> torch.Tensor:
    """One gradient step from zero with the best step size: ``w = sum_j y_j x_j / (i + d + 1 + k)``.

    For ``x ~ N(0, I_d)``, ``E[w w^T] = rho I`` (the dense and the sparse task) and noise variance
    ``sigma^2`` (``k = sigma^2 / rho``), ``E[(X^T X)^2] = i (i + d + 1) I`` makes this step size
    the minimiser of the expected error, whose weight error is then ``rho d (d + 1 + k) / (i + d +
    1 + k)``. No predictor ``x_i^T G sum_j y_j x_j`` (one layer of linear attention) does better.
    """
    require(noise_to_signal >= 0, "noise_to_signal", "a non-negative number", noise_to_signal)
    xs, ys = _check(xs, ys)
    i = torch.arange(xs.shape[1], dtype=xs.dtype)
    return _one_gradient_step(xs, ys, 1 / (i + xs.shape[-1] + 1 + noise_to_signal))


def best_gradient_descent(d: int, n: int, steps: int, samples: int = 2000, seed: int = 0) -> tuple[float, list[float]]:
    """The expected normalised error of ``steps`` gradient-descent steps from ``w = 0`` on ``n``
    noise-free Gaussian examples in ``d`` dims, with the step sizes that minimise it; returns the
    error and the step sizes (on the loss ``|Xw - y|^2 / (2n)``).

    After steps ``eta_t`` the weight error is ``p(A) w`` with ``A = X^T X / n`` and
    ``p(lam) = prod_t (1 - eta_t lam)``, so the error is the mean of ``p(lam)^2`` over the
    eigenvalues of ``A``, estimated on ``samples`` draws of ``X``. Minimising it over polynomials
    of degree ``steps`` with ``p(0) = 1`` is a least-squares fit; the step sizes are the inverse
    roots. One step gives ``(d + 1) / (n + d + 1)`` (:func:`gradient_step`); it is a point of
    reference for what a few layers can do, since one layer of linear attention computes one step.
    """
    for value, name in ((d, "d"), (n, "n"), (steps, "steps"), (samples, "samples")):
        check_positive_int(value, name)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, n, d, generator=g, dtype=torch.float64)
    lam = torch.linalg.eigvalsh(x.transpose(1, 2) @ x / n).flatten()
    powers = torch.stack([lam**j for j in range(1, steps + 1)], 1)
    coeffs = torch.linalg.lstsq(powers, -torch.ones_like(lam)[:, None]).solution[:, 0]
    error = float(((1 + powers @ coeffs) ** 2).mean())
    # p(lam) = 1 + c_1 lam + ... + c_k lam^k; its roots, real for this minimiser, are 1 / eta_t
    companion = torch.zeros(steps, steps, dtype=torch.float64)
    companion[0] = -torch.cat([coeffs.flip(0)[1:], coeffs.new_ones(1)]) / coeffs[-1]
    companion[1:, :-1] = torch.eye(steps - 1, dtype=torch.float64)
    roots = torch.linalg.eigvals(companion)
    return error, sorted(float(1 / r.real) for r in roots)


BASELINES = ("least_squares", "ridge", "3nn", "averaging", "gd_step")


def baseline_predictions(
    xs: torch.Tensor, ys: torch.Tensor, ridge_lambda: float, noise_to_signal: float = 0.0,
) -> dict[str, torch.Tensor]:
    """Every baseline's predictions, by name (:data:`BASELINES`)."""
    return {
        "least_squares": least_squares(xs, ys),
        "ridge": ridge(xs, ys, ridge_lambda),
        "3nn": nearest_neighbours(xs, ys, 3),
        "averaging": averaging(xs, ys),
        "gd_step": gradient_step(xs, ys, noise_to_signal),
    }
