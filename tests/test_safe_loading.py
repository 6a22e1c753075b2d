"""Nothing untrusted is unpickled: checkpoints are safetensors + JSON, configs are safe YAML. A
malicious payload (which would create a marker file if it were ever executed) is refused with one
clear error line, and the marker never appears."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch

from structured_attention.cli.main import main
from structured_attention.models import GPT, GPTConfig
from structured_attention.training import OptimConfig, build_optimizer, load_checkpoint, save_checkpoint
from structured_attention.training.checkpoint import get_rng_state

SRC = Path(__file__).resolve().parents[1] / "src" / "structured_attention"


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _checkpoint(tmp_path: Path) -> Path:
    model = GPT(GPTConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_seq_len=8, tie_embeddings=False))
    opt = build_optimizer(model, OptimConfig())
    state = {"config": {}, "rng": get_rng_state(), "losses": [], "metrics": []}
    return save_checkpoint(tmp_path / "ckpt", 1, model.state_dict(), opt.state_dict(), state)


def test_a_pickle_in_place_of_the_weights_is_refused_even_with_a_matching_checksum(tmp_path):
    marker = tmp_path / "pwned"
    folder = _checkpoint(tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(pickle.dumps({"weight": _Payload(marker)}))
    state = json.loads((folder / "state.json").read_text())
    state["sha256"]["model.safetensors"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    body = {k: v for k, v in state.items() if k != "state_sha256"}  # and state.json's own checksum
    state["state_sha256"] = hashlib.sha256(json.dumps(body, indent=1).encode()).hexdigest()
    (folder / "state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="cannot read tensors"):
        load_checkpoint(folder)
    assert not marker.exists()


def test_a_torch_save_file_given_as_checkpoint_is_refused_by_the_cli(tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = tmp_path / "model.pt"
    torch.save({"payload": _Payload(marker)}, path)  # pickle-based
    for argv in (["eval", "--checkpoint", str(path)], ["generate", "--checkpoint", str(path), "--prompt", "x"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no checkpoint found" in err[0]
    assert not marker.exists()


def test_a_config_with_a_python_object_tag_is_refused(tmp_path, capsys):
    marker = tmp_path / "pwned"
    config = tmp_path / "evil.yaml"
    config.write_text(f"model: !!python/object/apply:os.system ['touch {marker}']\n")
    assert main(["train", "lm", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not valid YAML" in err[0]
    assert not marker.exists()


def test_the_package_has_no_unsafe_deserialisation():
    """Static check of the whole package: no pickle, no torch.load without weights_only=True, no
    unsafe YAML loader, no numpy pickles."""
    unsafe = [
        (re.compile(r"^\s*(import|from)\s+(c?pickle|dill|marshal|shelve)\b"), "a pickle module"),
        (re.compile(r"torch\.load\((?![^)]*weights_only\s*=\s*True)"), "torch.load without weights_only=True"),
        (re.compile(r"yaml\.(unsafe_load|load)\(|yaml\.(Unsafe)?Loader\b"), "an unsafe YAML loader"),
        (re.compile(r"allow_pickle\s*=\s*True"), "numpy pickles"),
    ]
    found = []
    for path in SRC.rglob("*.py"):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            found += [f"{path.relative_to(SRC)}:{n}: {what}" for pattern, what in unsafe if pattern.search(line)]
    assert not found, found
