"""How low a few steps of gradient descent can take in-context regression: a point of reference
for what a transformer of a few layers can do (one layer of linear attention computes one step).

    PYTHONPATH=src python3 scripts/icl_gd_floor.py [--dims 16,32] [--max-steps 8]

For each ``d``, with ``n = 2d`` noise-free Gaussian examples (the experiment's ``N = 2d`` point),
prints the expected normalised error of ``k`` steps from ``w = 0`` with the best step sizes
(:func:`structured_attention.experiments.icl.baselines.best_gradient_descent`).
"""

from __future__ import annotations

import argparse

from structured_attention.experiments.icl.baselines import best_gradient_descent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", default="16,32", help="comma-separated input dimensions d")
    parser.add_argument("--max-steps", type=int, default=8, help="largest number of steps")
    args = parser.parse_args()
    dims = [int(d) for d in args.dims.split(",")]
    steps = range(1, args.max_steps + 1)
    print("| d | n |" + "".join(f" {k} step{'s' if k > 1 else ''} |" for k in steps))
    print("|---|---|" + "---|" * len(steps))
    for d in dims:
        errors = [best_gradient_descent(d, 2 * d, k)[0] for k in steps]
        print(f"| {d} | {2 * d} |" + "".join(f" {e:.4f} |" for e in errors))


if __name__ == "__main__":
    main()
