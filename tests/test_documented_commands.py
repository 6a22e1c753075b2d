"""Every ``sattn sweep`` command in the README and docs/ plans a valid grid (``--dry-run``), so a
reader who copies one gets runs, not a config error."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from structured_attention.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


def _documented_sweeps() -> list[tuple[str, str]]:
    """(file, command) for each ``sattn sweep`` line in a fenced code block, continuations joined."""
    found = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        in_block, command = False, ""
        for line in md.read_text().splitlines():
            if line.startswith("```"):
                in_block, command = not in_block, ""
                continue
            if not in_block:
                continue
            command += line.strip().removesuffix("\\")
            if line.rstrip().endswith("\\"):
                continue
            if "sattn sweep" in command:
                found.append((str(md.relative_to(ROOT)), command))
            command = ""
    return found


SWEEPS = _documented_sweeps()


def test_the_docs_document_sweeps():
    assert len(SWEEPS) >= 5, SWEEPS


@pytest.mark.parametrize(("source", "command"), SWEEPS, ids=[f"{s}:{i}" for i, (s, _) in enumerate(SWEEPS)])
def test_documented_sweep_plans(source, command, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    words = shlex.split(command, comments=True)
    args = words[next(i for i, w in enumerate(words) if w.endswith("sattn")) + 1:]
    assert main([*args, "--dry-run"]) == 0, f"{source}: {command}\n{capsys.readouterr().err}"
    assert "runs in" in capsys.readouterr().out
