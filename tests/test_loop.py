"""The shared training loop on a task that is not language modelling: a tiny least-squares
problem, with early stopping, the best model kept, and an exact resume."""

from __future__ import annotations

import json
import re
import shutil
import sys
import types

import numpy as np
import pytest
import torch
from torch import nn

from dataclasses import dataclass, field

from structured_attention.models import parameter_fans
from structured_attention.training import OptimConfig, RunConfig, Task, fit, load_checkpoint, load_config


@dataclass(frozen=True)
class ToyModelConfig:
    width: int = 4


@dataclass(frozen=True)
class ToyConfig:
    model: ToyModelConfig = field(default_factory=ToyModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)


class Linear(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, 1)

    def forward(self, x):
        return self.lin(x)[..., 0]

    def parameter_fans(self):
        return parameter_fans(self)

    def training_flops_per_token(self, seq_len=None):
        return 6 * 4


class ToyTask(Task):
    """y = <w, x> with w fixed; validation on a fixed set, so its loss is an exact function of the weights."""

    W = torch.tensor([1.0, -2.0, 0.5, 3.0])

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return Linear(self.config.model.width)

    def batch(self, index, rank, world_size, device):
        g = torch.Generator().manual_seed(1000 + index)
        x = torch.randn(self.config.run.batch_size * world_size, 4, generator=g)
        x = x[rank * self.config.run.batch_size:(rank + 1) * self.config.run.batch_size]
        return x.to(device), (x @ self.W).to(device)

    def loss(self, model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    def evaluate(self, model, device):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(7))
        err = model(x.to(device)) - (x @ self.W).to(device)
        return {"val_loss": float((err**2).mean()), "val_mae": float(err.abs().mean())}

    def tokens_per_batch(self):
        return self.config.run.batch_size

    def flops_per_token(self, model):
        return 6 * 4


def toy(tmp_path, *overrides):
    base = ["run.batch_size=8", "run.steps=40", "run.eval_every=5", "run.log_every=5", f"run.out_dir={tmp_path}",
            "optim.lr=0.1", "optim.schedule=constant", "optim.warmup_steps=0", "optim.weight_decay=0",
            "run.device=cpu"]  # the checks below compare exact float32 values
    return ToyTask(load_config(ToyConfig, None, [*base, *overrides]))


def test_fit_trains_a_non_language_task(tmp_path):
    result = fit(toy(tmp_path))
    assert result.steps == 40 and len(result.losses) == 40
    assert result.final["val_loss"] < 0.05 * result.losses[0]
    assert set(result.final) == {"val_loss", "val_mae"}
    assert result.tokens == 40 * 8 and result.flops == 40 * 8 * 24
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [5, 10, 15, 20, 25, 30, 35, 40]


def test_activation_checkpointing_of_a_model_without_a_transformer_backbone_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^run\.activation_checkpointing: expected false for a model without a "
                                         r"Transformer backbone .*, got True$"):
        fit(toy(tmp_path, "run.activation_checkpointing=true"))
    assert not (tmp_path / "ckpt").exists()


def test_patience_stops_early_and_keeps_the_best(tmp_path):
    # A learning rate this large makes the validation loss go up after the first evaluations.
    result = fit(toy(tmp_path, "optim.lr=2.5", "run.patience=2", "run.keep_best=true"))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    best_step, best_loss = min(evals, key=lambda e: e[1])
    # stopped exactly `patience` evaluations after the best one
    assert result.stopped_early and result.steps == evals[-1][0] == best_step + 2 * 5 < 40
    assert result.best_step == best_step and result.best["val_loss"] == pytest.approx(best_loss)
    best = load_checkpoint(tmp_path / "best")
    assert best.step == best_step
    model = Linear(4)
    model.load_state_dict(best.model_state)
    task = toy(tmp_path)
    with torch.no_grad():
        assert task.evaluate(model, torch.device("cpu"))["val_loss"] == pytest.approx(best_loss, rel=1e-6)


