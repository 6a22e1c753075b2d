"""``sattn train icl`` and ``sattn sweep icl``: in-context linear regression (docs/design.md,
'In-context linear regression').

```
sattn train icl [--config FILE] [section.key=value ...] [--resume]
sattn sweep icl [--config FILE] --widths 16,32,64 --kinds "mha@8;mha@1;bilinear_btt:1@8;bilinear_mlr:8|4|2@8" \
    --lrs 1e-3 --base-steps 3000 --out DIR [section.key=value ...]
sattn plot DIR
sattn eval --checkpoint DIR [--examples 8,16,32] [--batch-size B]
```

A kind is an attention spec and its number of heads, ``SPEC@HEADS`` (``mha@8`` is 8-head
attention, ``mha@1`` one full-rank head with head dim = width); without ``@`` it has ``--heads``.

The sweep matches training FLOPs per width, as ``sattn sweep lm`` does: the budget is what
``--base-steps`` steps of the first kind cost (``experiments.icl.training_flops``: 6 x the
forward multiply-adds per position x positions, step by step along the curriculum, so shorter
early prompts cost less); every other kind trains for as many steps as the same budget buys.
``sattn plot`` draws the error at ``N - 1`` in-context examples versus width and versus training
FLOPs (with each run's validation error along its training), the error versus the number of
examples, and writes a markdown table. ``sattn eval`` prints the same error-by-examples table for
any checkpoint of a run, the model's row beside every baseline's on the run's validation prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from . import ICLConfig, ICLTask
from ...training.checkpoint import LoadedCheckpoint
from ..._cli import kind_list, markdown_cell, number_list, one_line_warnings, pyplot
from ..common import add_sweep_parser, add_train_parser, best_per_kind_width, slug, run_sweep as sweep

EXPERIMENT = ICLTask.experiment  # the name its checkpoints record
NOUN = "an in-context regression model"  # in messages: "expected an in-context regression model's checkpoint"
# sattn eval's own flags for this experiment's checkpoints (flag -> argparse keywords)
EVAL_FLAGS: dict[str, dict[str, Any]] = {
    "--examples": {"help": "comma-separated numbers of in-context examples (default: eight evenly spaced up to N - 1)"},
}


def add_parsers(top: argparse._SubParsersAction, train: argparse._SubParsersAction,
                sweep: argparse._SubParsersAction) -> None:
    add_train_parser(train, EXPERIMENT, "train an in-context linear regression model",
                     "Train a causal transformer on in-context linear regression from a YAML config plus "
                     "section.key=value overrides, e.g. task.n_dims=16 model.attention=bilinear_btt:1 model.d_model=32.",
                     run_train_icl, ICLConfig)

    s = add_sweep_parser(sweep, EXPERIMENT, "widths x attention kinds x learning rates at matched training FLOPs",
                         "runs/sweep-icl", run_sweep)
    s.add_argument("--widths", default="16,32,64", help="comma-separated d_model values (default 16,32,64)")
    s.add_argument("--kinds", default="mha@8;mha@1;bilinear_btt:1@8;bilinear_mlr:8|4|2@8",
                   help="';'-separated SPEC@HEADS kinds; the first sets the FLOP budget "
                        "(default mha@8;mha@1;bilinear_btt:1@8;bilinear_mlr:8|4|2@8)")
    s.add_argument("--heads", type=int, default=8, help="heads of a kind given without @HEADS (default 8)")
    s.add_argument("--lrs", default="1e-3", help="comma-separated learning rates (default 1e-3)")
    s.add_argument("--base-steps", type=int, default=3000, help="steps of the first kind at each width (default 3000)")


def _summary(curves: dict[str, list[float]], n_dims: int) -> list[str]:
    """A few points of the model's and the baselines' error curves (normalised MSE)."""
    n = len(curves["model"])
    ks = sorted({k for k in (0, n_dims // 2, n_dims, n - 1) if 0 <= k < n})
    head = "in-context examples | " + " | ".join(f"{k:>7d}" for k in ks)
    rows = [head, "-" * len(head)]
    for name, curve in curves.items():
        rows.append(f"{name:>19s} | " + " | ".join(f"{curve[k]:7.4f}" for k in ks))
    return rows


def run_train_icl(args: argparse.Namespace) -> int:
    from . import load_icl_config, train_icl

    config = load_icl_config(args.config, args.overrides)
    with one_line_warnings("train"):
        result = train_icl(config, resume=args.resume)
    if result.curves is None:  # a rank other than 0
        return 0
    out = Path(result.out_dir)
    (out / "curves.json").write_text(json.dumps(result.curves) + "\n")
    d, n = config.task.n_dims, config.task.points
    print(f"normalised MSE with {n - 1} in-context examples (d={d}): model {result.mse_last:.4f}, "
          f"least squares {result.curves['least_squares'][-1]:.4f}, averaging {result.curves['averaging'][-1]:.4f}")
    print("\n".join(_summary(result.curves, d)))
    print(f"trained {result.steps} steps, {result.flops:.3e} training FLOPs in {result.wall_s:.1f} s; "
          f"checkpoint {result.checkpoint}; curves in {out / 'curves.json'}")
    return 0


def example_counts(n_examples: int) -> list[int]:
    """Eight evenly spaced numbers of in-context examples up to ``n_examples`` (fewer when it is below 8)."""
    return sorted({max(1, round(n_examples * k / 8)) for k in range(1, 9)})


def run_eval(args: argparse.Namespace, ckpt: LoadedCheckpoint) -> int:
    """``sattn eval`` on an in-context regression checkpoint: the model's and every baseline's
    normalised MSE by number of in-context examples, on the run's validation prompts."""
    from . import error_curves, load_icl, validation_prompts

    model, config, ckpt = load_icl(ckpt, device=args.device)
    n = config.task.points - 1
    if args.examples is None:
        counts = example_counts(n)
    else:
        counts = number_list(args.examples, "--examples", minimum=0)
        if max(counts) > n:
            raise ValueError(f"--examples: expected numbers from 0 to {n} (the prompts have {n + 1} points), got {args.examples!r}")
    prompts = validation_prompts(config, ckpt.state.get("data", {}).get("world_size", 1))  # the run's own
    curves = error_curves(model, prompts, config.task.ridge, args.batch_size or config.run.batch_size,
                          config.task.noise_to_signal)
    print(f"checkpoint {ckpt.path} (step {ckpt.step}), attention {config.model.attention}, {config.model.n_heads} heads; "
          f"{prompts.xs.shape[0]:,} validation prompts, d={config.task.n_dims}")
    print("normalised MSE by number of in-context examples:")
    print("| examples | " + " | ".join(str(i) for i in counts) + " |")
    print("|---|" + "---|" * len(counts))
    for name, curve in curves.items():
        label = markdown_cell(config.model.attention) if name == "model" else f"`{name}`"
        print(f"| {label} | " + " | ".join(f"{curve[i]:.4f}" for i in counts) + " |")
    return 0


