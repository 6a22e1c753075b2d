"""The language-model training loop: ``train(config) -> dict``.

One readable loop, nanoGPT style:

1. seed torch, numpy and Python ``random`` from ``run.seed``; set up DDP/FSDP if launched by
   ``torchrun``;
2. load (and on first use tokenise and cache) the corpus; build the GPT with the tokenizer's
   vocabulary; AdamW with decoupled weight decay on matrices only and, with ``optim.mup``, muP
   learning-rate multipliers (:func:`structured_attention.training.optim.mup_lr_multipliers`);
3. for each optimizer step ``s`` (0-based) and micro-batch ``m``, draw this rank's slice of the
   global batch with ``sample_batch(train, batch_size, seq_len, seed=run.seed,
   step=s * grad_accum + m, rank, world_size)`` -- a pure function of ``(seed, step)``, so
   ``--resume`` continues exactly;
4. warmup + cosine/constant learning rate, bfloat16 autocast on CUDA (``run.autocast='auto'``),
   gradient clipping, a NaN/inf loss stops the run (:class:`NonFiniteLossError`) before the update;
5. every ``eval_every`` steps and at the end: validation loss and bits per byte; every
   ``log_every`` steps a progress line on stderr and a JSON line in ``<out_dir>/metrics.jsonl``;
   every ``checkpoint_every`` steps and at the end a checkpoint in ``<out_dir>/ckpt/``
   (rank 0 only writes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from ..data import Corpus, eval_batches, load_corpus, sample_batch
from ..models.gpt import GPT
from .checkpoint import (
    check_compatible,
    find_checkpoints,
    get_rng_state,
    load_checkpoint,
    save_checkpoint,
    set_rng_state,
    tied_aliases,
)
from .config import TrainConfig, config_to_dict
from .distributed import DistInfo, all_reduce_mean, barrier, cleanup_distributed, setup_distributed, wrap_model
from .optim import build_optimizer, lr_at

__all__ = ["NonFiniteLossError", "evaluate", "generate_sample", "train"]


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the message names the step."""


# -- small pieces ------------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def autocast_context(mode: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bfloat16 autocast for ``'bf16'``, and for ``'auto'`` on CUDA; otherwise nothing."""
    if mode == "bf16" or (mode == "auto" and device.type == "cuda"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    max_batches: int | None = None,
    device: torch.device | str = "cpu",
    autocast: str = "auto",
) -> float:
    """Mean cross-entropy (nats per token) over ``eval_batches`` of ``tokens``."""
    was_training = model.training
    model.eval()
    seq_len = min(seq_len, len(tokens) - 1)
    total, count = 0.0, 0
    device = torch.device(device)
    for x, y in eval_batches(tokens, batch_size, seq_len, max_batches=max_batches, device=device):
        with autocast_context(autocast, device):
            _, loss = model(x, y)
        total += float(loss) * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / count


def generate_sample(
    model: GPT, tokenizer: Any, prompt: str, max_new_tokens: int, *, temperature: float = 0.8,
    top_k: int | None = 40, seed: int = 0, device: torch.device | str = "cpu",
) -> str:
    """``prompt`` followed by ``max_new_tokens`` sampled tokens (fewer if the context is short)."""
    ids = tokenizer.encode(prompt) or [0]
    ids = ids[-(model.config.max_seq_len - 1):]
    n = min(max_new_tokens, model.config.max_seq_len - len(ids))
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(torch.tensor([ids], device=device), n, temperature=temperature, top_k=top_k, generator=gen)
    return tokenizer.decode(out[0].tolist())


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
    """A one-line progress report on stderr: step, loss, lr, tokens/s, elapsed and ETA."""

    def __init__(self, total_steps: int, start_step: int, stream: TextIO | None = None) -> None:
        self.total = total_steps
        self.start_step = start_step
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.perf_counter()
        self.last_t = self.t0
        self.last_tokens = 0

    def rate(self, tokens_done: int) -> float:
        now = time.perf_counter()
        rate = (tokens_done - self.last_tokens) / max(now - self.last_t, 1e-9)
        self.last_t, self.last_tokens = now, tokens_done
        return rate

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

    def __init__(self, out_dir: Path, config: TrainConfig, history: list[dict[str, Any]], enabled: bool) -> None:
        self.enabled = enabled
        self.records = list(history)
        self.tb = None
        self.wandb = None
        if not enabled:
            return
        self.path = out_dir / "metrics.jsonl"
        # Rewrite from the history so a resumed run drops lines logged after its checkpoint.
        with open(self.path, "w", encoding="utf-8") as f:
            for r in self.records:
                f.write(json.dumps(r) + "\n")
        if config.run.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError(
                    "run.tensorboard: true needs the 'tensorboard' package (pip install tensorboard)"
                ) from None
            self.tb = SummaryWriter(str(out_dir / "tensorboard"))
        if config.run.wandb:
            try:
                import wandb  # type: ignore[import-not-found]
            except ImportError:
                raise ValueError("run.wandb: true needs the 'wandb' package (pip install wandb)") from None
            self.wandb = wandb.init(project=config.run.wandb_project, config=config_to_dict(config), dir=str(out_dir))

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


