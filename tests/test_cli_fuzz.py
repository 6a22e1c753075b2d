"""Fuzzed command lines: every command with one argument made invalid (a wrong type, a negative
count, an unknown flag or config key, a malformed attention spec, a missing file) exits non-zero
with exactly one line on stderr and no traceback, before any training or timing starts."""

from __future__ import annotations

import contextlib
import io
import string
from unittest import mock

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from structured_attention.cli.main import main

# -- invalid values by kind of argument ----------------------------------------------------------

not_a_number = st.text(alphabet=string.ascii_letters + "#%-_ ", min_size=1, max_size=8).filter(
    lambda s: not s.strip().lstrip("-").isdigit())
negative = st.integers(-10**6, -1).map(str)
bad_int = st.one_of(not_a_number, negative, st.sampled_from(["1.5", "1e3", "", "0x10", "--"]))
# an integer setting (section.key=value) takes a whole number written as a float ("1e3", as YAML's 10.0)
bad_setting_int = st.one_of(not_a_number, negative, st.sampled_from(["1.5", "1e-3", "", "0x10", "--", "nan"]))
bad_list = st.one_of(not_a_number, st.sampled_from(["1,,2", "-64", "64,x", "0", ",", "64;128"]))
bad_spec = st.one_of(
    st.text(alphabet=string.ascii_letters + "#|:=", min_size=1, max_size=12).filter(lambda s: s.lower() not in {"mha", "swa", "mlr", "global_swa", "bilinear_btt", "bilinear_mlr"}),
    st.sampled_from(["mlr:3|x", "mlr:0|8", "swa:-1", "global_swa:4|4|4", "mha:n_kv_heads=3", "mlr:8|8:bogus=1",
                     "bilinear_btt:0", "mlr::", "unknown_kind"]),
)
missing_path = st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=8).map(lambda s: f"/nonexistent/{s}")
unknown_flag = st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=8).map(lambda s: f"--zz-{s}")

# -- the commands and their arguments (flag -> strategy of invalid values) -----------------------

COMMANDS: dict[str, tuple[list[str], dict[str, st.SearchStrategy]]] = {
    "describe": ([], {"--d-model": bad_int, "--n-heads": bad_int, "--n-kv-heads": bad_int, "--context": bad_int,
                      "--kinds": bad_spec, "--bytes-per-number": bad_int}),
    "bench attention": ([], {"--kinds": bad_spec, "--d-model": bad_int, "--seq-lens": bad_list, "--n-heads": bad_int,
                             "--batch": bad_int, "--repeats": bad_int, "--warmup": bad_int, "--decode-cache": bad_int,
                             "--decode-steps": bad_int, "--dtype": not_a_number, "--device": not_a_number}),
    "bench lm": ([], {"--kinds": bad_spec, "--d-model": bad_int, "--n-layers": bad_int, "--seq-lens": bad_list,
                      "--n-heads": bad_int, "--batch": bad_int}),
    "bench mlr": ([], {"--ranks": bad_spec, "--v-dim": bad_int, "--seq-lens": bad_list, "--paths": not_a_number,
                       "--n-heads": bad_int, "--batch": bad_int, "--repeats": bad_int}),
    "eval": (["--checkpoint", "/nonexistent/ckpt"], {"--checkpoint": missing_path, "--max-batches": bad_int,
                                                      "--batch-size": bad_int, "--source": missing_path,
                                                      "--examples": bad_list}),
    "generate": (["--checkpoint", "/nonexistent/ckpt", "--prompt", "x"],
                 {"--checkpoint": missing_path, "--max-new-tokens": bad_int, "--top-k": bad_int,
                  "--temperature": not_a_number, "--seed": not_a_number}),
    "plot": (["/nonexistent/sweep"], {"--out": st.just("/nonexistent/out")}),
    "sweep lm": (["--dry-run"], {"--widths": bad_list, "--head-dim": bad_int, "--kinds": bad_spec, "--lrs": bad_list,
                                 "--base-steps": bad_int, "--config": missing_path}),
    "train lm": ([], {"--config": missing_path}),
    "sweep icl": (["--dry-run"], {"--widths": bad_list, "--kinds": bad_spec, "--heads": bad_int, "--lrs": bad_list,
                                  "--base-steps": bad_int, "--config": missing_path}),
    "train icl": ([], {"--config": missing_path}),
    "sweep ts": (["--dry-run", "data.source=/nonexistent/ett.csv"],
                 {"--horizons": bad_list, "--kinds": bad_spec, "--seeds": bad_list.filter(lambda v: v != "0"), "--config": missing_path}),
    "train ts": ([], {"--config": missing_path}),
}

