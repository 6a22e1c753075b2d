"""Checkpoints: safetensors for tensors, JSON for everything else, no pickle anywhere.

Layout of one checkpoint, a folder ``<out_dir>/ckpt/step-00000600/``:

- ``model.safetensors``: the model's full (unsharded, CPU) state dict. Tied parameters are stored
  once, under their first name; ``state.json["aliases"]`` maps each other name to it.
- ``optimizer.safetensors``: the optimizer state flattened to tensor keys
  ``"<parameter name>/<state key>"`` (``exp_avg``, ``exp_avg_sq``, ``step`` for AdamW), parameter
  names as ``torch.distributed.checkpoint.state_dict`` gives them (no ``module.`` prefixes, the same
  for plain, DDP and FSDP models).
- ``state.json`` (written last: it is the commit marker): ``format``, ``step``, the config, the
  tokenizer JSON, RNG states (torch/CUDA as base64 of their byte tensors, numpy's MT19937 key as a
  list, Python's ``random`` state as lists), the data position (batches are drawn from
  ``(seed, step)`` so the position is the next step), the per-step losses and metrics so far, the
  optimizer's param groups (hyper-parameters and parameter names), and the SHA-256 of both tensor
  files.

Each file is written to a temporary file in the same folder, flushed, fsynced and moved into place
with ``os.replace``; the folder itself is built under a temporary name and renamed when complete.
The two newest complete checkpoints are kept (``latest`` and ``previous``). :func:`load_checkpoint`
verifies the checksums and, when the newest checkpoint is missing a file, unreadable or corrupt,
warns and falls back to the previous one.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .._files import atomic_write

__all__ = [
    "CHECKPOINT_FORMAT",
    "LoadedCheckpoint",
    "find_checkpoints",
    "flatten_optimizer_state",
    "get_rng_state",
    "load_checkpoint",
    "remove_checkpoints",
    "save_checkpoint",
    "set_rng_state",
    "tied_aliases",
    "unflatten_optimizer_state",
]

CHECKPOINT_FORMAT = "structured-attention-checkpoint-v1"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
_SEP = "/"


# -- small helpers ---------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


# -- RNG states --------------------------------------------------------------------------------------


def get_rng_state() -> dict[str, Any]:
    """The torch (CPU and CUDA), numpy and Python ``random`` generator states, JSON-able."""
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "torch": _b64(torch.get_rng_state()),
        "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "numpy": {
            "kind": np_state[0],
            "key": [int(v) for v in np_state[1]],
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {"version": py_version, "internal": list(py_internal), "gauss_next": py_gauss},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available():
        cuda = [_unb64(s) for s in state["cuda"]]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    n = state["numpy"]
    np.random.set_state((n["kind"], np.array(n["key"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))


# -- tensors -----------------------------------------------------------------------------------------


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{alias name: first name}`` for parameters registered under more than one name (tied)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def flatten_optimizer_state(optim_sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """An FQN-keyed optimizer state dict (``torch.distributed.checkpoint.state_dict`` form) as flat
    tensors ``"<param>/<key>"`` plus JSON-able param groups. Non-tensor per-parameter state
    values are stored as 0-d float64 tensors."""
    tensors = {}
    for pname, st in optim_sd["state"].items():
        for key, value in st.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=torch.float64)
            tensors[f"{pname}{_SEP}{key}"] = t.detach().cpu().contiguous()
    groups = []
    for g in optim_sd["param_groups"]:
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()})
    return tensors, groups


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], groups: list[dict[str, Any]]) -> dict[str, Any]:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        pname, skey = key.rsplit(_SEP, 1)
        state.setdefault(pname, {})[skey] = t
    param_groups = []
    for g in groups:
        g = dict(g)
        if "betas" in g and isinstance(g["betas"], list):
            g["betas"] = tuple(g["betas"])
        param_groups.append(g)
    return {"state": state, "param_groups": param_groups}


# -- save ----------------------------------------------------------------------------------------------


def save_checkpoint(
    root: str | Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    optim_state: dict[str, Any],
    state: dict[str, Any],
    *,
    aliases: dict[str, str] | None = None,
    keep: int = 2,
) -> Path:
    """Write checkpoint ``root/step-<step>`` atomically and keep only the ``keep`` newest.

    ``model_state``: a full state dict (tied aliases are dropped here); ``optim_state``: an
    FQN-keyed optimizer state dict; ``state``: JSON-able extras (config, tokenizer, rng, metrics).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    aliases = dict(aliases or {})
    model_tensors = {k: v.detach().cpu().contiguous() for k, v in model_state.items() if k not in aliases}
    optim_tensors, groups = flatten_optimizer_state(optim_state)

    for stale in root.glob(".tmp-*"):  # left behind by a writer that was killed mid-save
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    final = root / f"step-{step:08d}"
    tmp_dir = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-step-{step:08d}-"))
    try:
        atomic_write(tmp_dir / MODEL_FILE, lambda p: save_file(model_tensors, p, metadata={"format": CHECKPOINT_FORMAT}))
        atomic_write(tmp_dir / OPTIM_FILE, lambda p: save_file(optim_tensors, p, metadata={"format": CHECKPOINT_FORMAT}))
        payload = {
            **state,
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "aliases": aliases,
            "optimizer": {"param_groups": groups},
            "sha256": {MODEL_FILE: _sha256(tmp_dir / MODEL_FILE), OPTIM_FILE: _sha256(tmp_dir / OPTIM_FILE)},
        }
        text = json.dumps(payload, indent=1, allow_nan=True)

        def write_json(p: str) -> None:
            with open(p, "w", encoding="utf-8") as f:
                f.write(text)

        atomic_write(tmp_dir / STATE_FILE, write_json)
        _fsync_dir(tmp_dir)
        if final.exists():  # re-saving the same step: move the old one aside first
            shutil.rmtree(final)
        os.replace(tmp_dir, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    for old in find_checkpoints(root, complete_only=False)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# -- load -----------------------------------------------------------------------------------------------


@dataclass
class LoadedCheckpoint:
    path: Path
    state: dict[str, Any]  # the state.json contents
    model_state: dict[str, torch.Tensor]  # with tied aliases restored
    optim_tensors: dict[str, torch.Tensor]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    def optimizer_state(self) -> dict[str, Any]:
        return unflatten_optimizer_state(self.optim_tensors, self.state["optimizer"]["param_groups"])


def _step_dirs(root: Path) -> list[Path]:
    dirs = [p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[5:]), reverse=True)


