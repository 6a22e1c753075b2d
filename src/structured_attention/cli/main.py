"""The ``sattn`` command. Errors in what the user gave end with one line and exit status 2; what
the machine refuses (a full disk, a read-only or forbidden folder, memory) with one line naming
the path and exit status 1; Ctrl-C before training starts with one line and exit status 130.

The commands are generic: each experiment's ``cli`` module (``experiments/lm/cli.py``, ...,
listed in ``experiments.EXPERIMENTS``) adds its own ``sattn train <experiment>`` and ``sattn sweep
<experiment>`` subcommands, evaluates its checkpoints and plots its sweeps (``plot(results, out)``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from ..experiments import EXPERIMENTS, checkpoint_experiment
from . import bench, coordcheck, describe


class _Parser(argparse.ArgumentParser):
    """Usage mistakes end with one line naming the command and the problem (``--help`` shows usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sattn", description="structured attention: costs, training and benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    describe.add_parser(sub)
    bench.add_parser(sub)
    coordcheck.add_parser(sub)
    train = sub.add_parser("train", help=f"train a model ({'|'.join(EXPERIMENTS)})")
    train_sub = train.add_subparsers(dest="experiment", required=True)
    sweep = sub.add_parser("sweep", help=f"grids of training runs ({'|'.join(EXPERIMENTS)})")
    sweep_sub = sweep.add_subparsers(dest="experiment", required=True)
    for module in EXPERIMENTS.values():
        module.add_parsers(sub, train_sub, sweep_sub)
    e = sub.add_parser("eval", help="metrics of a checkpoint: " + ", ".join(m.NOUN for m in EXPERIMENTS.values()),
                       description="Metrics of a checkpoint; the experiment it records says which, and which of "
                                   "the flags below apply.")
    e.add_argument("--checkpoint", required=True, help="checkpoint folder, its ckpt/ folder or the run's out_dir")
    e.add_argument("--batch-size", type=int, default=None, help="sequences per batch (default: the run's)")
    e.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    groups: dict[str, Any] = {}  # argument groups by the experiments whose checkpoints their flags apply to
    for flag, owners in _eval_flags().items():
        keywords = dict(owners[0][1])
        if len(owners) > 1:  # one flag, a meaning per experiment
            keywords["help"] = "; ".join(f"{m.NOUN}: {kw['help']}" for m, kw in owners)
        title = f"the checkpoints of {' or '.join(m.NOUN for m, _ in owners)}"
        if title not in groups:
            groups[title] = e.add_argument_group(title)
        groups[title].add_argument(flag, default=None, **keywords)
    e.set_defaults(run=run_eval)
    plot = sub.add_parser("plot", help="the plots and markdown tables of a sweep")
    plot.add_argument("sweep_dir", help="a folder made by 'sattn sweep ...'")
    plot.add_argument("--out", default=None, help="folder for the plots and tables (default: the sweep folder)")
    plot.set_defaults(run=run_plot)
    return parser


def run_plot(args: argparse.Namespace) -> int:
    sweep = Path(args.sweep_dir)
    if not sweep.is_dir():
        raise FileNotFoundError(f"sweep_dir: no such folder: {str(sweep)!r}")
    results = [{**_read_json(p), "run_dir": str(p.parent)} for p in sorted(sweep.glob("*/result.json"))]
    if not results:
        raise ValueError(f"sweep_dir: no finished runs (*/result.json) in {str(sweep)!r}")
    manifest = sweep / "sweep.json"
    experiment = _read_json(manifest).get("experiment") if manifest.is_file() else "lm"
    if experiment not in EXPERIMENTS:
        raise ValueError(f"sweep_dir: {str(manifest)!r} names experiment {experiment!r}; expected one of {sorted(EXPERIMENTS)}")
    try:
        return EXPERIMENTS[experiment].plot(results, Path(args.out) if args.out else sweep)
    except KeyError as err:
        raise ValueError(f"sweep_dir: a result.json in {str(sweep)!r} has no {err} (expected finished runs of "
                         f"'sattn sweep {experiment}')") from None


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or one line naming the file."""
    try:
        value = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"sweep_dir: {str(path)!r} is not JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"sweep_dir: {str(path)!r} holds {type(value).__name__}, expected a JSON object")
    return value


def _eval_flags() -> dict[str, list[tuple[ModuleType, dict[str, Any]]]]:
    """Each experiment's ``sattn eval`` flags (its ``EVAL_FLAGS``), with the experiments that take them."""
    flags: dict[str, list[tuple[ModuleType, dict[str, Any]]]] = {}
    for module in EXPERIMENTS.values():
        for flag, keywords in module.EVAL_FLAGS.items():
            flags.setdefault(flag, []).append((module, keywords))
    return flags


def run_eval(args: argparse.Namespace) -> int:
    """``sattn eval``: the experiment the checkpoint records evaluates it (its ``run_eval``: a
    language model's validation loss and bits per byte, an in-context regression model's error by
    number of examples beside the baselines', a forecaster's validation and test MSE/MAE); the
    flags that other experiments declare are refused with one line."""
    from ..training.checkpoint import load_checkpoint
    from .._cli import one_line_warnings, parse_device

    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size: expected a positive integer, got {args.batch_size}")
    args.device = parse_device(args.device)
    with one_line_warnings("eval"):
        ckpt = load_checkpoint(args.checkpoint)
    module = EXPERIMENTS[checkpoint_experiment(ckpt.state, str(ckpt.path))]
    for flag, owners in _eval_flags().items():
        if flag not in module.EVAL_FLAGS and getattr(args, flag[2:].replace("-", "_")) is not None:
            raise ValueError(f"{flag}: applies to the checkpoints of {' or '.join(m.NOUN for m, _ in owners)}; "
                             f"{ckpt.path} holds {module.NOUN}")
    return module.run_eval(args, ckpt)


def main(argv: Sequence[str] | None = None) -> int:
    from ..training.loop import TrainingStopped

    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # named by the command they were given to, whose --help lists what it takes
        prog = " ".join(["sattn", args.command, *(v for v in (getattr(args, "experiment", None),
                                                              getattr(args, "what", None)) if isinstance(v, str))])
        parser.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(extras)} (see {prog} --help)\n")
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, ImportError) as err:  # what the user gave
        print(f"sattn {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except TrainingStopped as err:  # a NaN loss, or SIGTERM / Ctrl-C after saving a checkpoint
        if err.main_process:
            print(f"sattn {args.command}: {err}", file=sys.stderr)
        return err.exit_code
    except OSError as err:  # files written before this were written atomically: none is half-written
        print(f"sattn {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 1
    except MemoryError:
        print(f"sattn {args.command}: error: out of memory (try smaller model, batch or sequence sizes)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # during training, Ctrl-C saves a checkpoint first (TrainingStopped)
        print(f"sattn {args.command}: interrupted", file=sys.stderr)
        return 130


def _one_line(err: BaseException) -> str:
    """The first line of an error's message, cut at 300 characters (a library's message can be
    long); a system error as its reason and path ("No space left on device: <path>")."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


if __name__ == "__main__":
    sys.exit(main())
