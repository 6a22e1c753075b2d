"""What the package tells ``torch.compile`` about its functions, without importing ``torch._dynamo``.

``torch.compiler.assume_constant_result`` imports ``torch._dynamo`` (about 3 s of a small
machine's time, doubling ``import structured_attention`` and every ``sattn`` command) only to set
one attribute on the function, which ``torch.compile`` reads when it traces a call. A process that
never compiles should not pay for it, so the attribute is set here directly;
``tests/test_compile.py`` checks that it is what PyTorch's decorator sets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., object])


def assume_constant_result(fn: F) -> F:
    """``torch.compiler.assume_constant_result(fn)``: under ``torch.compile`` a call of ``fn`` is
    made once, when the graph is traced, and its result is a constant of the graph."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn
