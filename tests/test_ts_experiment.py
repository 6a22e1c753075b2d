"""The forecasting experiment: metrics against numpy, reproducible epoch batches, training that
beats the last-value baseline, the best model scored on the test split, the CLI (one-line errors,
sweep, plot) -- on small synthetic CSVs."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from structured_attention.cli.main import main
from structured_attention.data.timeseries import load_series
from structured_attention.experiments.forecasting import (
    ForecastTask,
    TSConfig,
    forecast_metrics,
    load_forecaster,
    load_ts_config,
    train_ts,
)
from structured_attention.models.forecasting import ForecasterConfig, build_forecaster
from structured_attention.training.config import load_run_config

ETTH1 = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "ett" / "ETTh1.csv"


def sinusoid_csv(path: Path, n: int = 1200, seed: int = 0) -> Path:
    """Two channels with a 24-step cycle (and a phase shift), a slow trend and a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    a = np.sin(2 * np.pi * t / 24) + 0.002 * t + 0.05 * rng.normal(size=n)
    b = 2 * np.cos(2 * np.pi * t / 24 + 0.5) + 0.05 * rng.normal(size=n)
    rows = ["date,a,OT"] + [f"2020-01-01 {i},{float(x)!r},{float(y)!r}" for i, x, y in zip(t, a, b)]
    path.write_text("\n".join(rows) + "\n")
    return path


def small_config(tmp_path: Path, *overrides: str):
    base = [
        f"data.source={sinusoid_csv(tmp_path / 'sine.csv')}", "data.lookback=48", "data.horizon=24",
        "model.family=patch", "model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.patch_len=8",
        "model.stride=4", "model.dropout=0.0", "model.attention=mlr:4|4", "optim.lr=3e-3", "optim.warmup_steps=5",
        "run.steps=60", "run.batch_size=16", "run.eval_every=20", "run.log_every=20", "run.eval_batches=4",
        f"run.out_dir={tmp_path / 'run'}",
        "run.device=cpu",  # the tests score the trained model again on the CPU, to 1e-6
    ]
    return load_ts_config(None, [*base, *overrides])


def test_metrics_equal_numpy_over_every_window_including_the_last_partial_batch(tmp_path):
    data = load_series(sinusoid_csv(tmp_path / "s.csv", n=600), lookback=48, horizon=24)
    torch.manual_seed(0)
    encoder = dataclasses.replace(ForecasterConfig().backbone, n_layers=1, d_model=16, n_heads=2, dropout=0.0)
    model = build_forecaster(ForecasterConfig(family="point", n_channels=2, lookback=48, horizon=24,
                                              backbone=encoder)).eval()
    a, _ = data.borders["test"]
    n = data.n_windows("test")
    assert n % 7 != 0
    preds, truths = [], []
    with torch.no_grad():
        for i in range(n):  # one window at a time, sliced from the scaled array by hand
            x = data.values[a + i:a + i + 48]
            preds.append(model(torch.from_numpy(x)[None])[0].numpy())
            truths.append(data.values[a + i + 48:a + i + 72])
    err = np.stack(preds).astype(np.float64) - np.stack(truths)
    got = forecast_metrics(model, data, "test", batch_size=7)
    assert got["mse"] == pytest.approx(np.mean(err**2), rel=1e-5)
    assert got["mae"] == pytest.approx(np.mean(np.abs(err)), rel=1e-5)


