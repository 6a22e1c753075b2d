"""The training loop every experiment shares: ``fit(task, config) -> FitResult``.

An experiment (language modelling, in-context regression, forecasting) describes itself as a
:class:`Task` -- its model, its batches, its loss and its validation metrics -- and the loop does
the rest, nanoGPT style, in one readable function:

0. claim ``run.out_dir`` (``<out_dir>/run.lock``: host, pid, user), before anything there is
   touched, and release it at exit: a second run on a folder in use stops with one line and
   changes nothing (a lock whose process is gone from this host is taken over; one from another
   host is respected). A fresh run deletes an earlier run's checkpoints (only checkpoint folders
   this package wrote) once every check has passed;
1. seed torch, numpy and Python ``random`` from ``run.seed``; set up DDP/FSDP if launched by
   ``torchrun``;
2. build the model and AdamW (decoupled weight decay on matrices only and, with ``optim.mup``,
   muP learning-rate multipliers from the model's ``parameter_fans()``);
3. for each optimizer step ``s`` (0-based) and micro-batch ``m``, take this rank's share of global
   batch ``s * grad_accum + m`` from ``task.batch`` -- a pure function of ``(run.seed, index)``, so
   ``--resume`` continues exactly;
4. warmup + cosine/constant learning rate, bfloat16 autocast on CUDA (``run.autocast='auto'``),
   gradient clipping; a NaN/inf loss stops the run (:class:`NonFiniteLossError`) before the update,
   and so do non-finite weights before a checkpoint would store them; the error names the newest
   checkpoint that verifies and whose weights gave a finite loss at the step after it;
5. every ``eval_every`` steps and at the end: ``task.evaluate`` (``val_loss`` and the task's own
   metrics); the best validation loss is tracked, saved to ``<out_dir>/best/`` with
   ``run.keep_best``, and ``run.patience`` evaluations without improvement stop the run early;
   every ``log_every`` steps a progress line on stderr and a JSON line in
   ``<out_dir>/metrics.jsonl``; every ``checkpoint_every`` steps and at the end a checkpoint in
   ``<out_dir>/ckpt/`` (rank 0 writes);
6. SIGTERM (a scheduler pre-empting the job) or SIGINT (Ctrl-C) lets the current step finish, saves
   a checkpoint and raises :class:`TrainingInterrupted`; ``--resume`` continues from it exactly.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import sys
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from torch import nn

from .._files import claim, release
from .checkpoint import (
    check_compatible,
    checkpoint_verifies,
    get_rng_state,
    load_checkpoint,
    remove_checkpoints,
    save_checkpoint,
    set_rng_state,
    tied_aliases,
)
from .config import OptimConfig, RunConfig, config_to_dict
from .distributed import DistInfo, all_reduce_mean, barrier, cleanup_distributed, setup_distributed, wrap_model
from .memory import check_training_memory
from .optim import build_optimizer, lr_at

# ``<out_dir>/run.lock``: the claim of the run that is using out_dir (host, pid, user).
RUN_LOCK = "run.lock"

__all__ = [
    "FitResult",
    "NonFiniteLossError",
    "Task",
    "TrainingInterrupted",
    "TrainingStopped",
    "autocast_context",
    "fit",
    "seed_everything",
]


class TrainingStopped(RuntimeError):
    """Training ended before ``run.steps``; the message says why, at which step and what was kept.
    ``exit_code`` is the status the command line exits with."""

    exit_code = 1


class NonFiniteLossError(TrainingStopped):
    """The training loss became NaN or infinite; the message names the step and the last good checkpoint."""


class TrainingInterrupted(TrainingStopped):
    """SIGTERM or SIGINT arrived; a checkpoint of the last finished step was saved first."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell's convention for a process ended by a signal


