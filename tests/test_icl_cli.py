"""``sattn train icl``, ``sattn sweep icl`` and ``sattn plot`` on tiny runs, and one-line errors."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch

from structured_attention.experiments.icl.cli import _trajectory
from structured_attention.cli.main import main
from structured_attention.experiments.icl import ICLConfig, build_icl_model, load_icl_config, training_flops, validation_prompts
from structured_attention.training.checkpoint import load_checkpoint
from structured_attention.training.config import load_run_config

TINY = ["task.n_dims=2", "task.n_points=5", "model.max_seq_len=9", "model.d_model=8", "model.n_layers=1",
        "model.n_heads=1", "run.batch_size=4", "run.eval_batches=2", "run.log_every=1", "optim.warmup_steps=0"]


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.attention=nope"], "model.attention"),
        (["task.n_dims=0"], "task.n_dims"),
        (["task.n_points=0"], "task.n_points"),
        (["task.n_dims=4", "task.sparsity=5"], "task.sparsity"),
        (["task.nope=1"], "task.nope"),
        (["task.n_dims=16", "model.max_seq_len=32"], "model.max_seq_len"),
        (["task.dims_start=0", "task.curriculum_every=10"], "dims_start"),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_the_parameter(overrides, needle, capsys, tmp_path):
    assert main(["train", "icl", f"run.out_dir={tmp_path}", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and err[0].startswith("sattn train: error:")


def test_nan_loss_exits_1_with_one_line_naming_the_step(capsys, tmp_path):
    """lr=1e30: the weights after step 1 give the NaN, so no checkpoint is named as good."""
    args = ["train", "icl", *TINY, "run.steps=6", "optim.lr=1e30", "optim.grad_clip=0", "run.checkpoint_every=1",
            f"run.out_dir={tmp_path}"]
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()  # the training log, then the reason in one line
    assert err[-1].startswith("sattn train: training stopped: the loss is nan at step") and "Traceback" not in err
    assert "no checkpoint of this run has given a finite loss" in err[-1] and "optim.lr" in err[-1]


def test_bad_sweep_kinds_exit_2(capsys, tmp_path):
    assert main(["sweep", "icl", "--kinds", "mha@x", "--out", str(tmp_path), "--dry-run"]) == 2
    assert "--kinds" in capsys.readouterr().err
    assert main(["sweep", "icl", "--kinds", "mha@3", "--widths", "16", "--out", str(tmp_path), "--dry-run"]) == 2
    assert "n_heads" in capsys.readouterr().err


def test_train_icl_prints_the_error_against_the_baselines_and_writes_the_curves(capsys, tmp_path):
    assert main(["train", "icl", *TINY, "run.steps=4", f"run.out_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "normalised MSE with 4 in-context examples (d=2)" in out and "least_squares" in out
    curves = json.loads((tmp_path / "curves.json").read_text())
    assert set(curves) == {"model", "least_squares", "ridge", "3nn", "averaging", "gd_step"} and len(curves["model"]) == 5


def _table(out: str) -> dict[str, list[str]]:
    """The rows of a markdown table printed by ``sattn eval``, by first cell (``examples``: the header)."""
    rows = [[c.strip() for c in line.strip("|").replace("\\|", "/").split("|")] for line in out.splitlines()
            if line.startswith("| ")]
    return {row[0]: row[1:] for row in rows}


def test_eval_prints_the_checkpoints_error_by_number_of_examples_beside_the_baselines(capsys, tmp_path):
    assert main(["train", "icl", *TINY, "model.attention=bilinear_btt:1", "run.steps=3", f"run.out_dir={tmp_path}"]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(step 3)" in out and "8 validation prompts, d=2" in out
    table = _table(out)
    assert table["examples"] == ["1", "2", "3", "4"]  # N - 1 = 4 examples: fewer than eight counts
    # the model's row, recomputed from the checkpoint's weights on the run's validation prompts
    cfg = load_run_config(ICLConfig, tmp_path)
    model = build_icl_model(cfg).eval()
    model.load_state_dict(load_checkpoint(tmp_path).model_state)
    prompts = validation_prompts(cfg)
    with torch.no_grad():
        preds = model(prompts.xs, prompts.ys).double()
    expected = ((preds - prompts.ys.double()) ** 2).mean(0) / 2
    assert table["bilinear_btt:1"] == [f"{expected[i]:.4f}" for i in (1, 2, 3, 4)]
    # noiseless prompts in d = 2: least squares is exact from 2 examples on
    assert table["`least_squares`"][1:] == ["0.0000"] * 3 and set(table) >= {"`ridge`", "`gd_step`", "`3nn`", "`averaging`"}
    assert main(["eval", "--checkpoint", str(tmp_path), "--examples", "0,4"]) == 0
    assert _table(capsys.readouterr().out)["bilinear_btt:1"] == [f"{expected[i]:.4f}" for i in (0, 4)]


@pytest.mark.parametrize("flags, needle", [(["--examples", "5"], "--examples"), (["--examples", "x"], "--examples"),
                                           (["--source", "corpus.txt"], "--source"), (["--max-batches", "2"], "--max-batches")])
def test_eval_bad_input_exits_2_with_one_line_naming_the_parameter(flags, needle, capsys, tmp_path):
    assert main(["train", "icl", *TINY, "run.steps=1", f"run.out_dir={tmp_path}"]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_sweep_matches_training_flops_and_plots(capsys, tmp_path):
    kinds = "mha@2;mha@1;bilinear_btt:1@2"
    args = ["sweep", "icl", "--widths", "8", "--kinds", kinds, "--base-steps", "6", "--out", str(tmp_path), *TINY,
            "task.points_start=3", "task.curriculum_every=2", "run.eval_every=3",
            "run.autocast=bf16"]  # as on CUDA: the result's error is the last evaluation's, autocast and all
    assert main([*args, "--dry-run"]) == 0
    assert main(args) == 0
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*/result.json"))]
    assert len(results) == 3
    budget = next(r["flops"] for r in results if r["kind"] == "mha@2")
    for r in results:
        cfg = load_icl_config(None, r["overrides"])
        per_step = training_flops(build_icl_model(cfg), cfg, r["steps"] + 1) - training_flops(build_icl_model(cfg), cfg, r["steps"])
        assert abs(r["flops"] - budget) <= per_step / 2 + 1e-6  # the nearest whole number of steps
        assert r["steps_done"] == r["steps"] and 0 < r["mse_last"]
        # the validation error along training, against the FLOPs spent by each evaluation
        flops, mse = zip(*_trajectory(tmp_path / r["name"]))
        assert len(flops) == r["steps"] // 3 and list(flops) == sorted(flops) and flops[-1] == pytest.approx(r["flops"])
        assert mse[-1] == pytest.approx(r["mse_last"])
    capsys.readouterr()
    from matplotlib.figure import Figure

    figures, save = [], Figure.savefig
    with mock.patch.object(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k))):
        assert main(["plot", str(tmp_path), "--out", str(tmp_path / "plots")]) == 0
    for name in ("icl.md", "icl_width.png", "icl_flops.png", "icl_examples.png"):
        assert (tmp_path / "plots" / name).is_file()
    for fig in figures:  # one legend per figure, naming every labelled line of every panel
        (legend,) = fig.legends
        assert not any(ax.get_legend() for ax in fig.axes)
        labels = {line.get_label() for ax in fig.axes for line in ax.get_lines() if not line.get_label().startswith("_")}
        assert sorted(t.get_text() for t in legend.get_texts()) == sorted(labels)
        # colour, width and dash pattern (get_linestyle() reads '--' for every custom pattern)
        styles = {t.get_text(): (h.get_color(), h.get_linewidth(), str(h._unscaled_dash_pattern))
                  for t, h in zip(legend.get_texts(), legend.legend_handles)}
        assert len(set(styles.values())) == len(styles), styles  # no two lines look alike
    table = (tmp_path / "plots" / "icl.md").read_text()
    assert table.count("| bilinear_btt:1@2 | 8 |") == 1 and "least_squares" in table
    # the examples table: every kind's and baseline's curve, read at evenly spaced example counts
    header, _, *rows = table.split("by number of in-context examples, width 8:")[1].split("\n\n")[1].strip().splitlines()
    columns = [c.strip() for c in header.strip("|").split("|")][1:]
    curves = {r["kind"]: r["curves"]["model"] for r in results} | {k: v for k, v in results[0]["curves"].items() if k != "model"}
    assert sorted(columns) == sorted(curves) and len(rows) == 4  # 4 examples: counts 1..4
    for row in rows:
        count, *cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells == [f"{curves[k][int(count)]:.4f}" for k in columns]
    # the matched-FLOP table: at each budget a kind shows the error it had reached with no more FLOPs
    _, _, header, _, *matched = table.split("Validation MSE at matched training FLOPs, width 8")[1].strip().splitlines()
    kinds = [r["kind"] for r in results]
    columns = [c.strip() for c in header.strip("|").split("|")][1:]
    assert sorted(columns) == sorted(kinds)
    by_kind = {r["kind"]: _trajectory(tmp_path / r["name"]) for r in results}
    assert len(matched) == max(len(t) for t in by_kind.values())
    for row in matched:
        budget, *cells = [c.strip() for c in row.strip("|").split("|")]
        for kind, cell in zip(columns, cells):
            spent = [(f, m) for f, m in by_kind[kind] if f <= float(budget) * 1.001]
            assert cell == (f"{spent[-1][1]:.4f}" if spent else "")
