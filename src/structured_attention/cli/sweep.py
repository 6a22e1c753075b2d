"""``sattn sweep lm`` and ``sattn plot``: a grid of widths x attention kinds (x learning rates)
at matched training FLOPs, and the loss-versus-FLOPs plot and table it gives.

FLOPs are matched per width: the budget is what ``--base-steps`` steps of the first kind cost
(``steps x tokens per step x GPT.training_flops_per_token``, 2 FLOPs per multiply-add, forward
and backward, counting each attention kind's own cost); every other kind trains for as many steps
as the same budget buys. Each run lives in its own folder and a finished run is not trained again,
so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

from ..models.gpt import GPT


def add_parser(sub: argparse._SubParsersAction) -> None:
    sweep = sub.add_parser("sweep", help="grids of training runs")
    what = sweep.add_subparsers(dest="what", required=True)
    lm = what.add_parser("lm", help="widths x attention kinds x learning rates at matched training FLOPs")
    lm.add_argument("--config", default=None, help="base YAML config (default: built-in defaults)")
    lm.add_argument("--widths", default="64,128,256", help="comma-separated d_model values (default 64,128,256)")
    lm.add_argument("--head-dim", type=int, default=32, help="head dim; heads = width / head-dim (default 32)")
    lm.add_argument("--kinds", default="mha;swa:128;global_swa:16|16;mlr:16|8|4|4",
                    help="';'-separated attention specs; the first sets the FLOP budget (default mha;swa:128;global_swa:16|16;mlr:16|8|4|4)")
    lm.add_argument("--lrs", default="1e-3,3e-3", help="comma-separated learning rates (default 1e-3,3e-3)")
    lm.add_argument("--base-steps", type=int, default=300, help="steps of the first kind at each width (default 300)")
    lm.add_argument("--out", default="runs/sweep-lm", help="sweep folder (default runs/sweep-lm)")
    lm.add_argument("--dry-run", action="store_true", help="print the planned runs and exit")
    lm.add_argument("overrides", nargs="*", help="section.key=value overrides of the base config")
    lm.set_defaults(run=run_sweep)

    plot = sub.add_parser("plot", help="loss-versus-FLOPs PNG and markdown table of a sweep")
    plot.add_argument("sweep_dir", help="a folder made by 'sattn sweep lm'")
    plot.add_argument("--out", default=None, help="folder for lm.png and lm.md (default: the sweep folder)")
    plot.set_defaults(run=run_plot)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every run of the sweep: its name, overrides, steps and training FLOPs."""
    from ..experiments.lm import load_lm_config

    base = load_lm_config(args.config, args.overrides)
    kinds = [k.strip() for k in args.kinds.split(";") if k.strip()]
    try:
        widths = [int(w) for w in args.widths.split(",")]
        lrs = [float(x) for x in args.lrs.split(",")]
    except ValueError:
        raise ValueError(f"--widths/--lrs: expected comma-separated numbers, got {args.widths!r} / {args.lrs!r}") from None
    for w in widths:
        if w <= 0 or w % args.head_dim:
            raise ValueError(f"--widths: expected multiples of --head-dim={args.head_dim}, got {w}")
    if not kinds:
        raise ValueError("--kinds: expected at least one attention spec")
    if args.base_steps <= 0:
        raise ValueError(f"--base-steps: expected a positive integer, got {args.base_steps}")
    tokens_per_step = base.run.batch_size * base.run.grad_accum * base.run.seq_len
    runs = []
    for width in widths:
        shape = {"d_model": width, "n_heads": width // args.head_dim}
        per_token = {}
        for kind in kinds:
            model_cfg = base.model.__class__(**{**base.model.to_dict(), **shape, "attention": kind})
            per_token[kind] = GPT(model_cfg).training_flops_per_token(base.run.seq_len)
        budget = args.base_steps * tokens_per_step * per_token[kinds[0]]
        for kind in kinds:
            steps = max(1, round(budget / (tokens_per_step * per_token[kind])))
            for lr in lrs:
                name = f"{_slug(kind)}-w{width}-lr{lr:g}"
                runs.append({
                    "name": name, "kind": kind, "width": width, "lr": lr, "steps": steps,
                    "flops": steps * tokens_per_step * per_token[kind],
                    "overrides": [*args.overrides, f"model.d_model={width}", f"model.n_heads={shape['n_heads']}",
                                  f"model.attention={kind}", f"optim.lr={lr}", f"run.steps={steps}",
                                  f"run.out_dir={Path(args.out) / name}", "run.sample_tokens=0"],
                })
    return runs


def _result(run_dir: Path) -> dict[str, Any] | None:
    """Final validation numbers and median throughput from a run's metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "val_loss" in r]
    if not evals:
        return None
    speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    last = evals[-1]
    return {"step": last["step"], "val_loss": last["val_loss"], "val_bpb": last.get("val_bpb"),
            "tokens_per_s": statistics.median(speeds) if speeds else None}


def run_sweep(args: argparse.Namespace) -> int:
    runs = plan(args)
    out = Path(args.out)
    print(f"sweep: {len(runs)} runs in {out}")
    for r in runs:
        print(f"  {r['name']:40s} steps {r['steps']:6d}  training FLOPs {r['flops']:.3e}")
    if args.dry_run:
        return 0
    from ..experiments.lm import load_lm_config, train_lm

    out.mkdir(parents=True, exist_ok=True)
    for r in runs:
        run_dir = out / r["name"]
        done = run_dir / "result.json"
        if not done.is_file():
            train_lm(load_lm_config(args.config, r["overrides"]))
            result = _result(run_dir)
            if result is None:
                raise ValueError(f"sweep: run {r['name']} left no validation metrics in {run_dir}")
            done.write_text(json.dumps({**{k: v for k, v in r.items() if k != "overrides"}, **result}, indent=2))
        print(f"done {r['name']}: {json.loads(done.read_text())['val_bpb']:.4f} bits/byte", flush=True)
    return 0


def _best_per_kind_width(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for r in results:
        key = (r["kind"], r["width"])
        if key not in best or r["val_loss"] < best[key]["val_loss"]:
            best[key] = r
    return sorted(best.values(), key=lambda r: (r["width"], r["flops"]))


def run_plot(args: argparse.Namespace) -> int:
    sweep = Path(args.sweep_dir)
    if not sweep.is_dir():
        raise FileNotFoundError(f"sweep_dir: no such folder: {str(sweep)!r}")
    results = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/result.json"))]
    if not results:
        raise ValueError(f"sweep_dir: no finished runs (*/result.json) in {str(sweep)!r}")
    best = _best_per_kind_width(results)
    out = Path(args.out) if args.out else sweep
    out.mkdir(parents=True, exist_ok=True)
    lines = ["| kind | width | best lr | steps | training FLOPs | val bits/byte | tokens/s |", "|---|---|---|---|---|---|---|"]
    for r in best:
        tps = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else ""
        lines.append(f"| {r['kind'].replace('|', chr(92) + '|')} | {r['width']} | {r['lr']:g} | {r['steps']} | "
                     f"{r['flops']:.3e} | {r['val_bpb']:.4f} | {tps} |")
    table = "\n".join(lines)
    (out / "lm.md").write_text(table + "\n")
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'structured-attention[bench]'): no PNG written")
        return 0
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for kind in dict.fromkeys(r["kind"] for r in best):
        pts = sorted((r["flops"], r["val_bpb"]) for r in best if r["kind"] == kind)
        ax.plot(*zip(*pts), marker="o", label=kind)
    ax.set(xscale="log", xlabel="training FLOPs", ylabel="validation bits per byte", title="loss vs training FLOPs (best lr)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "lm.png", dpi=120)
    plt.close(fig)
    print(f"wrote {out / 'lm.png'} and {out / 'lm.md'}")
    return 0
