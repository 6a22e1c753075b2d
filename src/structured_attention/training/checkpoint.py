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
  optimizer's param groups (hyper-parameters and parameter names), the SHA-256 of both tensor
  files, and last ``state_sha256``, the SHA-256 of the rest of the file as written (so an edit to
  the step, the losses or the RNG state is caught like a flipped bit in a tensor file).

Each file is written to a temporary file in the same folder, flushed, fsynced and moved into place
with ``os.replace``; the folder itself is built under a temporary name and renamed when complete.
The two newest checkpoints that verify are kept (``latest`` and ``previous``); one that fails
verification is never counted, so a corrupt newest checkpoint cannot push out the last good one.
:func:`load_checkpoint` verifies the checksums and every field of ``state.json`` (its type and
range) and, when the newest checkpoint is missing a file, unreadable, corrupt or malformed, warns
in one line and falls back to the previous one. Checkpoints of the format before ``state_sha256``
(``...-v1``) still load, with their fields validated.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .._checks import fail, quote
from .._files import atomic_write, file_sha256, with_umask

__all__ = [
    "CHECKPOINT_FORMAT",
    "LoadedCheckpoint",
    "checkpoint_verifies",
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

CHECKPOINT_FORMAT = "structured-attention-checkpoint-v2"
_FORMATS = ("structured-attention-checkpoint-v1", CHECKPOINT_FORMAT)  # readable; v1 has no state_sha256
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
_SEP = "/"
_SAVE_PREFIX = ".tmp-step-"  # a save's folder until it is complete: .tmp-step-<8 digits>-<random>


# -- small helpers ---------------------------------------------------------------------------------



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


def _state_text(state: dict[str, Any]) -> str:
    """``state.json``'s text without its own checksum: written as is, and re-made on load from the
    parsed file (Python's JSON round-trips its own floats and key order exactly)."""
    return json.dumps({k: v for k, v in state.items() if k != "state_sha256"}, indent=1, allow_nan=True)


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

    for stale in _killed_saves(root):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step-{step:08d}"
    if final.exists() and not _ours(final):
        fail("run.out_dir", f"no folder {final} other than this package's checkpoints (it would be replaced by "
                            f"step {step}'s checkpoint)", "a folder this package did not write")
    tmp_dir = Path(tempfile.mkdtemp(dir=root, prefix=f"{_SAVE_PREFIX}{step:08d}-"))
    with_umask(tmp_dir, 0o777)
    try:
        atomic_write(tmp_dir / MODEL_FILE, lambda p: save_file(model_tensors, p, metadata={"format": CHECKPOINT_FORMAT}))
        atomic_write(tmp_dir / OPTIM_FILE, lambda p: save_file(optim_tensors, p, metadata={"format": CHECKPOINT_FORMAT}))
        payload = {
            **state,
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "aliases": aliases,
            "optimizer": {"param_groups": groups},
            "sha256": {MODEL_FILE: file_sha256(tmp_dir / MODEL_FILE), OPTIM_FILE: file_sha256(tmp_dir / OPTIM_FILE)},
        }
        payload["state_sha256"] = hashlib.sha256(_state_text(payload).encode("utf-8")).hexdigest()
        text = json.dumps(payload, indent=1, allow_nan=True)

        def write_json(p: str) -> None:
            with open(p, "w", encoding="utf-8") as f:
                f.write(text)

        atomic_write(tmp_dir / STATE_FILE, write_json)
        _fsync_dir(tmp_dir)
        old = None
        if final.exists():  # re-saving the same step: the old one moves aside, whole, until the new is in
            old = Path(tempfile.mkdtemp(dir=root, prefix=f"{_SAVE_PREFIX}{step:08d}-old-"))
            os.replace(final, old / final.name)
        os.replace(tmp_dir, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    # Keep the new checkpoint and the newest ones before it that verify, ``keep`` in all; the rest
    # (older, or corrupt) go, but only folders this package wrote.
    kept = 0
    for old in find_checkpoints(root, complete_only=False):
        if old == final or (kept < keep and checkpoint_verifies(old)):
            kept += 1
        elif _ours(old):
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


def _ours(folder: Path) -> bool:
    """A ``step-*`` folder this package wrote: its ``state.json`` names one of our formats, or it
    holds nothing but our three file names (a checkpoint whose deletion was killed half-way)."""
    try:
        return json.loads((folder / STATE_FILE).read_text(encoding="utf-8")).get("format") in _FORMATS
    except (OSError, ValueError, AttributeError):
        pass
    try:
        return {p.name for p in folder.iterdir()} <= {MODEL_FILE, OPTIM_FILE, STATE_FILE}
    except OSError:
        return False


def remove_checkpoints(root: str | Path) -> int:
    """Delete the checkpoints this package wrote in ``root`` (see :func:`_ours`) and the temporary
    folders of killed saves. Anything else there (other files, folders, ``root`` itself) is left
    alone. Returns how many checkpoints were deleted."""
    root = Path(root)
    if not root.is_dir():
        return 0
    removed = 0
    for folder in _step_dirs(root):
        if _ours(folder):
            shutil.rmtree(folder)
            removed += 1
    for stale in _killed_saves(root):
        shutil.rmtree(stale, ignore_errors=True)
    return removed


def _killed_saves(root: Path) -> list[Path]:
    """The folders of saves killed before they completed (this package's names alone: a user's
    ``.tmp-*`` files and folders there stay)."""
    return [p for p in root.glob(f"{_SAVE_PREFIX}*") if p.is_dir() and re.fullmatch(
        rf"{re.escape(_SAVE_PREFIX)}\d{{8}}-.+", p.name)]


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


def _require_field(ok: bool, folder: Path, field: str, expected: str, got: Any) -> None:
    if not ok:
        raise ValueError(f"{folder / STATE_FILE}: field {field!r}: expected {expected}, got {quote(got, 60)}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_rng(folder: Path, rng: Any) -> None:
    """The structure :func:`get_rng_state` writes, so :func:`set_rng_state` cannot fail half-way."""
    def b64_ok(x: Any) -> bool:
        try:
            return isinstance(x, str) and len(base64.b64decode(x, validate=True)) > 0
        except ValueError:
            return False

    _require_field(isinstance(rng, dict), folder, "rng", "an object", rng)
    _require_field(b64_ok(rng.get("torch")), folder, "rng.torch", "a base64 generator state", rng.get("torch"))
    cuda = rng.get("cuda", [])
    _require_field(isinstance(cuda, list) and all(map(b64_ok, cuda)), folder, "rng.cuda", "a list of base64 states", cuda)
    n = rng.get("numpy")
    _require_field(isinstance(n, dict), folder, "rng.numpy", "an object", n)
    key = n.get("key")
    _require_field(isinstance(key, list) and len(key) == 624 and all(_is_int(v) and 0 <= v < 2**32 for v in key),
                   folder, "rng.numpy.key", "624 integers in [0, 2^32)", key)
    _require_field(n.get("kind") == "MT19937", folder, "rng.numpy.kind", "'MT19937'", n.get("kind"))
    _require_field(_is_int(n.get("pos")) and 0 <= n["pos"] <= 624, folder, "rng.numpy.pos", "0..624", n.get("pos"))
    _require_field(n.get("has_gauss") in (0, 1), folder, "rng.numpy.has_gauss", "0 or 1", n.get("has_gauss"))
    _require_field(_is_number(n.get("cached_gaussian")), folder, "rng.numpy.cached_gaussian", "a number",
                   n.get("cached_gaussian"))
    p = rng.get("python")
    _require_field(isinstance(p, dict), folder, "rng.python", "an object", p)
    internal = p.get("internal")
    _require_field(_is_int(p.get("version")), folder, "rng.python.version", "an integer", p.get("version"))
    _require_field(isinstance(internal, list) and len(internal) == 625 and all(_is_int(v) and 0 <= v < 2**32
                                                                             for v in internal[:624])
                   and _is_int(internal[624]) and 0 <= internal[624] <= 624,
                   folder, "rng.python.internal", "624 integers in [0, 2^32) and a position", internal)
    _require_field(p.get("gauss_next") is None or _is_number(p.get("gauss_next")), folder, "rng.python.gauss_next",
                   "null or a number", p.get("gauss_next"))


def _check_state(folder: Path, state: dict[str, Any]) -> None:
    """Every field of ``state.json`` that this package reads, by type and range: one line naming
    the field otherwise. Optional fields (written by the training loop) are checked when present."""
    if state["format"] == CHECKPOINT_FORMAT:
        digest = hashlib.sha256(_state_text(state).encode("utf-8")).hexdigest()
        _require_field(state.get("state_sha256") == digest, folder, "state_sha256",
                       "the SHA-256 of the rest of state.json (the file was edited or damaged)", state.get("state_sha256"))
    step = state.get("step")
    _require_field(_is_int(step) and step >= 0, folder, "step", "a non-negative integer", step)
    if folder.name.startswith("step-") and folder.name[5:].isdigit():
        _require_field(step == int(folder.name[5:]), folder, "step", f"{int(folder.name[5:])} (the folder's step)", step)
    sha = state.get("sha256")
    _require_field(isinstance(sha, dict) and all(isinstance(sha.get(n), str) and len(sha[n]) == 64
                                                 for n in (MODEL_FILE, OPTIM_FILE)),
                   folder, "sha256", "the SHA-256 of both tensor files", sha)
    aliases = state.get("aliases", {})
    _require_field(isinstance(aliases, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()),
                   folder, "aliases", "an object of parameter names", aliases)
    groups = (state.get("optimizer") or {}).get("param_groups") if isinstance(state.get("optimizer"), dict) else None
    _require_field(isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                                    for g in groups),
                   folder, "optimizer.param_groups", "a list of parameter groups", groups)
    if "config" in state:
        _require_field(isinstance(state["config"], dict), folder, "config", "an object", state["config"])
    if "rng" in state:
        _check_rng(folder, state["rng"])
    if "data" in state:
        data = state["data"]
        _require_field(isinstance(data, dict) and _is_int(data.get("seed")) and data.get("next_step") == step,
                       folder, "data", f"the seed and next_step={step}", data)
    if "losses" in state:
        losses = state["losses"]
        _require_field(isinstance(losses, list) and all(map(_is_number, losses)), folder, "losses",
                       "a list of numbers", losses)
    if "metrics" in state:
        metrics = state["metrics"]
        _require_field(isinstance(metrics, list) and all(isinstance(r, dict) and _is_int(r.get("step"))
                                                         and 0 < r["step"] <= step for r in metrics),
                       folder, "metrics", f"a list of records of steps 1..{step}", metrics)
    if "experiment" in state:
        _require_field(isinstance(state["experiment"], str), folder, "experiment", "an experiment's name",
                       state["experiment"])
    if "wandb_id" in state:
        _require_field(isinstance(state["wandb_id"], str) and state["wandb_id"].isalnum(), folder, "wandb_id",
                       "a W&B run id (letters and digits)", state["wandb_id"])
    if "tracker" in state:
        tracker = state["tracker"]
        _require_field(isinstance(tracker, dict) and _is_number(tracker.get("best_val_loss"))
                       and _is_int(tracker.get("best_step")) and 0 <= tracker["best_step"] <= step
                       and _is_int(tracker.get("bad_evals")) and tracker["bad_evals"] >= 0
                       and isinstance(tracker.get("best"), dict),
                       folder, "tracker", "best_val_loss, best_step, bad_evals and best", tracker)


# The files' (size, mtime) when they last verified: keep-N checks the kept checkpoints at every
# save without hashing unchanged files again.
_VERIFIED: dict[Path, tuple[tuple[int, int], ...]] = {}


def _verify(folder: Path) -> dict[str, Any]:
    """``folder``'s state after checking it field by field and both tensor files against their
    checksums; ``ValueError`` naming what is wrong otherwise."""
    try:
        state = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder / STATE_FILE} is unreadable: {e}") from None
    if not isinstance(state, dict) or state.get("format") not in _FORMATS:
        raise ValueError(f"{folder} is not a {CHECKPOINT_FORMAT} checkpoint")
    _check_state(folder, state)
    try:
        stamp = tuple((st.st_size, st.st_mtime_ns) for st in (os.stat(folder / n) for n in (STATE_FILE, MODEL_FILE, OPTIM_FILE)))
    except OSError as e:
        raise ValueError(f"{folder}: {e.filename} is missing") from None
    if _VERIFIED.get(folder) != stamp:
        for name in (MODEL_FILE, OPTIM_FILE):
            if file_sha256(folder / name) != state["sha256"][name]:
                raise ValueError(f"{folder / name} does not match its stored SHA-256 checksum (corrupt or truncated)")
        _VERIFIED[folder] = stamp
    return state


def checkpoint_verifies(folder: str | Path) -> bool:
    """Whether one checkpoint folder verifies (its ``state.json`` field by field, both tensor files
    against their checksums), without loading its tensors."""
    try:
        _verify(Path(folder))
    except ValueError:
        return False
    return True


def _load_one(folder: Path, map_location: str = "cpu") -> LoadedCheckpoint:
    state = _verify(folder)
    try:
        model_state = load_file(folder / MODEL_FILE, device=map_location)
        optim_tensors = load_file(folder / OPTIM_FILE, device=map_location)
    except Exception as e:  # safetensors raises its own error types for malformed files
        raise ValueError(f"{folder}: cannot read tensors: {e}") from None
    missing = [name for name in state["aliases"].values() if name not in model_state]
    if missing:
        raise ValueError(f"{folder / STATE_FILE}: field 'aliases': names {missing[0]!r}, which the model file lacks")
    for alias, name in state["aliases"].items():
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
    """Raise one-line ``ValueError`` unless ``model_state`` has exactly the model's keys, shapes and
    dtypes (loading would otherwise cast a tensor silently)."""
    own = model.state_dict()
    missing = sorted(set(own) - set(model_state))
    extra = sorted(set(model_state) - set(own))
    shapes = [k for k in own if k in model_state and own[k].shape != model_state[k].shape]
    if missing or extra or shapes:
        detail = (
            f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}" if extra
            else f"{shapes[0]} has shape {tuple(model_state[shapes[0]].shape)}, the model needs {tuple(own[shapes[0]].shape)}"
        )
        raise ValueError(f"checkpoint {where} is from another architecture ({detail})")
    dtypes = [k for k in own if own[k].dtype != model_state[k].dtype]
    if dtypes:
        k = dtypes[0]
        raise ValueError(f"checkpoint {where}: {k} is {model_state[k].dtype}, the model needs {own[k].dtype} "
                         f"({len(dtypes)} tensor(s) differ)")
