"""Building the C++ MLR attention kernel (``cpu_kernel.cpp``) on first use.

The kernel is compiled with ``torch.utils.cpp_extension`` (a C++17 compiler and ninja are needed;
the build takes about a minute and is cached under ``$TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``) for the instruction set ``torch.backends.cpu.get_cpu_capability()``
reports, so the vectorised code matches the machine. If it cannot be built, :func:`load` warns once
and returns ``None``, and the dispatcher falls back to the blocked PyTorch path.
``SATTN_CPU_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["BLOCK_K", "BLOCK_Q", "available", "load"]

_SOURCE = Path(__file__).with_name("cpu_kernel.cpp")
# Query rows per tile and the widest key piece: a piece's scores (64 x 256 float32, 64 KiB) and its
# products stay in a core's L2.
BLOCK_Q = 64
BLOCK_K = 256

_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}
_module: ModuleType | None = None
_failed = False


def load() -> ModuleType | None:
    """The compiled kernel, built on first call; ``None`` (after one warning) when it cannot be
    built here or ``SATTN_CPU_KERNEL=0``."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    if os.environ.get("SATTN_CPU_KERNEL", "1") == "0":
        _failed = True
        return None
    if shutil.which("ninja") is None:  # the pip package's binary, when its folder is not on PATH
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    capability = torch.backends.cpu.get_cpu_capability()
    isa = capability if capability in _FLAGS else "DEFAULT"
    try:
        from torch.utils.cpp_extension import load as build

        # at::parallel_for runs on one thread unless the extension is compiled with OpenMP; linked
        # with -fopenmp it binds to the libgomp.so.1 torch has already loaded, so it shares torch's
        # thread pool and follows torch.set_num_threads.
        openmp = ["-fopenmp"] if torch.backends.openmp.is_available() and sys.platform.startswith("linux") else []
        module = build(
            name=f"sattn_mlr_cpu_{isa.lower()}",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", *_FLAGS.get(isa, []), f"-DCPU_CAPABILITY={isa}", f"-DCPU_CAPABILITY_{isa}", *openmp],
            extra_ldflags=openmp,
            verbose=False,
        )
        _self_check(module)
        _module = module
    except Exception as err:  # no compiler, no ninja, a failed build or self-check: use the PyTorch path
        _failed = True
        warnings.warn(f"structured_attention: the C++ MLR attention kernel could not be built ({str(err).splitlines()[0]}); "
                      "using the slower blocked PyTorch path", stacklevel=2)
    return _module


def _self_check(module: ModuleType) -> None:
    """One tiny forward against plain softmax attention (one level: MLR is then ordinary causal
    attention): a kernel that cannot run here (the GEMM library refusing this CPU) or computes
    wrongly is never used."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 24, 4, generator=g) for _ in range(3))
    out, _ = module.forward(q, k.transpose(1, 2).contiguous(), v, [32], [0, 4], True, False, BLOCK_Q, BLOCK_K)
    scores = (q @ k.transpose(1, 2)).masked_fill(torch.ones(24, 24, dtype=torch.bool).triu(1), float("-inf"))
    if not torch.allclose(out, torch.softmax(scores, -1) @ v, atol=1e-4, rtol=1e-4):
        raise RuntimeError("self-check: the kernel's output differs from plain attention")


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the C++ kernel is (or can be) loaded."""
    return load() is not None
