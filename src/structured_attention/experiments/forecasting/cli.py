"""``sattn train ts`` and ``sattn sweep ts``: long-range time-series forecasting.

```
sattn train ts [--config FILE] [section.key=value ...] [--resume]
sattn sweep ts [--config FILE] --horizons 96,192,336,720 --kinds "mha;mlr:8|4|4" --seeds 0,1,2 [--out DIR]
sattn plot DIR [--out DOCS_DIR]
sattn eval --checkpoint DIR [--source CSV] [--batch-size B]
```

``train ts`` trains with early stopping on validation MSE, then reports the test MSE and MAE
(normalised data, every test window) of the best-validation model and writes them with a few
example forecasts to ``<run.out_dir>/test.json``. A bad file (missing values, non-numeric cells,
too few rows for lookback + horizon), an unknown target column or config key ends with one line
and exit status 2.

``sweep ts`` trains horizons x attention kinds x seeds (resumable: a run with a ``result.json``
is skipped). ``plot`` writes ``<family>.md`` (test MSE/MAE mean +/- std over seeds per horizon and
kind, beside the published ETTh1 PatchTST/64 and DLinear figures), ``<family>-mse.png`` (test MSE
versus horizon) and ``<family>-forecast.png`` (forecast versus truth on test windows).
``eval`` scores any checkpoint of a run (``<out_dir>/best`` is the one ``train ts`` reports) on
every validation and test window, of the run's file or of another CSV with the same columns.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from . import ForecastTask, TSConfig
from ...training.checkpoint import LoadedCheckpoint
from ..._cli import kind_list, markdown_cell, number_list, one_line_warnings, pyplot
from ..common import add_sweep_parser, add_train_parser, slug, run_sweep as sweep

EXPERIMENT = ForecastTask.experiment  # the name its checkpoints record
NOUN = "a forecaster"  # in messages: "expected a forecaster's checkpoint"
# sattn eval's own flags for this experiment's checkpoints (flag -> argparse keywords)
EVAL_FLAGS: dict[str, dict[str, Any]] = {
    "--source": {"help": "score this CSV (the same columns) instead of the run's file"},
}

# Published ETTh1 multivariate test (MSE, MAE) on normalised data, as the papers report them:
# PatchTST/64 (Nie et al., 2023, lookback 512) and DLinear (Zeng et al., 2023, lookback 336).
PUBLISHED = {
    "PatchTST/64": {96: (0.370, 0.400), 192: (0.413, 0.429), 336: (0.422, 0.440), 720: (0.447, 0.468)},
    "DLinear": {96: (0.375, 0.399), 192: (0.405, 0.416), 336: (0.439, 0.443), 720: (0.472, 0.490)},
}


def add_parsers(top: argparse._SubParsersAction, train: argparse._SubParsersAction,
                sweep: argparse._SubParsersAction) -> None:
    add_train_parser(train, EXPERIMENT, "train a forecaster (ETT or any CSV) and report test MSE/MAE",
                     "Train a point-token or patch forecaster from a YAML config plus section.key=value "
                     "overrides, e.g. data.source=ETTh1.csv data.horizon=336 model.attention=mlr:8|4|4.", run_train_ts, TSConfig)

    s = add_sweep_parser(sweep, EXPERIMENT, "horizons x attention kinds x seeds; test MSE/MAE of each", "runs/sweep-ts", run_sweep)
    s.add_argument("--horizons", default="96,192,336,720", help="comma-separated horizons (default 96,192,336,720)")
    s.add_argument("--kinds", default="mha;mlr:8|4|4", help="';'-separated attention specs (default mha;mlr:8|4|4)")
    s.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")


def _report(result: dict[str, Any]) -> str:
    return (f"test MSE {result['test_mse']:.4f}, MAE {result['test_mae']:.4f} over {result['test_windows']} windows "
            f"(best validation MSE {result['val_mse']:.4f} at step {result['best_step']} of {result['steps']})")


def run_train_ts(args: argparse.Namespace) -> int:
    from . import load_ts_config, train_ts

    config = load_ts_config(args.config, args.overrides)
    with one_line_warnings("train"):
        result = train_ts(config, resume=args.resume)
    if result.scores is not None:  # rank 0
        print(_report(result.test_json()))
        print(f"trained in {result.wall_s:.1f} s; metrics and example forecasts in {Path(config.run.out_dir) / 'test.json'}")
    return 0


def run_eval(args: argparse.Namespace, ckpt: LoadedCheckpoint) -> int:
    """``sattn eval`` on a forecasting checkpoint: MSE and MAE (normalised with the run's training
    statistics) over every validation and test window, and over the test windows PatchTST's
    published figures used."""
    import numpy as np

    from . import PUBLISHED_TEST_BATCH, checkpoint_series, forecast_metrics, load_forecaster

    model, config, ckpt = load_forecaster(ckpt, device=args.device)
    data = checkpoint_series(config, ckpt, args.source)
    batch_size = args.batch_size or config.run.batch_size
    n_test = data.n_windows("test")
    n_published = n_test // PUBLISHED_TEST_BATCH * PUBLISHED_TEST_BATCH
    rows = [("val", "val", data.n_windows("val"), None), ("test", "test", n_test, None)]
    if n_published:
        rows.append((f"test, first {n_published:,} (PatchTST's windows)", "test", n_published, np.arange(n_published)))
    print(f"checkpoint {ckpt.path} (step {ckpt.step}), {config.model.family} model, attention {config.model.backbone.attention}")
    print(data.describe())
    print("| split | windows | MSE | MAE |")
    print("|---|---|---|---|")
    for label, split, n, index in rows:
        m = forecast_metrics(model, data, split, batch_size, device=args.device, index=index)
        print(f"| {label} | {n:,} | {m['mse']:.4f} | {m['mae']:.4f} |")
    return 0


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every run of the sweep: its name, horizon, kind, seed and overrides (each checked by
    building its config, so a bad kind or horizon fails before anything trains)."""
    from . import load_ts_config

    base = load_ts_config(args.config, args.overrides)
    horizons = number_list(args.horizons, "--horizons")
    seeds = number_list(args.seeds, "--seeds", minimum=0)
    kinds = kind_list(args.kinds, "sweep")
    runs = []
    for horizon in horizons:
        for kind in kinds:
            for seed in seeds:
                name = f"{base.model.family}-{slug(kind)}-h{horizon}-s{seed}"
                overrides = [*args.overrides, f"data.horizon={horizon}", f"model.attention={kind}", f"run.seed={seed}",
                             f"run.out_dir={Path(args.out) / name}"]
                load_ts_config(args.config, overrides)
                runs.append({"name": name, "family": base.model.family, "horizon": horizon, "kind": kind,
                             "seed": seed, "overrides": overrides})
    return runs


