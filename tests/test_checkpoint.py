"""Checkpoints: safetensors + JSON, tied weights once, checksums, fallback, atomic keep-two, RNG."""

from __future__ import annotations

import json
import os
import random
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from structured_attention._files import atomic_write
from structured_attention.models import GPT, GPTConfig
from structured_attention.training import OptimConfig, build_optimizer, find_checkpoints, load_checkpoint, save_checkpoint
from structured_attention.training.checkpoint import (
    check_compatible,
    get_rng_state,
    set_rng_state,
    tied_aliases,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)


def trained(seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(CFG)
    opt = build_optimizer(model, OptimConfig())
    x = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def save(model, opt, root, step, **extra):
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    state = {"config": {"model": CFG.to_dict()}, "losses": [1.0, float("nan")], "rng": get_rng_state(), **extra}
    return save_checkpoint(root, step, msd, osd, state, aliases=tied_aliases(model))


def test_roundtrip_and_tied_weights(tmp_path):
    model, opt = trained()
    folder = save(model, opt, tmp_path / "ckpt", 2)
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors", "optimizer.safetensors", "state.json"]
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "tok_emb.weight" in keys and "head.weight" not in keys  # the tied tensor is stored once
    state = json.loads((folder / "state.json").read_text())
    assert state["aliases"] == {"head.weight": "tok_emb.weight"} and len(state["sha256"]["model.safetensors"]) == 64

    loaded = load_checkpoint(tmp_path)  # a run's out_dir works too (it holds ckpt/)
    assert loaded.step == 2 and loaded.state["losses"][0] == 1.0
    model2 = GPT(CFG)
    opt2 = build_optimizer(model2, OptimConfig())
    set_state_dict(model2, opt2, model_state_dict=loaded.model_state, optim_state_dict=loaded.optimizer_state(),
                   options=StateDictOptions(full_state_dict=True))
    assert model2.head.weight is model2.tok_emb.weight
    for (n, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), n
    s1, s2 = opt.state_dict(), opt2.state_dict()
    for i in s1["state"]:
        for k in s1["state"][i]:
            assert torch.equal(s1["state"][i][k], s2["state"][i][k])
    assert [g["lr_mult"] for g in s1["param_groups"]] == [g["lr_mult"] for g in s2["param_groups"]]
    assert tuple(s2["param_groups"][0]["betas"]) == s1["param_groups"][0]["betas"]


def test_keeps_two_and_falls_back_on_corruption(tmp_path):
    model, opt = trained()
    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        save(model, opt, root, step)
    assert [p.name for p in find_checkpoints(root)] == ["step-00000003", "step-00000002"]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]
    # flip one byte of the newest tensor file: checksum mismatch -> warn and use the previous one
    f = root / "step-00000003" / "optimizer.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="checksum"):
        assert load_checkpoint(root).step == 2
    (root / "step-00000002" / "model.safetensors").unlink()
    with pytest.warns(UserWarning, match="checksum"), pytest.raises(ValueError, match="no valid checkpoint"):
        load_checkpoint(root)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nowhere")


def test_a_save_deletes_only_what_this_package_wrote(tmp_path):
    """A killed save's folder goes; a user's .tmp-* files and folders and a step-* folder this
    package did not write stay, and saving over the latter is refused in one line."""
    model, opt = trained()
    root = tmp_path / "ckpt"
    (root / ".tmp-step-00000001-x1y2").mkdir(parents=True)  # a save killed midway
    (root / ".tmp-keepme").mkdir()
    (root / ".tmp-keepme" / "notes.txt").write_text("mine")
    (root / ".tmp-notes.txt").write_text("mine")
    (root / "step-00000002").mkdir()
    (root / "step-00000002" / "readme.txt").write_text("mine")
    save(model, opt, root, 1)
    assert not (root / ".tmp-step-00000001-x1y2").exists()
    assert (root / ".tmp-keepme" / "notes.txt").read_text() == "mine" and (root / ".tmp-notes.txt").is_file()
    with pytest.raises(ValueError, match=r"^run\.out_dir: expected no folder .*step-00000002 other than"):
        save(model, opt, root, 2)
    assert (root / "step-00000002" / "readme.txt").read_text() == "mine"
    assert [p.name for p in find_checkpoints(root)] == ["step-00000001"]


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    """Re-saving a step (a resumed run that saves where it stopped): the old checkpoint moves aside
    whole until the new one is in place, then goes; nothing of either is left beside them."""
    model, opt = trained()
    root = tmp_path / "ckpt"
    save(model, opt, root, 1, marker="old")
    save(model, opt, root, 1, marker="new")
    assert load_checkpoint(root).state["marker"] == "new"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]


def test_incomplete_checkpoint_is_ignored(tmp_path):
    model, opt = trained()
    root = tmp_path / "ckpt"
    save(model, opt, root, 1)
    (root / "step-00000002").mkdir()  # a crash before state.json (the commit marker) was written
    (root / "step-00000002" / "model.safetensors").write_bytes(b"partial")
    assert load_checkpoint(root).step == 1


def test_other_architecture_is_one_clear_error(tmp_path):
    model, opt = trained()
    folder = save(model, opt, tmp_path / "ckpt", 1)
    loaded = load_checkpoint(folder)
    other = GPT(GPTConfig(vocab_size=64, d_model=48, n_layers=1, n_heads=2, max_seq_len=16))
    with pytest.raises(ValueError, match="another architecture") as err:
        check_compatible(other, loaded.model_state, str(folder))
    assert "\n" not in str(err.value)
    deeper = GPT(GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16))
    with pytest.raises(ValueError, match="another architecture"):
        check_compatible(deeper, loaded.model_state, str(folder))