def test_batches_are_a_pure_function_of_seed_and_index_and_cover_each_epoch(tmp_path):
    task = ForecastTask(small_config(tmp_path, "run.batch_size=8"))
    task.prepare(None)
    n = task.data.n_windows("train")
    per_epoch = n // 8
    epoch = np.concatenate([task.train_windows(i, 0, 1) for i in range(per_epoch)])
    assert len(np.unique(epoch)) == per_epoch * 8  # no window twice in an epoch
    assert not np.array_equal(task.train_windows(per_epoch, 0, 1), task.train_windows(0, 0, 1))  # reshuffled
    x, y = task.batch(3, 0, 1, torch.device("cpu"))
    wx, wy = task.data.windows("train", task.train_windows(3, 0, 1))
    torch.testing.assert_close(x, torch.from_numpy(wx))
    torch.testing.assert_close(y, torch.from_numpy(wy))
    again = ForecastTask(small_config(tmp_path, "run.batch_size=8"))
    again.prepare(None)
    np.testing.assert_array_equal(again.train_windows(3, 0, 1), task.train_windows(3, 0, 1))
    # two ranks of a step together are the one-process global batch of twice the size
    big = ForecastTask(small_config(tmp_path, "run.batch_size=16"))
    big.prepare(None)
    both = np.concatenate([task.train_windows(5, 0, 2), task.train_windows(5, 1, 2)])
    np.testing.assert_array_equal(both, big.train_windows(5, 0, 1))


def test_training_beats_the_last_value_baseline_and_scores_the_best_model(tmp_path):
    config = small_config(tmp_path)
    result = train_ts(config)
    data = load_series(config.data.source, lookback=48, horizon=24)
    x, y = data.windows("test", np.arange(data.n_windows("test")))
    last_value_mse = float(np.mean((x[:, -1:, :] - y) ** 2))
    assert result.scores.test_mse < 0.2 * last_value_mse
    assert result.scores.test_windows == data.n_windows("test") and result.steps == 60
    saved = json.loads((tmp_path / "run" / "test.json").read_text())
    assert saved == result.test_json() and saved["test_mse"] == result.scores.test_mse
    ex = saved["examples"][0]
    assert ex["channel"] == "OT" and len(ex["history"]) == 48 and len(ex["truth"]) == len(ex["forecast"]) == 24
    # the reported numbers are the best-validation model's, as reloaded from <out_dir>/best
    model, loaded, ckpt = load_forecaster(tmp_path / "run" / "best")
    assert ckpt.step == result.best_step and loaded.model.n_channels == 2
    # config.json: the config as given, and as run, with the data's lookback, horizon and channels
    assert load_run_config(TSConfig, tmp_path / "run", "requested") == config
    resolved = load_run_config(TSConfig, tmp_path / "run")
    assert resolved == loaded and resolved.model == dataclasses.replace(config.model, lookback=48, horizon=24, n_channels=2)
    assert (config.model.lookback, config.model.n_channels) == (512, 7)  # the defaults, as given
    assert ckpt.state["columns"] == ["a", "OT"]
    assert forecast_metrics(model, data, "test")["mse"] == pytest.approx(result.scores.test_mse, rel=1e-6)
    # PatchTST's published figures dropped the last partial test batch of 128: scored apart, by hand here
    kept = data.n_windows("test") // 128 * 128
    assert kept > 0 and saved["published_windows"] == kept
    with torch.no_grad():
        err = model(torch.from_numpy(x[:kept])).double().numpy() - y[:kept]
    assert saved["test_mse_published_windows"] == pytest.approx(np.mean(err**2), rel=1e-5)
    assert saved["test_mae_published_windows"] == pytest.approx(np.mean(np.abs(err)), rel=1e-5)


def test_without_keep_best_the_last_model_is_scored_with_its_own_validation(tmp_path):
    """run.keep_best=false scores the last model on the test windows: test.json's validation
    figures are that model's too (they were the best evaluation's, another model's)."""
    from structured_attention.experiments.forecasting import _spread

    config = small_config(tmp_path, "run.keep_best=false", "run.eval_every=10", "run.patience=0", "optim.lr=3e-2",
                          "optim.schedule=constant")
    result = train_ts(config)
    assert result.best_step < result.steps == 60  # the last model is not the best one
    saved = json.loads((tmp_path / "run" / "test.json").read_text())
    model, _, ckpt = load_forecaster(tmp_path / "run" / "ckpt")
    assert ckpt.step == 60
    data = load_series(config.data.source, lookback=48, horizon=24)
    val = forecast_metrics(model, data, "val", index=_spread(data.n_windows("val"), 4 * 16))
    assert saved["val_mse"] == pytest.approx(val["mse"], rel=1e-5) and saved["val_mae"] == pytest.approx(val["mae"], rel=1e-5)
    assert saved["test_mse"] == pytest.approx(forecast_metrics(model, data, "test")["mse"], rel=1e-6)


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("problem", ["missing", "text", "short", "target", "blocks", "model-horizon", "model-channels"])
def test_bad_inputs_end_with_one_line_and_status_2(tmp_path, capsys, problem):
    path = sinusoid_csv(tmp_path / "in.csv", n=400)
    lines = path.read_text().splitlines()
    args = [f"data.source={path}", "data.lookback=48", "data.horizon=24", f"run.out_dir={tmp_path / 'r'}"]
    expected = {"missing": "missing value in column 'a' at line 11", "text": "non-numeric value 'n/k'",
                "short": "too few for lookback 48 + horizon 24", "target": "target: expected one of the columns",
                "blocks": "model.attention='mlr:4|2|1|1': block_sizes",
                # the data decides these: a model.* value of its own was silently replaced
                "model-horizon": "model.horizon: expected data.horizon's value, 24",
                "model-channels": "model.n_channels: expected the file's channel count, 2"}[problem]
    if problem in ("missing", "text"):
        lines[10] = lines[10].split(",")[0] + ("," if problem == "missing" else ",n/k") + "," + lines[10].split(",")[2]
        path.write_text("\n".join(lines) + "\n")
    elif problem == "short":
        path.write_text("\n".join(lines[:150]) + "\n")
    elif problem == "target":
        args.append("data.target=load")
    elif problem.startswith("model-"):
        args.append("model.horizon=12" if problem == "model-horizon" else "model.n_channels=5")
    else:  # 48-step lookback, patches of 8 every 8 steps: 7 patches, not divisible by 2^3
        args += ["model.family=patch", "model.d_model=16", "model.n_heads=2", "model.patch_len=8", "model.stride=8",
                 "model.attention=mlr:4|2|1|1"]
    code, err = run_cli(capsys, "train", "ts", *args)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("sattn train: error:")
    assert expected in err
    if problem == "blocks":
        assert "context=7" in err  # 7 patches


def test_cli_sweep_is_resumable_and_plots_tables_and_pngs(tmp_path, capsys):
    sinusoid_csv(tmp_path / "sine.csv", n=600)
    out = tmp_path / "sweep"
    argv = ["sweep", "ts", "--horizons", "12,24", "--kinds", "mha;mlr:4|4", "--seeds", "0,1", "--out", str(out),
            f"data.source={tmp_path / 'sine.csv'}", "data.lookback=48", "model.family=patch", "model.n_layers=1",
            "model.d_model=16", "model.n_heads=2", "model.patch_len=8", "model.stride=4", "run.steps=4",
            "run.eval_every=2", "run.batch_size=8", "run.eval_batches=2", "run.log_every=2"]
    assert main(argv) == 0
    names = sorted(p.parent.name for p in out.glob("*/result.json"))
    assert len(names) == 8 and "patch-mlr-4-4-h24-s1" in names
    result = json.loads((out / "patch-mha-h12-s0" / "result.json").read_text())
    assert result["horizon"] == 12 and result["kind"] == "mha" and result["test_mse"] > 0
    capsys.readouterr()
    assert main(argv) == 0  # everything done: nothing retrains
    assert "step" not in capsys.readouterr().err
    docs = tmp_path / "docs"
    assert main(["plot", str(out), "--out", str(docs)]) == 0
    table = (docs / "patch.md").read_text()
    assert "mlr:4\\|4 MSE" in table and "PatchTST/64 MSE / MAE" in table and "(n=2)" in table
    mse = [json.loads((out / f"patch-mha-h24-s{s}" / "result.json").read_text())["test_mse"] for s in (0, 1)]
    assert f"{np.mean(mse):.3f} ± {np.std(mse, ddof=1):.3f}" in table
    mlr = [json.loads((out / f"patch-mlr-4-4-h24-s{s}" / "result.json").read_text())["test_mse"] for s in (0, 1)]
    change = 100 * (np.mean(mlr) - np.mean(mse)) / np.mean(mse)
    wins = sum(a < b for a, b in zip(mlr, mse))
    assert "Test MSE change against mha, paired by seed" in table
    assert f"| 24 | {change:+.2f}% (lower in {wins} of 2 seeds) |" in table
    assert (docs / "patch-mse.png").stat().st_size > 0 and (docs / "patch-forecast.png").stat().st_size > 0


