"""Faults during training, through the real command line: SIGKILL at a random step, SIGTERM and
Ctrl-C (SIGINT) in child processes, a damaged newest checkpoint. Every resumed run must end with
exactly the losses and validation metrics of an uninterrupted run (one thread, CPU: deterministic).
The runs that are not signalled run in this process, on one thread as the children do (a child
process costs seconds of imports on a small machine)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from structured_attention.cli.main import main
from structured_attention.training import find_checkpoints, load_checkpoint
from test_training import make_corpus

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _args(tmp: Path, out: str, steps: int, **run) -> list[str]:
    corpus = tmp / "corpus.txt"
    if not corpus.exists():
        make_corpus(corpus)
    settings = {
        "data.source": corpus, "data.cache_dir": tmp / "cache", "model.d_model": 32, "model.n_layers": 2,
        "model.n_heads": 2, "model.max_seq_len": 32, "run.seq_len": 32, "run.batch_size": 4, "run.steps": steps,
        "run.eval_every": 0, "run.eval_batches": 2, "run.log_every": 1, "run.out_dir": tmp / out,
        "run.sample_tokens": 0, "optim.warmup_steps": 2, "optim.schedule": "constant",
    }
    settings.update({f"run.{k}": v for k, v in run.items()})
    return ["train", "lm", *[f"{k}={v}" for k, v in settings.items()]]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run_here(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """``sattn`` in this process, on one thread as a child has: its exit code and its stderr."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main([str(a) for a in args])
    finally:
        torch.set_num_threads(threads)
    return code, capsys.readouterr().err


def _start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "structured_attention.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**_env(), **(env or {})})


def _wait_for_step(proc: subprocess.Popen, metrics: Path, step: int, timeout: float = 120) -> None:
    """Until ``metrics.jsonl`` has logged ``step`` (the clock here only bounds the wait)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"training ended early: {proc.communicate()}"
        if metrics.is_file():
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            if rows and rows[-1]["step"] >= step:
                return
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"step {step} was not reached")


def _outcome(out_dir: Path) -> tuple[list[float], float]:
    """Per-step training losses and the final validation loss, from the newest checkpoint."""
    state = load_checkpoint(out_dir / "ckpt").state
    evals = [r for r in state["metrics"] if "val_loss" in r]
    return state["losses"], evals[-1]["val_loss"]


def test_sigkill_at_a_random_step_then_resume_matches_an_uninterrupted_run(tmp_path, capsys):
    steps = 40
    code, err = _run_here(_args(tmp_path, "full", steps), capsys)
    assert code == 0, err
    kill_at = random.randint(3, steps - 5)
    proc = _start(_args(tmp_path, "killed", steps, checkpoint_every=1))
    _wait_for_step(proc, tmp_path / "killed" / "metrics.jsonl", kill_at)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    survived = find_checkpoints(tmp_path / "killed" / "ckpt")[0]
    code, err = _run_here([*_args(tmp_path, "killed", steps, checkpoint_every=1), "--resume"], capsys)
    assert code == 0, err
    assert f"resumed from {survived}" in err, f"killed at step {kill_at}"
    assert _outcome(tmp_path / "killed") == _outcome(tmp_path / "full"), f"killed at step {kill_at}"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_ctrl_c_save_a_checkpoint_then_exit(tmp_path, capsys, sig):
    proc = _start(_args(tmp_path, "run", 100_000))
    _wait_for_step(proc, tmp_path / "run" / "metrics.jsonl", 3)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"sattn train: {signal.Signals(sig).name} received: stopped after step ") and "--resume" in last
    assert "Traceback" not in err
    stopped = int(last.split("stopped after step ")[1].split()[0])
    ckpt = load_checkpoint(tmp_path / "run" / "ckpt")
    assert ckpt.step == stopped >= 3 and len(ckpt.state["losses"]) == stopped
    # The interrupted run continues exactly like one that was never stopped.
    target = stopped + 3
    resumed = _run_here([*_args(tmp_path, "run", target), "--resume"], capsys)
    full = _run_here(_args(tmp_path, "full", target), capsys)
    assert resumed[0] == 0 and full[0] == 0, resumed[1] + full[1]
    assert _outcome(tmp_path / "run") == _outcome(tmp_path / "full")


def test_sigterm_to_one_rank_under_torchrun_stops_every_rank_at_one_step_with_one_line(tmp_path):
    """Two processes started as torchrun starts them (gloo on the CPU); a scheduler's SIGTERM
    reaches rank 1 alone. Both ranks stop after the same step, rank 0 saves it, both exit with
    128 + 15, and one line says so: rank 0's, naming the checkpoint (each rank printed its own,
    rank 1's naming no checkpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [*_args(tmp_path, "run", 100_000), "run.device=cpu"]
    procs = [_start(args, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                           "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}) for rank in range(2)]
    try:
        _wait_for_step(procs[0], tmp_path / "run" / "metrics.jsonl", 3)
        procs[1].send_signal(signal.SIGTERM)
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, errs
    lines = [line for err in errs for line in err.splitlines() if "received" in line]
    assert len(lines) == 1 and lines[0] in errs[0] and "Traceback" not in errs[0] + errs[1], errs
    stopped = int(lines[0].split("stopped after step ")[1].split()[0])
    ckpt = load_checkpoint(tmp_path / "run" / "ckpt")
    assert ckpt.step == stopped >= 3 and str(ckpt.path) in lines[0]


def test_a_damaged_newest_checkpoint_is_detected_and_resume_uses_the_previous_one(tmp_path, capsys):
    full = _run_here(_args(tmp_path, "full", 8), capsys)
    part = _run_here(_args(tmp_path, "part", 6, checkpoint_every=2), capsys)
    assert full[0] == 0 and part[0] == 0, full[1] + part[1]
    newest = find_checkpoints(tmp_path / "part" / "ckpt")[0]
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated, as by a full disk
    code, err = _run_here([*_args(tmp_path, "part", 8, checkpoint_every=2), "--resume"], capsys)
    assert code == 0, err
    assert "does not match its stored SHA-256" in err and "falling back to the previous checkpoint" in err
    assert "resumed from" in err and "step-00000004" in err
    assert _outcome(tmp_path / "part") == _outcome(tmp_path / "full")