def test_rng_state_roundtrip():
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    state = json.loads(json.dumps(get_rng_state()))  # JSON-safe
    a = (random.random(), np.random.rand(), torch.rand(3))
    set_rng_state(state)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_no_pickle_in_checkpoint(tmp_path):
    model, opt = trained()
    folder = save(model, opt, tmp_path / "ckpt", 1)
    for f in folder.iterdir():
        head = f.read_bytes()[:2]
        assert head != b"\x80\x02" and not f.name.endswith((".pt", ".pkl", ".bin"))


def _edit_state(folder, edit, *, reseal: bool = False):
    """Change state.json as valid JSON; with ``reseal`` also recompute its checksum (a forged or
    buggy writer), so only the field checks can catch it."""
    import hashlib

    path = folder / "state.json"
    state = json.loads(path.read_text())
    edit(state)
    if reseal:
        body = {k: v for k, v in state.items() if k != "state_sha256"}
        state["state_sha256"] = hashlib.sha256(json.dumps(body, indent=1).encode()).hexdigest()
    path.write_text(json.dumps(state, indent=1))


@pytest.mark.parametrize("edit", [
    lambda s: s.update(step=7),
    lambda s: s["losses"].__setitem__(0, 0.5),
    lambda s: s["rng"]["numpy"].update(pos=3),
], ids=["step", "loss", "rng"])
def test_an_edited_state_falls_back_to_the_previous_checkpoint(tmp_path, edit):
    model, opt = trained()
    root = tmp_path / "ckpt"
    for step in (1, 2):
        save(model, opt, root, step)
    _edit_state(root / "step-00000002", edit)
    with pytest.warns(UserWarning, match=r"step-00000002.*state_sha256.*falling back") as caught:
        assert load_checkpoint(root).step == 1
    assert all("\n" not in str(w.message) for w in caught)


@pytest.mark.parametrize("field,edit", [
    ("step", lambda s: s.update(step="2")),
    ("step", lambda s: s.update(step=5)),
    ("rng.numpy.key", lambda s: s["rng"]["numpy"].update(key=[1, 2])),
    ("rng.torch", lambda s: s["rng"].update(torch="not base64!")),
    ("rng.python.internal", lambda s: s["rng"]["python"].update(internal="x")),
    ("losses", lambda s: s.update(losses=["a"])),
    ("sha256", lambda s: s.update(sha256=None)),
    ("aliases", lambda s: s.update(aliases=[1])),
    ("optimizer.param_groups", lambda s: s.update(optimizer={"param_groups": 3})),
    ("data", lambda s: s.update(data={"seed": 0, "next_step": 9})),
    ("metrics", lambda s: s.update(metrics=[{"step": 99}])),
    ("tracker", lambda s: s.update(tracker={"best_val_loss": "low"})),
])
def test_malformed_fields_are_named_and_fall_back(tmp_path, field, edit):
    model, opt = trained()
    root = tmp_path / "ckpt"
    for step in (1, 2):
        save(model, opt, root, step, data={"seed": 0, "next_step": step}, metrics=[],
             tracker={"best_val_loss": float("inf"), "best_step": 0, "bad_evals": 0, "best": {}})
    _edit_state(root / "step-00000002", edit, reseal=True)
    with pytest.warns(UserWarning, match=rf"field '{field}': expected"):
        assert load_checkpoint(root).step == 1
    with pytest.raises(ValueError, match=rf"field '{field}'"):
        load_checkpoint(root / "step-00000002")


def test_keep_two_counts_only_checkpoints_that_verify(tmp_path):
    """A corrupt newest checkpoint is not one of the two kept: after the next save the last good
    one is still there, and a second fault still leaves one to resume from."""
    model, opt = trained()
    root = tmp_path / "ckpt"
    for step in (1, 2):
        save(model, opt, root, step)
    f = root / "step-00000002" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    save(model, opt, root, 3)
    assert [p.name for p in find_checkpoints(root)] == ["step-00000003", "step-00000001"]
    (root / "step-00000003" / "optimizer.safetensors").unlink()  # a second fault
    with pytest.warns(UserWarning, match="falling back"):
        assert load_checkpoint(root).step == 1


def test_a_checkpoint_of_another_dtype_is_refused(tmp_path):
    model, opt = trained()
    folder = save(model, opt, tmp_path / "ckpt", 1)
    loaded = load_checkpoint(folder)
    with pytest.raises(ValueError, match=r"tok_emb.weight is torch.float32, the model needs torch.float64"):
        check_compatible(GPT(CFG).double(), loaded.model_state, str(folder))


def test_a_checkpoint_of_the_first_format_still_loads(tmp_path):
    model, opt = trained()
    folder = save(model, opt, tmp_path / "ckpt", 1)
    _edit_state(folder, lambda s: (s.pop("state_sha256"), s.update(format="structured-attention-checkpoint-v1")))
    assert load_checkpoint(folder).step == 1


@pytest.mark.skipif(not hasattr(os, "umask") or os.name != "posix", reason="POSIX permissions")
@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_checkpoint_files_take_the_users_umask(tmp_path, umask, file_mode, dir_mode):
    """A checkpoint's folder and files get what the umask gives new files (tempfile alone would
    make them 0700 and 0600 whatever it is), as does every other atomically written file."""
    model, opt = trained()
    before = os.umask(umask)
    try:
        path = save(model, opt, tmp_path / "ckpt", 1)
        atomic_write(tmp_path / "other.txt", lambda p: Path(p).write_text("x"))
    finally:
        os.umask(before)
    assert stat.S_IMODE(path.stat().st_mode) == dir_mode
    assert {stat.S_IMODE(f.stat().st_mode) for f in path.iterdir()} == {file_mode}
    assert stat.S_IMODE((tmp_path / "other.txt").stat().st_mode) == file_mode
