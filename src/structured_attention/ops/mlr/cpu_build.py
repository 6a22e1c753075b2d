"""Building the C++ MLR attention kernel (``cpu_kernel.cpp``) on first use.

The kernel is compiled with ``torch.utils.cpp_extension`` (a C++17 compiler and ninja are needed)
for the instruction set ``torch.backends.cpu.get_cpu_capability()`` reports, so the vectorised code
matches the machine. The build takes under a minute and says so in one line on stderr before it
starts. It goes to a folder of its own (:func:`build_directory`) under ``$TORCH_EXTENSIONS_DIR``
(by default ``~/.cache/torch_extensions``), keyed by the torch and Python versions, the install and
a hash of the source and flags: each virtual environment builds once and keeps its build, and a new
version of the source never loads an old binary. Later processes import that build directly.

Concurrent first uses build once: the builder holds an OS lock (``build.lock``, holding its PID
and host) that the system drops when the process dies, so a build killed midway is simply redone
by the next process, and torch's own lock file it left behind is cleared. A process that finds a
live builder says whom it waits for.

If the kernel cannot be built (no compiler, no ninja, a failed build or self-check), :func:`load`
warns once, in one line, and returns ``None``; the dispatcher then uses the blocked PyTorch path.
``SATTN_CPU_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import re
import shlex
import shutil
import socket
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import torch

from ..._compiler import assume_constant_result

__all__ = ["BLOCK_K", "BLOCK_Q", "available", "build_directory", "load"]

_SOURCE = Path(__file__).with_name("cpu_kernel.cpp")
# Query rows per tile and the widest key piece: a piece's scores (64 x 256 float32, 64 KiB) and its
# products stay in a core's L2.
BLOCK_Q = 64
BLOCK_K = 256

_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}
_NAME = "sattn_mlr_cpu"
_BUILT = "built"  # written once a build passed its self-check; holds the library's file name
_LOCK = "build.lock"
_TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton, which a killed build leaves behind
# Where no OS lock can be had (Windows, a file system without locks), a torch lock file older than
# this is taken for a dead build's: the build takes under a minute.
_STALE_AFTER_S = 15 * 60
_SKIP = "SATTN_CPU_KERNEL=0 skips it"
_FALLBACK = "MLR attention uses the slower blocked PyTorch path"

_module: ModuleType | None = None
_failed = False
_loading = threading.Lock()


class _Unavailable(RuntimeError):
    """A missing tool: its message is the whole (one-line) warning."""


def load() -> ModuleType | None:
    """The compiled kernel, built on first call; ``None`` (after one warning) when it cannot be
    built here or ``SATTN_CPU_KERNEL=0``."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _loading:  # threads that ask at once wait for one build
        if _module is not None or _failed:
            return _module
        if os.environ.get("SATTN_CPU_KERNEL", "1") == "0":
            _failed = True
            return None
        try:
            _module = _load_or_build()
        except _Unavailable as err:
            _failed = True
            warnings.warn(str(err), stacklevel=2)
        except Exception as err:  # a failed build or self-check: use the PyTorch path
            _failed = True
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            warnings.warn(f"structured_attention: the C++ MLR attention kernel could not be built ({first}); "
                          f"{_FALLBACK} ({_SKIP})", stacklevel=2)
    return _module


@assume_constant_result
def available() -> bool:
    """Whether the C++ kernel is (or can be) loaded."""
    return load() is not None


def build_directory() -> Path:
    """The folder this install builds the kernel in: ``$TORCH_EXTENSIONS_DIR`` (by default torch's
    ``~/.cache/torch_extensions``) / ``sattn_mlr_cpu`` / a key of the torch version, the install
    and the source and flags (see :func:`_build_key`)."""
    from torch.utils.cpp_extension import get_cxx_compiler, get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    isa, cflags, ldflags = _flags()
    install = f"{sys.prefix}\0{Path(torch.__file__).parent}\0{sys.implementation.cache_tag}{getattr(sys, 'abiflags', '')}"
    return Path(root) / _NAME / _build_key(torch.__version__, install, _SOURCE.read_bytes(),
                                           [isa, *cflags, "\0", *ldflags, "\0", get_cxx_compiler()])


def _build_key(torch_version: str, install: str, source: bytes, flags: Sequence[str]) -> str:
    """``torch<version>-<install hash>-<source and flags hash>``: a binary is reused only by the same
    torch, in the same environment (its Python, its torch install), from the same source built
    the same way, and environments do not evict each other's builds."""
    def digest(*parts: bytes) -> str:
        return hashlib.sha256(b"\0".join(parts)).hexdigest()[:12]

    version = re.sub(r"[^A-Za-z0-9.]+", "_", torch_version)
    return f"torch{version}-{digest(install.encode())}-{digest(source, *(f.encode() for f in flags))}"


def _flags() -> tuple[str, list[str], list[str]]:
    """The instruction set and the compile and link flags for this machine."""
    capability = torch.backends.cpu.get_cpu_capability()
    isa = capability if capability in _FLAGS else "DEFAULT"
    # at::parallel_for runs on one thread unless the extension is compiled with OpenMP; linked with
    # -fopenmp it binds to the libgomp.so.1 torch has already loaded, so it shares torch's thread
    # pool and follows torch.set_num_threads.
    openmp = ["-fopenmp"] if torch.backends.openmp.is_available() and sys.platform.startswith("linux") else []
    cflags = ["-O3", *_FLAGS.get(isa, []), f"-DCPU_CAPABILITY={isa}", f"-DCPU_CAPABILITY_{isa}", *openmp]
    return isa, cflags, openmp


