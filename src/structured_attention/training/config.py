"""Typed experiment configuration: dataclass sections, YAML loading and ``section.key=value`` overrides.

An experiment's config is a frozen dataclass whose fields are *sections*, each itself a frozen
dataclass (the language model's is ``model / data / optim / run``). A config file is YAML (read
with ``yaml.safe_load``) holding some of those sections as mappings:

```yaml
model: {d_model: 128, n_layers: 4, n_heads: 4, max_seq_len: 256, attention: mha}
optim: {lr: 3.0e-3, warmup_steps: 50, schedule: cosine}
run:   {steps: 600, batch_size: 16, out_dir: runs/lm-default}
```

Missing keys keep their defaults. Command-line overrides are ``section.field=value`` strings
(``model.attention=mlr:16|16|16|16 optim.lr=3e-3``); the value is parsed by the field's declared
type (``int``, ``float``, ``bool``, ``str``, optionally ``| None`` where ``none``/``null`` gives
``None``). An unknown section or key raises ``ValueError`` naming it and listing the valid ones.
:class:`OptimConfig` and :class:`RunConfig` are the sections every experiment shares.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .._checks import parse_typed, require
from ..models.gpt import COMPILE_MODES
from .memory import parse_memory

__all__ = [
    "OptimConfig",
    "RunConfig",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
]

C = TypeVar("C")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 50
    schedule: str = "cosine"  # "cosine" (to min_lr_ratio * lr at the last step) or "constant"
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    mup: bool = False  # muP learning-rate scaling, see training.optim.mup_lr_multipliers
    mup_base_width: int = 128

    def __post_init__(self) -> None:
        require(self.lr > 0, "optim.lr", "a positive number", self.lr)
        require(self.weight_decay >= 0, "optim.weight_decay", "a non-negative number", self.weight_decay)
        require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1/beta2", "numbers in [0, 1)", (self.beta1, self.beta2))
        require(self.eps > 0, "optim.eps", "a positive number (AdamW's denominator term)", self.eps)
        require(self.warmup_steps >= 0, "optim.warmup_steps", "a non-negative integer", self.warmup_steps)
        require(self.schedule in ("cosine", "constant"), "optim.schedule", "'cosine' or 'constant'", self.schedule)
        require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "a number in [0, 1]", self.min_lr_ratio)
        require(self.grad_clip >= 0, "optim.grad_clip", "a non-negative number (0 disables)", self.grad_clip)
        require(self.mup_base_width > 0, "optim.mup_base_width", "a positive integer", self.mup_base_width)

    def check_model_mup(self, model_base_width: int | None) -> None:
        """One-line ``ValueError`` unless a model with muP's initialisation (``model.mup_base_width``)
        trains with muP's learning rates from the same base width: half of muP is not muP."""
        if model_base_width is not None:
            require(self.mup and self.mup_base_width == model_base_width, "optim.mup",
                    f"true with optim.mup_base_width={model_base_width} (that of model.mup_base_width)",
                    f"{self.mup} with optim.mup_base_width={self.mup_base_width}")


@dataclass(frozen=True)
class RunConfig:
    """How the shared loop (``training.loop.fit``) runs; every experiment has this section."""

    steps: int = 600
    batch_size: int = 16  # examples per micro-batch per process
    grad_accum: int = 1  # micro-batches per optimizer step; global batch = batch_size * grad_accum * world_size
    eval_every: int = 200  # 0: evaluate only at the end
    eval_batches: int = 20  # validation batches per evaluation, of the global batch (batch_size x processes)
    log_every: int = 10
    checkpoint_every: int = 0  # 0: only at the end
    patience: int = 0  # stop after this many evaluations without a better val_loss; 0: never
    keep_best: bool = False  # keep the model of the best evaluation in <out_dir>/best/
    seed: int = 0
    out_dir: str = "runs/run"
    compile: bool = False
    # keep only each block's input for the backward pass and compute the block again there: the
    # activations of one block at a time, for about one more forward pass (Transformer backbones)
    activation_checkpointing: bool = False
    # torch.compile's mode with compile=true: "default"; "reduce-overhead" records each step's
    # kernels in CUDA graphs and replays them (no host work between kernels; CUDA only, the CPU
    # compiles as "default"); "max-autotune", "max-autotune-no-cudagraphs" also tune inductor's kernels
    compile_mode: str = "default"
    autocast: str = "auto"  # "auto": bfloat16 on CUDA, none on CPU; "bf16"; "none"
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "structured-attention"
    fsdp: bool = False  # shard the model with FSDP (fully_shard) instead of DDP when distributed
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda"
    # a run whose model and micro-batch need more than this (at least) stops before allocating:
    # "auto" (the device's memory) or a size such as "16GB"
    max_memory: str = "auto"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "eval_batches", "log_every"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, f"run.{name}", "a positive integer", value)
        for name in ("eval_every", "checkpoint_every", "seed", "patience"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 0, f"run.{name}", "a non-negative integer", value)
        require(self.autocast in ("auto", "bf16", "none"), "run.autocast", "'auto', 'bf16' or 'none'", self.autocast)
        require(self.compile_mode in COMPILE_MODES, "run.compile_mode", f"one of {list(COMPILE_MODES)}",
                self.compile_mode)
        require(self.compile or self.compile_mode == "default", "run.compile_mode",
                "'default' unless run.compile=true (a mode is torch.compile's; set run.compile=true to use it)",
                self.compile_mode)
        # an empty value (an unset shell variable) would train in the current folder and, as a fresh
        # run, remove the checkpoints found there
        require(isinstance(self.out_dir, str) and self.out_dir.strip() != "", "run.out_dir",
                "a folder path, not empty", self.out_dir)
        require(self.device in ("auto", "cpu", "cuda"), "run.device", "'auto', 'cpu' or 'cuda'", self.device)
        parse_memory(self.max_memory)