def parse_kinds(text: str, default_heads: int) -> list[tuple[str, int]]:
    """``"mha@8;bilinear_btt:1"`` -> ``[("mha", 8), ("bilinear_btt:1", default_heads)]``."""
    kinds = []
    for item in kind_list(text, "sweep"):
        spec, _, heads = item.partition("@")
        try:
            h = int(heads) if heads else default_heads
        except ValueError:
            raise ValueError(f"--kinds: expected SPEC@HEADS with an integer HEADS, got {item!r}") from None
        if h <= 0 or not spec.strip():
            raise ValueError(f"--kinds: expected SPEC@HEADS with a spec and a positive HEADS, got {item!r}")
        kinds.append((spec.strip(), h))
    return kinds


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every run of the sweep: its name, overrides, steps and training FLOPs."""
    from . import build_icl_model, load_icl_config, training_flops
    from ...training.budget import steps_for_flops

    base = load_icl_config(args.config, args.overrides)
    if args.heads <= 0:
        raise ValueError(f"--heads: expected a positive integer, got {args.heads}")
    kinds = parse_kinds(args.kinds, args.heads)
    widths = number_list(args.widths, "--widths")
    lrs = number_list(args.lrs, "--lrs", float, minimum=1e-12)
    if args.base_steps <= 0:
        raise ValueError(f"--base-steps: expected a positive integer, got {args.base_steps}")
    runs = []
    for width in widths:
        configs = {}
        for spec, heads in kinds:
            shape = [f"model.d_model={width}", f"model.n_heads={heads}", f"model.attention={spec}"]
            try:
                configs[(spec, heads)] = (shape, load_icl_config(args.config, [*args.overrides, *shape]))
            except ValueError as e:
                raise ValueError(f"--kinds {spec}@{heads} at width {width}: {e}") from None
        first = configs[kinds[0]][1]
        budget = training_flops(build_icl_model(first), first, args.base_steps)
        for spec, heads in kinds:
            shape, config = configs[(spec, heads)]
            model = build_icl_model(config)
            steps = (args.base_steps if (spec, heads) == kinds[0]
                     else steps_for_flops(budget, lambda s, m=model, c=config: training_flops(m, c, s)))
            for lr in lrs:
                name = f"{slug(spec)}-h{heads}-w{width}-lr{lr:g}"
                runs.append({
                    "name": name, "kind": f"{spec}@{heads}", "attention": spec, "heads": heads, "width": width,
                    "lr": lr, "steps": steps, "flops": training_flops(model, config, steps),
                    "params": sum(p.numel() for p in model.parameters()),
                    "overrides": [*args.overrides, *shape, f"optim.lr={lr}", f"run.steps={steps}",
                                  f"run.out_dir={Path(args.out) / name}"],
                })
    return runs


def _throughput(run_dir: Path) -> float | None:
    speeds = [r["tokens_per_s"] for r in _metrics(run_dir) if "tokens_per_s" in r]
    return statistics.median(speeds) if speeds else None


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _trajectory(run_dir: Path) -> list[tuple[float, float]]:
    """The validation error after each evaluation of a run against the training FLOPs spent by then,
    counted along the curriculum as the sweep's budgets are (the log's own count assumes full prompts)."""
    from . import ICLConfig, build_icl_model, training_flops
    from ...training.config import load_run_config

    rows = {r["step"]: r["val_mse_last"] for r in _metrics(run_dir) if "val_mse_last" in r}  # a resumed run logs a step twice
    if not rows or not (run_dir / "config.json").is_file():
        return []
    config = load_run_config(ICLConfig, run_dir)
    model = build_icl_model(config)
    return [(training_flops(model, config, step), mse) for step, mse in sorted(rows.items())]


def run_sweep(args: argparse.Namespace) -> int:
    from . import load_icl_config, train_icl

    def train_one(r: dict[str, Any], resume: bool) -> dict[str, Any]:
        with one_line_warnings("sweep"):
            result = train_icl(load_icl_config(args.config, r["overrides"]), resume=resume)
        return {"mse_last": result.mse_last, "curves": result.curves, "flops": result.flops,
                "steps_done": result.steps, "wall_s": result.wall_s,
                "tokens_per_s": _throughput(Path(args.out) / r["name"]), "n_dims": result.config["task"]["n_dims"]}

    return sweep(args, EXPERIMENT, plan(args), train_one,
                 lambda r: f"normalised MSE {r['mse_last']:.4f} with {len(r['curves']['model']) - 1} examples")


def matched_flops_table(best: list[dict[str, Any]]) -> list[str]:
    """Markdown lines, per width: each kind's validation error at the training FLOPs of every
    evaluation of the width's most often evaluated run, read from the kind's last evaluation within
    that budget (never one that cost more), so kinds with different costs per step compare at equal
    compute all along training, not only at the end."""
    lines: list[str] = []
    for width in sorted({r["width"] for r in best}):
        runs = [r for r in best if r["width"] == width and "run_dir" in r]
        trajectories = {r["kind"]: _trajectory(Path(r["run_dir"])) for r in runs}
        trajectories = {kind: t for kind, t in trajectories.items() if t}
        if len(trajectories) < 2:
            continue
        budgets = [flops for flops, _ in max(trajectories.values(), key=len)]
        kinds = list(trajectories)
        lines += ["", f"Validation MSE at matched training FLOPs, width {width} (each kind's last evaluation within "
                  "the budget):", "", "| training FLOPs | " + " | ".join(markdown_cell(k) for k in kinds) + " |",
                  "|---|" + "---|" * len(kinds)]
        for budget in budgets:
            cells = []
            for kind in kinds:
                within = [mse for flops, mse in trajectories[kind] if flops <= budget * (1 + 1e-9)]
                cells.append(f"{within[-1]:.4f}" if within else "")
            lines.append(f"| {budget:.3e} | " + " | ".join(cells) + " |")
    return lines


def examples_table(best: list[dict[str, Any]]) -> list[str]:
    """Markdown lines, per width: each kind's and each baseline's validation error at eight evenly
    spaced numbers of in-context examples (the numbers behind ``icl_examples.png``), so a reader can
    see which baseline a model's curve follows, not only where it ends."""
    lines: list[str] = []
    baselines = {k: v for k, v in best[0]["curves"].items() if k != "model"}
    counts = example_counts(len(best[0]["curves"]["model"]) - 1)
    for width in sorted({r["width"] for r in best}):
        models = {r["kind"]: r["curves"]["model"] for r in best if r["width"] == width}
        curves = {**models, **baselines}
        lines += ["", f"Normalised MSE by number of in-context examples, width {width}:", "",
                  "| examples | " + " | ".join(markdown_cell(k) for k in curves) + " |",
                  "|---|" + "---|" * len(curves)]
        lines += [f"| {i} | " + " | ".join(f"{c[i]:.4f}" for c in curves.values()) + " |" for i in counts]
    return lines