def test_a_sweep_continues_an_interrupted_run_from_its_checkpoint(tmp_path, capsys):
    sinusoid_csv(tmp_path / "sine.csv", n=600)
    argv = ["--horizons", "12", "--kinds", "mha", "--seeds", "0", f"data.source={tmp_path / 'sine.csv'}",
            "data.lookback=48", "model.family=patch", "model.n_layers=1", "model.d_model=16", "model.n_heads=2",
            "model.patch_len=8", "model.stride=4", "run.eval_every=2", "run.batch_size=8", "run.eval_batches=2",
            "run.log_every=2", "run.patience=0", "run.device=cpu"]  # `sattn eval` below scores on the CPU
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(["sweep", "ts", "--out", str(whole), *argv, "run.steps=4"]) == 0
    # killed after its step-2 checkpoint, before writing result.json
    assert main(["sweep", "ts", "--out", str(cut), *argv, "run.steps=2"]) == 0
    (cut / "patch-mha-h12-s0" / "result.json").unlink()
    capsys.readouterr()
    assert main(["sweep", "ts", "--out", str(cut), *argv, "run.steps=4"]) == 0
    assert re.search(r"resumed from \S+step-0+2 at step 2", capsys.readouterr().err)
    resumed, straight = (json.loads((d / "patch-mha-h12-s0" / "result.json").read_text()) for d in (cut, whole))
    assert resumed["steps"] == 4
    assert resumed["test_mse"] == pytest.approx(straight["test_mse"], rel=1e-6)
    # `sattn eval` on the run's best checkpoint gives the test MSE the run reported
    assert main(["eval", "--checkpoint", str(cut / "patch-mha-h12-s0" / "best")]) == 0
    assert eval_table(capsys.readouterr().out)["test"][1] == f"{resumed['test_mse']:.4f}"


