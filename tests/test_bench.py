"""sattn bench on tiny shapes: it writes the JSON and plot it promises."""

from __future__ import annotations

import json

import pytest
import torch

from structured_attention.cli import bench
from structured_attention.cli.bench import markdown_table
from structured_attention.cli.main import main

TINY = ["--seq-lens", "16,32", "--n-heads", "2", "--repeats", "1"]


def test_bench_attention_writes_json_and_plot(tmp_path, capsys):
    # one length: on the CPU each case's peak memory is measured in a fresh process (seconds each);
    # the table's rows per length are in test_bench_lm_reports_training_tokens_per_second
    args = ["bench", "attention", "--kinds", "mha,mlr:4|4,swa:4", "--d-model", "16", "--decode-steps", "2",
            "--out", str(tmp_path), "--seq-lens", "32", "--n-heads", "2", "--repeats", "1"]
    assert main(args) == 0
    data = json.loads((tmp_path / "attention.json").read_text())
    assert data["environment"]["torch"] and data["environment"]["settings"]["d_model"] == 16
    rows = data["results"]
    assert [(r["case"], r["seq_len"]) for r in rows] == [(k, 32) for k in ("mha", "mlr:4|4", "swa:4")]
    for r in rows:
        assert r["forward_ms"] > 0 and r["forward_backward_ms"] > 0 and r["decode_ms_per_token"] > 0
        assert r["decode_cache_len"] == 30 and "peak_memory_mib" in r
    assert all(r["speedup_forward"] == pytest.approx(1.0) for r in rows if r["case"] == "mha")
    assert (tmp_path / "attention.png").stat().st_size > 0
    assert "| case | T |" in capsys.readouterr().out


def test_bench_lm_reports_training_tokens_per_second(tmp_path, capsys):
    args = ["bench", "lm", "--kinds", "mha,mlr:4|4", "--d-model", "16", "--n-layers", "1", "--batch", "2",
            "--no-memory", "--out", str(tmp_path), *TINY]
    assert main(args) == 0
    rows = json.loads((tmp_path / "lm.json").read_text())["results"]
    assert [(r["case"], r["seq_len"]) for r in rows] == [("mha", 16), ("mlr:4|4", 16), ("mha", 32), ("mlr:4|4", 32)]
    for r in rows:  # tokens per second of one training forward+backward: batch x T / its time
        assert r["train_tokens_per_s"] == pytest.approx(2 * r["seq_len"] / (r["forward_backward_ms"] / 1e3))
    assert "train tokens/s" in capsys.readouterr().out


def test_bench_lm_compile_adds_a_compiled_case_per_kind(tmp_path):
    # aot_eager: the case's plumbing, in seconds (inductor's training graph: tests/test_compile.py)
    args = ["bench", "lm", "--kinds", "mlr:4|4", "--compile", "--backend", "aot_eager", "--d-model", "16",
            "--n-layers", "1", "--batch", "2", "--no-memory", "--out", str(tmp_path), "--seq-lens", "16",
            "--n-heads", "2", "--repeats", "1"]
    assert main(args) == 0
    rows = json.loads((tmp_path / "lm.json").read_text())["results"]
    assert [r["case"] for r in rows] == ["mlr:4|4", "mlr:4|4+compile"]
    assert all(r["forward_backward_ms"] > 0 for r in rows)


def test_bench_mlr_compares_paths_with_sdpa(tmp_path):
    args = ["bench", "mlr", "--ranks", "4|2|1|1", "--v-dim", "8", "--no-memory", "--profile", "--out", str(tmp_path), *TINY]
    assert main(args) == 0
    rows = json.loads((tmp_path / "mlr.json").read_text())["results"]
    assert [r["case"] for r in rows] == ["sdpa", "mlr", "mlr_blocked", "mlr_reference"] * 2
    report = (tmp_path / "mlr-profile.txt").read_text()
    assert "== mlr, T=32, forward+backward ==" in report and "Self CPU" in report


