"""What the package tells ``torch.compile`` about its functions, without importing ``torch._dynamo``,
and its memo for functions that ``torch.compile`` traces.

``torch.compiler.assume_constant_result`` imports ``torch._dynamo`` (about 3 s of a small
machine's time, doubling ``import structured_attention`` and every ``sattn`` command) only to set
one attribute on the function, which ``torch.compile`` reads when it traces a call. A process that
never compiles should not pay for it, so the attribute is set here directly;
``tests/test_compile.py`` checks that it is what PyTorch's decorator sets.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., object])


def assume_constant_result(fn: F) -> F:
    """``torch.compiler.assume_constant_result(fn)``: under ``torch.compile`` a call of ``fn`` is
    made once, when the graph is traced, and its result is a constant of the graph."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def memoized(maxsize: int | None) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)`` for a function that ``torch.compile`` may trace: outside a
    compiled region a call returns the cached result; inside one the function itself is traced, as
    Dynamo traces an ``lru_cache``'s function anyway, ignoring its cache, but with a warning of
    possible silent incorrectness that every user compiling a model would read about this package.
    The cache's ``cache_info`` and ``cache_clear`` are the result's."""

    def decorate(fn: F) -> F:
        cached = functools.lru_cache(maxsize)(fn)

        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            return fn(*args) if torch.compiler.is_compiling() else cached(*args)

        call.cache_info = cached.cache_info  # type: ignore[attr-defined]
        call.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        return call  # type: ignore[return-value]

    return decorate