def test_resuming_a_run_that_stopped_early_trains_nothing_more(tmp_path, capsys):
    """A run that stopped early, resumed (a sweep after a crash, a user by habit), keeps its result:
    it trained one more step, and saved it, every time. A larger run.patience continues it."""
    args = ("optim.lr=2.5", "run.patience=2")
    first = fit(toy(tmp_path, *args))
    assert first.stopped_early and first.steps < 40
    ckpts = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    again = fit(toy(tmp_path, *args), resume=True)
    assert "stopped early at step" in capsys.readouterr().err
    assert again.stopped_early and again.steps == first.steps and again.losses == first.losses
    assert again.final == first.final and again.best_step == first.best_step
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ckpts
    longer = fit(toy(tmp_path, "optim.lr=2.5", "run.patience=100"), resume=True)
    assert longer.steps == 40 and longer.losses[:first.steps] == first.losses


@pytest.mark.parametrize("change", ["run.batch_size=4", "run.grad_accum=2", "run.seed=1"])
def test_a_resume_on_other_batches_is_refused_in_one_line(tmp_path, change):
    """A resumed run continues its batches, and counts tokens and FLOPs by them: a changed batch
    size, accumulation or seed was taken silently (the tokens in metrics.jsonl went down, batches
    already trained on came again). Other run settings (steps, evaluation, logging) may change."""
    from structured_attention.training.loop import _batch_diff

    fit(toy(tmp_path, "run.steps=10"))
    with pytest.raises(ValueError, match=rf"^--resume: checkpoint .* was trained on other batches "
                                         rf"\({re.escape(change.split('=')[0])}=.* in the checkpoint, .* now\)"):
        fit(toy(tmp_path, "run.steps=20", change), resume=True)
    assert fit(toy(tmp_path, "run.steps=20", "run.eval_every=2", "run.log_every=1"), resume=True).steps == 20
    state = load_checkpoint(tmp_path / "ckpt").state
    assert state["data"]["world_size"] == 1
    assert _batch_diff(state, state["config"]["run"], 2) == "world size 1 in the checkpoint, 2 now"


def test_resume_continues_exactly_with_early_stopping_state(tmp_path):
    args = ("run.patience=3", "run.checkpoint_every=10")
    full = fit(toy(tmp_path / "full", *args))
    fit(toy(tmp_path / "part", *args, "run.steps=20"))  # same schedule (constant lr), stopped at 20
    resumed = fit(toy(tmp_path / "part", *args), resume=True)
    assert resumed.losses == full.losses
    assert resumed.best_step == full.best_step and resumed.final == full.final


def test_a_resumed_run_continues_its_tensorboard_and_wandb_logs(tmp_path, monkeypatch):
    """Cut off after its step-10 checkpoint with steps 15 and 20 already logged, a run resumes:
    TensorBoard purges what came after the checkpoint (purge_step 11) and W&B continues the same
    run (the id the checkpoint holds), so each step is logged once per run."""
    writers, runs = [], []

    class SummaryWriter:
        def __init__(self, log_dir, purge_step=None):
            writers.append({"purge_step": purge_step, "steps": []})

        def add_scalar(self, name, value, step):
            if name == "loss":
                writers[-1]["steps"].append(step)

        def close(self):
            pass

    class Run:
        def log(self, record, step):
            runs[-1]["steps"].append(step)

        def finish(self):
            pass

    def init(**kwargs):
        runs.append({**kwargs, "steps": []})
        return Run()

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    args = ("run.steps=20", "run.tensorboard=true", "run.wandb=true", "run.checkpoint_every=10")
    fit(toy(tmp_path, *args))
    shutil.rmtree(tmp_path / "ckpt" / "step-00000020")
    assert load_checkpoint(tmp_path / "ckpt").state["wandb_id"] == runs[0]["id"]
    fit(toy(tmp_path, *args), resume=True)
    assert [w["purge_step"] for w in writers] == [None, 11]
    assert [w["steps"] for w in writers] == [[5, 10, 15, 20], [15, 20]]
    assert runs[1]["id"] == runs[0]["id"] and runs[1]["resume"] == "allow"
    assert [r["steps"] for r in runs] == [[5, 10, 15, 20], [15, 20]]
