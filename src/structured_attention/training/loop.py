"""The training loop every experiment shares: ``fit(task, config) -> FitResult``.

An experiment (language modelling, in-context regression, forecasting) describes itself as a
:class:`Task` -- its model, its batches, its loss and its validation metrics -- and the loop does
the rest, nanoGPT style: ``_fit`` is the loop itself, a few lines that call the phases of
``_Training`` in order (set up, restore or begin, ``train_step``, ``report``, ``checkpoint``,
``finish``), with a typed :class:`BestTracker` for early stopping:

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
   ``<out_dir>/metrics.jsonl`` (and TensorBoard / W&B with ``run.tensorboard`` / ``run.wandb``,
   which a resumed run continues without duplicate steps); every ``checkpoint_every`` steps and
   at the end a checkpoint in ``<out_dir>/ckpt/`` (rank 0 writes);
6. SIGTERM (a scheduler pre-empting the job) or SIGINT (Ctrl-C) lets the current step finish, saves
   a checkpoint and raises :class:`TrainingInterrupted`; ``--resume`` continues from it exactly.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import secrets
import signal
import sys
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO, TypeVar

import numpy as np
import torch
from torch import nn

from .._checks import require
from .._files import claim, made_folder, release
from ..models.protocol import TrainableModel
from ..models.transformer import Transformer
from .checkpoint import (
    check_compatible,
    checkpoint_verifies,
    find_checkpoints,
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
    "BestTracker",
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
    ``exit_code`` is the status the command line exits with; ``main_process`` whether it was
    raised on rank 0 (under torchrun every rank stops at the same step, and the command line
    prints rank 0's line alone: the other ranks' would repeat it, naming no checkpoint)."""

    exit_code = 1
    main_process = True


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
    """An experiment as :func:`fit` sees it. Its config is the experiment's config dataclass, with
    ``optim: OptimConfig`` and ``run: RunConfig`` sections and usually ``model``, and flows one
    way: ``requested`` is what the user gave and never changes; ``setup`` is called once per
    process before anything else (load data there: rank 0 first, so it can write caches the
    others then read); then :meth:`resolve` derives what the data decides (a vocabulary size, the
    channels), once, and the result is ``config``, what the run uses and its checkpoints record.
    ``config.json`` in the run's folder holds both."""

    # the experiment's name, recorded in every checkpoint (``sattn eval`` dispatches by it)
    experiment: str = ""

    # the processes training together (set by prepare): an evaluation covers run.eval_batches
    # global batches, so its figures do not depend on how the global batch is split
    world_size: int = 1
    _step_cost: tuple[int, float] | None = None  # the default step_cost, once computed

    def __init__(self, config: Any) -> None:
        self.requested = config
        self.config = config

    def setup(self, info: DistInfo) -> None:
        """Load or generate the data (never the config); called on every rank, rank 0 before the others."""

    def resolve(self) -> Any:
        """The config the run uses: ``requested`` with what the data decides filled in; called
        once, after :meth:`setup`. By default nothing is derived."""
        return self.requested

    def prepare(self, info: DistInfo | None) -> None:
        """:meth:`setup`, then ``config`` set to :meth:`resolve`'s: what :func:`fit` does first on
        each rank, and what using a task outside it takes."""
        self.world_size = info.world_size if info is not None else 1
        self.setup(info)
        self.config = self.resolve()

    def describe(self) -> str:
        """One line about the data, printed when training starts."""
        return ""

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A fresh model implementing :class:`~structured_attention.models.TrainableModel`
        (``parameter_fans()``, ``training_flops_per_token(seq_len)``)."""

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
        and gradients are off. Every rank evaluates the same data (FSDP needs all ranks):
        ``run.eval_batches`` global batches (``run.batch_size`` examples per process, of
        :attr:`world_size` processes), so that 2 processes of 4 examples score what 1 of 8 does."""

    @abstractmethod
    def tokens_per_batch(self) -> int:
        """Sequence positions in one rank's micro-batch (for tokens/s and FLOPs)."""

    @abstractmethod
    def flops_per_token(self, model: TrainableModel) -> float:
        """Training FLOPs per sequence position (2 per multiply-add, forward and backward): the
        model's ``training_flops_per_token`` at the task's length."""

    def step_cost(self, step: int, model: TrainableModel) -> tuple[int, float]:
        """Sequence positions and training FLOPs of optimizer step ``step`` (0-based) on one
        process, over its ``run.grad_accum`` micro-batches: :meth:`tokens_per_batch` each at
        :meth:`flops_per_token`, by default; a task whose examples change length along the run
        (a curriculum) counts its own."""
        if self._step_cost is None:
            positions = self.tokens_per_batch() * self.config.run.grad_accum
            self._step_cost = (positions, positions * self.flops_per_token(model))
        return self._step_cost

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

    @classmethod
    def extend(cls: type[_R], fit: FitResult, **own: Any) -> _R:
        """An experiment's typed result (a subclass with its own fields, keyword-only) from ``fit``'s
        fields and ``own``, which may also replace one of them (in-context regression's FLOPs)."""
        return cls(**{**{f.name: getattr(fit, f.name) for f in fields(FitResult)}, **own})


