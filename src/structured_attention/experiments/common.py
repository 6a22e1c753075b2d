"""What the experiments' command lines share: the ``sattn train <name>`` and ``sattn sweep <name>``
parsers, sweep plans (run names, the best run per kind and width) and the grid runner that trains
a sweep's runs, resumable and shared by several processes."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._files import atomic_write, claim, make_folder, release
from ..training.checkpoint import find_checkpoints

__all__ = ["add_sweep_parser", "add_train_parser", "best_per_kind_width", "print_plan", "run_grid", "run_sweep", "slug"]


def add_train_parser(train: argparse._SubParsersAction, name: str, help: str, description: str,
                     run: Callable[[argparse.Namespace], int], config_cls: type) -> argparse.ArgumentParser:
    """``sattn train <name> [--config FILE_OR_NAME] [--resume] [--print-config] [section.key=value ...]``;
    ``--help`` lists ``config_cls``'s keys with their types and defaults."""
    from ..configs import shipped_configs
    from ..training.config import config_keys

    listed = config_keys(config_cls)
    width = max(len(key) for key, _, _ in listed)
    keys = "\n".join(f"  {key:<{width}}  {kind}, default {default!r}" for key, kind, default in listed)
    t = train.add_parser(name, help=help, description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog=f"config keys (section.key=value):\n{keys}")
    shipped = ", ".join(c for c in shipped_configs() if c.rsplit("/", 1)[-1].startswith(f"{name}-"))
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
    make_folder(out, "--out")
    manifest = out / "sweep.json"
    if manifest.is_file():  # a sweep's folder takes that sweep's runs again, no other experiment's
        try:
            recorded = json.loads(manifest.read_text()).get("experiment")
        except (ValueError, AttributeError):
            recorded = None
        if recorded != experiment:
            raise ValueError(f"--out: expected a new folder or one of a {experiment} sweep; {str(manifest)!r} names "
                             f"{recorded!r}")
    else:
        atomic_write(manifest, lambda tmp: Path(tmp).write_text(json.dumps({"experiment": experiment}) + "\n"))
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


def run_sweep(args: argparse.Namespace, experiment: str, runs: list[dict[str, Any]],
              train_one: Callable[[dict[str, Any], bool], dict[str, Any]], report: Callable[[dict[str, Any]], str]) -> int:
    """``sattn sweep <experiment>``: print the plan (and stop there with ``--dry-run``), train the
    runs in ``args.out`` with :func:`run_grid`, and print one ``report`` line per finished run."""
    out = Path(args.out)
    print_plan(out, runs)
    if args.dry_run:
        return 0
    for result in run_grid(out, experiment, runs, train_one):
        print(f"{result['name']}: {report(result)}")
    return 0