BASELINE_STYLE = {"least_squares": ":", "ridge": "-.", "3nn": "--", "averaging": (0, (1, 3)), "gd_step": (0, (3, 1, 1, 1, 1, 1))}


def _figure_legend(fig: Any) -> None:
    """One legend for the whole figure, right of its axes, naming every labelled line of every
    axes once (a kind missing from one panel is still named)."""
    named: dict[str, Any] = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            named.setdefault(label, handle)
    fig.legend(list(named.values()), list(named), loc="outside right upper", fontsize=7)


def plot(results: list[dict[str, Any]], out: Path) -> int:
    """``icl.md`` (the tables: final errors, errors by number of examples, errors at matched FLOPs) and ``icl_width.png``, ``icl_flops.png``, ``icl_examples.png`` in
    ``out`` from a sweep's results (best learning rate per kind and width; a result's ``run_dir``,
    where given, adds the run's validation error along its training to ``icl_flops.png``)."""
    best = best_per_kind_width(results, "mse_last")
    out.mkdir(parents=True, exist_ok=True)
    n_examples = len(best[0]["curves"]["model"]) - 1
    d = best[0].get("n_dims")
    at_d = f"MSE at {d} ex." if d is not None else "MSE at d ex."
    lines = [f"| kind | width | lr | steps | training FLOPs | params | MSE at {n_examples} ex. | {at_d} | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in best:
        tps = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else ""
        mse_d = f"{r['curves']['model'][d]:.4f}" if d is not None and d <= n_examples else ""
        lines.append(f"| {markdown_cell(r['kind'])} | {r['width']} | {r['lr']:g} | {r['steps']} | "
                     f"{r['flops']:.3e} | {r['params']:,} | {r['mse_last']:.4f} | {mse_d} | {tps} |")
    baselines = best[0]["curves"]
    lines += ["", f"Baselines on the same prompts (normalised MSE with {n_examples} examples): "
              + ", ".join(f"{k} {v[-1]:.4f}" for k, v in baselines.items() if k != "model")]
    lines += examples_table(best)
    lines += matched_flops_table(best)
    table = "\n".join(lines)
    (out / "icl.md").write_text(table + "\n")
    print(table)
    plt = pyplot()
    if plt is None:
        return 0
    kinds = list(dict.fromkeys(r["kind"] for r in best))
    ylabel = f"normalised MSE, {n_examples} in-context examples"
    styles = {name: style for name, style in BASELINE_STYLE.items() if name in baselines}  # runs before gd_step lack it

    # Baselines are black and dashed (a pattern each); the kinds have a colour each, solid; a run's
    # error during training is its kind's colour, solid, thicker for wider models.
    def baseline_lines(ax: Any) -> None:
        for name, style in styles.items():
            if baselines[name][-1] > 1e-6:  # noiseless least squares is exactly 0 from d examples on
                ax.axhline(baselines[name][-1], color="black", linestyle=style, linewidth=1, label=name)

    colours = {kind: f"C{i}" for i, kind in enumerate(kinds)}
    widths = sorted({r["width"] for r in best})
    width_lines = {width: 0.6 + 0.8 * i for i, width in enumerate(widths)}
    for key, xlabel, fname in (("width", "width (d_model)", "icl_width.png"), ("flops", "training FLOPs", "icl_flops.png")):
        fig, ax = plt.subplots(figsize=(8.5, 4.5), layout="constrained")
        drawn: set[int] = set()
        for kind in kinds:
            pts = sorted((r[key], r["mse_last"]) for r in best if r["kind"] == kind)
            ax.plot(*zip(*pts), marker="o", color=colours[kind], label=kind)
            if key == "flops":  # each run's validation error as training went, where it was logged
                for r in best:
                    trajectory = _trajectory(Path(r["run_dir"])) if r["kind"] == kind and "run_dir" in r else []
                    if len(trajectory) > 1:
                        ax.plot(*zip(*trajectory), color=colours[kind], linewidth=width_lines[r["width"]], alpha=0.5)
                        drawn.add(r["width"])
        for width in sorted(drawn):
            ax.plot([], [], color="grey", linewidth=width_lines[width], alpha=0.5,
                    label=f"during training, width {width}")
        baseline_lines(ax)
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel, title=f"in-context regression, d={d}")
        if key == "width":
            ax.set_xticks(widths, labels=[str(w) for w in widths])
        ax.grid(True, which="both", alpha=0.3)
        _figure_legend(fig)
        fig.savefig(out / fname, dpi=120)
        plt.close(fig)

    fig, axes = plt.subplots(1, len(widths), figsize=(4.2 * len(widths) + 1.5, 4), sharey=True, squeeze=False,
                             layout="constrained")
    for ax, width in zip(axes[0], widths):
        for kind in kinds:
            for r in best:
                if r["kind"] == kind and r["width"] == width:
                    ax.plot(r["curves"]["model"], color=colours[kind], label=kind)
        for name, style in styles.items():
            ax.plot([max(v, 1e-4) for v in baselines[name]], color="black", linestyle=style, linewidth=1, label=name)
        ax.set(yscale="log", xlabel="in-context examples", title=f"width {width}")
        ax.set_ylim(1e-4, 10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("normalised MSE")
    _figure_legend(fig)
    fig.savefig(out / "icl_examples.png", dpi=120)
    plt.close(fig)
    print(f"wrote {out / 'icl_width.png'}, {out / 'icl_flops.png'}, {out / 'icl_examples.png'} and {out / 'icl.md'}")
    return 0