def test_bench_back_to_back_times_n_calls_a_round_and_reports_them_beside_single_calls(tmp_path, monkeypatch):
    calls = []

    def counted(q, k, v, ranks):
        calls.append(q.requires_grad and torch.is_grad_enabled())
        return bench._MLR_FUNCTIONS["mlr_reference"](q, k, v, ranks)

    monkeypatch.setitem(bench._MLR_FUNCTIONS, "mlr", counted)
    args = ["bench", "mlr", "--paths", "sdpa,mlr", "--ranks", "4|4", "--v-dim", "8", "--seq-lens", "16", "--n-heads",
            "2", "--warmup", "1", "--repeats", "2", "--back-to-back", "3", "--no-memory", "--out", str(tmp_path)]
    assert main(args) == 0
    # 3 rounds, each a forward and a forward+backward alone, then 3 of each back to back
    assert calls.count(False) == calls.count(True) == 3 * (1 + 3)
    rows = json.loads((tmp_path / "mlr.json").read_text())["results"]
    for r in rows:
        assert r["back_to_back_calls"] == 3
        assert r["forward_ms_back_to_back"] > 0 and r["forward_backward_ms_back_to_back"] > 0
    assert rows[0]["speedup_forward_backward_back_to_back"] == pytest.approx(1.0)
    assert "fwd+bwd ms, back to back" in markdown_table(rows)


def _bench_generate(out, kinds: str, batches: str, *extra: str) -> list[dict]:
    """``sattn bench generate`` of a tiny model (a 13-token cache, 3 new tokens, one round); its records."""
    args = ["bench", "generate", "--kinds", kinds, "--d-model", "16", "--n-heads", "2", "--n-layers", "1",
            "--batches", batches, "--cache-lens", "13", "--new-tokens", "3", "--repeats", "1", "--warmup", "0",
            "--out", str(out), *extra]
    assert main(args) == 0
    return json.loads((out / "generate.json").read_text())["results"]


def test_bench_generate_times_every_kind_and_mode_and_reports_its_cache(tmp_path):
    rows = _bench_generate(tmp_path, "mha,mlr:4|2|2", "1,2", "--backend", "aot_eager")
    modes = ["", "+static", "+compiled", "+exported"] + (["+graph"] if torch.cuda.is_available() else [])  # graph: CUDA's
    assert [(r["case"], r["batch"]) for r in rows] == [
        (kind + mode, batch) for batch in (1, 2) for kind in ("mha", "mlr:4|2|2") for mode in modes]
    for r in rows:
        assert {"case", "batch", "cache_len", "tokens_per_s", "ms_per_token", "cache_bytes"} <= set(r)
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["ms_per_token"])
        assert r["tokens_match_first_mode"]
    # the growing MHA cache holds keys and values of 16 tokens (1 layer, 2 heads of 8 dims, float32)
    assert rows[0]["cache_bytes"] == 16 * 2 * 2 * 8 * 4
    # static buffers are preallocated to the context (16 slots here): MHA holds the same bytes
    assert rows[1]["cache_bytes"] == rows[0]["cache_bytes"]
    assert (tmp_path / "generate.png").is_file()


