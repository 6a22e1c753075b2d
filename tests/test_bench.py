"""sattn bench attention on a tiny shape: it writes the JSON and plot it promises."""

from __future__ import annotations

import json

import pytest

from structured_attention.cli.main import main


def test_bench_attention_writes_json_and_plot(tmp_path, capsys):
    args = ["bench", "attention", "--kinds", "mha,mlr:4|4,swa:4", "--seq-lens", "16,32", "--d-model", "16",
            "--n-heads", "2", "--repeats", "1", "--decode-steps", "2", "--out", str(tmp_path)]
    assert main(args) == 0
    data = json.loads((tmp_path / "attention.json").read_text())
    assert data["environment"]["torch"]
    rows = data["results"]
    assert {(r["kind"], r["seq_len"]) for r in rows} == {(k, t) for k in ("mha", "mlr:4|4", "swa:4") for t in (16, 32)}
    for r in rows:
        assert r["forward_ms"] > 0 and r["forward_backward_ms"] > 0 and r["decode_ms_per_token"] > 0
        assert r["decode_cache_len"] == 30 and "peak_memory_mib" in r
    mha = [r for r in rows if r["kind"] == "mha"]
    assert all(r["speedup_forward"] == pytest.approx(1.0) for r in mha)
    assert (tmp_path / "attention.png").stat().st_size > 0
    assert "| kind | T |" in capsys.readouterr().out


def test_bench_rejects_a_cache_longer_than_the_context(tmp_path, capsys):
    args = ["bench", "attention", "--kinds", "mha", "--seq-lens", "16", "--decode-cache", "40", "--no-memory",
            "--d-model", "16", "--n-heads", "2", "--repeats", "1", "--out", str(tmp_path)]
    assert main(args) == 2
    assert "--decode-cache" in capsys.readouterr().err
