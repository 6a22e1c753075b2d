"""The ``sattn`` command. Errors in what the user gave end with one line and exit status 2.

Each experiment's CLI module (``cli/lm.py``, ...) adds its own ``sattn train <experiment>`` and
``sattn sweep <experiment>`` subcommands and knows how to plot its sweeps (``plot(results, out)``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from . import bench, describe, icl, lm, ts

EXPERIMENTS = {module.EXPERIMENT: module for module in (lm, icl, ts)}


class _Parser(argparse.ArgumentParser):
    """Usage mistakes end with one line naming the command and the problem (``--help`` shows usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sattn", description="structured attention: costs, training and benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    describe.add_parser(sub)
    bench.add_parser(sub)
    train = sub.add_parser("train", help=f"train a model ({'|'.join(EXPERIMENTS)})")
    train_sub = train.add_subparsers(dest="experiment", required=True)
    sweep = sub.add_parser("sweep", help=f"grids of training runs ({'|'.join(EXPERIMENTS)})")
    sweep_sub = sweep.add_subparsers(dest="experiment", required=True)
    for module in EXPERIMENTS.values():
        module.add_parsers(sub, train_sub, sweep_sub)
    plot = sub.add_parser("plot", help="the plots and markdown tables of a sweep")
    plot.add_argument("sweep_dir", help="a folder made by 'sattn sweep ...'")
    plot.add_argument("--out", default=None, help="folder for the plots and tables (default: the sweep folder)")
    plot.set_defaults(run=run_plot)
    return parser


def run_plot(args: argparse.Namespace) -> int:
    sweep = Path(args.sweep_dir)
    if not sweep.is_dir():
        raise FileNotFoundError(f"sweep_dir: no such folder: {str(sweep)!r}")
    results = [{**json.loads(p.read_text()), "run_dir": str(p.parent)} for p in sorted(sweep.glob("*/result.json"))]
    if not results:
        raise ValueError(f"sweep_dir: no finished runs (*/result.json) in {str(sweep)!r}")
    manifest = sweep / "sweep.json"
    experiment = json.loads(manifest.read_text()).get("experiment") if manifest.is_file() else "lm"
    if experiment not in EXPERIMENTS:
        raise ValueError(f"sweep_dir: {str(manifest)!r} names experiment {experiment!r}; expected one of {sorted(EXPERIMENTS)}")
    return EXPERIMENTS[experiment].plot(results, Path(args.out) if args.out else sweep)


def main(argv: Sequence[str] | None = None) -> int:
    from ..training.loop import TrainingStopped

    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"sattn {args.command}: error: {err}", file=sys.stderr)
        return 2
    except TrainingStopped as err:  # a NaN loss, or SIGTERM / Ctrl-C after saving a checkpoint
        print(f"sattn {args.command}: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
