"""Sizes that cannot fit are refused before anything is allocated: one line naming the settings
and the bytes they imply, from a lower bound checked here against the model actually built."""

from __future__ import annotations

import pytest
import torch

from structured_attention.cli.main import main
from structured_attention.experiments.lm import LMTask, load_lm_config
from structured_attention.training.memory import check_training_memory, format_bytes, parse_memory
from test_faults import _args


@pytest.mark.parametrize("override,names", [
    ("model.d_model=1000000", "model.d_model=1000000"),
    ("model.mlp_ratio=1e9", "model.mlp_ratio=1000000000.0"),
    ("model.n_layers=1000000", "model.n_layers=1000000"),
    ("model.max_seq_len=1000000000", "model.max_seq_len=1000000000"),
    ("model.attention=bilinear_btt:100000000", "model.attention='bilinear_btt:100000000'"),
    ("run.batch_size=1000000000", "run.batch_size=1000000000"),
])
def test_sizes_that_cannot_fit_are_one_line_before_allocating(tmp_path, capsys, override, names):
    assert main([*_args(tmp_path, "run", 2), "run.device=cpu", override]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("sattn train: error: ") and names in line and "more than the memory available on the cpu device" in line
    assert not (tmp_path / "run" / "ckpt").exists()


def test_an_integer_beyond_64_bits_is_one_line(tmp_path, capsys):
    assert main([*_args(tmp_path, "run", 2), "run.seed=10000000000000000000000"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "sattn train: error: run.seed: expected an integer in the 64-bit range, got 10000000000000000000000")


def test_the_bound_is_the_built_models_bytes_and_max_memory_applies(tmp_path):
    """The check's total, computed here from the real model: 16 bytes per parameter, 4 per buffer
    element and 4 per float each block keeps per position (its input and the MLP hidden layer)."""
    config = load_lm_config(None, _args(tmp_path, "run", 2)[2:])
    task = LMTask(config)
    model = task.build_model()
    m, r = config.model, config.run
    total = (16 * sum(p.numel() for p in model.parameters()) + 4 * sum(b.numel() for b in model.buffers())
             + 4 * r.batch_size * r.seq_len * m.n_layers * (m.d_model + int(m.mlp_ratio * m.d_model)))
    check_training_memory(task, r.batch_size, str(total), torch.device("cpu"))
    with pytest.raises(ValueError, match=rf"more than run.max_memory={total - 1} \({format_bytes(total - 1)}\)"):
        check_training_memory(task, r.batch_size, str(total - 1), torch.device("cpu"))


def test_max_memory_setting(tmp_path, capsys):
    assert parse_memory("auto") is None
    assert parse_memory("16GB") == 16 * 10**9 and parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("1.5 tb") == 1_500_000_000_000 and parse_memory("1000") == 1000
    for bad in ("lots", "0", "-3GB", "16 parsecs"):
        with pytest.raises(ValueError, match=r"^run.max_memory: expected 'auto' or a size"):
            parse_memory(bad)
    assert main([*_args(tmp_path, "run", 2), "run.max_memory=100kB"]) == 2
    assert "more than run.max_memory=100kB (100.0 kB)" in capsys.readouterr().err
    assert main([*_args(tmp_path, "run", 2), "run.max_memory=4GB"]) == 0


@pytest.mark.parametrize("argv", [
    ["train", "icl", "model.d_model=1000000"],
    ["bench", "mlr", "--seq-lens", "1000000000"],
    ["bench", "attention", "--seq-lens", "1000000000"],
    ["bench", "varlen", "--seq-len", "1000000000", "--max-doc", "1000"],
    ["bench", "ragged", "--max-len", "1000000000"],
    ["bench", "generate", "--cache-lens", "1000000000"],
])
def test_other_commands_refuse_sizes_that_cannot_fit(tmp_path, capsys, argv):
    assert main([*argv, *(["--out", str(tmp_path)] if argv[0] == "bench" else [f"run.out_dir={tmp_path}"])]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"sattn {argv[0]}: error: ") and "memory" in lines[-1]
