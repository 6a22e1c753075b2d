"""Pieces the ``sattn`` subcommands share."""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .._files import atomic_write, claim, release
from ..training.checkpoint import find_checkpoints

__all__ = ["add_sweep_parser", "add_timing_options", "add_train_parser", "bench_environment", "best_per_kind_width",
           "number_list", "one_line_warnings", "print_plan", "pyplot", "run_grid", "slug"]


@contextlib.contextmanager
def one_line_warnings(command: str) -> Iterator[None]:
    """Show warnings as one ``sattn <command>: warning: ...`` line each."""
    old = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        print(f"sattn {command}: warning: {message}", file=sys.stderr, flush=True)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = old


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the file-only Agg backend, or ``None`` after saying, in one line,
    that matplotlib is missing (the tables are still written; only the PNGs need it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'structured-attention[bench]'): no PNG written")
        return None
    return plt


def add_timing_options(p: argparse.ArgumentParser) -> None:
    """The options every ``sattn bench`` benchmark takes: dtype, device, rounds and output folder."""
    import torch

    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; medians are reported (default 3)")
    p.add_argument("--out", default="runs/bench", help="folder for the results (default runs/bench)")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def time_ms(fn: Callable[[], Any], device: Any) -> float:
    """Milliseconds of one call of ``fn``, the device synchronised before and after (CUDA)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def check_positive_options(args: argparse.Namespace, *names: str) -> None:
    """One-line ``ValueError`` naming the first of ``names`` (option dests) that is not a positive integer."""
    for name in names:
        value = getattr(args, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"--{name.replace('_', '-')}: expected a positive integer, got {value}")


def records_table(records: list[dict[str, Any]], skip: tuple[str, ...] = ()) -> str:
    """A markdown table of benchmark records, one column per key of the first (floats to 3 places)."""
    keys = [k for k in records[0] if k not in skip]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in records:
        lines.append("| " + " | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    return "\n".join(lines)


def parse_device(text: str) -> Any:
    """``--device``: the CPU or an available CUDA device, else one line naming the option."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"--device: expected 'cpu' or an available CUDA device, got {text!r}")
    return device


def parse_ranks(text: str) -> tuple[int, ...]:
    """``'8|8|4'`` or ``'8+8+4'`` -> ``(8, 8, 4)``: the ``--ranks`` option of the benchmarks; one-line
    ``ValueError`` naming ``--ranks`` otherwise."""
    from ..attention.config import parse_levels

    ranks = parse_levels(text)
    if not ranks:
        raise ValueError(f"--ranks: expected positive integers separated by '|' or '+', got {text!r}")
    return ranks


def check_bench_memory(option: str, value: object, floats: int, args: argparse.Namespace) -> None:
    """One-line ``ValueError`` naming ``option`` when a benchmark's inputs and their gradients,
    ``floats`` numbers of ``args.dtype``, alone exceed the memory available on the device."""
    import torch

    from ..training.memory import available_memory, format_bytes

    device = torch.device(args.device)
    need, have = 2 * floats * getattr(torch, args.dtype).itemsize, available_memory(device)
    if need > have:
        raise ValueError(f"{option}: expected sizes that fit the memory available on the {device.type} device "
                         f"({format_bytes(have)}), "
                         f"got {value}, whose inputs and their gradients alone take {format_bytes(need)}")


def bench_environment(args: argparse.Namespace) -> dict[str, Any]:
    """What a benchmark ran on: the device's name, threads, versions and every setting."""
    import torch

    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    settings = {k: v for k, v in vars(args).items() if k not in ("run", "command", "out")}
    return {"device": name, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "settings": settings}


def add_train_parser(train: argparse._SubParsersAction, name: str, help: str, description: str,
                     run: Callable[[argparse.Namespace], int], config_cls: type) -> argparse.ArgumentParser:
    """``sattn train <name> [--config FILE_OR_NAME] [--resume] [--print-config] [section.key=value ...]``;
    ``--help`` lists ``config_cls``'s keys with their types and defaults."""
    from ..configs import shipped_configs
    from ..training.config import config_keys

    width = max(len(key) for key, _, _ in config_keys(config_cls))
    keys = "\n".join(f"  {key:<{width}}  {kind}, default {default!r}" for key, kind, default in config_keys(config_cls))
    t = train.add_parser(name, help=help, description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog=f"config keys (section.key=value):\n{keys}")
    shipped = ", ".join(c for c in shipped_configs() if c.startswith(f"{name}-"))
    t.add_argument("--config", default=None,
                   help=f"YAML config: a file, or a shipped config by name ({shipped}); default: the built-in defaults")
    t.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in run.out_dir/ckpt")
    t.add_argument("--print-config", action="store_true",
                   help="print the config these arguments make, as YAML, and exit without training")

    def train_or_print(args: argparse.Namespace) -> int:
        if not args.print_config:
            return run(args)
        import yaml

        from ..training.config import config_to_dict, load_config

        print(yaml.safe_dump(config_to_dict(load_config(config_cls, args.config, args.overrides)), sort_keys=False),
              end="")
        return 0

    t.set_defaults(run=train_or_print)
    return t