_R = TypeVar("_R", bound=FitResult)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def run_matmul_precision(device: torch.device) -> Any:
    """TensorFloat-32 float32 products on CUDA for the length of a run, and the caller's setting
    after it: the setting is the process's, so a run in the caller's process (a notebook, a test)
    would otherwise change every float32 product that comes after it."""
    before = torch.get_float32_matmul_precision()
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


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
    """``metrics.jsonl`` (one JSON object per line) plus TensorBoard / W&B when enabled.

    A run resumed from its checkpoint at ``resume_step`` continues each log where the checkpoint
    left it: ``metrics.jsonl`` is rewritten from the checkpoint's records, TensorBoard purges the
    events of later steps (which the interrupted run logged after its checkpoint), and W&B resumes
    the run whose id the checkpoint holds (``wandb_id``) instead of starting another."""

    def __init__(self, out_dir: Path, run: RunConfig, config: dict[str, Any], history: list[dict[str, Any]],
                 enabled: bool, resume_step: int | None = None, wandb_id: str | None = None) -> None:
        self.enabled = enabled
        self.records = list(history)
        self.tb = None
        self.wandb = None
        self.wandb_id = wandb_id
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
            self.tb = SummaryWriter(str(out_dir / "tensorboard"),
                                    purge_step=None if resume_step is None else resume_step + 1)
        if run.wandb:
            self.wandb_id = self.wandb_id or secrets.token_hex(8)
            self.wandb = wandb.init(project=run.wandb_project, config=config, dir=str(out_dir), id=self.wandb_id,
                                    resume="allow")

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


# The run settings that decide which examples each step trains on and how many: a resumed run
# continues the same batches (and counts its tokens and FLOPs by them), so they cannot change.
_BATCH_KEYS = ("seed", "batch_size", "grad_accum", "seq_len")


def _batch_diff(saved: dict[str, Any], run: dict[str, Any], world_size: int) -> str:
    """How a checkpoint's batches (its ``state``: the config's run section, the processes) differ
    from those of this run (``run``: its run section, ``world_size``); ``""`` if they do not."""
    before = saved["config"].get("run", {})
    diffs = [f"run.{k}={before[k]!r} in the checkpoint, {run.get(k)!r} now" for k in _BATCH_KEYS
             if k in before and before[k] != run.get(k)]
    processes = saved.get("data", {}).get("world_size")  # absent from older checkpoints
    if processes is not None and processes != world_size:
        diffs.append(f"world size {processes} in the checkpoint, {world_size} now")
    return "; ".join(diffs)


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
    ckpt_dir = Path(task.config.run.out_dir) / "ckpt"
    if resume and not find_checkpoints(ckpt_dir, complete_only=False):  # before the data loads and the model is built
        raise FileNotFoundError(f"--resume: no checkpoint in {str(ckpt_dir)!r} (run.out_dir={task.config.run.out_dir!r})")
    info = setup_distributed(task.config.run.device)
    lock = Path(task.config.run.out_dir) / RUN_LOCK
    try:
        with contextlib.ExitStack() as out_dir:
            if info.is_main:  # before anything in out_dir is touched
                out_dir.enter_context(made_folder(lock.parent, "run.out_dir"))
                holder = claim(lock)
                if holder is not None:
                    raise ValueError(f"run.out_dir: expected a folder no other run is using, got "
                                     f"{task.config.run.out_dir!r}, in use by {holder} (its lock: {lock})")
            barrier(info)
            try:
                with run_matmul_precision(info.device):
                    return _fit(task, resume, info, stream)
            except TrainingStopped as err:
                err.main_process = info.is_main
                raise
            finally:
                if info.is_main:
                    release(lock)
    finally:
        cleanup_distributed(info)


