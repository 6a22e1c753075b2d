"""Command-line helpers every ``sattn`` command shares, whatever it runs: warnings as one line,
matplotlib when installed, device and number-list arguments, markdown cells."""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["kind_list", "markdown_cell", "number_list", "one_line_warnings", "parse_device", "pyplot"]


@contextlib.contextmanager
def one_line_warnings(command: str) -> Iterator[None]:
    """Show warnings as one ``sattn <command>: warning: ...`` line each."""
    old = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        print(f"sattn {command}: warning: {message}", file=sys.stderr, flush=True)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = old


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the file-only Agg backend, or ``None`` after saying, in one line,
    that matplotlib is missing (the tables are still written; only the PNGs need it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'structured-attention[bench]'): no PNG written")
        return None
    return plt


def parse_device(text: str) -> Any:
    """``--device``: the CPU or an available CUDA device, else one line naming the option."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cuda" and not (
            torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count())):
        raise ValueError(f"--device: expected 'cpu' or an available CUDA device, got {text!r}")
    return device


def number_list(text: str, flag: str, cast: Callable[[str], Any] = int, *, minimum: float = 1) -> list[Any]:
    """``"64,128"`` -> ``[64, 128]``; a value that does not parse, is below ``minimum`` or is not
    finite, a value given twice (``1e-3,0.001``: two runs of one name), or an empty list, is a
    ``ValueError`` naming ``flag``."""
    what = "integers" if cast is int else "numbers"
    try:
        values = [cast(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated {what} >= {minimum:g}, got {text!r}") from None
    if not values or not all(minimum <= v < float("inf") for v in values):
        raise ValueError(f"{flag}: expected comma-separated {what} >= {minimum:g}, got {text!r}")
    if len(set(values)) < len(values):
        raise ValueError(f"{flag}: expected distinct values, got {text!r}")
    return values


def kind_list(text: str, command: str) -> list[str]:
    """The attention specs of a sweep's or the coordinate check's ``--kinds``, separated by ``;``
    (a spec may hold commas: a per-layer pattern such as ``mha,swa:128``). Each spec with a comma
    gets one line on stderr saying it is one kind, since ``sattn bench`` and ``describe`` separate
    their kinds with commas."""
    kinds = [k.strip() for k in text.split(";") if k.strip()]
    if not kinds:
        raise ValueError(f"--kinds: expected attention specs separated by ';', got {text!r}")
    for kind in kinds:
        if "," in kind:
            print(f"sattn {command}: warning: --kinds: {kind!r} is one kind, a per-layer pattern (the layers take "
                  f"{', '.join(kind.split(','))} in turn); separate kinds with ';'", file=sys.stderr, flush=True)
    return kinds


def markdown_cell(text: str) -> str:
    """``text`` escaped for a markdown table cell (attention specs contain ``|``)."""
    return text.replace("|", "\\|")
