"""A run's out_dir is claimed (run.lock) and a fresh run deletes only checkpoints it can identify as
this package's, after every check has passed: through the real command line, the live run in a
child process."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from structured_attention.cli.main import main
from structured_attention.training import find_checkpoints
from test_faults import _args, _run_here, _start, _wait_for_step

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX processes")


def _listing(folder: Path) -> dict[str, float]:
    return {str(p.relative_to(folder)): p.stat().st_mtime for p in sorted(folder.rglob("*"))}


def test_a_second_run_on_a_live_folder_stops_with_one_line_and_changes_nothing(tmp_path, capsys):
    first = _start(_args(tmp_path, "run", 4000, checkpoint_every=2))
    try:
        _wait_for_step(first, tmp_path / "run" / "metrics.jsonl", 3)
        assert find_checkpoints(tmp_path / "run" / "ckpt")
        lock = (tmp_path / "run" / "run.lock").read_text()
        assert lock.startswith(f"{socket.gethostname()} {first.pid} ")
        os.kill(first.pid, signal.SIGSTOP)  # alive, holding its lock, and its folder holds still
        before = _listing(tmp_path / "run")
        code, err = _run_here(_args(tmp_path, "run", 4), capsys)
        assert code != 0
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("sattn train: error: run.out_dir: expected a folder no other run")
        assert f" {first.pid} " in lines[0]
        assert _listing(tmp_path / "run") == before  # nothing of the live run touched
        os.kill(first.pid, signal.SIGCONT)
        assert first.poll() is None  # and it is still training
    finally:
        first.kill()
        first.wait()


def test_a_lock_left_by_a_dead_process_is_taken_over_and_released_at_exit(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.lock").write_text(f"{socket.gethostname()} 999999999 someone")
    assert main(_args(tmp_path, "run", 2)) == 0
    assert not (tmp_path / "run" / "run.lock").exists()


def test_a_lock_held_on_another_host_is_respected(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.lock").write_text("other-host 123 someone")
    assert main(_args(tmp_path, "run", 2)) == 2
    err = capsys.readouterr().err
    assert "in use by other-host 123 someone" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "run" / "run.lock").read_text() == "other-host 123 someone"


def test_a_fresh_run_deletes_only_its_own_kind_of_checkpoints_after_its_checks(tmp_path, capsys):
    assert main(_args(tmp_path, "run", 2, checkpoint_every=1)) == 0
    ckpt = tmp_path / "run" / "ckpt"
    old = find_checkpoints(ckpt)
    assert old
    # Things that are not this package's checkpoints: a note, a folder named like one without a
    # state.json of this format, and a state.json at the top of ckpt/.
    (ckpt / "notes.txt").write_text("keep me")
    (ckpt / "step-99999999").mkdir()
    (ckpt / "step-99999999" / "state.json").write_text(json.dumps({"format": "someone-else"}))
    (ckpt / "state.json").write_text("{}")
    # A fresh run whose checks fail (wandb asked for and not installed) deletes nothing.
    if "wandb" not in sys.modules:
        try:
            import wandb  # noqa: F401
        except ImportError:
            assert main(_args(tmp_path, "run", 2, wandb="true")) == 2
            assert all(p.is_dir() for p in old)
    capsys.readouterr()
    assert main(_args(tmp_path, "run", 1)) == 0
    assert "removed 2 checkpoint(s) of an earlier run" in capsys.readouterr().err
    assert (ckpt / "notes.txt").read_text() == "keep me"
    assert (ckpt / "step-99999999" / "state.json").is_file() and (ckpt / "state.json").is_file()
    assert [p.name for p in find_checkpoints(ckpt)] == ["step-99999999", "step-00000001"]
    assert os.listdir(tmp_path / "run").count("run.lock") == 0
