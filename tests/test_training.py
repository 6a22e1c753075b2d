"""Training: config loading and overrides, the LR schedule, muP groups, the loop, resume, the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
import torch

from structured_attention.cli.main import main
from structured_attention.models import GPT, GPTConfig
from structured_attention.experiments.lm import LMConfig, load_lm_config, train_lm
from structured_attention.training import (
    OptimConfig,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_checkpoint,
    lr_at,
    mup_lr_multipliers,
    param_groups,
)

WORDS = ["def", "return", "self", "class", "import", "for", "in", "if", "else", "x", "y", "(", ")", ":", "\n", "    "]


def make_corpus(path, n_words: int = 6000, seed: int = 0):
    rng = random.Random(seed)
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(n_words)), encoding="utf-8")
    return path


def tiny_overrides(tmp_path, **run):
    corpus = make_corpus(tmp_path / "corpus.txt")
    out = {
        "data.source": str(corpus), "data.cache_dir": str(tmp_path / "cache"),
        "model.d_model": "32", "model.n_layers": "2", "model.n_heads": "2", "model.max_seq_len": "32",
        "run.seq_len": "32", "run.batch_size": "4", "run.steps": "8", "run.eval_every": "4", "run.eval_batches": "2",
        "run.log_every": "2", "run.out_dir": str(tmp_path / "run"), "run.sample_tokens": "8",
        "optim.warmup_steps": "2",
    }
    out.update({f"run.{k}": str(v) for k, v in run.items()})
    return [f"{k}={v}" for k, v in out.items()]


def sattn(argv):
    return main(argv)


# -- config ------------------------------------------------------------------------------------------


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: {d_model: 64, n_heads: 4}\noptim: {lr: 1.0e-3, mup: true}\nrun: {steps: 10, seq_len: 128}\n")
    cfg = load_lm_config(f, ["model.attention=mlr:8|8", "optim.lr=3e-3", "run.compile=false", "data.source=none", "model.n_kv_heads=2"])
    assert cfg.model.d_model == 64 and cfg.model.attention == "mlr:8|8" and cfg.model.n_kv_heads == 2
    assert cfg.optim.lr == 3e-3 and cfg.optim.mup is True and cfg.run.steps == 10 and cfg.data.source is None
    assert config_from_dict(LMConfig, config_to_dict(cfg)) == cfg
    assert apply_overrides(cfg, ["run.steps=20"]).run.steps == 20


@pytest.mark.parametrize(
    "override, match",
    [
        ("optim.lrr=1", r"optim\.lrr.*valid keys.*\blr\b"),
        ("foo.bar=1", r"foo\.bar"),
        ("run.steps=abc", r"run\.steps: expected an integer"),
        ("run.steps=10.5", r"run\.steps: expected an integer"),
        ("run.steps=inf", r"run\.steps: expected an integer"),
        ("run.compile=maybe", r"run\.compile: expected a boolean"),
        ("run.compile_mode=fast", r"run\.compile_mode: expected one of \['default', 'reduce-overhead'"),
        ("run.compile_mode=reduce-overhead", r"run\.compile_mode: expected 'default' unless run\.compile=true"),
        ("optim.lr=inf", r"optim\.lr: expected a finite number"),
        ("optim.grad_clip=nan", r"optim\.grad_clip: expected a finite number"),
        ("optim.eps=-1", r"optim\.eps: expected a positive number"),  # torch's line named no key
        ("optim.eps=0", r"optim\.eps: expected a positive number"),
        ("run.out_dir=", r"run\.out_dir: expected a folder path, not empty"),  # it trained in the current folder
        ("model.attention=nosuchkind", r"attention|kind"),
        ("run.seq_len=1024", r"run\.seq_len"),
        ("noequals", r"override"),
    ],
)
def test_bad_config(override, match):
    with pytest.raises(ValueError, match=match):
        load_lm_config(None, [override])


def test_a_whole_number_written_as_a_float_is_an_integer_setting_on_the_command_line_as_in_yaml(tmp_path):
    (tmp_path / "c.yaml").write_text("run: {steps: 10.0}\n")
    assert load_lm_config(tmp_path / "c.yaml", []).run.steps == 10  # YAML's 10.0
    assert load_lm_config(None, ["run.steps=10.0"]).run.steps == 10 == load_lm_config(None, ["run.steps=1e1"]).run.steps


def test_compile_mode_reaches_torch_compile_and_every_optimizer_step_is_a_new_cuda_graph_step(tmp_path,
                                                                                              monkeypatch):
    """run.compile_mode is torch.compile's mode; with CUDA graphs (reduce-overhead) a replay after a
    step's start may overwrite the last step's outputs, so the loop marks each optimizer step, not
    each micro-batch (whose accumulated gradients are the last backward's outputs)."""
    seen, marks = [], []

    def fake_compile(model, **kwargs):
        seen.append(kwargs)
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(None))
    train_lm(load_lm_config(None, tiny_overrides(tmp_path, steps=2, grad_accum=2, compile="true",
                                                 compile_mode="reduce-overhead")))
    assert seen == [{"mode": "reduce-overhead"}] and len(marks) == 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)"))])