def test_bench_generate_times_an_aotinductor_package_of_the_step(tmp_path):
    """The aoti mode, not a default one (its build is slow): the package of the step is timed."""
    rows = _bench_generate(tmp_path, "mlr:4|2|2", "2", "--modes", "static,aoti")
    assert [r["case"] for r in rows] == ["mlr:4|2|2+static", "mlr:4|2|2+aoti"]
    assert rows[1]["tokens_per_s"] > 0 and rows[1]["cache_bytes"] == rows[0]["cache_bytes"]
    assert rows[1]["tokens_match_first_mode"]


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["attention", "--kinds", "mha", "--decode-cache", "40", "--d-model", "16", "--seq-lens", "32"], "--decode-cache"),
        (["mlr", "--ranks", "4|x"], "--ranks"),
        (["mlr", "--paths", "sdpa,flash9"], "--paths"),
        (["attention", "--seq-lens", "16,a"], "--seq-lens"),
        (["mlr", "--back-to-back", "-1"], "--back-to-back"),
        (["lm", "--compile-mode", "reduce-overhead"], "--compile-mode"),
    ],
)
def test_bench_bad_arguments_exit_2_naming_the_option(tmp_path, capsys, extra, needle):
    args = ["bench", *extra[:1], "--no-memory", "--n-heads", "2", "--repeats", "1", "--out", str(tmp_path), *extra[1:]]
    if "--seq-lens" not in extra:
        args += ["--seq-lens", "16"]
    assert main(args) == 2
    assert needle in capsys.readouterr().err


def test_bench_varlen_times_packed_against_per_document_and_padded(tmp_path):
    args = ["bench", "varlen", "--seq-len", "64", "--min-doc", "8", "--max-doc", "24", "--n-heads", "2",
            "--ranks", "4|2|2", "--v-dim", "8", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)]
    assert main(args) == 0
    [row] = json.loads((tmp_path / "varlen.json").read_text())["results"]
    assert row["documents"] >= 2 * (64 // 24) and row["longest_document"] <= 24
    assert row["packed_ms"] > 0 and row["per_document_sum_ms"] > 0 and row["packed_over_padded"] > 0


def test_document_lengths_fill_the_row():
    from structured_attention.cli.bench_batches import document_lengths, parse_lengths, prompt_lengths

    assert parse_lengths("64;2x16,32") == [[64], [16, 16, 32]]
    for bad in ("64;2x16", "64;16,-16,64", "a;b"):
        with pytest.raises(ValueError, match="^--lengths: expected"):
            parse_lengths(bad)

    lengths = document_lengths(100, 10, 30, seed=1)
    assert sum(lengths) == 100 and all(1 <= n <= 30 for n in lengths) and all(n >= 10 for n in lengths[:-1])
    assert prompt_lengths(8, 64, 1024) == [64, 201, 338, 475, 613, 750, 887, 1024]


def test_bench_ragged_compares_mixed_with_equal_prompts(tmp_path):
    args = ["bench", "ragged", "--kinds", "mha,mlr:4|4", "--d-model", "16", "--n-heads", "2", "--n-layers", "1",
            "--batch", "3", "--min-len", "4", "--max-len", "12", "--new-tokens", "4", "--repeats", "1",
            "--warmup", "0", "--out", str(tmp_path)]
    assert main(args) == 0
    rows = json.loads((tmp_path / "ragged.json").read_text())["results"]
    assert [r["case"] for r in rows] == ["mha", "mlr:4|4"] and rows[0]["prompt_lengths"] == [4, 8, 12]
    assert all(r["mixed_over_equal"] == pytest.approx(r["mixed_tokens_per_s"] / r["equal_tokens_per_s"]) for r in rows)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["varlen", "--max-doc", "99", "--seq-len", "64"], "--max-doc"),
        (["varlen", "--ranks", "4|0"], "--ranks"),
        (["ragged", "--min-len", "20", "--max-len", "10"], "--min-len"),
        (["ragged", "--kinds", "mlr:3|3", "--d-model", "16", "--n-heads", "2"], "ranks"),
        (["generate", "--modes", "eager,paged"], "--modes"),
        (["generate", "--modes", "eager,graph", "--device", "cpu"], "--modes"),
        (["generate", "--batches", "0"], "--batches"),
        (["generate", "--kinds", "mlr:3|3", "--d-model", "16", "--n-heads", "2"], "ranks"),
    ],
)
def test_bench_batches_bad_arguments_exit_2(tmp_path, capsys, extra, needle):
    assert main(["bench", *extra, "--repeats", "1", "--out", str(tmp_path)]) == 2
    assert needle in capsys.readouterr().err