def _load_data(config: TrainConfig, info: DistInfo) -> Corpus:
    d = config.data

    def load() -> Corpus:
        return load_corpus(d.source, tokenizer=d.tokenizer, val_fraction=d.val_fraction, cache_dir=d.cache_dir)

    if info.is_main:  # rank 0 tokenises and writes the cache first; the others then read it
        corpus = load()
        barrier(info)
    else:
        barrier(info)
        corpus = load()
    need = config.run.seq_len + 1
    if len(corpus.train) < need:
        raise ValueError(
            f"data.source: the training split has {len(corpus.train)} tokens; run.seq_len={config.run.seq_len} "
            f"needs at least {need} (use a larger corpus or a shorter run.seq_len)"
        )
    if len(corpus.val) < 2:
        raise ValueError(f"data.source: the validation split has {len(corpus.val)} tokens; at least 2 are needed")
    return corpus


def _model_diff(saved: dict[str, Any], current: dict[str, Any]) -> str:
    diffs = [f"model.{k}={saved.get(k)!r} in the checkpoint, {current.get(k)!r} now" for k in current if saved.get(k) != current.get(k)]
    return "; ".join(diffs[:3])


# -- the loop ------------------------------------------------------------------------------------------


def train(config: TrainConfig, *, resume: bool = False, stream: TextIO | None = None) -> dict[str, Any]:
    """Train a GPT language model as ``config`` says; see the module docstring.

    Returns ``{"steps", "losses" (per optimizer step, all steps 1..steps including those before a
    resume), "final_val_loss", "final_val_bpb", "tokens", "flops", "wall_s", "sample", "out_dir",
    "checkpoint", "config"}``. With ``resume`` it continues from the newest valid checkpoint in
    ``<run.out_dir>/ckpt`` (``FileNotFoundError`` if there is none).
    """
    info = setup_distributed(config.run.device)
    try:
        return _train(config, resume, info, stream)
    finally:
        cleanup_distributed(info)