def _load_or_build() -> ModuleType:
    """This install's build if there is one, else a new build (under the build lock); either has
    passed :func:`_self_check`."""
    directory = build_directory()
    module = _cached(directory)
    if module is not None:
        return module
    _check_toolchain()
    directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory):
        module = _cached(directory)  # built by the process this one waited for
        if module is not None:
            return module
        isa, cflags, ldflags = _flags()
        print(f"structured_attention: building the C++ MLR attention kernel ({isa}) in {directory}, under a minute, "
              f"once per install; {_SKIP}", file=sys.stderr, flush=True)
        module = _compile(f"{_NAME}_{isa.lower()}", directory, cflags, ldflags)
        _self_check(module)
        library = getattr(module, "__file__", None)
        if library:
            (directory / _BUILT).write_text(Path(library).name + "\n")
    return module


def _cached(directory: Path) -> ModuleType | None:
    """The finished build in ``directory``, or ``None`` when there is none (or it fails to load or
    self-check, and is then rebuilt)."""
    try:
        library = directory / (directory / _BUILT).read_text().strip()
    except OSError:
        return None
    if not library.is_file():
        return None
    try:
        module = _import_library(library)
        _self_check(module)
    except Exception:
        return None
    return module


def _import_library(library: Path) -> ModuleType:
    """Imports a built extension without torch's build step (no ninja or compiler needed)."""
    spec = importlib.util.spec_from_file_location(library.name.split(".")[0], library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_toolchain() -> None:
    """Raises :class:`_Unavailable` with one line when ninja or the C++ compiler is missing, before
    torch would print its multi-line banners."""
    if shutil.which("ninja") is None:  # the pip package's binary, when its folder is not on PATH
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    if shutil.which("ninja") is None:
        raise _Unavailable(f"structured_attention: no ninja found to build the C++ MLR attention kernel "
                           f"(pip install ninja); {_FALLBACK} ({_SKIP})")
    from torch.utils.cpp_extension import get_cxx_compiler

    cxx = get_cxx_compiler()
    if shutil.which((shlex.split(cxx) or [""])[0]) is None:
        raise _Unavailable(f"structured_attention: no C++ compiler found (CXX={cxx}) to build the C++ MLR attention "
                           f"kernel; {_FALLBACK} (install one or set CXX; {_SKIP})")


def _compile(name: str, directory: Path, cflags: list[str], ldflags: list[str]) -> ModuleType:
    """``torch.utils.cpp_extension.load`` in ``directory``, its compiler banners silenced: a
    failure is reported in one warning and a success is vouched for by the self-check."""
    from torch.utils.cpp_extension import load as build

    cpp_logger = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_logger.level
    cpp_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build(name=name, sources=[str(_SOURCE)], extra_cflags=cflags, extra_ldflags=ldflags,
                         build_directory=str(directory), verbose=False)
    finally:
        cpp_logger.setLevel(level)


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Holds ``directory``'s build lock: an OS lock (``flock``) on ``build.lock``, which the system
    releases when its holder dies, so a killed build never blocks the next one. While it is held no
    other process builds here, so torch's lock file, if present, is a dead build's and is removed
    (torch would wait on it forever)."""
    try:
        import fcntl
    except ImportError:
        fcntl = None
    with open(directory / _LOCK, "a+") as f:
        locked = False
        if fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                f.seek(0)
                owner = f.read().strip() or "another process"
                print(f"structured_attention: waiting for {owner}, which is building the C++ MLR attention kernel "
                      f"in {directory}; {_SKIP}", file=sys.stderr, flush=True)
                fcntl.flock(f, fcntl.LOCK_EX)
                locked = True
            except OSError:  # a file system without locks: fall back on the lock file's age
                pass
        torch_lock = directory / _TORCH_LOCK
        with contextlib.suppress(FileNotFoundError):
            if locked or time.time() - torch_lock.stat().st_mtime > _STALE_AFTER_S:
                torch_lock.unlink()
        if locked:
            f.seek(0)
            f.truncate()
            f.write(f"process {os.getpid()} on {socket.gethostname()}\n")
            f.flush()
        try:
            yield
        finally:
            if locked:
                fcntl.flock(f, fcntl.LOCK_UN)


def _self_check(module: ModuleType) -> None:
    """One tiny forward against plain softmax attention (one level: MLR is then ordinary causal
    attention): a kernel that cannot run here (the GEMM library refusing this CPU) or computes
    wrongly is never used. It runs in float32 on the CPU whatever the caller's context: the first
    MLR call may come inside ``torch.autocast``, under a default device or while ``torch.export``
    traces (its fake tensors hold no data), where a check computed as the context says failed, and
    the kernel was built again and then left unused for the whole process."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.autocast("cpu", enabled=False), torch.no_grad():
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 24, 4, generator=g, dtype=torch.float32, device="cpu") for _ in range(3))
        causal = torch.ones(24, 24, dtype=torch.bool, device="cpu").triu(1)
        out, _ = module.forward(q, k, v, torch.empty(0, 3, dtype=torch.long, device="cpu"), [32], [0, 4], [], 1.0,
                                True, False, BLOCK_Q, BLOCK_K)
        scores = (q @ k.transpose(-1, -2)).masked_fill(causal, float("-inf"))
        if not torch.allclose(out, torch.softmax(scores, -1) @ v, atol=1e-4, rtol=1e-4):
            raise RuntimeError("self-check: the kernel's output differs from plain attention")
