"""The sattn command: the describe table and one-line errors."""

from __future__ import annotations

import re

import pytest

from structured_attention.attention import build_attention
from structured_attention.cli.main import main


def test_describe_prints_a_row_per_kind_from_the_layers_costs(capsys):
    assert main(["describe", "--d-model", "64", "--n-heads", "4", "--context", "128", "--kinds", "mha,mlr:8|4|2|2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[3:]}
    assert set(rows) == {"mha", "mlr:8|4|2|2"}
    mha = build_attention("mha", d_model=64, n_heads=4, max_seq_len=128).cost(128)
    mlr = build_attention("mlr:8|4|2|2", d_model=64, n_heads=4, max_seq_len=128).cost(128)
    assert rows["mha"][1] == f"{mha.params / 1e3:.2f}K"
    # KV bytes per token at 2 bytes a number: MHA holds k and v for every token and head
    assert float(rows["mha"][4]) == 4 * 2 * 16 * 2
    assert float(rows["mlr:8|4|2|2"][4]) == pytest.approx(mlr.kv_cache_bytes_per_token(2))
    assert float(rows["mlr:8|4|2|2"][4]) < float(rows["mha"][4])


@pytest.mark.parametrize(
    "args, needle",
    [
        (["describe", "--kinds", "mlr:3|3"], "ranks"),
        (["describe", "--kinds", "unknown"], "kind"),
        (["describe", "--n-heads", "7"], "n_heads"),
        (["describe", "--context", "1000", "--kinds", "mlr:8|8|8|8|8|8|8|8"], "block_sizes"),
        # checked before any work (these ended in a traceback: a division by zero, a negative
        # tensor size after the timings, dynamo's InvalidBackend at the first compiled call)
        (["sweep", "lm", "--head-dim", "0", "--dry-run"], "--head-dim: expected a positive integer"),
        (["bench", "attention", "--seq-lens", "8", "--decode-steps", "16", "--kinds", "mha", "--no-memory"],
         "--decode-steps: expected fewer than the longest --seq-lens"),
        (["bench", "lm", "--compile", "--backend", "bogus"], "--backend: expected a torch.compile backend"),
        (["bench", "generate", "--modes", "compiled", "--backend", "bogus"], "--backend: expected a torch.compile"),
        # accepted and ignored before
        (["bench", "generate", "--modes", "eager", "--compile-mode", "reduce-overhead"], "--compile-mode: expected"),
        (["sweep", "lm", "--lrs", "1e-3,0.001", "--dry-run"], "--lrs: expected distinct values"),
        # before any model trains (mha's trained first), and before coordcheck.json was written
        (["coordcheck", "--kinds", "mha;foo", "--out", "runs/never-made"], "--kinds: 'foo' at width"),
        (["coordcheck", "--kinds", "", "--out", "runs/never-made"], "--kinds: expected attention specs"),
        # the subcommand's help, which lists what it takes (it pointed at sattn --help)
        (["train", "lm", "--bogus-flag"], "sattn train lm: error: unrecognized arguments: --bogus-flag "
                                          "(see sattn train lm --help)"),
    ],
)
def test_bad_input_exits_nonzero_with_one_line(args, needle, capsys):
    code, _, err = _sattn(args, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0]


def _sattn(args: list[str], capsys) -> tuple[int, str, str]:
    """``sattn ARGS`` in this process (a process each cost seconds of imports): exit code, stdout, stderr;
    an exception other than SystemExit fails the test with its traceback."""
    try:
        code = main(args)
    except SystemExit as stop:  # argparse's errors
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("args", [["sweep", "lm", "--widths", "64", "--lrs", "1e-3", "--dry-run"],
                                  ["sweep", "icl", "--widths", "64", "--dry-run"],
                                  ["sweep", "ts", "--horizons", "96", "--seeds", "0", "--dry-run"]], ids=["lm", "icl", "ts"])
def test_a_kind_with_commas_in_a_sweep_is_one_per_layer_pattern_and_says_so(args, capsys):
    """The sweeps separate kinds with ';' (a kind may be a per-layer pattern, "mha,swa:4"), where
    bench and describe take commas: a kind with a comma is run as one kind, and stderr says so."""
    code, out, err = _sattn([*args, "--kinds", "mha,swa:4;mha"], capsys)
    assert code == 0
    assert err.strip().splitlines() == ["sattn sweep: warning: --kinds: 'mha,swa:4' is one kind, a per-layer pattern "
                                        "(the layers take mha, swa:4 in turn); separate kinds with ';'"]
    assert out.startswith("sweep: 2 runs in ")


def test_train_prints_its_config_and_help_lists_every_key(tmp_path, capsys):
    """--print-config prints the config the arguments make (a shipped config by name plus
    overrides) as YAML and trains nothing; --help lists each experiment's keys with defaults."""
    import yaml

    from structured_attention.experiments.lm import load_lm_config
    from structured_attention.training.config import config_to_dict

    out_dir = tmp_path / "run"
    args = ["--config", "lm-default", "optim.lr=0.002", f"run.out_dir={out_dir}", "--print-config"]
    assert main(["train", "lm", *args]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == config_to_dict(load_lm_config("lm-default", ["optim.lr=0.002", f"run.out_dir={out_dir}"]))
    assert printed["optim"]["lr"] == 0.002 and not out_dir.exists()
    for experiment, line in [("lm", "run.seq_len"), ("icl", "task.n_dims"), ("ts", "data.horizon")]:
        with pytest.raises(SystemExit):
            main(["train", experiment, "--help"])
        help_text = capsys.readouterr().out
        assert any(row.split()[:1] == [line] and ", default " in row for row in help_text.splitlines())


def test_eval_help_lists_each_experiments_flags_under_its_checkpoints(capsys):
    """Every flag an experiment declares for ``sattn eval`` is listed in a group naming that
    experiment's checkpoints (a flag several declare: one group naming them all)."""
    from structured_attention.experiments import EXPERIMENTS

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    sections = help_text.split("the checkpoints of ")[1:]
    for module in EXPERIMENTS.values():
        for flag in module.EVAL_FLAGS:
            owners = [m.NOUN for m in EXPERIMENTS.values() if flag in m.EVAL_FLAGS]
            assert any(s.startswith(" or ".join(owners) + ":") and re.search(rf" {flag}[ ,]", s) for s in sections), flag


@pytest.mark.parametrize("args", [["bench", "mlr", "--seq-lens", "16", "--repeats", "1", "--out", "{file}/sub"],
                                  ["coordcheck", "--kinds", "mha", "--widths", "32,64", "--base-width", "32",
                                   "--steps", "1", "--seeds", "1", "--out", "{file}"],
                                  ["train", "lm", "run.steps=1", "run.out_dir={file}"]],
                         ids=["bench", "coordcheck", "train"])
def test_an_output_folder_that_cannot_be_made_is_refused_before_the_work(tmp_path, args, capsys):
    """Checked first, naming the option: the timings or the training were done, then lost on an
    error that named neither (\"Not a directory\", \"File exists\")."""
    (tmp_path / "taken").write_text("a file")
    argv = [a.replace("{file}", str(tmp_path / "taken")) for a in args]
    code, out, err = _sattn(argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    option = "run.out_dir" if args[0] == "train" else "--out"
    assert len(lines) == 1 and f"error: {option}: expected a folder, got" in lines[0] and "is a file" in lines[0]
    assert "fwd" not in out and (tmp_path / "taken").read_text() == "a file"