def test_compiled_training_with_gradient_accumulation_equals_eager_training(tmp_path, device):
    """run.compile with compile_mode="reduce-overhead": on CUDA each step's kernels replayed from
    CUDA graphs (the accumulated gradients kept across a step's micro-batches), on the CPU
    inductor's code; either way the run trains as the eager run does. On the CPU this is the
    suite's test of the C++ kernel's forward and backward ops in inductor's code (whole graphs of
    every layer kind: tests/test_compile.py, with aot_eager)."""
    results = []
    for compile_mode in (None, "reduce-overhead"):
        run = dict(steps=3, grad_accum=2, device=device, autocast="none", eval_every=0, sample_tokens=0)
        if compile_mode:
            run.update(compile="true", compile_mode=compile_mode)
        folder = tmp_path / (compile_mode or "eager")
        folder.mkdir()
        overrides = tiny_overrides(folder, **run) + ["model.attention=mlr:8|4|2|2"]
        results.append(train_lm(load_lm_config(None, overrides)))
    eager, graphs = results
    assert graphs.losses == pytest.approx(eager.losses, rel=1e-4)
    for p, q in zip(graphs.model.parameters(), eager.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)


def test_activation_checkpointing_computes_the_same_gradients_from_fewer_saved_activations():
    """Each block computed again in the backward pass, with dropout's masks drawn again from the
    same RNG state: the loss and gradients of the run without it, bit for bit, on padded and packed
    batches, for every kind of attention path; the backward keeps a tenth of the bytes (each block's
    input, not its activations: counted with saved_tensors_hooks)."""
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    batches = dict(attention_mask=torch.tensor([[0] * 7 + [1] * 33, [1] * 40]),
                   document_ids=torch.tensor([[0] * 15 + [1] * 25] * 2))
    for spec in ("mlr:8|8|8|8", "mha:n_kv_heads=2", "swa:8", "bilinear_btt:1"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(attention=spec, max_seq_len=64, n_layers=3, dropout=0.1)).train()
        for name, extra in batches.items():
            runs = []
            for checkpointed in (False, True):
                model.backbone.activation_checkpointing = checkpointed
                model.zero_grad()
                torch.manual_seed(1)
                saved = []
                with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
                    _, loss = model(x, x, **{name: extra})
                loss.backward()
                runs.append((loss.detach(), [p.grad.clone() for p in model.parameters()], sum(saved)))
            (loss, grads, kept), (loss_ac, grads_ac, kept_ac) = runs
            assert torch.equal(loss_ac, loss), (spec, name)
            assert all(torch.equal(a, b) for a, b in zip(grads_ac, grads)), (spec, name)
            assert kept_ac < kept / 8, (spec, name, kept, kept_ac)


