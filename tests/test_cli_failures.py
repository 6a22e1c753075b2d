"""What the machine refuses (a full disk, a folder that cannot be made, memory), Ctrl-C before the
loop and sources that cannot be read: one line naming the path or parameter, a non-zero exit, and
nothing already written lost or left half-written."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest

from structured_attention.cli.main import main
from structured_attention.training import find_checkpoints, load_checkpoint
from test_faults import _args


def _one_line(capsys) -> str:
    """The error line, which ends stderr (the run's progress lines may come before it), and no
    traceback."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert not [line for line in lines if line.startswith(("Traceback", "  File "))], lines
    assert sum(line.startswith("sattn ") for line in lines) == 1, lines
    return lines[-1]


def test_a_full_disk_while_saving_keeps_the_previous_checkpoint(tmp_path, capsys, monkeypatch):
    from structured_attention.training import checkpoint

    assert main(_args(tmp_path, "run", 2, checkpoint_every=1)) == 0
    before = load_checkpoint(tmp_path / "run")
    real_save_file = checkpoint.save_file

    def full(tensors, path, metadata=None):
        real_save_file(tensors, path, metadata=metadata)
        with open(path, "r+b") as f:  # half the file is on disk when the disk fills up
            f.truncate(os.path.getsize(path) // 2)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(checkpoint, "save_file", full)
    capsys.readouterr()
    assert main([*_args(tmp_path, "run", 4, checkpoint_every=1), "--resume"]) == 1
    line = _one_line(capsys)
    assert line.startswith("sattn train: error: No space left on device: ") and str(tmp_path / "run") in line
    ckpt = tmp_path / "run" / "ckpt"
    assert [p.name for p in find_checkpoints(ckpt)] == ["step-00000002", "step-00000001"]
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".tmp")]  # no half-written folder left
    assert load_checkpoint(tmp_path / "run").state["state_sha256"] == before.state["state_sha256"]


def test_an_out_dir_that_cannot_be_made_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    assert main(_args(tmp_path, "file/run", 2)) == 2
    line = _one_line(capsys)
    assert line.startswith("sattn train: error: run.out_dir: expected a folder, got ") and str(tmp_path / "file") in line


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_cache_dir_is_one_line(tmp_path, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o500)
    try:
        assert main([*_args(tmp_path, "run", 2), f"data.cache_dir={cache}"]) == 1
    finally:
        cache.chmod(0o700)
    assert "Permission denied" in _one_line(capsys)


def test_a_read_only_file_system_is_one_line(tmp_path, capsys, monkeypatch):
    """The same refusal as the file system gives it (this runs as root too, where chmod does not
    stop a write): the corpus cache's first write raises EROFS."""
    from structured_attention.data import corpus

    def read_only(path, write):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(corpus, "atomic_write", read_only)
    assert main(_args(tmp_path, "run", 2)) == 1
    line = _one_line(capsys)
    assert line.startswith("sattn train: error: Read-only file system: ") and str(tmp_path / "cache") in line
    assert not (tmp_path / "run" / "run.lock").exists()


def test_ctrl_c_before_the_loop_is_one_line(tmp_path, capsys, monkeypatch):
    from structured_attention.experiments import lm

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(lm, "load_corpus", interrupted)
    assert main(_args(tmp_path, "run", 2)) == 130
    assert _one_line(capsys) == "sattn train: interrupted"
    assert not (tmp_path / "run" / "run.lock").exists()  # the claim is released


def test_out_of_memory_is_one_line(tmp_path, capsys, monkeypatch):
    from structured_attention.experiments import lm

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(lm, "load_corpus", no_memory)
    assert main(_args(tmp_path, "run", 2)) == 1
    assert _one_line(capsys).startswith("sattn train: error: out of memory")


def test_an_eval_batch_whose_logits_cannot_fit_is_one_line(tmp_path, capsys, monkeypatch):
    """sattn eval bounds a batch by its logits and their log-softmax (8 bytes per sequence position
    and vocabulary entry), capped by the split's windows, against the memory available."""
    from structured_attention.training import memory

    assert main(_args(tmp_path, "run", 1)) == 0
    vocab = load_checkpoint(tmp_path / "run").state["config"]["model"]["vocab_size"]
    per_row = 8 * 32 * vocab  # run.seq_len 32
    monkeypatch.setattr(memory, "available_memory", lambda device: 3 * per_row)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--batch-size", "3", "--max-batches", "1"]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--batch-size", "1000000"]) == 2
    line = _one_line(capsys)
    assert line.startswith("sattn eval: error: --batch-size: expected at most 3 sequences per batch on this cpu "
                           "device") and "got 1,000,000" in line, line
    monkeypatch.setattr(memory, "available_memory", lambda device: 2 * per_row)  # the run's batch of 4
    assert main(["eval", "--checkpoint", str(tmp_path / "run")]) == 2
    assert _one_line(capsys).startswith(f"sattn eval: error: run.batch_size of {tmp_path / 'run'}")


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not Path("/dev/zero").exists(), reason="POSIX FIFOs and devices")
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_fifo_or_device_as_the_corpus_is_refused(tmp_path, capsys, kind):
    if kind == "fifo":
        source = tmp_path / "pipe"
        os.mkfifo(source)
    else:
        source = Path("/dev/zero")
    assert main([*_args(tmp_path, "run", 2), f"data.source={source}"]) == 2
    assert _one_line(capsys) == (f"sattn train: error: source: expected a regular file or a folder "
                                 f"(not a FIFO or a device), got {str(source)!r}")


def test_a_hub_source_that_fails_to_load_is_one_line(tmp_path, capsys, monkeypatch):
    import types

    from structured_attention.data import corpus

    def offline(name, config, split):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)\nsecond line")

    monkeypatch.setattr(corpus, "_import_datasets", lambda: types.SimpleNamespace(load_dataset=offline))
    assert main([*_args(tmp_path, "run", 2), "data.source=hf:someone/corpus"]) == 2
    assert _one_line(capsys) == ("sattn train: error: source: could not load 'hf:someone/corpus': ConnectionError: "
                                 "Couldn't reach 'someone/corpus' on the Hub (LocalEntryNotFoundError)")


@pytest.mark.parametrize("argv", [["bench", "attention"], ["bench", "mlr"], ["bench", "lm"], ["bench", "varlen"],
                                  ["bench", "ragged"], ["bench", "generate"], ["bench", "hf"],
                                  ["eval", "--checkpoint", "."], ["generate", "--checkpoint", ".", "--prompt", "a"]])
def test_a_device_this_machine_lacks_is_one_line(tmp_path, capsys, argv):
    """A CUDA index past the machine's last GPU (every index on a machine without one) is refused
    before anything runs, by every command that takes --device."""
    import torch

    missing = f"cuda:{torch.cuda.device_count()}"
    assert main([*argv, "--device", missing, *(["--out", str(tmp_path)] if argv[0] == "bench" else [])]) == 2
    assert _one_line(capsys).endswith(f"--device: expected 'cpu' or an available CUDA device, got '{missing}'")