def add_sweep_parser(sweep: argparse._SubParsersAction, name: str, help: str, out: str,
                     run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """``sattn sweep <name> [--config FILE] [--out DIR] [--dry-run] [section.key=value ...]``; the
    experiment adds its grid's own flags to the returned parser."""
    s = sweep.add_parser(name, help=help)
    s.add_argument("--config", default=None,
                   help="base YAML config: a file or a shipped config's name (default: built-in defaults)")
    s.add_argument("--out", default=out, help=f"sweep folder (default {out})")
    s.add_argument("--dry-run", action="store_true", help="print the planned runs and exit")
    s.add_argument("overrides", nargs="*", help="section.key=value overrides of the base config")
    s.set_defaults(run=run)
    return s


def markdown_cell(text: str) -> str:
    """``text`` escaped for a markdown table cell (attention specs contain ``|``)."""
    return text.replace("|", "\\|")


def number_list(text: str, flag: str, cast: Callable[[str], Any] = int, *, minimum: float = 1) -> list[Any]:
    """``"64,128"`` -> ``[64, 128]``; a value that does not parse, is below ``minimum`` or is not
    finite, or an empty list, is a ``ValueError`` naming ``flag``."""
    what = "integers" if cast is int else "numbers"
    try:
        values = [cast(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated {what} >= {minimum:g}, got {text!r}") from None
    if not values or not all(minimum <= v < float("inf") for v in values):
        raise ValueError(f"{flag}: expected comma-separated {what} >= {minimum:g}, got {text!r}")
    return values


def best_per_kind_width(results: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """The run with the lowest ``metric`` for each (kind, width) of a sweep (its best learning
    rate), ordered by width then training FLOPs."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for r in results:
        key = (r["kind"], r["width"])
        if key not in best or r[metric] < best[key][metric]:
            best[key] = r
    return sorted(best.values(), key=lambda r: (r["width"], r["flops"]))


def slug(text: str) -> str:
    """A folder-name-safe form of ``text`` (``mlr:16|8`` -> ``mlr-16-8``)."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def print_plan(out: Path, runs: list[dict[str, Any]]) -> None:
    """A sweep's plan: each run's name, with its steps and training FLOPs where the plan has them."""
    print(f"sweep: {len(runs)} runs in {out}")
    width = max((len(r["name"]) for r in runs), default=0)
    for r in runs:
        budget = f"  steps {r['steps']:6d}  training FLOPs {r['flops']:.3e}" if "flops" in r else ""
        print(f"  {r['name']:{width}s}{budget}".rstrip())


def run_grid(
    out: Path, experiment: str, runs: list[dict[str, Any]], train_one: Callable[[dict[str, Any], bool], dict[str, Any]],
) -> list[dict[str, Any]]:
    """Run a sweep: each run (a dict with a unique ``name``) trains in ``out/<name>`` through
    ``train_one(run, resume)``, whose result is stored with the run in ``out/<name>/result.json``.
    A run whose ``result.json`` exists is not trained again, and ``resume`` is true when the run's
    folder holds a complete checkpoint, so an interrupted sweep resumes where it stopped, inside
    a run too. A run being trained is claimed by ``out/<name>/claim``, so the same sweep command
    started in several processes (one per core, or per node on a shared file system) splits the
    grid between them. ``out/sweep.json`` names the experiment (for ``sattn plot``). Returns the
    results of every finished run."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"experiment": experiment}) + "\n")
    results = []
    for r in runs:
        done = out / r["name"] / "result.json"
        if not done.is_file():
            done.parent.mkdir(parents=True, exist_ok=True)
            claim_path = done.parent / "claim"
            holder = claim(claim_path)
            if holder is not None:
                print(f"skip {r['name']}: another sweep process is training it ({holder}; "
                      f"delete {claim_path} if that process is gone)", flush=True)
                continue
            try:
                if not done.is_file():  # finished by another process since the check above
                    result = {**r, **train_one(r, bool(find_checkpoints(done.parent / "ckpt")))}
                    text = json.dumps(result, indent=2)
                    atomic_write(done, lambda tmp: Path(tmp).write_text(text))
            finally:
                release(claim_path)
        results.append(json.loads(done.read_text()))
        print(f"done {r['name']}", flush=True)
    return results