def remove_checkpoints(root: str | Path) -> int:
    """Delete the checkpoints this package wrote in ``root``: ``step-*`` folders whose
    ``state.json`` names this checkpoint format, and the temporary folders of killed saves.
    Anything else there (other files, folders, ``root`` itself) is left alone. Returns how many
    checkpoints were deleted."""
    root = Path(root)
    if not root.is_dir():
        return 0
    removed = 0
    for folder in _step_dirs(root):
        try:
            ours = json.loads((folder / STATE_FILE).read_text(encoding="utf-8")).get("format") == CHECKPOINT_FORMAT
        except (OSError, ValueError, AttributeError):
            ours = False
        if ours:
            shutil.rmtree(folder)
            removed += 1
    for stale in root.glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return removed


def find_checkpoints(path: str | Path, complete_only: bool = True) -> list[Path]:
    """Checkpoint folders under ``path``, newest first. ``path`` may be one checkpoint folder
    (holding ``state.json``), a folder of ``step-*`` checkpoints, or a run's ``out_dir`` (holding
    ``ckpt/``)."""
    path = Path(path)
    if (path / STATE_FILE).is_file() and not _step_dirs(path):
        return [path]
    for root in (path, path / "ckpt"):
        dirs = _step_dirs(root) if root.is_dir() else []
        if dirs:
            return [d for d in dirs if (d / STATE_FILE).is_file()] if complete_only else dirs
    return []


def _load_one(folder: Path, map_location: str = "cpu") -> LoadedCheckpoint:
    try:
        state = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder / STATE_FILE} is unreadable: {e}") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{folder} is not a {CHECKPOINT_FORMAT} checkpoint")
    for name in (MODEL_FILE, OPTIM_FILE):
        f = folder / name
        if not f.is_file():
            raise ValueError(f"{f} is missing")
        if _sha256(f) != state.get("sha256", {}).get(name):
            raise ValueError(f"{f} does not match its stored SHA-256 checksum (corrupt or truncated)")
    try:
        model_state = load_file(folder / MODEL_FILE, device=map_location)
        optim_tensors = load_file(folder / OPTIM_FILE, device=map_location)
    except Exception as e:  # safetensors raises its own error types for malformed files
        raise ValueError(f"{folder}: cannot read tensors: {e}") from None
    for alias, name in state.get("aliases", {}).items():
        model_state[alias] = model_state[name]
    return LoadedCheckpoint(folder, state, model_state, optim_tensors)


def load_checkpoint(path: str | Path, map_location: str = "cpu") -> LoadedCheckpoint:
    """The newest valid checkpoint under ``path`` (see :func:`find_checkpoints`), checksums verified.

    A newest checkpoint that fails verification is skipped with a warning in favour of the
    previous one. Raises ``FileNotFoundError`` when there is no checkpoint at all and
    ``ValueError`` when none is valid.
    """
    candidates = find_checkpoints(path)
    if not candidates:
        raise FileNotFoundError(f"checkpoint: no checkpoint found at {str(path)!r}")
    errors = []
    for folder in candidates:
        try:
            loaded = _load_one(folder, map_location)
        except ValueError as e:
            errors.append(str(e))
            if folder is not candidates[-1]:
                warnings.warn(f"checkpoint: skipping {folder}: {e}; falling back to the previous checkpoint", stacklevel=2)
            continue
        return loaded
    raise ValueError(f"checkpoint: no valid checkpoint at {str(path)!r}: {'; '.join(errors)}")


def check_compatible(model: torch.nn.Module, model_state: dict[str, torch.Tensor], where: str) -> None:
    """Raise one-line ``ValueError`` unless ``model_state`` has exactly the model's keys and shapes."""
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in model_state.items()}
    missing = sorted(set(own) - set(theirs))
    extra = sorted(set(theirs) - set(own))
    shapes = [k for k in own if k in theirs and own[k] != theirs[k]]
    if missing or extra or shapes:
        detail = (
            f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}" if extra
            else f"{shapes[0]} has shape {theirs[shapes[0]]}, the model needs {own[shapes[0]]}"
        )
        raise ValueError(f"checkpoint {where} is from another architecture ({detail})")