def run_sweep(args: argparse.Namespace) -> int:
    from . import load_ts_config, train_ts

    def train_one(r: dict[str, Any], resume: bool) -> dict[str, Any]:
        with one_line_warnings("sweep"):
            return train_ts(load_ts_config(args.config, r["overrides"]), resume=resume).test_json()

    return sweep(args, EXPERIMENT, plan(args), train_one, _report)


# -- plots and tables ------------------------------------------------------------------------------


def _mean_std(values: list[float]) -> str:
    """``mean ± sample std``; a single value alone (it has no spread to show)."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def _groups(results: list[dict[str, Any]]) -> dict[tuple[str, int, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in sorted(results, key=lambda r: (r["family"], r["horizon"], r["seed"])):
        groups.setdefault((r["family"], r["horizon"], r["kind"]), []).append(r)
    return groups


def table(results: list[dict[str, Any]], family: str) -> str:
    """Markdown: per horizon, each kind's test MSE and MAE (mean ± std over seeds), the linear
    skip alone where the model has one, and the published ETTh1 figures."""
    groups = {k: v for k, v in _groups(results).items() if k[0] == family}
    kinds = list(dict.fromkeys(k[2] for k in groups))
    horizons = sorted({k[1] for k in groups})
    # the ridge-fitted linear skip alone (model.linear_skip), the same for every kind and seed
    skip = {h: [r for (_, rh, _), rs in groups.items() if rh == h for r in rs if "skip_test_mse" in r] for h in horizons}
    head = ["horizon", *[f"{k} MSE" for k in kinds], *[f"{k} MAE" for k in kinds]]
    head += ["linear skip alone MSE / MAE"] if any(skip.values()) else []
    head += [f"{p} MSE / MAE" for p in PUBLISHED]
    lines = ["| " + " | ".join(h.replace("|", "\\|") for h in head) + " |", "|" + "---|" * len(head)]
    for h in horizons:
        cells = [str(h)]
        for metric in ("test_mse", "test_mae"):
            for k in kinds:
                rs = groups.get((family, h, k), [])
                cells.append(f"{_mean_std([r[metric] for r in rs])} (n={len(rs)})" if rs else "")
        if any(skip.values()):
            rs = skip[h]
            cells.append(f"{statistics.mean(r['skip_test_mse'] for r in rs):.3f} / "
                         f"{statistics.mean(r['skip_test_mae'] for r in rs):.3f}" if rs else "")
        for figures in PUBLISHED.values():
            cells.append("{:.3f} / {:.3f}".format(*figures[h]) if h in figures else "")
        lines.append("| " + " | ".join(cells) + " |")
    if len(kinds) > 1:  # each kind against the first, seed by seed (same seed: same init and batches)
        base = kinds[0]
        lines += ["", f"Test MSE change against {markdown_cell(base)}, paired by seed (negative: lower error):", "",
                  "| horizon | " + " | ".join(k.replace("|", "\\|") for k in kinds[1:]) + " |", "|" + "---|" * len(kinds)]
        for h in horizons:
            ref = {r["seed"]: r["test_mse"] for r in groups.get((family, h, base), [])}
            cells = [str(h)]
            for k in kinds[1:]:
                pairs = [(r["test_mse"], ref[r["seed"]]) for r in groups.get((family, h, k), []) if r["seed"] in ref]
                if not pairs:
                    cells.append("")
                    continue
                mean_k = statistics.mean(a for a, _ in pairs)
                mean_b = statistics.mean(b for _, b in pairs)
                wins = sum(a < b for a, b in pairs)
                cells.append(f"{100 * (mean_k - mean_b) / mean_b:+.2f}% (lower in {wins} of {len(pairs)} seeds)")
            lines.append("| " + " | ".join(cells) + " |")
    scored = {(h, k): [r["test_mse_published_windows"] for r in groups.get((family, h, k), [])
                       if "test_mse_published_windows" in r] for h in horizons for k in kinds}
    windows = {h: r["published_windows"] for (_, h, _), rs in groups.items() for r in rs if "published_windows" in r}
    patchtst = PUBLISHED["PatchTST/64"]
    if windows:  # scored as PatchTST's published figures were, for a like-for-like comparison
        lines += ["", "Test MSE on the test windows PatchTST's published figures averaged over (its loader dropped "
                  "the last partial batch of 128), and the change against PatchTST/64:", "",
                  "| horizon | windows | " + " | ".join(k.replace("|", "\\|") for k in kinds) + " | PatchTST/64 |",
                  "|" + "---|" * (3 + len(kinds))]
        for h in horizons:
            if h not in windows or h not in patchtst:
                continue
            ref = patchtst[h][0]
            cells = [str(h), str(windows[h])]
            for k in kinds:
                values = scored[(h, k)]
                cells.append(f"{_mean_std(values)} ({100 * (statistics.mean(values) - ref) / ref:+.1f}%)" if values else "")
            cells.append(f"{ref:.3f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], out: Path) -> int:
    """For each model family in the sweep: ``<family>.md`` (the table), ``<family>-mse.png``
    (test MSE versus horizon, mean ± std over seeds, published figures dashed) and
    ``<family>-forecast.png`` (the first seed's forecasts of one test window per horizon)."""
    out.mkdir(parents=True, exist_ok=True)
    families = list(dict.fromkeys(r["family"] for r in results))
    for family in families:
        text = table(results, family)
        (out / f"{family}.md").write_text(text + "\n", encoding="utf-8")
        print(text)
    plt = pyplot()
    if plt is None:
        return 0
    groups = _groups(results)
    for family in families:
        mine = {k: v for k, v in groups.items() if k[0] == family}
        kinds = list(dict.fromkeys(k[2] for k in mine))
        horizons = sorted({k[1] for k in mine})

        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for kind in kinds:
            hs = [h for h in horizons if (family, h, kind) in mine]
            values = [[r["test_mse"] for r in mine[(family, h, kind)]] for h in hs]
            ax.errorbar(hs, [statistics.mean(v) for v in values],
                        yerr=[statistics.stdev(v) if len(v) > 1 else 0 for v in values], marker="o", capsize=3, label=kind)
        for name, figures in PUBLISHED.items():
            hs = [h for h in horizons if h in figures]
            ax.plot(hs, [figures[h][0] for h in hs], ls="--", marker="x", label=f"{name} (published)")
        ax.set(xlabel="horizon", ylabel="test MSE (normalised)", title=f"{family} model: test MSE (mean ± std over seeds)")
        ax.set_xticks(horizons)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{family}-mse.png", dpi=120)
        plt.close(fig)

        fig, axes = plt.subplots(len(horizons), 1, figsize=(9, 2.6 * len(horizons)), squeeze=False)
        for ax, h in zip(axes[:, 0], horizons):
            shown = False
            for kind in kinds:
                rs = mine.get((family, h, kind), [])
                if not rs or not rs[0].get("examples"):
                    continue
                ex = rs[0]["examples"][len(rs[0]["examples"]) // 2]  # the middle test window
                past = ex["history"][-min(len(ex["history"]), 2 * h):]
                if not shown:
                    ax.plot(range(-len(past), 0), past, color="0.5", lw=1, label="lookback")
                    ax.plot(range(h), ex["truth"], color="black", lw=1.2, label="truth")
                    shown = True
                ax.plot(range(h), ex["forecast"], lw=1.2, label=f"{kind} (seed {rs[0]['seed']})")
            if shown:
                ax.set_title(f"horizon {h}: {ex['channel']} from {ex['start_date']} (test window {ex['window']}, normalised)", fontsize=9)
                ax.axvline(0, color="0.7", lw=0.8)
                ax.legend(fontsize=7, loc="upper left")
                ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / f"{family}-forecast.png", dpi=110)
        plt.close(fig)
        print(f"wrote {out / f'{family}.md'}, {out / f'{family}-mse.png'} and {out / f'{family}-forecast.png'}")
    return 0
