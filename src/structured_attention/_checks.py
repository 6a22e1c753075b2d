"""Input validation shared by the whole package.

Every check raises ``ValueError`` with one line that names the parameter, what was expected and
what was given, so a user (or the CLI, which prints the line) knows what to fix.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Sequence
from typing import Any, NoReturn

import torch


def require(condition: bool, name: str, expected: str, got: object) -> None:
    """Raise ``ValueError("<name>: expected <expected>, got <got>")`` unless ``condition``; a long
    ``got`` is cut to 200 characters, so the message stays one readable line."""
    if not condition:
        fail(name, expected, got)


def fail(name: str, expected: str, got: object) -> NoReturn:
    """The error of :func:`require`, raised unconditionally: ``if not ok: fail(...)`` builds the
    message only when it is needed, for checks on a call's hot path (an attention call is checked
    on every layer of every step, before its kernels can start)."""
    raise ValueError(f"{name}: expected {expected}, got {quote(got)}")


def quote(value: object, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters with ``...``."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_positive_int(value: object, name: str) -> int:
    require(isinstance(value, int) and not isinstance(value, bool) and value > 0, name, "a positive integer", value)
    return value  # type: ignore[return-value]


def check_int_list(values: object, name: str, min_len: int = 1) -> tuple[int, ...]:
    """A non-empty sequence of positive integers, returned as a tuple."""
    ok = (
        (isinstance(values, (tuple, list)) or (isinstance(values, Sequence) and not isinstance(values, str)))
        and len(values) >= min_len
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)
    )
    require(ok, name, f"a sequence of at least {min_len} positive integers", values)
    return tuple(values)  # type: ignore[arg-type]


def check_divides(divisor: int, total: int, divisor_name: str, total_name: str) -> None:
    require(total % divisor == 0, divisor_name, f"a divisor of {total_name}={total}", divisor)


def check_tensor(x: object, name: str, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        fail(name, "a torch.Tensor", type(x).__name__)
    if ndim is not None and x.dim() != ndim:
        fail(name, f"a {ndim}-dimensional tensor", tuple(x.shape))
    return x


def check_same_dtype_device(tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """All tensors share the first one's dtype and device."""
    first_name, first = tensors[0]
    dtype, device = first.dtype, first.device
    for name, t in tensors[1:]:
        if t.dtype != dtype:
            fail(f"{name}.dtype", f"{dtype} (the dtype of {first_name})", t.dtype)
        if t.device != device:
            fail(f"{name}.device", f"{device} (the device of {first_name})", t.device)


def parse_typed(raw: Any, tp: Any, key: str) -> Any:
    """Coerce ``raw`` (a string from the command line or a spec, or a YAML scalar) to the type ``tp``
    (``bool``, ``int``, ``float``, ``str`` or one of them ``| None``); booleans are true/false/1/0
    only. Raises a one-line ``ValueError`` naming ``key``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("none", "null", "~", "")):
            return None
        require(len(args) == 1, key, "a supported type", tp)
        return parse_typed(raw, args[0], key)
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, int) and raw in (0, 1):
            return bool(raw)
        if isinstance(raw, str) and raw.strip().lower() in ("true", "1"):
            return True
        if isinstance(raw, str) and raw.strip().lower() in ("false", "0"):
            return False
        raise ValueError(f"{key}: expected a boolean (true/false/1/0), got {quote(raw)}")
    if tp is int:
        if isinstance(raw, bool):
            raise ValueError(f"{key}: expected an integer, got {quote(raw)}")
        if isinstance(raw, int):
            value = raw
        elif isinstance(raw, float) and raw.is_integer():
            value = int(raw)
        else:
            text = str(raw).strip().replace("_", "")
            try:
                value = int(text)
            except ValueError:
                # "10.0" or "1e3" on the command line, as YAML's 10.0 is taken: a whole number
                try:
                    number = float(text)
                except ValueError:
                    number = math.nan
                if not number.is_integer():  # NaN and inf are not
                    raise ValueError(f"{key}: expected an integer, got {quote(raw)}") from None
                value = int(number)
        # every integer setting ends up in a tensor, a seed or a size: beyond 64 bits none fits
        require(-(2**63) <= value < 2**63, key, "an integer in the 64-bit range", value)
        return value
    if tp is float:
        if isinstance(raw, bool):
            raise ValueError(f"{key}: expected a number, got {quote(raw)}")
        try:
            value = float(raw)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"{key}: expected a number, got {quote(raw)}") from None
        if not math.isfinite(value):  # no setting means inf or nan; both would only corrupt a run
            raise ValueError(f"{key}: expected a finite number, got {quote(raw)}")
        return value
    if tp is str:
        require(isinstance(raw, (str, int, float)) and not isinstance(raw, bool), key, "a string", raw)
        return str(raw)
    raise ValueError(f"{key}: unsupported field type {tp!r}")  # pragma: no cover