def _fit(task: Task, resume: bool, info: DistInfo, stream: TextIO | None) -> FitResult:
    """The loop: restore or start, then step, evaluate, checkpoint; then finish."""
    run = task.config.run
    t = _Training(task, info, stream)
    if resume:
        t.restore()
    t.begin(fresh=not resume)
    try:
        with _stop_signals() as signals:
            for step in range(t.start_step, t.end_step):
                loss, lr = t.train_step(step)
                done = step + 1
                improved = t.report(done, loss, lr)
                if improved and run.keep_best and _finite_weights(t.model, info):
                    t.save(t.best_dir, keep=1)
                t.stopped_early = t.tracker.exhausted(run.patience)
                interrupt = _agreed_signal(signals["signal"], info)
                if interrupt or t.stopped_early or done == run.steps or _every(done, run.checkpoint_every):
                    t.checkpoint()
                if interrupt:
                    raise TrainingInterrupted(
                        f"{signal.Signals(interrupt).name} received: stopped after step {done} with a checkpoint in "
                        f"{t.last_ckpt or t.ckpt_dir} (continue with --resume)", interrupt)
                if t.stopped_early:
                    t.say(f"early stop at step {done}: no better val loss in {run.patience} evaluations "
                          f"(best {t.tracker.best_val_loss:.4f} at step {t.tracker.best_step})")
                    break
    finally:  # TensorBoard / W&B writers are closed however training ends
        t.logger.close()
    return t.finish()


def _every(step: int, period: int) -> bool:
    return period > 0 and step % period == 0


@dataclass
class BestTracker:
    """The lowest validation loss so far, its step and metrics, and the evaluations since it last
    improved (``run.patience`` of them stop the run); checkpoints store it as ``tracker``."""

    best_val_loss: float = math.inf
    best_step: int = 0
    best: dict[str, float] = field(default_factory=dict)
    bad_evals: int = 0

    def update(self, step: int, metrics: dict[str, float]) -> bool:
        """Take one evaluation's metrics; whether they improve on the best."""
        if metrics["val_loss"] < self.best_val_loss:
            self.best_val_loss, self.best_step, self.best, self.bad_evals = metrics["val_loss"], step, metrics, 0
            return True
        self.bad_evals += 1
        return False

    def exhausted(self, patience: int) -> bool:
        """Whether ``patience`` evaluations (0: never) have passed without improvement."""
        return patience > 0 and self.bad_evals >= patience


class _Training:
    """One run's state and the phases :func:`_fit` calls: set up (data, model, optimiser), restore
    or begin, train a step, report (log and evaluate), checkpoint, finish."""

    def __init__(self, task: Task, info: DistInfo, stream: TextIO | None) -> None:
        self.task, self.info, self.stream = task, info, stream
        self.run: RunConfig = task.config.run
        self.optim_cfg: OptimConfig = task.config.optim
        self.device = info.device
        self.out_dir = Path(self.run.out_dir)
        self.ckpt_dir, self.best_dir = self.out_dir / "ckpt", self.out_dir / "best"
        seed_everything(self.run.seed)
        if info.is_main:  # rank 0 first: it may write data caches that the other ranks then read
            task.prepare(info)
            barrier(info)
        else:
            barrier(info)
            task.prepare(info)
        if task.describe():
            self.say(task.describe())
        check_training_memory(task, self.run.batch_size, self.run.max_memory, self.device,
                              self.run.activation_checkpointing)
        self.config = config_to_dict(task.config)

        self.raw_model = task.build_model().to(self.device)
        require(isinstance(self.raw_model, TrainableModel), "build_model()",
                "a model with parameter_fans() and training_flops_per_token(seq_len) (models.TrainableModel)",
                type(self.raw_model).__name__)
        if self.run.activation_checkpointing:
            backbones = [m for m in self.raw_model.modules() if isinstance(m, Transformer)]
            require(bool(backbones), "run.activation_checkpointing", "false for a model without a Transformer "
                    "backbone (it is the backbone's blocks that are computed again)", True)
            for backbone in backbones:
                backbone.activation_checkpointing = True
        self.flops_per_token = task.flops_per_token(self.raw_model)
        self.aliases = tied_aliases(self.raw_model)
        self.model = wrap_model(self.raw_model, info, self.run.fsdp)
        self.step_model = self.model  # compiled in begin() once the weights are in place
        self.optimizer = build_optimizer(self.raw_model, self.optim_cfg,
                                         fused=self.device.type == "cuda" and not self.run.fsdp)
        self.tokens_per_step = task.tokens_per_batch() * self.run.grad_accum * info.world_size
        n_params = sum(p.numel() for p in self.raw_model.parameters())
        self.say(f"model: {n_params:,} parameters | {self.flops_per_token / 1e6:.2f} MFLOPs/token (training) | "
                 f"{self.tokens_per_step:,} tokens/step | device {self.device}"
                 f"{f' x{info.world_size}' if info.enabled else ''}")

        self.start_step = self.done = 0
        self.tokens_done, self.flops_done = 0, 0.0  # by one process (each trains as much), as step_cost counts them
        self.end_step = self.run.steps  # the step the loop runs to: less for a resumed run that stopped early
        self.losses: list[float] = []
        self.history: list[dict[str, Any]] = []
        self.tracker = BestTracker()
        self.final: dict[str, Any] = {}
        self.stopped_early = False
        self.wandb_id: str | None = None
        self.last_ckpt: Path | None = None
        # A checkpoint is *good* once the step after it gave a finite loss with its weights; the
        # newest saved one waits in ``untried`` until then (the one resumed from too).
        self.good: Path | None = None
        self.untried: Path | None = None

    def say(self, msg: str) -> None:
        if self.info.is_main:
            print(msg, file=self.stream if self.stream is not None else sys.stderr, flush=True)

    def restore(self) -> None:
        """Continue from the newest valid checkpoint: weights, optimiser, random state, losses,
        metrics and the best-tracker; its model config must equal this one's."""
        ckpt = load_checkpoint(self.ckpt_dir)
        saved_model, current_model = ckpt.state["config"].get("model"), self.config.get("model")
        if saved_model != current_model:
            raise ValueError(f"--resume: checkpoint {ckpt.path} is from another architecture "
                             f"({_model_diff(saved_model or {}, current_model or {})})")
        batches = _batch_diff(ckpt.state, self.config.get("run", {}), self.info.world_size)
        if batches:
            raise ValueError(f"--resume: checkpoint {ckpt.path} was trained on other batches ({batches}); a resumed "
                             f"run continues its batches: set them back, or start a fresh run without --resume")
        check_compatible(self.raw_model, ckpt.model_state, str(ckpt.path))
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=ckpt.model_state,
                       optim_state_dict=ckpt.optimizer_state(), options=StateDictOptions(full_state_dict=True))
        for group in self.optimizer.param_groups:  # the state-dict helpers hand betas back as a list
            group["betas"] = tuple(group["betas"])
        set_rng_state(ckpt.state["rng"])
        self.start_step = self.done = ckpt.step
        for step in range(ckpt.step):  # added up step by step, as a run that was never resumed adds them
            tokens, flops = self.task.step_cost(step, self.raw_model)
            self.tokens_done, self.flops_done = self.tokens_done + tokens, self.flops_done + flops
        self.losses = list(ckpt.state["losses"])
        self.history = list(ckpt.state["metrics"])
        saved = ckpt.state.get("tracker", {})
        self.tracker = BestTracker(**{k: saved[k] for k in ("best_val_loss", "best_step", "best", "bad_evals")
                                      if k in saved})
        self.wandb_id = ckpt.state.get("wandb_id")
        self.untried = ckpt.path
        self.last_ckpt = ckpt.path  # the run's checkpoint until it saves one (none, with nothing left to train)
        self.final = next((dict(r) for r in reversed(self.history) if "val_loss" in r), {})
        self.say(f"resumed from {ckpt.path} at step {self.start_step}")
        if self.start_step >= self.run.steps:
            self.say(f"checkpoint step {self.start_step} >= run.steps={self.run.steps}: nothing to train")
        elif self.tracker.exhausted(self.run.patience):  # it stopped early: a step more would change its result
            self.stopped_early, self.end_step = True, self.start_step
            self.say(f"the run stopped early at step {self.start_step} (no better val loss in {self.run.patience} "
                     f"evaluations): nothing to train (a larger run.patience continues it)")

    def begin(self, fresh: bool) -> None:
        """Open the logs (a resumed run's continue where its checkpoint left them) and, for a fresh
        run, take over ``out_dir``: every check has passed by now (data, model, optimiser,
        loggers), so an earlier run's checkpoints there, which would otherwise outrank this run's
        by step number, are removed (only checkpoints this package wrote)."""
        self.logger = MetricsLogger(self.out_dir, self.run, self.config, self.history, enabled=self.info.is_main,
                                    resume_step=None if fresh else self.start_step, wandb_id=self.wandb_id)
        if fresh and self.info.is_main:
            removed = remove_checkpoints(self.ckpt_dir) + remove_checkpoints(self.best_dir)
            if removed:
                self.say(f"fresh run: removed {removed} checkpoint(s) of an earlier run in {self.out_dir} "
                         f"(use --resume to continue it)")
        barrier(self.info)
        if self.info.is_main:
            configs = {"requested": config_to_dict(self.task.requested), "resolved": self.config}
            (self.out_dir / "config.json").write_text(json.dumps(configs, indent=2) + "\n", encoding="utf-8")
        if self.run.compile:
            self.step_model = torch.compile(self.model, mode=self.run.compile_mode)
        self.progress = Progress(self.run.steps, self.start_step, self.stream)
        self.t_start = time.perf_counter()
        self.tokens_this_run = 0
        self.model.train()

    def train_step(self, step: int) -> tuple[float, float]:
        """One optimiser step (0-based ``step``) over ``grad_accum`` micro-batches: its loss
        (averaged over ranks) and learning rate. A non-finite loss stops before the update."""
        run, info = self.run, self.info
        lr = lr_at(step, run.steps, self.optim_cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["lr_mult"]
        loss_sum = torch.zeros((), device=self.device)
        if run.compile:
            # A new step for CUDA graphs (compile_mode="reduce-overhead"): the last step's outputs
            # (its losses, added up below; its gradients, set to None) are dead, so this step's replays
            # may overwrite them. Not per micro-batch: the gradients accumulated so far are outputs
            # of the last backward's graph, which the next replays must keep.
            torch.compiler.cudagraph_mark_step_begin()
        for micro in range(run.grad_accum):
            t_data = time.perf_counter()
            batch = self.task.batch(step * run.grad_accum + micro, info.rank, info.world_size, self.device)
            self.progress.data_s += time.perf_counter() - t_data
            sync = contextlib.nullcontext()
            if info.enabled and not run.fsdp and micro < run.grad_accum - 1:
                sync = self.model.no_sync()  # type: ignore[operator]
            with sync:
                with autocast_context(run.autocast, self.device):
                    loss = self.task.loss(self.step_model, batch)
                (loss / run.grad_accum).backward()
            loss_sum += loss.detach().float()
        step_loss = float(all_reduce_mean(loss_sum / run.grad_accum, info))
        if not math.isfinite(step_loss):
            raise self._nonfinite(f"the loss is {step_loss} at step {step + 1}")
        if self.untried is not None:
            self.good, self.untried = self.untried, None
        if self.optim_cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.done = step + 1
        self.losses.append(step_loss)
        tokens, flops = self.task.step_cost(step, self.raw_model)
        self.tokens_done, self.flops_done = self.tokens_done + tokens, self.flops_done + flops
        self.tokens_this_run += tokens * info.world_size
        return step_loss, lr

    def report(self, done: int, loss: float, lr: float) -> bool:
        """Every ``log_every`` steps a metrics record and a progress line; every ``eval_every``
        steps and at the end an evaluation too. Whether the validation loss improved on the best."""
        run = self.run
        evaluate = done == run.steps or _every(done, run.eval_every)
        if not evaluate and done % run.log_every:
            return False
        timing = self.progress.window(self.tokens_this_run, done)
        record: dict[str, Any] = {
            "step": done, "loss": loss, "lr": lr, "tokens": self.tokens_done * self.info.world_size,
            "flops": self.flops_done * self.info.world_size,
            **timing, "elapsed_s": time.perf_counter() - self.t_start, "rss_mib": resident_mib(),
        }
        improved, extra = False, ""
        if evaluate:
            metrics = _evaluate(self.task, self.model, self.device, run.autocast)
            record.update(metrics)
            self.final = record
            extra = _format_metrics(metrics)
            improved = self.tracker.update(done, metrics)
        self.logger.log(record)
        if self.info.is_main:
            self.progress.line(done, loss, lr, timing["tokens_per_s"], extra)
        self.progress.mark()
        return improved

    def save(self, root: Path, keep: int) -> Path | None:
        """A checkpoint of the last finished step in ``root`` (rank 0 writes; every rank gathers)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.info.is_main:
            return None
        state = {
            "config": self.config,
            **self.task.state(),
            "rng": get_rng_state(),
            "data": {"seed": self.run.seed, "next_step": self.done, "world_size": self.info.world_size},
            "losses": self.losses,
            "metrics": self.logger.records,
            "tracker": asdict(self.tracker),
            **({"experiment": self.task.experiment} if self.task.experiment else {}),
            **({"wandb_id": self.logger.wandb_id} if self.logger.wandb_id else {}),
        }
        return save_checkpoint(root, self.done, msd, osd, state, aliases=self.aliases, keep=keep)

    def checkpoint(self) -> None:
        """The run's checkpoint of the last finished step, in ``ckpt/`` (two kept); never one of
        non-finite weights."""
        if not _finite_weights(self.model, self.info):
            raise self._nonfinite(f"the weights are not finite after step {self.done} (its loss was finite)")
        self.last_ckpt = self.save(self.ckpt_dir, keep=2) or self.last_ckpt
        self.untried = self.last_ckpt

    def _nonfinite(self, what: str) -> NonFiniteLossError:
        where = "; no checkpoint of this run has given a finite loss yet"
        if self.good is not None and checkpoint_verifies(self.good):
            where = f"; the last good checkpoint is {self.good}"
        return NonFiniteLossError(f"training stopped: {what}{where} (try a lower optim.lr, or optim.grad_clip > 0)")

    def finish(self) -> FitResult:
        """The result: final and best metrics (an evaluation now if nothing was trained), counts,
        and the trained model (gathered in full on rank 0 under FSDP)."""
        wall = time.perf_counter() - self.t_start
        run, info = self.run, self.info
        final = self.final
        if self.start_step >= self.end_step or not final:  # nothing trained: still report the validation metrics
            final = {"step": self.done, **_evaluate(self.task, self.model, self.device, run.autocast)}
        trained = self.raw_model
        if run.fsdp and info.enabled:  # gather the full weights (a collective) into a fresh model on rank 0
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            trained = None
            if info.is_main:
                trained = self.task.build_model()
                trained.load_state_dict(full)
                trained = trained.to(self.device)
        metrics = {k: v for k, v in final.items() if k not in _RECORD_KEYS}
        return FitResult(
            steps=self.done,
            losses=self.losses,
            final=metrics,
            best=dict(self.tracker.best) or metrics,
            best_step=self.tracker.best_step or self.done,
            stopped_early=self.stopped_early,
            tokens=self.tokens_done * info.world_size,
            flops=self.flops_done * info.world_size,
            wall_s=wall,
            out_dir=str(self.out_dir),
            checkpoint=str(self.last_ckpt) if self.last_ckpt else None,
            config=self.config,
            rank=info.rank,
            world_size=info.world_size,
            model=trained if info.is_main else None,
        )


# the keys of a metrics record that are not the task's metrics
_RECORD_KEYS = ("step", "loss", "lr", "tokens", "flops", "tokens_per_s", "step_s", "data_s", "elapsed_s", "rss_mib")
