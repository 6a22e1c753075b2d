"""``run_grid``: a sweep resumes where it stopped, and sweep processes started side by side split
the grid through per-run claim files (a live holder is respected, a dead one's claim taken over)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from structured_attention._files import claim, release
from structured_attention.experiments.common import run_grid


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _train(trained: list[str]):
    def train_one(r, resume):
        trained.append(r["name"])
        return {"score": len(r["name"])}
    return train_one


def test_claimed_runs_are_left_to_their_holder_and_dead_claims_are_taken_over(tmp_path):
    runs = [{"name": n} for n in ("a", "held", "stale", "remote")]
    host = socket.gethostname()
    for name, holder in [("held", f"{host} {os.getppid()}"), ("stale", f"{host} {_dead_pid()}"),
                         ("remote", f"another-host-{host} 1")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "claim").write_text(holder)

    trained: list[str] = []
    results = run_grid(tmp_path, "lm", runs, _train(trained))

    assert trained == ["a", "stale"]
    assert [r["name"] for r in results] == ["a", "stale"]
    assert json.loads((tmp_path / "stale" / "result.json").read_text()) == {"name": "stale", "score": 5}
    assert not (tmp_path / "a" / "claim").exists() and not (tmp_path / "stale" / "claim").exists()
    assert (tmp_path / "held" / "claim").read_text() == f"{host} {os.getppid()}"
    assert not (tmp_path / "held" / "result.json").exists()

    # the holder finished and left: a rerun trains only what is still missing
    (tmp_path / "held" / "claim").unlink()
    again: list[str] = []
    results = run_grid(tmp_path, "lm", runs[:3], _train(again))
    assert again == ["held"] and [r["name"] for r in results] == ["a", "held", "stale"]


def test_a_failed_run_releases_its_claim_and_leaves_no_result(tmp_path):
    def fail(r, resume):
        raise RuntimeError("diverged")

    with pytest.raises(RuntimeError, match="diverged"):
        run_grid(tmp_path, "lm", [{"name": "x"}], fail)
    assert not (tmp_path / "x" / "claim").exists() and not (tmp_path / "x" / "result.json").exists()


def test_a_claim_is_exclusive_and_released_only_by_its_holder(tmp_path):
    path = tmp_path / "claim"
    assert claim(path) is None
    assert claim(path).startswith(f"{socket.gethostname()} {os.getpid()} ")  # held by this (live) process
    path.write_text(f"{socket.gethostname()} 999999999 someone")  # a process gone from this host
    assert claim(path) is None  # taken over
    path.write_text("another-host 1 someone")
    assert claim(path) == "another-host 1 someone"  # respected: it cannot be checked from here
    release(path)
    assert path.exists()  # not ours to remove


def test_resume_is_asked_for_exactly_when_the_run_holds_a_complete_checkpoint(tmp_path):
    for name, files in [("fresh", []), ("partial", ["ckpt/step-00000004/model.safetensors"]),
                        ("saved", ["ckpt/step-00000004/model.safetensors", "ckpt/step-00000004/state.json"])]:
        for f in files:
            (tmp_path / name / f).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / f).write_text("{}")
    asked = {}

    def train_one(r, resume):
        asked[r["name"]] = resume
        return {}

    run_grid(tmp_path, "lm", [{"name": n} for n in ("fresh", "partial", "saved")], train_one)
    assert asked == {"fresh": False, "partial": False, "saved": True}


def test_a_sweep_folder_takes_no_other_experiments_sweep(tmp_path):
    """Another experiment's sweep into the same --out would have replaced sweep.json, and the
    folder's plots would then read its results as the other experiment's (a KeyError)."""
    run_grid(tmp_path, "lm", [{"name": "a"}], _train([]))
    trained: list[str] = []
    with pytest.raises(ValueError, match=r"^--out: expected a new folder or one of a icl sweep; .*sweep.json' "
                                         r"names 'lm'$"):
        run_grid(tmp_path, "icl", [{"name": "b"}], _train(trained))
    assert trained == [] and json.loads((tmp_path / "sweep.json").read_text()) == {"experiment": "lm"}
    assert [r["name"] for r in run_grid(tmp_path, "lm", [{"name": "a"}], _train(trained))] == ["a"]