def eval_table(out: str) -> dict[str, list[str]]:
    """The rows of the markdown table printed by ``sattn eval``, by first cell."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")]
    return {r[0]: r[1:] for r in rows}


def test_eval_scores_every_window_with_the_checkpoints_training_statistics(tmp_path, capsys):
    config = small_config(tmp_path, "run.steps=4", "run.eval_every=2", "run.batch_size=8")
    train_ts(config)
    capsys.readouterr()
    model, _, _ = load_forecaster(tmp_path / "run" / "best")

    def by_hand(csv: Path, split: str) -> tuple[float, float, int]:
        # every window, sliced from the CSV scaled by hand with the first run's training rows
        trained_on = np.loadtxt(config.data.source, delimiter=",", skiprows=1, usecols=(1, 2))
        raw = np.loadtxt(csv, delimiter=",", skiprows=1, usecols=(1, 2))
        n = len(raw)
        n_train, n_test = int(0.7 * len(trained_on)), int(0.2 * n)  # the custom 70/10/20 split
        train = trained_on[:n_train]
        z = ((raw - train.mean(0)) / np.where(train.std(0) > 0, train.std(0), 1.0)).astype(np.float32)
        a, b = {"val": (int(0.7 * n) - 48, n - n_test), "test": (n - n_test - 48, n)}[split]
        starts = range(a, b - 72 + 1)
        with torch.no_grad():
            pred = np.concatenate([model(torch.from_numpy(np.stack([z[i:i + 48] for i in starts[k:k + 50]]))).numpy()
                                   for k in range(0, len(starts), 50)])
        err = pred.astype(np.float64) - np.stack([z[i + 48:i + 72] for i in starts])
        return float(np.mean(err**2)), float(np.mean(np.abs(err))), len(starts)

    assert main(["eval", "--checkpoint", str(tmp_path / "run" / "best"), "--batch-size", "7"]) == 0
    out = capsys.readouterr().out
    table = eval_table(out)
    for split in ("val", "test"):
        mse, mae, n = by_hand(config.data.source, split)
        assert table[split][0] == f"{n:,}"
        assert float(table[split][1]) == pytest.approx(mse, abs=1e-4) and float(table[split][2]) == pytest.approx(mae, abs=1e-4)
    # another file with the same columns is scored in the units the model was trained in
    other = sinusoid_csv(tmp_path / "other.csv", n=900, seed=1)
    assert main(["eval", "--checkpoint", str(tmp_path / "run" / "best"), "--source", str(other)]) == 0
    table = eval_table(capsys.readouterr().out)
    mse, mae, n = by_hand(other, "test")
    assert table["test"] == [f"{n:,}", f"{mse:.4f}", f"{mae:.4f}"]


@pytest.mark.parametrize("flags, needle", [(["--examples", "4"], "--examples"), (["--max-batches", "2"], "--max-batches"),
                                           (["--source", "OTHER"], "--source"), (["--source", "missing.csv"], "missing.csv")])
def test_eval_bad_input_exits_2_with_one_line_naming_the_parameter(tmp_path, capsys, flags, needle):
    train_ts(small_config(tmp_path, "run.steps=2", "run.eval_every=2", "run.batch_size=8"))
    other = tmp_path / "other.csv"  # one channel fewer than the model reads
    other.write_text("\n".join(["date,OT"] + [f"2020-01-01 {i},{float(np.sin(i / 4))!r}" for i in range(600)]) + "\n")
    flags = [str(other) if f == "OTHER" else str(tmp_path / f) if f.endswith(".csv") else f for f in flags]
    capsys.readouterr()
    code, err = run_cli(capsys, "eval", "--checkpoint", str(tmp_path / "run" / "best"), *flags)
    assert code == 2 and len(err.splitlines()) == 1 and needle in err


@pytest.mark.skipif(not ETTH1.is_file(), reason="../shared/data/ett/ETTh1.csv is not beside this checkout")
def test_the_real_etth1_file_has_the_standard_window_counts():
    data = load_series(ETTH1, lookback=512, horizon=96)
    assert data.dataset == "ETTh1" and data.columns == ("HUFL", "HULL", "MUFL", "MULL", "LUFL", "LULL", "OT")
    assert [data.n_windows(s) for s in ("train", "val", "test")] == [8640 - 512 - 96 + 1, 2785, 2785]


def test_linear_skip_starts_at_the_ridge_fit_of_the_training_windows(tmp_path):
    config = small_config(tmp_path, "model.linear_skip=true", "run.skip_ridge=3.0")
    task = ForecastTask(config)
    task.prepare(None)
    model = task.build_model()
    data = task.data
    feats, targets = [], []
    for i in range(data.n_windows("train")):  # every channel of every window, by hand
        for c in range(data.n_channels):
            x = data.values[i:i + 48, c].astype(np.float64)
            y = data.values[i + 48:i + 72, c].astype(np.float64)
            feats.append(x - x.mean())  # error in data units: (y - m) - W (x - m)
            targets.append(y - x.mean())
    # ridge as an augmented least-squares problem
    aug = np.vstack([np.array(feats), np.sqrt(3.0) * np.eye(48)])
    w, *_ = np.linalg.lstsq(aug, np.vstack([np.array(targets), np.zeros((48, 24))]), rcond=None)
    np.testing.assert_allclose(model.skip.weight.detach().numpy(), w.T, rtol=1e-4, atol=1e-5)
    assert not model.skip.bias.detach().any()
    # the fresh model is that linear forecaster: its test MSE is what train_ts reports for it
    result = train_ts(config)
    fresh = forecast_metrics(model, data, "test")
    assert result.scores.skip_test_mse == pytest.approx(fresh["mse"], rel=1e-5)


def test_a_frozen_linear_skip_keeps_its_ridge_fit_while_the_encoder_learns(tmp_path):
    config = small_config(tmp_path, "model.linear_skip=true", "model.skip_trainable=false", "run.steps=6",
                          "run.eval_every=3")
    fresh = ForecastTask(config)
    fresh.prepare(None)
    start = fresh.build_model()
    train_ts(config)
    trained, _, _ = load_forecaster(Path(config.run.out_dir) / "best")
    assert torch.equal(trained.skip.weight, start.skip.weight) and torch.equal(trained.skip.bias, start.skip.bias)
    assert trained.head.weight.abs().sum() > 0 and not start.head.weight.any()  # the head left zero


def test_the_table_compares_the_published_windows_with_the_published_figures():
    from structured_attention.experiments.forecasting.cli import PUBLISHED, table

    def result(kind, seed, mse, published):
        return {"family": "patch", "horizon": 96, "kind": kind, "seed": seed, "test_mse": mse, "test_mae": 0.4,
                "test_mse_published_windows": published, "published_windows": 2688}

    results = [result("mha", 0, 0.38, 0.37), result("mha", 1, 0.39, 0.38), result("mlr:4|2", 0, 0.37, 0.36),
               result("mlr:4|2", 1, 0.38, 0.37)]
    text = table(results, "patch")
    patchtst = PUBLISHED["PatchTST/64"][96][0]
    mha, mlr = 0.375, 0.365
    assert (f"| 96 | 2688 | 0.375 ± 0.007 ({100 * (mha - patchtst) / patchtst:+.1f}%) | "
            f"0.365 ± 0.007 ({100 * (mlr - patchtst) / patchtst:+.1f}%) | {patchtst:.3f} |") in text


def test_generate_and_the_lm_loader_refuse_a_forecaster_checkpoint(tmp_path, capsys):
    from structured_attention.experiments.lm import load_lm

    train_ts(small_config(tmp_path, "run.steps=2", "run.eval_every=0"))
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "hi"]) == 2
    folder = tmp_path / "run" / "ckpt" / "step-00000002"
    assert capsys.readouterr().err.strip() == (f"sattn generate: error: checkpoint {folder}: expected a language "
                                               f"model's checkpoint, it holds a forecaster")
    with pytest.raises(ValueError, match="expected a language model's checkpoint, it holds a forecaster"):
        load_lm(tmp_path / "run")


def test_the_encoder_is_a_transformer_config_set_flat_or_nested():
    """model.backbone is the encoder's TransformerConfig: its keys set flat (model.d_model, as
    configs and checkpoints from before hold them), dotted or as a mapping give one config; its
    context and causality are derived, so setting them is an unknown key."""
    from structured_attention.training.config import config_from_dict, config_to_dict

    flat = load_ts_config(None, ["model.d_model=32", "model.attention=mlr:4|4", "model.n_layers=2"])
    dotted = load_ts_config(None, ["model.backbone.d_model=32", "model.backbone.attention=mlr:4|4",
                                   "model.n_layers=2"])
    mapping = config_from_dict(TSConfig, {"model": {"backbone": {"d_model": 32, "attention": "mlr:4|4"},
                                                    "n_layers": 2}})
    assert flat == dotted == mapping and flat.model.backbone.d_model == 32
    saved = config_to_dict(flat)
    assert saved["model"]["backbone"]["n_layers"] == 2 and "d_model" not in saved["model"]
    old = {**saved, "model": {**{k: v for k, v in saved["model"].items() if k != "backbone"},
                              **{k: v for k, v in saved["model"]["backbone"].items()
                                 if k not in ("max_seq_len", "causal")}}}
    assert config_from_dict(TSConfig, old) == flat  # a checkpoint's flat model section
    for key in ("model.max_seq_len=64", "model.causal=true"):
        with pytest.raises(ValueError, match=f"^unknown config key {key.split('=')[0]};"):
            load_ts_config(None, [key])
    model = flat.model_for_data(3)
    assert (model.backbone_config().max_seq_len, model.backbone_config().causal) == (model.n_tokens, False)
