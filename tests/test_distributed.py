"""Distributed data parallel on the CPU (gloo): 2 processes == 1 process at the same global batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

import torch

from structured_attention.experiments.lm import load_lm, load_lm_config, train_lm

from test_training import tiny_overrides

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")

WORKER = textwrap.dedent(
    """
    import gc, json, os, sys
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from structured_attention.experiments.lm import load_lm_config, train_lm
    if os.environ.get("AS_IF_A_GPU"):  # the machine's accelerator, as torch reports it, is CUDA
        torch._C._get_accelerator = lambda: torch.device("cuda")
    result = train_lm(load_lm_config(None, json.loads(sys.argv[1])))
    # a wrapper that outlives training holds the process group until interpreter exit (a SIGABRT there)
    gc.disable()
    assert not any(isinstance(o, DistributedDataParallel) for o in gc.get_objects()), "the DDP wrapper outlived train_lm"
    if result.rank == 0:
        with open(sys.argv[2], "w") as f:
            json.dump({"losses": result.losses, "world_size": result.world_size, "bpb": result.val_bpb}, f)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, overrides: list[str], world_size: int = 2, timeout: float = 120,
           env: dict[str, str] | None = None) -> dict:
    """Start ``world_size`` processes the way torchrun would (RANK/WORLD_SIZE/MASTER_* in the env,
    plus ``env``); on a timeout the failure shows what each process had printed."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    result_file = tmp_path / "result.json"
    port = _free_port()
    procs = []
    for rank in range(world_size):
        proc_env = {
            **os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1",
            "PYTHONFAULTHANDLER": "1",  # a crash prints every thread's Python stack
        }
        procs.append(subprocess.Popen(
            [sys.executable, str(script), json.dumps(overrides), str(result_file)],
            env=proc_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        printed = [p.communicate()[0] for p in procs]
        pytest.fail(f"not done in {timeout} s; each process printed:\n" + "\n---\n".join(o[-2000:] for o in printed))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return json.loads(result_file.read_text())


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_processes_match_one(tmp_path, fsdp):
    common = tiny_overrides(tmp_path, steps=4, eval_every=0, sample_tokens=0, checkpoint_every=0, eval_batches=2,
                            device="cpu")  # gloo on the CPU, on any machine
    single = train_lm(load_lm_config(None, common + ["run.batch_size=8", f"run.out_dir={tmp_path / 'single'}"]))
    # run.device=cpu on a machine whose accelerator is a GPU: the processes (and FSDP's shards) stay
    # on the CPU; they compute their blocks again in the backward pass, which the single one does
    # not (activation checkpointing under DDP and FSDP changes no loss)
    multi = launch(tmp_path, common + ["run.batch_size=4", f"run.out_dir={tmp_path / 'multi'}", f"run.fsdp={fsdp}",
                                       "run.activation_checkpointing=true"], env={"AS_IF_A_GPU": "1"})
    assert multi["world_size"] == 2
    assert len(multi["losses"]) == len(single.losses) == 4
    for a, b in zip(multi["losses"], single.losses):
        assert abs(a - b) < 1e-5, (multi["losses"], single.losses)
    # both score run.eval_batches global batches of 8: the first 16 validation windows (the two
    # processes scored their 4 x 2 windows each, the first 8, a different figure)
    assert abs(multi["bpb"] - single.val_bpb) < 1e-4
    # only rank 0 wrote the checkpoint and the metrics
    assert (tmp_path / "multi" / "ckpt").is_dir() and (tmp_path / "multi" / "metrics.jsonl").is_file()
    # the checkpoint has the plain model's parameter names (no DDP "module." prefix): it loads as is
    model, _, _, ckpt = load_lm(tmp_path / "multi")
    single_model, _, _, _ = load_lm(tmp_path / "single")
    assert ckpt.step == 4
    for (name, a), b in zip(model.state_dict().items(), single_model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), name


def test_more_processes_than_gpus_is_one_line(monkeypatch):
    """torchrun with more processes per machine than GPUs: the process without a GPU says so
    (with run.device=auto it would otherwise fail inside torch.cuda.set_device)."""
    from structured_attention.training.distributed import setup_distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match=r"^run\.device: expected a CUDA device for each process of this machine, "
                                         r"got process LOCAL_RANK=1 and 1 device\(s\)"):
        setup_distributed("auto")