def _sections(cls: type) -> dict[str, type]:
    """The section dataclasses of a config class, by field name."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _nested(cls: type) -> dict[str, type]:
    """The fields of a section dataclass that are dataclasses themselves (a forecaster's backbone)."""
    hints = _field_types(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


def _section_updates(section: str, cls: type, values: Any) -> dict[str, Any]:
    """``values`` parsed by ``cls``'s field types. A field that is a dataclass takes a mapping
    (``backbone: {d_model: 64}``) or dotted keys (``backbone.d_model``), and its keys also flat
    (``d_model``), unless ``cls`` lists them in ``derived_fields`` (set from other fields)."""
    require(isinstance(values, dict), section, "a mapping of keys to values", type(values).__name__)
    hints = _field_types(cls)
    nested = _nested(cls)
    derived = getattr(cls, "derived_fields", ())
    flat = {k: name for name, sub in nested.items() for k in _field_types(sub) if k not in hints and k not in derived}
    out: dict[str, Any] = {}
    for key, raw in values.items():
        head, _, rest = key.partition(".") if isinstance(key, str) else (key, "", "")
        if head in nested and (rest or isinstance(raw, dict)):
            inner = {rest: raw} if rest else raw
            out.setdefault(head, {}).update(_section_updates(f"{section}.{head}", nested[head], inner))
        elif key in flat:
            out.setdefault(flat[key], {}).update(_section_updates(section, nested[flat[key]], {key: raw}))
        elif key in hints and key not in nested:
            out[key] = parse_typed(raw, hints[key], f"{section}.{key}")
        else:
            shown = key if isinstance(key, str) and key.isprintable() else repr(key)  # one line, whatever the key
            valid = sorted({*hints, *flat} - set(nested)) + [f"{n}.<key>" for n in nested]
            raise ValueError(f"unknown config key {section}.{shown}; valid keys in '{section}': {', '.join(valid)}")
    return out


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    """``into`` updated with ``new``, a nested field's updates merged rather than replaced."""
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            into[key].update(value)
        else:
            into[key] = value


def _build(section: str, cls: type, updates: dict[str, Any]) -> Any:
    """``cls`` from parsed updates; a nested dataclass field's updates apply to its default (its
    one-line errors name the section: ``model.norm: ...``)."""
    for name in _nested(cls):
        if name in updates:
            default = next(f for f in dataclasses.fields(cls) if f.name == name)
            base = default.default_factory() if default.default_factory is not dataclasses.MISSING else default.default
            try:
                updates = {**updates, name: dataclasses.replace(base, **updates[name])}
            except ValueError as e:
                raise ValueError(f"{section}.{e}") from None
    return cls(**updates)


def config_from_dict(cls: type[C], d: dict[str, Any] | None, overrides: list[str] | tuple[str, ...] = ()) -> C:
    """A ``cls`` config from a nested dict (as YAML gives) plus ``section.key=value`` overrides."""
    sections = _sections(cls)
    d = d or {}
    require(isinstance(d, dict), "config", f"a mapping with sections {'/'.join(sections)}", type(d).__name__)
    updates: dict[str, dict[str, Any]] = {s: {} for s in sections}
    for section, values in d.items():
        if section not in sections:
            raise ValueError(f"unknown config section {section!r}; valid sections: {', '.join(sections)}")
        # An empty section (``model:`` alone) is no change; 0, [], "" or false is a mistake.
        _merge(updates[section], _section_updates(section, sections[section], {} if values is None else values))
    for item in overrides:
        require(isinstance(item, str) and "=" in item, "override", "'section.key=value'", item)
        key, raw = item.split("=", 1)
        key = key.strip()
        if "." not in key or key.split(".", 1)[0] not in sections:
            valid = ", ".join(f"{s}.<key>" for s in sections)
            raise ValueError(f"unknown config key {key!r}; expected one of {valid}")
        section, name = key.split(".", 1)
        _merge(updates[section], _section_updates(section, sections[section], {name: raw}))
    parts = {s: _build(s, sections[s], updates[s]) for s in sections}
    return cls(**parts)


def load_config(cls: type[C], path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> C:
    """Read a YAML config (a file, or a shipped config's name such as ``lm-default``; ``None``: all
    defaults) into ``cls`` and apply ``section.key=value`` overrides."""
    d: Any = {}
    if path is not None:
        from ..configs import find_config

        p = find_config(path)
        import yaml

        try:
            d = yaml.safe_load(p.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"config: {str(p)!r} is not UTF-8 text (byte {e.start} is 0x{e.object[e.start]:02x})") from None
        except yaml.YAMLError as e:
            raise ValueError(f"config: {str(p)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
        _check_size(d, str(p))
    return config_from_dict(cls, d, overrides)


# A config is a few dozen values; aliases can make a short file stand for billions (each alias is
# a reference, so loading is cheap, but anything that walks the values is not).
_MAX_CONFIG_VALUES = 10_000


def _check_size(d: Any, path: str) -> None:
    """Count the values ``d`` stands for, aliases expanded, stopping at the limit."""
    count, stack = 0, [d]
    while stack:
        node = stack.pop()
        count += 1
        if count > _MAX_CONFIG_VALUES:
            raise ValueError(f"config: {path!r} expands to more than {_MAX_CONFIG_VALUES:,} values "
                             f"(YAML aliases repeating a large value?)")
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def apply_overrides(config: C, overrides: list[str] | tuple[str, ...]) -> C:
    """``config`` with ``section.key=value`` overrides applied."""
    return config_from_dict(type(config), config_to_dict(config), overrides)


def load_run_config(cls: type[C], run_dir: str | Path, which: str = "resolved") -> C:
    """The config a training run in ``run_dir`` recorded in its ``config.json``: ``"resolved"``
    (what it ran with) or ``"requested"`` (what the user gave). A run older than the two records
    holds only the resolved one."""
    path = Path(run_dir) / "config.json"
    require(which in ("resolved", "requested"), "which", "'resolved' or 'requested'", which)
    if not path.is_file():
        raise FileNotFoundError(f"run_dir: no config.json in {str(run_dir)!r}")
    recorded = json.loads(path.read_text(encoding="utf-8"))
    if "resolved" not in recorded:  # one record: the resolved config
        require(which == "resolved", "which", f"'resolved' ({path} records nothing else)", which)
        return config_from_dict(cls, recorded)
    return config_from_dict(cls, recorded[which])


def config_keys(cls: type) -> list[tuple[str, str, Any]]:
    """Every ``section.key`` of config class ``cls`` with its type (as written in the dataclass)
    and default value, in declaration order (what ``sattn train <name> --help`` lists)."""
    defaults = cls()
    keys = []
    for section, section_cls in _sections(cls).items():
        values = getattr(defaults, section)
        nested, derived = _nested(section_cls), getattr(section_cls, "derived_fields", ())
        for f in dataclasses.fields(section_cls):
            if f.name not in nested:
                keys.append((f"{section}.{f.name}", str(f.type), getattr(values, f.name)))
                continue
            inner = getattr(values, f.name)  # listed flat, as they are set
            for g in dataclasses.fields(inner):
                if g.name not in derived:
                    keys.append((f"{section}.{g.name}", str(g.type), getattr(inner, g.name)))
    return keys


def config_to_dict(config: Any) -> dict[str, Any]:
    """A JSON/YAML-able nested dict that :func:`config_from_dict` turns back into ``config``."""
    return {s: dataclasses.asdict(getattr(config, s)) for s in _sections(type(config))}