@contextlib.contextmanager
def _stop_signals() -> Any:
    """While training, SIGTERM and SIGINT only record that they arrived (``got["signal"]``), so the
    loop can finish its step and checkpoint. Signal handlers exist on the main thread only."""
    got: dict[str, int | None] = {"signal": None}
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def record(signum: int, frame: Any) -> None:
        got["signal"] = signum

    previous = {sig: signal.signal(sig, record) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield got
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Task(ABC):
    """An experiment as :func:`fit` sees it. ``config`` is the experiment's config dataclass, with
    ``optim: OptimConfig`` and ``run: RunConfig`` sections and usually ``model``; ``setup`` is
    called once per process before anything else (load data there: rank 0 first, so it can write
    caches the others then read) and may refine ``config`` (a vocabulary size from the data)."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def setup(self, info: DistInfo) -> None:
        """Load or generate the data; called on every rank, rank 0 before the others."""

    def describe(self) -> str:
        """One line about the data, printed when training starts."""
        return ""

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A fresh model; it must have ``parameter_fans()`` (see ``models.parameter_fans``)."""

    def backbone_config(self) -> Any:
        """The model's ``TransformerConfig``, for the memory check before the model is built
        (:mod:`.memory`); ``None`` skips the check."""
        return None

    @abstractmethod
    def batch(self, index: int, rank: int, world_size: int, device: torch.device) -> Any:
        """This rank's share of global micro-batch ``index``: a pure function of the run's seed and
        ``index`` (no hidden state), so a resumed run draws the same batches."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The scalar training loss of ``batch``."""

    @abstractmethod
    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Validation metrics, at least ``val_loss`` (lower is better); the model is in eval mode
        and gradients are off. Every rank evaluates the same data (FSDP needs all ranks)."""

    @abstractmethod
    def tokens_per_batch(self) -> int:
        """Sequence positions in one rank's micro-batch (for tokens/s and FLOPs)."""

    @abstractmethod
    def flops_per_token(self, model: nn.Module) -> float:
        """Training FLOPs per sequence position (2 per multiply-add, forward and backward)."""

    def state(self) -> dict[str, Any]:
        """JSON-able extras stored with every checkpoint (a tokenizer, scaling statistics)."""
        return {}


@dataclass
class FitResult:
    steps: int  # optimizer steps taken in all (fewer than run.steps when stopped early)
    losses: list[float]  # training loss per optimizer step, from step 1 (a resumed run's too)
    final: dict[str, float]  # the last evaluation's metrics
    best: dict[str, float]  # the metrics of the evaluation with the lowest val_loss
    best_step: int
    stopped_early: bool
    tokens: int
    flops: float
    wall_s: float
    out_dir: str
    checkpoint: str | None
    config: dict[str, Any]
    rank: int = 0
    world_size: int = 1
    model: nn.Module | None = field(default=None, repr=False)  # the trained model (full, on rank 0)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def autocast_context(mode: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bfloat16 autocast for ``'bf16'``, and for ``'auto'`` on CUDA; otherwise nothing."""
    if mode == "bf16" or (mode == "auto" and device.type == "cuda"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def resident_mib() -> float:
    """This process's resident memory in MiB (the peak where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return peak / (2**20 if sys.platform == "darwin" else 2**10)


def _fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _fmt_count(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


class Progress:
    """A one-line progress report on stderr (step, loss, lr, tokens/s, elapsed and ETA), and the
    time accounting of each logging window: wall time per step and the part of it spent waiting
    for batches."""

    def __init__(self, total_steps: int, start_step: int, stream: TextIO | None = None) -> None:
        self.total = total_steps
        self.start_step = start_step
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.perf_counter()
        self.last_t = self.t0
        self.last_tokens = 0
        self.last_step = start_step
        self.data_s = 0.0

    def window(self, tokens_done: int, step: int) -> dict[str, float]:
        """Since the last window: ``tokens_per_s``, ``step_s`` (wall seconds per step) and
        ``data_s`` (seconds per step spent getting batches)."""
        now = time.perf_counter()
        steps = max(step - self.last_step, 1)
        stats = {
            "tokens_per_s": (tokens_done - self.last_tokens) / max(now - self.last_t, 1e-9),
            "step_s": (now - self.last_t) / steps,
            "data_s": self.data_s / steps,
        }
        self.last_t, self.last_tokens, self.last_step, self.data_s = now, tokens_done, step, 0.0
        return stats

    def mark(self) -> None:
        """Restart the tokens/s window (after an evaluation, so it does not count as training)."""
        self.last_t = time.perf_counter()

    def eta(self, step: int) -> float:
        done = step - self.start_step
        elapsed = time.perf_counter() - self.t0
        return elapsed / done * (self.total - step) if done > 0 else float("nan")

    def line(self, step: int, loss: float, lr: float, tokens_per_s: float, extra: str = "") -> None:
        elapsed = time.perf_counter() - self.t0
        msg = (
            f"step {step:>{len(str(self.total))}}/{self.total} | loss {loss:.4f} | lr {lr:.2e} | "
            f"{_fmt_count(tokens_per_s)} tok/s | {_fmt_time(elapsed)} elapsed | ETA {_fmt_time(self.eta(step))}"
        )
        print(msg + extra, file=self.stream, flush=True)


class MetricsLogger:
    """``metrics.jsonl`` (one JSON object per line) plus TensorBoard / W&B when enabled."""

    def __init__(self, out_dir: Path, run: RunConfig, config: dict[str, Any], history: list[dict[str, Any]],
                 enabled: bool) -> None:
        self.enabled = enabled
        self.records = list(history)
        self.tb = None
        self.wandb = None
        if not enabled:
            return
        # The optional loggers' packages are checked before anything in out_dir is written.
        if run.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError(
                    "run.tensorboard: true needs the 'tensorboard' package (pip install tensorboard)"
                ) from None
        if run.wandb:
            try:
                import wandb  # type: ignore[import-not-found]
            except ImportError:
                raise ValueError("run.wandb: true needs the 'wandb' package (pip install wandb)") from None
        self.path = out_dir / "metrics.jsonl"
        # Rewrite from the history so a resumed run drops lines logged after its checkpoint.
        with open(self.path, "w", encoding="utf-8") as f:
            for r in self.records:
                f.write(json.dumps(r) + "\n")
        if run.tensorboard:
            self.tb = SummaryWriter(str(out_dir / "tensorboard"))
        if run.wandb:
            self.wandb = wandb.init(project=run.wandb_project, config=config, dir=str(out_dir))

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        step = record["step"]
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(record, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _agreed_signal(signum: int | None, info: DistInfo) -> int:
    """The signal any rank received (0 if none): all ranks must stop, and save, at the same step."""
    if not info.enabled:
        return signum or 0
    flag = torch.tensor(float(signum or 0), device=info.device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return int(flag)


def _model_diff(saved: dict[str, Any], current: dict[str, Any]) -> str:
    diffs = [f"model.{k}={saved.get(k)!r} in the checkpoint, {current.get(k)!r} now" for k in current if saved.get(k) != current.get(k)]
    return "; ".join(diffs[:3])


@torch.no_grad()
def _evaluate(task: Task, model: nn.Module, device: torch.device, autocast: str) -> dict[str, float]:
    was_training = model.training
    model.eval()
    with autocast_context(autocast, device):
        metrics = task.evaluate(model, device)
    model.train(was_training)
    if "val_loss" not in metrics:
        raise RuntimeError(f"{type(task).__name__}.evaluate must return 'val_loss'")  # a programming error
    return {k: float(v) for k, v in metrics.items()}


def _format_metrics(metrics: dict[str, float]) -> str:
    return "".join(f" | {k.replace('_', ' ')} {v:.4f}" for k, v in metrics.items())


# -- the loop ------------------------------------------------------------------------------------------


def _finite_weights(model: nn.Module, info: DistInfo) -> bool:
    """Whether every weight is finite, on every rank (a shard's local part under FSDP)."""
    params = [getattr(p, "to_local", lambda p=p: p)() for p in model.parameters()]
    bad = sum((~torch.isfinite(p.detach())).sum().float() for p in params if p.numel())
    return float(all_reduce_mean(torch.as_tensor(bad, device=params[0].device), info)) == 0


def fit(task: Task, *, resume: bool = False, stream: TextIO | None = None) -> FitResult:
    """Train ``task``'s model as ``task.config`` says; see the module docstring. With ``resume`` it
    continues from the newest valid checkpoint in ``<run.out_dir>/ckpt`` (``FileNotFoundError`` if
    there is none), whose ``model`` config section must equal this one's."""
    info = setup_distributed(task.config.run.device)
    lock = Path(task.config.run.out_dir) / RUN_LOCK
    try:
        if info.is_main:  # before anything in out_dir is touched
            lock.parent.mkdir(parents=True, exist_ok=True)
            holder = claim(lock)
            if holder is not None:
                raise ValueError(f"run.out_dir: expected a folder no other run is using, got "
                                 f"{task.config.run.out_dir!r}, in use by {holder} (its lock: {lock})")
        barrier(info)
        try:
            return _fit(task, resume, info, stream)
        finally:
            if info.is_main:
                release(lock)
    finally:
        cleanup_distributed(info)


def _fit(task: Task, resume: bool, info: DistInfo, stream: TextIO | None) -> FitResult:
    run: RunConfig = task.config.run
    optim_cfg: OptimConfig = task.config.optim
    device = info.device
    out_dir = Path(run.out_dir)
    ckpt_dir = out_dir / "ckpt"
    best_dir = out_dir / "best"
    say = (lambda msg: print(msg, file=stream if stream is not None else sys.stderr, flush=True)) if info.is_main else (lambda msg: None)
    seed_everything(run.seed)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")

    if info.is_main:  # rank 0 first: it may write data caches that the other ranks then read
        task.setup(info)
        barrier(info)
    else:
        barrier(info)
        task.setup(info)
    if task.describe():
        say(task.describe())
    check_training_memory(task, run.batch_size, run.max_memory, device)
    config_dict = config_to_dict(task.config)

    raw_model = task.build_model().to(device)
    flops_per_token = task.flops_per_token(raw_model)
    aliases = tied_aliases(raw_model)
    model = wrap_model(raw_model, info, run.fsdp)
    optimizer = build_optimizer(raw_model, optim_cfg, fused=device.type == "cuda" and not run.fsdp)
    tokens_per_step = task.tokens_per_batch() * run.grad_accum * info.world_size
    n_params = sum(p.numel() for p in raw_model.parameters())
    say(
        f"model: {n_params:,} parameters | {flops_per_token / 1e6:.2f} MFLOPs/token (training) | "
        f"{tokens_per_step:,} tokens/step | device {device}{f' x{info.world_size}' if info.enabled else ''}"
    )

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    start_step, losses, history = 0, [], []
    tracker = {"best_val_loss": math.inf, "best_step": 0, "best": {}, "bad_evals": 0}
    if resume:
        if not ckpt_dir.is_dir():
            raise FileNotFoundError(f"--resume: no checkpoint folder {str(ckpt_dir)!r} (run.out_dir={run.out_dir!r})")
        ckpt = load_checkpoint(ckpt_dir)
        saved_model = ckpt.state["config"].get("model")
        current_model = config_dict.get("model")
        if saved_model != current_model:
            raise ValueError(
                f"--resume: checkpoint {ckpt.path} is from another architecture ({_model_diff(saved_model or {}, current_model or {})})"
            )
        check_compatible(raw_model, ckpt.model_state, str(ckpt.path))
        set_state_dict(
            model, optimizer, model_state_dict=ckpt.model_state, optim_state_dict=ckpt.optimizer_state(),
            options=StateDictOptions(full_state_dict=True),
        )
        for group in optimizer.param_groups:  # the state-dict helpers hand betas back as a list
            group["betas"] = tuple(group["betas"])
        set_rng_state(ckpt.state["rng"])
        start_step = ckpt.step
        losses = list(ckpt.state["losses"])
        history = list(ckpt.state["metrics"])
        tracker.update(ckpt.state.get("tracker", {}))
        say(f"resumed from {ckpt.path} at step {start_step}")
        if start_step >= run.steps:
            say(f"checkpoint step {start_step} >= run.steps={run.steps}: nothing to train")

    logger = MetricsLogger(out_dir, run, config_dict, history, enabled=info.is_main)
    if not resume and info.is_main:
        # Every check has passed (data, model, optimiser, loggers). A fresh run owns its out_dir:
        # checkpoints of an earlier run there would otherwise outrank (by step number) the ones
        # this run writes. Only checkpoints this package wrote are deleted.
        removed = remove_checkpoints(ckpt_dir) + remove_checkpoints(best_dir)
        if removed:
            say(f"fresh run: removed {removed} checkpoint(s) of an earlier run in {out_dir} (use --resume to continue it)")
    barrier(info)
    if info.is_main:
        (out_dir / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n", encoding="utf-8")
    step_fn_model = torch.compile(model) if run.compile else model

    def save(step: int, root: Path, keep: int) -> Path | None:
        msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not info.is_main:
            return None
        state = {
            "config": config_dict,
            **task.state(),
            "rng": get_rng_state(),
            "data": {"seed": run.seed, "next_step": step},
            "losses": losses,
            "metrics": logger.records,
            "tracker": tracker,
        }
        return save_checkpoint(root, step, msd, osd, state, aliases=aliases, keep=keep)

    progress = Progress(run.steps, start_step, stream)
    t_start = time.perf_counter()
    tokens_this_run = 0
    last_ckpt: Path | None = None
    # A checkpoint is *good* once the step after it gave a finite loss with its weights; the newest
    # saved one waits in ``untried`` until then (the one resumed from too).
    good: Path | None = None
    untried: Path | None = ckpt.path if resume else None

    def stop_nonfinite(what: str) -> NonFiniteLossError:
        where = "; no checkpoint of this run has given a finite loss yet"
        if good is not None and checkpoint_verifies(good):
            where = f"; the last good checkpoint is {good}"
        return NonFiniteLossError(f"training stopped: {what}{where} (try a lower optim.lr, or optim.grad_clip > 0)")

    final: dict[str, float] = next((dict(r) for r in reversed(history) if "val_loss" in r), {})
    stopped_early = False
    done = start_step
    model.train()
    try:
        with _stop_signals() as signals:
            for step in range(start_step, run.steps):
                lr = lr_at(step, run.steps, optim_cfg)
                for group in optimizer.param_groups:
                    group["lr"] = lr * group["lr_mult"]
                loss_sum = torch.zeros((), device=device)
                for micro in range(run.grad_accum):
                    t_data = time.perf_counter()
                    batch = task.batch(step * run.grad_accum + micro, info.rank, info.world_size, device)
                    progress.data_s += time.perf_counter() - t_data
                    sync = contextlib.nullcontext()
                    if info.enabled and not run.fsdp and micro < run.grad_accum - 1:
                        sync = model.no_sync()  # type: ignore[operator]
                    with sync:
                        with autocast_context(run.autocast, device):
                            loss = task.loss(step_fn_model, batch)
                        (loss / run.grad_accum).backward()
                    loss_sum += loss.detach().float()
                step_loss = float(all_reduce_mean(loss_sum / run.grad_accum, info))
                if not math.isfinite(step_loss):
                    raise stop_nonfinite(f"the loss is {step_loss} at step {step + 1}")
                if untried is not None:
                    good, untried = untried, None
                if optim_cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), optim_cfg.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

                done = step + 1
                losses.append(step_loss)
                tokens_this_run += tokens_per_step
                do_eval = done == run.steps or (run.eval_every > 0 and done % run.eval_every == 0)
                improved = False
                if do_eval or done % run.log_every == 0:
                    tokens = done * tokens_per_step
                    timing = progress.window(tokens_this_run, done)
                    record: dict[str, Any] = {
                        "step": done, "loss": step_loss, "lr": lr, "tokens": tokens, "flops": tokens * flops_per_token,
                        **timing, "elapsed_s": time.perf_counter() - t_start, "rss_mib": resident_mib(),
                    }
                    extra = ""
                    if do_eval:
                        metrics = _evaluate(task, model, device, run.autocast)
                        record.update(metrics)
                        final = record
                        extra = _format_metrics(metrics)
                        if metrics["val_loss"] < tracker["best_val_loss"]:
                            improved = True
                            tracker.update(best_val_loss=metrics["val_loss"], best_step=done, best=metrics, bad_evals=0)
                        else:
                            tracker["bad_evals"] += 1
                    logger.log(record)
                    if info.is_main:
                        progress.line(done, step_loss, lr, timing["tokens_per_s"], extra)
                    progress.mark()
                if improved and run.keep_best and _finite_weights(model, info):
                    save(done, best_dir, keep=1)
                early = run.patience > 0 and tracker["bad_evals"] >= run.patience
                if early:
                    stopped_early = True
                    say(f"early stop at step {done}: no better val loss in {run.patience} evaluations "
                        f"(best {tracker['best_val_loss']:.4f} at step {tracker['best_step']})")
                interrupt = _agreed_signal(signals["signal"], info)
                if interrupt or early or done == run.steps or (run.checkpoint_every > 0 and done % run.checkpoint_every == 0):
                    if not _finite_weights(model, info):
                        raise stop_nonfinite(f"the weights are not finite after step {done} (its loss was finite)")
                    last_ckpt = save(done, ckpt_dir, keep=2) or last_ckpt
                    untried = last_ckpt
                if interrupt:
                    name = signal.Signals(interrupt).name
                    raise TrainingInterrupted(
                        f"{name} received: stopped after step {done} with a checkpoint in {last_ckpt or ckpt_dir} "
                        f"(continue with --resume)", interrupt)
                if early:
                    break
    finally:  # TensorBoard / W&B writers are closed however training ends
        logger.close()
    wall = time.perf_counter() - t_start

    if start_step >= run.steps or not final:  # nothing trained: still report the validation metrics
        final = {"step": done, **_evaluate(task, model, device, run.autocast)}

    trained = raw_model
    if run.fsdp and info.enabled:  # gather the full weights (a collective) into a fresh model on rank 0
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        trained = None
        if info.is_main:
            trained = task.build_model()
            trained.load_state_dict(full)
            trained = trained.to(device)
    metric_keys = [k for k in final if k not in ("step", "loss", "lr", "tokens", "flops", "tokens_per_s", "step_s",
                                                 "data_s", "elapsed_s", "rss_mib")]
    return FitResult(
        steps=done,
        losses=losses,
        final={k: final[k] for k in metric_keys},
        best=dict(tracker["best"]) or {k: final[k] for k in metric_keys},
        best_step=tracker["best_step"] or done,
        stopped_early=stopped_early,
        tokens=done * tokens_per_step,
        flops=done * tokens_per_step * flops_per_token,
        wall_s=wall,
        out_dir=str(out_dir),
        checkpoint=str(last_ckpt) if last_ckpt else None,
        config=config_dict,
        rank=info.rank,
        world_size=info.world_size,
        model=trained if info.is_main else None,
    )
