"""The shipped YAML configs, installed with the package and loadable by name:
``sattn train lm --config lm-default`` reads ``lm-default.yaml`` here (a path works too)."""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

__all__ = ["find_config", "shipped_configs"]


def shipped_configs() -> list[str]:
    """The names of the shipped configs (file names without ``.yaml``)."""
    return sorted(f.name[:-5] for f in resources.files(__name__).iterdir() if f.name.endswith(".yaml"))


def find_config(config: str | Path) -> Path | Traversable:
    """The YAML file ``config`` names: a file path, else the shipped config of that name;
    ``FileNotFoundError`` (one line naming both) if it is neither."""
    path = Path(config)
    if path.is_file():
        return path
    shipped = resources.files(__name__) / f"{config}.yaml"
    if "/" not in str(config) and shipped.is_file():
        return shipped
    raise FileNotFoundError(f"config: expected a YAML file or a shipped config ({', '.join(shipped_configs())}), "
                            f"got {str(config)!r}")