def test_a_run_with_activation_checkpointing_trains_as_one_without(tmp_path):
    """run.activation_checkpointing reaches the backbone, and the losses and weights are those of
    the run without it; the memory bound counts what the backward then keeps."""
    from structured_attention.training import memory

    results = []
    for checkpointed in (False, True):
        folder = tmp_path / str(checkpointed)
        folder.mkdir()
        run = dict(steps=3, eval_every=0, sample_tokens=0, activation_checkpointing=str(checkpointed).lower())
        results.append(train_lm(load_lm_config(None, tiny_overrides(folder, **run) + ["model.attention=mlr:8|4|2|2",
                                                                                        "model.dropout=0.1"])))
    plain, checkpointed = results
    assert checkpointed.model.backbone.activation_checkpointing and not plain.model.backbone.activation_checkpointing
    assert checkpointed.losses == plain.losses
    for p, q in zip(checkpointed.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    backbone = plain.model.config
    assert backbone.saved_floats_per_position(True) == 2 * 32 + 32 + 128 < backbone.saved_floats_per_position() == 2 * 160
    with pytest.raises(ValueError, match=r"run\.activation_checkpointing=true: the activations kept"):
        memory.check_training_memory(_TaskOfBackbone(backbone, positions=10**9), 1, "1GB", torch.device("cpu"), True)


class _TaskOfBackbone:
    """What the memory check reads of a task."""

    def __init__(self, backbone, positions):
        self.backbone, self.positions = backbone, positions

    def backbone_config(self):
        return self.backbone

    def tokens_per_batch(self):
        return self.positions

    def build_model(self):
        return GPT(self.backbone)


def test_config_json_records_the_requested_and_the_resolved_config(tmp_path):
    """The config flows one way: the run records what the user gave and, apart, what it ran with
    (the vocabulary derived from the corpus, a char vocabulary here); the checkpoint holds the latter."""
    from structured_attention.training.config import load_run_config

    given = load_lm_config(None, tiny_overrides(tmp_path, steps=1) + ["data.tokenizer=char"])
    train_lm(given)
    requested, resolved = (load_run_config(LMConfig, tmp_path / "run", w) for w in ("requested", "resolved"))
    assert requested == given and resolved.model.vocab_size != given.model.vocab_size
    assert resolved == dataclasses.replace(given, model=dataclasses.replace(given.model,
                                                                            vocab_size=resolved.model.vocab_size))
    state = load_checkpoint(tmp_path / "run").state
    assert state["config"] == config_to_dict(resolved) and state["experiment"] == "lm"


def test_a_checkpoint_names_its_experiment_and_an_old_one_is_inferred_with_a_warning():
    from structured_attention.experiments import checkpoint_experiment

    assert checkpoint_experiment({"experiment": "icl", "config": {}}) == "icl"
    with pytest.raises(ValueError, match=r"^checkpoint x: expected an experiment among \['icl', 'lm', 'ts'\]"):
        checkpoint_experiment({"experiment": "speech"}, "x")
    for config, found in [({"task": {}}, "icl"), ({"data": {"lookback": 96}}, "ts"), ({"data": {}}, "lm")]:
        with pytest.warns(UserWarning, match=f"checkpoint old records no experiment .*taken as '{found}'"):
            assert checkpoint_experiment({"config": config}, "old") == found


def test_unknown_yaml_key(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("run: {stepz: 3}\n")
    with pytest.raises(ValueError, match=r"run\.stepz.*valid keys"):
        load_lm_config(f)
    with pytest.raises(FileNotFoundError):
        load_lm_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("value", ["0", "[]", "''", "false", "3"])
def test_a_section_set_to_a_non_mapping_is_an_error(tmp_path, value):
    f = tmp_path / "c.yaml"
    f.write_text(f"run: {value}\n")
    with pytest.raises(ValueError, match=r"^run: expected a mapping of keys to values"):
        load_lm_config(f)
    f.write_text("run:\nmodel: {d_model: 32}\n")  # an empty section is no change
    assert load_lm_config(f).model.d_model == 32


def test_a_config_that_is_not_utf8_names_the_file(tmp_path):
    f = tmp_path / "latin1.yaml"
    f.write_bytes("run: {out_dir: caf\xe9}\n".encode("latin-1"))
    with pytest.raises(ValueError) as err:
        load_lm_config(f)
    assert str(err.value) == f"config: {str(f)!r} is not UTF-8 text (byte 18 is 0xe9)"


def test_a_yaml_alias_bomb_is_refused_quickly(tmp_path):
    """Nine levels of ten aliases stand for 10^9 values; loading stops at the limit, not at a
    MemoryError (time it by hand: well under a second)."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    f = tmp_path / "bomb.yaml"
    f.write_text("\n".join(lines) + "\nrun: {steps: 1}\n")
    with pytest.raises(ValueError, match=r"expands to more than 10,000 values"):
        load_lm_config(f)


def test_shipped_configs_load_by_name(tmp_path):
    """Every shipped config loads by name with its experiment's loader; a path still works; an
    unknown name is one line listing the shipped ones."""
    from structured_attention.configs import shipped_configs
    from structured_attention.experiments.forecasting import load_ts_config
    from structured_attention.experiments.icl import load_icl_config

    loaders = {"lm": load_lm_config, "icl": load_icl_config, "ts": load_ts_config}
    names = shipped_configs()
    assert {"lm-default", "lm-cpu-sweep", "icl-d16", "ts-patch"} <= set(names)
    assert {"paper/lm-mlr", "paper/icl-btt", "paper/ts-mlr"} <= set(names)
    for name in names:
        loaders[name.rsplit("/", 1)[-1].split("-")[0]](name)
    assert load_lm_config("lm-default", ["run.steps=7"]).run.steps == 7
    f = tmp_path / "lm-default"  # a file of that name is read as the file
    f.write_text("run: {steps: 3}\n")
    assert load_lm_config(f).run.steps == 3
    with pytest.raises(FileNotFoundError, match=r"^config: expected a YAML file or a shipped config \(icl-d16, "):
        load_lm_config("lm-defualt")


def test_the_paper_configs_build_their_models_with_the_authors_options():
    """configs/paper/: each builds its model with the authors' conventions in place, and a forward
    pass gives finite outputs (the language model's logits, the regression predictions, a
    forecast)."""
    from structured_attention.experiments.forecasting import load_ts_config
    from structured_attention.experiments.icl import build_icl_model, load_icl_config
    from structured_attention.models.forecasting import build_forecaster

    lm = load_lm_config("paper/lm-mlr")
    gpt = GPT(lm.model)
    attn = gpt.blocks[0].attn
    assert (attn.ranks, attn.options.qk_norm_scope, attn.options.level_scale) == ((32, 8, 6, 4, 4, 4, 4, 2), "head", "inverse_rank")
    assert attn.scale == 1.0 and gpt.logit_scale == 1.0 and lm.optim.mup and lm.model.mup_base_width == 256
    assert torch.isfinite(gpt(torch.randint(0, 256, (1, 64)))[0]).all()
    icl = load_icl_config("paper/icl-btt")
    model = build_icl_model(icl)
    attn = model.backbone.blocks[0].attn
    assert attn.options.key_norm == "shared" and attn.options.weight_cap and attn.scale == 8 / icl.model.d_model
    assert torch.isfinite(model(torch.randn(2, 65, 32), torch.randn(2, 65))).all()
    ts = load_ts_config("paper/ts-mlr")
    forecaster = build_forecaster(ts.model_for_data(n_channels=7))
    assert forecaster.backbone.blocks[0].attn.ranks == (48, 16)
    assert torch.isfinite(forecaster(torch.randn(2, 96, 7))).all()


# -- optimizer -----------------------------------------------------------------------------------------


def test_lr_schedule():
    c = OptimConfig(lr=1.0, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert lr_at(0, 100, c) == pytest.approx(0.1)
    assert lr_at(9, 100, c) == pytest.approx(1.0)
    assert lr_at(10, 100, c) == pytest.approx(1.0)
    assert lr_at(99, 100, c) == pytest.approx(0.1)
    vals = [lr_at(s, 100, c) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    k = OptimConfig(lr=1.0, warmup_steps=0, schedule="constant")
    assert lr_at(0, 100, k) == lr_at(99, 100, k) == 1.0


def test_weight_decay_and_mup_groups():
    model = GPT(GPTConfig(d_model=64, n_layers=1, n_heads=2, max_seq_len=16, tie_embeddings=False))
    groups = param_groups(model, OptimConfig(mup=True, mup_base_width=32, weight_decay=0.1))
    by_name = {n: g for g in groups for n in g["names"]}
    assert by_name["backbone.blocks.0.mlp.up.weight"]["weight_decay"] == 0.1
    assert by_name["backbone.blocks.0.ln_attn.weight"]["weight_decay"] == 0.0
    assert by_name["tok_emb.weight"]["weight_decay"] == 0.0
    mult = mup_lr_multipliers(model, 32)
    assert mult["backbone.blocks.0.mlp.up.weight"] == pytest.approx(32 / 64)  # fan_in = d_model
    assert mult["backbone.blocks.0.mlp.down.weight"] == pytest.approx(32 / 256)  # fan_in = 4 d_model
    assert mult["head.weight"] == pytest.approx(32 / 64)
    assert mult["tok_emb.weight"] == mult["backbone.pos_emb.weight"] == mult["backbone.ln_f.weight"] == 1.0
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


@pytest.mark.parametrize("tie", [True, False])
def test_mup_init_and_read_out_follow_the_fans_relative_to_the_base_width(tie):
    """muP's init against its definition: at the base width the model is the standard one; at 4x
    the width each hidden weight is drawn with std x sqrt(base fan_in / fan_in) (the MLP's down
    projection: fan_in 4d), embeddings keep theirs, an untied read-out takes the ratio itself, and
    a tied read-out's logits are multiplied by base / width."""
    def build(width, base=None):
        torch.manual_seed(0)
        return GPT(GPTConfig(d_model=width, n_heads=width // 16, n_layers=2, max_seq_len=16, tie_embeddings=tie,
                             mup_base_width=base))

    for name, w in build(32, 32).state_dict().items():  # at the base width: the standard model
        assert torch.equal(w, build(32).state_dict()[name]), name
    wide, plain = build(128, 32), build(128)
    params, plain_params = dict(wide.named_parameters()), dict(plain.named_parameters())
    expected = {"backbone.blocks.0.attn.q_proj.weight": math.sqrt(32 / 128),
                "backbone.blocks.1.mlp.down.weight": math.sqrt(4 * 32 / (4 * 128)),
                "tok_emb.weight": 1.0, "backbone.pos_emb.weight": 1.0}
    if not tie:
        expected["head.weight"] = 32 / 128
    for name, factor in expected.items():  # the same draw, scaled
        torch.testing.assert_close(params[name], plain_params[name] * factor, msg=name)
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        hidden = wide.backbone(wide.tok_emb(idx))
        torch.testing.assert_close(wide(idx)[0], hidden @ wide.head.weight.T * (32 / 128 if tie else 1.0))
    with pytest.raises(ValueError, match="optim.mup"):  # muP's init without its learning rates
        load_lm_config(None, ["model.mup_base_width=64"])


def test_coordinate_check_keeps_activation_sizes_across_widths_under_mup_only():
    """sattn coordcheck's measurement: after a few Adam steps at lr 1e-2, every layer's mean
    |output| varies by less than 2.5x from width 64 to 256 under muP for MHA, MLR and Bilinear
    BTT, while in the standard parametrisation the attention outputs grow by more than 10x."""
    from structured_attention.cli.coordcheck import coord_check, spreads

    rows = coord_check(["mha", "mlr:8|8|8|8", "bilinear_btt:1"], [64, 128, 256], steps=3, seeds=2)
    spread = spreads(rows)
    for (kind, parametrisation, site), s in spread.items():
        if parametrisation == "mup":
            assert s < 2.5, (kind, site, s)
    for kind in ("mha", "mlr:8|8|8|8", "bilinear_btt:1"):
        assert max(s for (k, p, site), s in spread.items() if k == kind and p == "sp" and "attn" in site) > 10, kind


# -- the loop ----------------------------------------------------------------------------------------------


def test_train_tiny(tmp_path, capsys):
    cfg = load_lm_config(None, tiny_overrides(tmp_path))
    result = train_lm(cfg)
    assert len(result.losses) == 8 and all(math.isfinite(v) for v in result.losses)
    assert result.losses[-1] < result.losses[0]
    assert math.isfinite(result.val_bpb) and result.sample
    lines = [json.loads(s) for s in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [2, 4, 6, 8]
    assert {"step", "loss", "lr", "tokens", "flops", "tokens_per_s"} <= set(lines[0])
    assert "val_bpb" in lines[1] and "val_bpb" not in lines[0]
    fpt = GPT(GPTConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, max_seq_len=32)).training_flops_per_token(32)
    assert lines[-1]["tokens"] == 8 * 4 * 32 and lines[-1]["flops"] == pytest.approx(8 * 4 * 32 * fpt)
    err = capsys.readouterr().err
    assert "step 8/8" in err and "tok/s" in err and "ETA" in err


def test_a_run_sets_tf32_products_on_cuda_only_while_it_runs(tmp_path):
    from structured_attention.training.loop import run_matmul_precision

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # the caller's choice, whatever it is
    try:
        with run_matmul_precision(torch.device("cuda")):
            assert torch.get_float32_matmul_precision() == "high"
        assert torch.get_float32_matmul_precision() == "medium"
        with pytest.raises(RuntimeError), run_matmul_precision(torch.device("cuda")):
            raise RuntimeError("a run that fails")
        assert torch.get_float32_matmul_precision() == "medium"
        with run_matmul_precision(torch.device("cpu")):
            assert torch.get_float32_matmul_precision() == "medium"
        device = "cuda" if torch.cuda.is_available() else "cpu"
        train_lm(load_lm_config(None, tiny_overrides(tmp_path, steps=2, device=device)))
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)


def test_resume_is_exact(tmp_path):
    """N steps in one go == N/2 steps, then --resume to N (cosine schedule, dropout on)."""
    base = tiny_overrides(tmp_path, steps=8, checkpoint_every=4) + ["model.dropout=0.1"]
    full = train_lm(load_lm_config(None, base + [f"run.out_dir={tmp_path / 'full'}"])).losses
    # a run that "crashed" after its step-4 checkpoint: drop the final checkpoint and resume
    run2 = tmp_path / "crashed"
    train_lm(load_lm_config(None, base + [f"run.out_dir={run2}"]))
    import shutil

    shutil.rmtree(run2 / "ckpt" / "step-00000008")
    resumed = train_lm(load_lm_config(None, base + [f"run.out_dir={run2}"]), resume=True).losses
    assert resumed == full
    steps = [json.loads(s)["step"] for s in (run2 / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6, 8]


def test_half_then_resume_constant_lr(tmp_path):
    base = tiny_overrides(tmp_path, checkpoint_every=0) + ["optim.schedule=constant"]
    full = train_lm(load_lm_config(None, base + ["run.steps=6", f"run.out_dir={tmp_path / 'a'}"])).losses
    train_lm(load_lm_config(None, base + ["run.steps=3", f"run.out_dir={tmp_path / 'b'}"]))
    resumed = train_lm(load_lm_config(None, base + ["run.steps=6", f"run.out_dir={tmp_path / 'b'}"]), resume=True)
    assert resumed.losses == full


def test_a_resumed_run_with_nothing_left_to_train_reports_its_checkpoint(tmp_path):
    """It reported checkpoint None: the run's checkpoint is the one it resumed from."""
    base = tiny_overrides(tmp_path, steps=2)
    first = train_lm(load_lm_config(None, base))
    again = train_lm(load_lm_config(None, base), resume=True)
    assert again.checkpoint == first.checkpoint and again.checkpoint.endswith("step-00000002")


def test_resume_other_architecture(tmp_path):
    base = tiny_overrides(tmp_path, steps=2)
    train_lm(load_lm_config(None, base))
    with pytest.raises(ValueError, match="another architecture.*d_model"):
        train_lm(load_lm_config(None, base + ["model.d_model=48"]), resume=True)
    # found before the data loads (this source does not exist) and before run.out_dir is made
    with pytest.raises(FileNotFoundError, match="^--resume: no checkpoint in"):
        train_lm(load_lm_config(None, base + [f"run.out_dir={tmp_path / 'nothing'}", f"data.source={tmp_path / 'none.txt'}"]),
                 resume=True)
    assert not (tmp_path / "nothing").exists()


def _checkpoint_loss(folder) -> float:
    """The training loss of a checkpoint's weights on one batch, computed here from the files."""
    ckpt = load_checkpoint(folder)
    model = GPT(GPTConfig(**ckpt.state["config"]["model"]))
    model.load_state_dict(ckpt.model_state)
    idx = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return float(model(idx[:, :-1], idx[:, 1:])[1])


def test_nonfinite_loss_stops(tmp_path):
    """lr=1e30: step 1's update leaves finite but huge weights whose loss is NaN. The run stops at
    step 2 and names no checkpoint: the only one it wrote gives a NaN itself."""
    from structured_attention.training import NonFiniteLossError

    cfg = load_lm_config(None, tiny_overrides(tmp_path, steps=6, checkpoint_every=1) + ["optim.warmup_steps=0"] + ["optim.lr=1e30", "optim.grad_clip=0"])
    with pytest.raises(NonFiniteLossError, match=r"the loss is nan at step 2; no checkpoint of this run has given a finite loss"):
        train_lm(cfg)
    assert not math.isfinite(_checkpoint_loss(tmp_path / "run" / "ckpt" / "step-00000001"))


def test_nonfinite_weights_are_never_checkpointed(tmp_path, monkeypatch):
    """An update that leaves an infinite weight (injected) stops the run before the checkpoint."""
    from structured_attention.training import NonFiniteLossError

    real_step = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        with torch.no_grad():
            self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    cfg = load_lm_config(None, tiny_overrides(tmp_path, steps=6, checkpoint_every=1))
    with pytest.raises(NonFiniteLossError, match=r"the weights are not finite after step 1 \(its loss was finite\)"):
        train_lm(cfg)
    assert not (tmp_path / "run" / "ckpt" / "step-00000001").exists()


def test_nonfinite_loss_names_a_checkpoint_that_gives_a_finite_loss(tmp_path, monkeypatch):
    """A NaN at step 4 (injected): the checkpoint after step 3 holds the weights that gave it, so
    the run names step 2's, whose own loss (computed here from its files) is finite."""
    from structured_attention.experiments.lm import LMTask
    from structured_attention.training import NonFiniteLossError

    calls = []
    real_loss = LMTask.loss

    def loss(self, model, batch):
        calls.append(1)
        out = real_loss(self, model, batch)
        return out * float("nan") if len(calls) == 4 else out

    monkeypatch.setattr(LMTask, "loss", loss)
    cfg = load_lm_config(None, tiny_overrides(tmp_path, steps=6, checkpoint_every=1))
    with pytest.raises(NonFiniteLossError, match=r"at step 4; the last good checkpoint is .*step-00000002") as err:
        train_lm(cfg)
    named = str(err.value).split("the last good checkpoint is ")[1].split(" (")[0]
    assert math.isfinite(_checkpoint_loss(named))


def test_grad_accum_matches_bigger_batch(tmp_path):
    """grad_accum=2 draws different batches than batch_size*2 (by design), but runs and logs tokens."""
    cfg = load_lm_config(None, tiny_overrides(tmp_path, steps=2, grad_accum=2))
    r = train_lm(cfg)
    assert r.tokens == 2 * 2 * 4 * 32


def test_mup_and_mlr_train(tmp_path):
    cfg = load_lm_config(None, tiny_overrides(tmp_path, steps=2) + ["optim.mup=true", "model.attention=mlr:8|8", "model.attn_scale=mup"])
    assert len(train_lm(cfg).losses) == 2


# -- CLI -----------------------------------------------------------------------------------------------------


def test_cli_train_eval_generate(tmp_path, capsys):
    assert sattn(["train", "lm", *tiny_overrides(tmp_path, steps=4)]) == 0
    out = capsys.readouterr().out
    assert "bits per byte" in out and "sample:" in out
    assert sattn(["eval", "--checkpoint", str(tmp_path / "run"), "--max-batches", "2"]) == 0
    assert "bits per byte" in capsys.readouterr().out
    assert sattn(["eval", "--checkpoint", str(tmp_path / "run"), "--device", "cuda:7"]) == (
        0 if torch.cuda.device_count() > 7 else 2)
    assert torch.cuda.device_count() > 7 or "--device: expected" in capsys.readouterr().err
    other = make_corpus(tmp_path / "other.txt", n_words=800, seed=1)
    assert sattn(["eval", "--checkpoint", str(tmp_path / "run"), "--source", str(other)]) == 0
    assert "bits per byte" in capsys.readouterr().out
    assert sattn(["generate", "--checkpoint", str(tmp_path / "run" / "ckpt"), "--prompt", "def ", "--max-new-tokens", "10",
                  "--temperature", "0.8", "--top-k", "5", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def ")
    # same seed, same text
    assert sattn(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "def ", "--max-new-tokens", "10",
                  "--top-k", "5", "--temperature", "0.8", "--seed", "1"]) == 0
    assert capsys.readouterr().out == out
    # greedy: static caches and a compiled step give the text of growing caches
    greedy = ["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "def ", "--max-new-tokens", "12",
              "--temperature", "0"]
    texts = []
    for extra in ([], ["--cache", "static"], ["--compile", "aot_eager"]):
        assert sattn([*greedy, *extra]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[1] == texts[0] and texts[2] == texts[0]
    assert sattn([*greedy, "--compile", "--cache", "growing"]) == 2
    assert "--cache: expected static with --compile" in capsys.readouterr().err
    assert sattn([*greedy, "--cuda-graph", "--device", "cpu"]) == 2
    assert "--cuda-graph: expected a CUDA --device" in capsys.readouterr().err
    assert sattn([*greedy, "--device", "tpu"]) == 2
    assert "--device: expected 'cpu' or an available CUDA device" in capsys.readouterr().err
    # named by their flags, before the prompt is echoed (generate's own names came after it)
    for extra, message in ((["--max-new-tokens", "-1"], "--max-new-tokens: expected a non-negative integer"),
                           (["--temperature", "nan"], "--temperature: expected a non-negative number"),
                           (["--compile", "inductr"], "--compile: expected a torch.compile mode"),
                           (["--prompt", "x" * 300], "--prompt: expected fewer tokens than the model's")):
        assert sattn([*greedy, *extra]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and message in captured.err and len(captured.err.strip().splitlines()) == 1


def test_cli_char_tokenizer(tmp_path, capsys):
    assert sattn(["train", "lm", *tiny_overrides(tmp_path, steps=2), "data.tokenizer=char"]) == 0
    capsys.readouterr()
    assert sattn(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "def", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("def")


@pytest.mark.parametrize(
    "argv_tail, match",
    [
        (["model.attention=nosuchkind"], "error:"),
        (["optim.nosuch=1"], "optim.nosuch"),
        (["data.source=/nonexistent/corpus.txt"], "no such file"),
    ],
)
def test_cli_bad_train_input(tmp_path, capsys, argv_tail, match):
    assert sattn(["train", "lm", *tiny_overrides(tmp_path, steps=1), *argv_tail]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_empty_corpus(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert sattn(["train", "lm", *tiny_overrides(tmp_path, steps=1), f"data.source={empty}"]) == 2
    assert "source" in capsys.readouterr().err


def test_a_run_that_fails_before_writing_leaves_no_folder_it_made(tmp_path, capsys):
    """A bad data source is found after the run has made run.out_dir (its lock goes there first):
    the folders the run made, empty, are removed again; a folder that was there stays, with its files."""
    missing = f"data.source={tmp_path / 'nowhere.txt'}"
    out = tmp_path / "new" / "run"
    assert sattn(["train", "lm", *tiny_overrides(tmp_path, steps=1, out_dir=out), missing]) == 2
    assert "source" in capsys.readouterr().err and not (tmp_path / "new").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("kept")
    assert sattn(["train", "lm", *tiny_overrides(tmp_path, steps=1, out_dir=mine), missing]) == 2
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_cli_bad_checkpoint(tmp_path, capsys):
    assert sattn(["eval", "--checkpoint", str(tmp_path / "none")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert sattn(["train", "lm", *tiny_overrides(tmp_path, steps=1)]) == 0
    capsys.readouterr()
    assert sattn(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "x" * 30, "--max-new-tokens", "5"]) == 2
    assert "--max-new-tokens: the prompt takes 30 of the model's 32 positions" in capsys.readouterr().err
    assert sattn(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "x" * 40, "--max-new-tokens", "5"]) == 2
    assert "--prompt: expected fewer tokens than the model's 32 positions" in capsys.readouterr().err
    assert sattn(["eval", "--checkpoint", str(tmp_path / "run"), "--examples", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--examples" in err[0] and "in-context regression" in err[0]
    (tmp_path / "run" / "ckpt" / "step-00000001" / "model.safetensors").write_bytes(b"garbage")
    assert sattn(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "a", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "checksum" in err and "Traceback" not in err


def test_fresh_run_replaces_old_checkpoints(tmp_path):
    train_lm(load_lm_config(None, tiny_overrides(tmp_path, steps=4, checkpoint_every=2)))
    train_lm(load_lm_config(None, tiny_overrides(tmp_path, steps=1)))
    from structured_attention.training import load_checkpoint

    assert load_checkpoint(tmp_path / "run").step == 1


def test_missing_logger_package_is_a_clear_error(tmp_path):
    pytest.importorskip("torch")
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="tensorboard"):
            train_lm(load_lm_config(None, tiny_overrides(tmp_path, steps=1) + ["run.tensorboard=true"]))
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="wandb"):
            train_lm(load_lm_config(None, tiny_overrides(tmp_path, steps=1) + ["run.wandb=true"]))


def test_sweep_matches_flops_and_plots(tmp_path, capsys):
    overrides = [o for o in tiny_overrides(tmp_path, steps=4, eval_every=0) if not o.startswith(("run.out_dir", "run.steps"))]
    out = tmp_path / "sweep"
    args = ["sweep", "lm", "--widths", "16,32", "--head-dim", "8", "--kinds", "mha;mlr:4|2|1|1",
            "--lrs", "1e-3,3e-3", "--base-steps", "3", "--out", str(out), *overrides]
    assert sattn(args) == 0
    results = [json.loads(p.read_text()) for p in sorted(out.glob("*/result.json"))]
    assert len(results) == 8
    for width in (16, 32):
        runs = {r["kind"]: r for r in results if r["width"] == width}
        mha, mlr = runs["mha"], runs["mlr:4|2|1|1"]
        assert mha["steps"] == 3 and mlr["steps"] >= 3  # MLR is cheaper per token: at least as many steps
        assert abs(mlr["flops"] - mha["flops"]) / mha["flops"] < 0.5 / mha["steps"] + 0.2
    mtimes = {p: p.stat().st_mtime for p in out.glob("*/result.json")}
    assert sattn(args) == 0  # a finished sweep is not trained again
    assert mtimes == {p: p.stat().st_mtime for p in out.glob("*/result.json")}
    assert sattn(["plot", str(out), "--out", str(tmp_path / "plot")]) == 0
    table = (tmp_path / "plot" / "lm.md").read_text()
    assert table.count("\n") == 2 + 4  # header, rule, best lr per (kind, width)
    assert (tmp_path / "plot" / "lm.png").stat().st_size > 0
    assert (tmp_path / "plot" / "lm-lr.png").stat().st_size > 0  # two rates: each width's loss against them


def test_a_sweep_run_stopped_early_records_the_steps_and_flops_it_trained(tmp_path, capsys):
    """With run.patience a run stops before its planned steps: result.json (what `sattn plot` draws)
    records the FLOPs of the steps trained, as metrics.jsonl counts them, not the planned budget."""
    overrides = [o for o in tiny_overrides(tmp_path, eval_every=1, log_every=1) if not o.startswith(("run.out_dir", "run.steps"))]
    out = tmp_path / "sweep"
    assert sattn(["sweep", "lm", "--widths", "32", "--head-dim", "16", "--kinds", "mha", "--lrs", "0.05",
                  "--base-steps", "12", "--out", str(out), *overrides, "run.patience=1",
                  "optim.warmup_steps=0", "optim.schedule=constant"]) == 0
    (run,) = out.glob("*/result.json")
    result = json.loads(run.read_text())
    rows = [json.loads(line) for line in (run.parent / "metrics.jsonl").read_text().splitlines()]
    per_step = rows[0]["flops"] / rows[0]["step"]
    assert result["steps"] == 12 and result["steps_done"] == rows[-1]["step"] < 12  # it did stop early
    assert result["flops"] == rows[-1]["flops"] == pytest.approx(result["steps_done"] * per_step)


def test_plot_of_an_empty_folder_is_one_clear_error(tmp_path, capsys):
    assert sattn(["plot", str(tmp_path)]) == 2
    assert "no finished runs" in capsys.readouterr().err


@pytest.mark.parametrize("text, needle", [("{}", "has no 'kind'"), ("{oops", "result.json' is not JSON"),
                                          ("[1]", "holds list, expected a JSON object")])
def test_plot_of_a_malformed_result_is_one_line_naming_it(tmp_path, capsys, text, needle):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "result.json").write_text(text)
    assert sattn(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("sattn plot: error: sweep_dir:") and needle in err
