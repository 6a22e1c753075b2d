"""Language modelling with packed documents (``data.pack_documents``): the training loss of a packed
batch is each document's loss computed alone, evaluation uses the validation split's documents the
same way, ``data.pack_documents=false`` is the plain batch, and the CLI reads and checks the flag.

Small temporary corpora only (a folder of short files, so windows cross document boundaries)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from structured_attention.cli.main import main
from structured_attention.data import eval_batches, sample_batch
from structured_attention.experiments.lm import DataConfig, LMConfig, LMTask, evaluate_lm, load_lm, load_lm_config, train_lm
from structured_attention.training import config_from_dict, config_to_dict
from structured_attention.training.distributed import DistInfo

# Short documents (6 to 28 bytes), blank lines inside some: a 32-token window holds several.
FILES = {f"doc_{i:02d}.py": f"a = {i}\n" + "\n\n" * (i % 2) + f"b = a * {i}\n" * (i % 3) for i in range(20)}


def overrides(tmp_path, *extra: str) -> list[str]:
    for name, text in FILES.items():
        (tmp_path / "corpus").mkdir(exist_ok=True)
        (tmp_path / "corpus" / name).write_text(text, encoding="utf-8")
    return [
        f"data.source={tmp_path / 'corpus'}", f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.5",
        "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=32", "run.seq_len=32",
        "run.batch_size=6", "run.steps=4", "run.eval_every=2", "run.eval_batches=4", "run.log_every=2",
        f"run.out_dir={tmp_path / 'run'}", "run.sample_tokens=0", "optim.warmup_steps=1", *extra,
    ]


def ready_task(tmp_path, *extra: str) -> LMTask:
    task = LMTask(load_lm_config(None, overrides(tmp_path, *extra)))
    task.prepare(DistInfo())
    return task


@torch.no_grad()
def per_document_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch with each row's documents run through ``model`` one at a
    time, alone (no document ids): the independent reference for a packed batch."""
    total = torch.zeros((), dtype=torch.float64)
    for row_x, row_y, row_ids in zip(x, y, ids):
        _, counts = torch.unique_consecutive(row_ids, return_counts=True)
        for seg_x, seg_y in zip(row_x.split(counts.tolist()), row_y.split(counts.tolist())):
            _, loss = model(seg_x[None], seg_y[None])
            total += loss.double() * len(seg_x)
    return total / y.numel()


@pytest.mark.parametrize(
    "model_overrides",
    [["model.attention=mha"], ["model.attention=mlr:8|4|4"], ["model.attention=mha", "model.positions=rotary"]],
    ids=["mha", "mlr", "mha-rotary"],
)
def test_packed_loss_is_the_mean_of_per_document_losses(tmp_path, model_overrides):
    torch.manual_seed(0)
    task = ready_task(tmp_path, "data.pack_documents=true", *model_overrides)
    model = task.build_model().train()
    x, y, ids = task.batch(3, 0, 1, torch.device("cpu"))
    assert bool((ids[:, -1] > ids[:, 0]).all())  # every window crosses a document boundary
    loss = task.loss(model, (x, y, ids))
    torch.testing.assert_close(loss.double(), per_document_loss(model, x, y, ids), rtol=2e-6, atol=2e-6)
    # Packing changes the loss: without the ids, later documents see the earlier ones.
    assert abs(float(loss.detach()) - float(model(x, y)[1].detach())) > 1e-4
    loss.backward()  # a packed training step has gradients
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())

    # Evaluation: consecutive windows of the validation split, each document's tokens alone.
    model.eval()
    run, corpus = task.config.run, task.corpus
    windows = eval_batches(corpus.val, run.batch_size, run.seq_len, run.eval_batches,
                           document_starts=corpus.val_document_starts)
    expected = [(per_document_loss(model, *b), b[1].numel()) for b in windows]
    metrics = task.evaluate(model, torch.device("cpu"))
    reference = sum(float(v) * n for v, n in expected) / sum(n for _, n in expected)
    assert metrics["val_loss"] == pytest.approx(reference, rel=2e-6)
    assert metrics["val_bpb"] == pytest.approx(corpus.bits_per_byte(reference), rel=2e-6)


def test_pack_documents_false_is_the_plain_batch(tmp_path):
    task = ready_task(tmp_path)
    assert task.config.data.pack_documents is False
    run, corpus = task.config.run, task.corpus
    batch = task.batch(5, 0, 1, torch.device("cpu"))
    plain = sample_batch(corpus.train, run.batch_size, run.seq_len, seed=run.seed, step=5)
    assert len(batch) == 2 and all(torch.equal(a, b) for a, b in zip(batch, plain))
    model = task.build_model()
    assert torch.equal(task.loss(model, batch), model(*plain)[1])
    val = evaluate_lm(model, corpus.val, run.batch_size, run.seq_len, run.eval_batches, "cpu", "none")
    assert task.evaluate(model, torch.device("cpu"))["val_loss"] == val
    # The packed batch holds the same windows, with their document ids.
    packed = ready_task(tmp_path, "data.pack_documents=true").batch(5, 0, 1, torch.device("cpu"))
    assert len(packed) == 3 and torch.equal(packed[0], batch[0]) and torch.equal(packed[1], batch[1])


def test_old_configs_without_the_field_load(tmp_path):
    config = load_lm_config(None, overrides(tmp_path))
    d = config_to_dict(config)
    del d["data"]["pack_documents"]  # as saved by a checkpoint from before the field existed
    assert config_from_dict(LMConfig, d) == config and config_from_dict(LMConfig, d).data.pack_documents is False


@pytest.mark.parametrize("value", ["maybe", "2", ""])
def test_bad_pack_documents_value_is_one_line(tmp_path, capsys, value):
    with pytest.raises(ValueError, match=r"^data\.pack_documents: expected a boolean[^\n]*$"):
        load_lm_config(None, [f"data.pack_documents={value}"])
    assert main(["train", "lm", *overrides(tmp_path, f"data.pack_documents={value}")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sattn train: error: data.pack_documents: expected a boolean") and err.count("\n") == 1
    with pytest.raises(ValueError, match=r"^data\.pack_documents: expected a boolean[^\n]*$"):
        DataConfig(pack_documents=value)  # type: ignore[arg-type]


def test_train_packed_and_eval_both_protocols(tmp_path, capsys):
    # on the CPU, as `sattn eval` below: its loss is compared with training's last evaluation
    result = train_lm(load_lm_config(None, overrides(tmp_path, "data.pack_documents=true", "run.device=cpu")))
    assert len(result.losses) == 4 and all(np.isfinite(result.losses))
    rows = [json.loads(s) for s in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["val_loss"] == result.val_loss
    model, _, config, _ = load_lm(tmp_path / "run")
    assert config.data.pack_documents is True  # the checkpoint keeps the protocol it trained with
    capsys.readouterr()

    def eval_cli(*flags: str) -> tuple[str, float]:
        assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--max-batches", "4", *flags]) == 0
        out = capsys.readouterr().out
        return out, float(out.split("val loss ")[1].split()[0])

    own, own_loss = eval_cli()
    packed, packed_loss = eval_cli("--pack-documents")
    unpacked, unpacked_loss = eval_cli("--no-pack-documents")
    assert "documents, packed)" in own and own_loss == packed_loss == pytest.approx(result.val_loss, abs=5e-5)
    assert "documents, not packed)" in unpacked and abs(unpacked_loss - packed_loss) > 1e-4