def _train(config: TrainConfig, resume: bool, info: DistInfo, stream: TextIO | None) -> dict[str, Any]:
    run, optim_cfg = config.run, config.optim
    device = info.device
    out_dir = Path(run.out_dir)
    ckpt_dir = out_dir / "ckpt"
    say = (lambda msg: print(msg, file=stream if stream is not None else sys.stderr, flush=True)) if info.is_main else (lambda msg: None)
    seed_everything(run.seed)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")

    corpus = _load_data(config, info)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=corpus.vocab_size))
    say(
        f"data: {corpus.source} | tokenizer {corpus.tokenizer.name} (vocab {corpus.vocab_size}) | "
        f"train {len(corpus.train):,} tokens, val {len(corpus.val):,} tokens"
    )

    raw_model = GPT(config.model).to(device)
    flops_per_token = raw_model.training_flops_per_token(run.seq_len)
    aliases = tied_aliases(raw_model)
    model = wrap_model(raw_model, info, run.fsdp)
    optimizer = build_optimizer(raw_model, optim_cfg, fused=device.type == "cuda" and not run.fsdp)
    tokens_per_step = run.batch_size * run.grad_accum * info.world_size * run.seq_len
    say(
        f"model: {raw_model.num_params():,} parameters | attention {config.model.attention} | "
        f"{flops_per_token / 1e6:.2f} MFLOPs/token (training) | {tokens_per_step:,} tokens/step | "
        f"device {device}{f' x{info.world_size}' if info.enabled else ''}"
    )

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    start_step, losses, history = 0, [], []
    if resume:
        if not ckpt_dir.is_dir():
            raise FileNotFoundError(f"--resume: no checkpoint folder {str(ckpt_dir)!r} (run.out_dir={run.out_dir!r})")
        ckpt = load_checkpoint(ckpt_dir)
        saved_model = ckpt.state["config"]["model"]
        current_model = config_to_dict(config)["model"]
        if saved_model != current_model:
            raise ValueError(
                f"--resume: checkpoint {ckpt.path} is from another architecture ({_model_diff(saved_model, current_model)})"
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
        say(f"resumed from {ckpt.path} at step {start_step}")
        if start_step >= run.steps:
            say(f"checkpoint step {start_step} >= run.steps={run.steps}: nothing to train")

    if not resume and info.is_main and ckpt_dir.is_dir():
        # A fresh run owns its out_dir: checkpoints of an earlier run there would otherwise
        # outrank (by step number) the ones this run writes.
        old = find_checkpoints(ckpt_dir, complete_only=False)
        if old:
            say(f"fresh run: removing {len(old)} checkpoint(s) of an earlier run in {ckpt_dir} (use --resume to continue it)")
            for folder in old:
                shutil.rmtree(folder, ignore_errors=True)
    barrier(info)
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(config_to_dict(config), indent=2) + "\n", encoding="utf-8")
    logger = MetricsLogger(out_dir, config, history, enabled=info.is_main)
    step_fn_model = torch.compile(model) if run.compile else model

    def save(step: int) -> Path | None:
        msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not info.is_main:
            return None
        state = {
            "config": config_to_dict(config),
            "tokenizer": corpus.tokenizer.to_json(),
            "rng": get_rng_state(),
            "data": {"seed": run.seed, "next_step": step, "source": corpus.source},
            "losses": losses,
            "metrics": logger.records,
        }
        return save_checkpoint(ckpt_dir, step, msd, osd, state, aliases=aliases)

    def run_eval() -> tuple[float, float]:
        # every rank evaluates the same batches (FSDP needs all ranks in each forward)
        loss = evaluate(model, corpus.val, run.batch_size, run.seq_len, run.eval_batches, device, run.autocast)
        return loss, corpus.bits_per_byte(loss)

    progress = Progress(run.steps, start_step, stream)
    t_start = time.perf_counter()
    tokens_this_run = 0
    last_ckpt: Path | None = None
    val_loss = val_bpb = float("nan")
    model.train()
    for step in range(start_step, run.steps):
        lr = lr_at(step, run.steps, optim_cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_mult"]
        loss_sum = torch.zeros((), device=device)
        for micro in range(run.grad_accum):
            x, y = sample_batch(
                corpus.train, run.batch_size, run.seq_len, seed=run.seed, step=step * run.grad_accum + micro,
                rank=info.rank, world_size=info.world_size, device=device,
            )
            sync = contextlib.nullcontext()
            if info.enabled and not run.fsdp and micro < run.grad_accum - 1:
                sync = model.no_sync()  # type: ignore[operator]
            with sync:
                with autocast_context(run.autocast, device):
                    _, loss = step_fn_model(x, y)
                (loss / run.grad_accum).backward()
            loss_sum += loss.detach().float()
        step_loss = float(all_reduce_mean(loss_sum / run.grad_accum, info))
        if not math.isfinite(step_loss):
            where = f"; the last good checkpoint is {last_ckpt}" if last_ckpt else ""
            raise NonFiniteLossError(
                f"training stopped: the loss is {step_loss} at step {step + 1}{where} "
                f"(try a lower optim.lr, or optim.grad_clip > 0)"
            )
        if optim_cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim_cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        done = step + 1
        losses.append(step_loss)
        tokens_this_run += tokens_per_step
        is_last = done == run.steps
        do_eval = is_last or (run.eval_every > 0 and done % run.eval_every == 0)
        if do_eval or done % run.log_every == 0:
            tokens = done * tokens_per_step
            rate = progress.rate(tokens_this_run)
            record: dict[str, Any] = {
                "step": done, "loss": step_loss, "lr": lr, "tokens": tokens, "flops": tokens * flops_per_token,
                "tokens_per_s": rate, "elapsed_s": time.perf_counter() - t_start,
            }
            extra = ""
            if do_eval:
                val_loss, val_bpb = run_eval()
                record.update(val_loss=val_loss, val_bpb=val_bpb)
                extra = f" | val loss {val_loss:.4f} | val bpb {val_bpb:.4f}"
            logger.log(record)
            if info.is_main:
                progress.line(done, step_loss, lr, rate, extra)
            progress.mark()
        if is_last or (run.checkpoint_every > 0 and done % run.checkpoint_every == 0):
            last_ckpt = save(done) or last_ckpt
    wall = time.perf_counter() - t_start

    if start_step >= run.steps:  # nothing trained: still report the validation loss
        val_loss, val_bpb = run_eval()
    sample = ""
    if run.sample_tokens > 0:
        gen_model: GPT | None = raw_model
        if run.fsdp and info.enabled:  # gather the full weights (a collective), sample on rank 0
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            gen_model = None
            if info.is_main:
                gen_model = GPT(config.model)
                gen_model.load_state_dict(full)
                gen_model = gen_model.to(device)
        if info.is_main and gen_model is not None:
            sample = generate_sample(
                gen_model, corpus.tokenizer, run.sample_prompt, run.sample_tokens, seed=run.seed, device=device
            )
    logger.close()
    total_tokens = run.steps * tokens_per_step
    return {
        "steps": run.steps,
        "losses": losses,
        "final_val_loss": val_loss,
        "final_val_bpb": val_bpb,
        "tokens": total_tokens,
        "flops": total_tokens * flops_per_token,
        "wall_s": wall,
        "sample": sample if info.is_main else "",
        "out_dir": str(out_dir),
        "checkpoint": str(last_ckpt) if last_ckpt else None,
        "config": config_to_dict(config),
        "rank": info.rank,
        "world_size": info.world_size,
    }