# Values some of those keys accept (a drawn "none" is a valid run.autocast, not an invalid one).
VALID_WORDS = {"auto", "none", "cpu", "cuda", "learned", "rotary", "cosine", "constant", "byte", "char"}

# `train lm` overrides: section.key=value with a wrong value, or an unknown key.
BAD_OVERRIDES = st.one_of(
    st.tuples(st.sampled_from(["model.d_model", "model.n_layers", "model.n_heads", "model.max_seq_len", "run.steps",
                               "run.batch_size", "run.seq_len", "run.grad_accum", "run.log_every", "optim.warmup_steps"]),
              bad_setting_int),
    st.tuples(st.sampled_from(["optim.lr", "data.val_fraction", "optim.weight_decay"]), st.one_of(not_a_number, negative)),
    st.tuples(st.just("model.attention"), bad_spec),
    st.tuples(st.sampled_from(["model.positions", "data.tokenizer", "optim.schedule", "run.autocast", "run.device"]),
              not_a_number.filter(lambda v: v.strip().lower() not in VALID_WORDS)),
    st.tuples(st.sampled_from(["run.compile", "optim.mup", "model.tie_embeddings"]), st.sampled_from(["maybe", "2", "yes please"])),
    st.tuples(st.sampled_from(["model.bogus", "nosection.key", "run", "model.", ".steps"]), st.just("1")),
    st.tuples(st.just("data.source"), missing_path),
).map(lambda kv: f"{kv[0]}={kv[1]}")

def not_none(value: str) -> bool:
    """Optional fields accept these as None (training.config), so they are not invalid there."""
    return value.strip().lower() not in ("", "none", "null", "~")


# Overrides shared by every experiment's config (model, optim, run sections) and each one's own.
COMMON_BAD_OVERRIDES = st.one_of(
    st.tuples(st.sampled_from(["model.d_model", "model.n_layers", "model.n_heads", "run.steps", "run.batch_size"]),
              bad_setting_int),
    st.tuples(st.just("optim.lr"), st.one_of(not_a_number, negative)),
    st.tuples(st.just("model.attention"), bad_spec),
    st.tuples(st.sampled_from(["model.bogus", "nosection.key", "run", ".steps"]), st.just("1")),
)
EXPERIMENT_BAD_OVERRIDES = {
    "train lm": BAD_OVERRIDES,
    "train icl": st.one_of(
        COMMON_BAD_OVERRIDES,
        st.tuples(st.just("task.n_dims"), bad_setting_int),
        st.tuples(st.sampled_from(["task.n_points", "task.sparsity"]), bad_setting_int.filter(not_none)),
        st.tuples(st.just("task.noise_std"), st.one_of(not_a_number, negative)),
        st.tuples(st.just("task.ridge_lambda"), st.one_of(not_a_number, negative).filter(not_none)),
        st.tuples(st.just("model.causal"), st.just("false")),
    ),
    "train ts": st.one_of(
        COMMON_BAD_OVERRIDES,
        st.tuples(st.sampled_from(["data.lookback", "data.horizon"]), bad_setting_int),
        st.tuples(st.sampled_from(["data.features", "data.dataset", "model.family"]),
                  not_a_number.filter(lambda v: not_none(v) and v.strip().lower() not in {"m", "s", "point", "patch", "custom"})),
        st.tuples(st.just("data.source"), missing_path),
    ),
}


@st.composite
def invalid_command(draw) -> list[str]:
    name = draw(st.sampled_from(sorted(COMMANDS)))
    base, flags = COMMANDS[name]
    argv = [*name.split(), *base]
    mutation = draw(st.sampled_from(["value", "unknown flag"] + (["override"] if name in EXPERIMENT_BAD_OVERRIDES else [])))
    if mutation == "value":
        flag = draw(st.sampled_from(sorted(flags)))
        argv += [flag, draw(flags[flag])]
    elif mutation == "unknown flag":
        argv.append(draw(unknown_flag))
    else:
        argv.append(draw(EXPERIMENT_BAD_OVERRIDES[name].map(lambda kv: kv if isinstance(kv, str) else f"{kv[0]}={kv[1]}")))
    return argv


class TrainingStarted(BaseException):
    """Raised in place of training (after the task's data and model are set up, when the optimiser
    would be built): no handler in the CLI may swallow it."""


def _training_started(*args, **kwargs):
    raise TrainingStarted("an invalid command line reached the training loop")


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    no_training = mock.patch("structured_attention.training.loop.build_optimizer", _training_started)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), no_training:
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's usage errors
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(argv=invalid_command())
def test_every_invalid_command_line_exits_nonzero_with_one_line(argv):
    code, out, err = _run(argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code not in (0, None), (argv, out, err)
    assert len(lines) == 1 and lines[0].startswith("sattn"), (argv, err)
    assert "Traceback" not in err and "Traceback" not in out
