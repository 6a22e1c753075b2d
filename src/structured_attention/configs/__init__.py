"""The shipped YAML configs, installed with the package and loadable by name:
``sattn train lm --config lm-default`` reads ``lm-default.yaml`` here (a path works too);
``paper/`` holds the paper's settings in this project's options (``--config paper/lm-mlr``)."""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

__all__ = ["find_config", "shipped_configs"]

PAPER = "paper"  # the folder of the paper's settings


def shipped_configs() -> list[str]:
    """The names of the shipped configs (file names without ``.yaml``; ``paper/...`` for the
    paper's)."""
    root = resources.files(__name__)
    names = [f.name[:-5] for f in root.iterdir() if f.name.endswith(".yaml")]
    names += [f"{PAPER}/{f.name[:-5]}" for f in root.joinpath(PAPER).iterdir() if f.name.endswith(".yaml")]
    return sorted(names)


def find_config(config: str | Path) -> Path | Traversable:
    """The YAML file ``config`` names: a file path, else the shipped config of that name;
    ``FileNotFoundError`` (one line naming both) if it is neither."""
    path = Path(config)
    if path.is_file():
        return path
    if str(config) in shipped_configs():
        return resources.files(__name__).joinpath(*f"{config}.yaml".split("/"))
    raise FileNotFoundError(f"config: expected a YAML file or a shipped config ({', '.join(shipped_configs())}), "
                            f"got {str(config)!r}")
