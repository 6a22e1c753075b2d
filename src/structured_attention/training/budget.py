"""Matching training budgets across models: the one helper every experiment's sweep uses."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["steps_for_flops"]


def steps_for_flops(budget: float, flops_after: Callable[[int], float]) -> int:
    """The number of optimiser steps (at least 1) whose training FLOPs are closest to ``budget``.

    ``flops_after(steps)`` is a run's training FLOPs after ``steps`` steps, non-decreasing in
    ``steps``: ``steps x tokens per step x model.training_flops_per_token(seq_len)`` for a fixed
    length, or a sum over a curriculum whose steps grow. Bisection, so both cases match alike; a
    tie goes to the fewer steps."""
    lo, hi = 1, 1
    while flops_after(hi) < budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # the last step count below the budget, and the first at or above it
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if flops_after(mid) < budget else (lo, mid)
    return min((lo, hi), key=lambda s: abs(flops_after(s) - budget))
