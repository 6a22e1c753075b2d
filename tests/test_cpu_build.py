"""Tests for building the C++ CPU kernel on first use (structured_attention.ops.mlr.cpu_build).

The build logic (the build folder's key, the lock, the one-line messages, warning once) is tested
with the compile step replaced by a stand-in, so these tests run without a compiler. The tests that
load the real kernel share the suite's one build (the folder is keyed by this install), and run
what must not hang in a subprocess with a timeout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from structured_attention.functional import mlr_attention_reference
from structured_attention.ops.mlr import cpu_build


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """cpu_build as in a new process, building under tmp_path."""
    monkeypatch.setattr(cpu_build, "_module", None)
    monkeypatch.setattr(cpu_build, "_failed", False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("SATTN_CPU_KERNEL", raising=False)
    return tmp_path


def _fake_build(monkeypatch, calls: list | None = None):
    """The compile step replaced by one that writes a stand-in library and returns a module that
    passes the (replaced) self-check; no compiler or ninja is needed."""
    def compile_(name, directory, cflags, ldflags):
        if calls is not None:
            calls.append(directory)
        library = directory / f"{name}.so"
        library.write_bytes(b"stand-in")
        return SimpleNamespace(__file__=str(library), forward=None)

    monkeypatch.setattr(cpu_build, "_check_toolchain", lambda: None)
    monkeypatch.setattr(cpu_build, "_compile", compile_)
    monkeypatch.setattr(cpu_build, "_self_check", lambda module: None)
    monkeypatch.setattr(cpu_build, "_import_library", lambda library: SimpleNamespace(__file__=str(library)))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_build_folder_is_keyed_by_torch_version_install_and_source():
    key = cpu_build._build_key("2.13.0+cpu", "/venv/a", b"source", ["-O3"])
    assert key.startswith("torch2.13.0_cpu-")
    assert cpu_build._build_key("2.13.0+cpu", "/venv/a", b"source", ["-O3"]) == key
    others = [cpu_build._build_key("2.12.1+cpu", "/venv/a", b"source", ["-O3"]),
              cpu_build._build_key("2.13.0+cpu", "/venv/b", b"source", ["-O3"]),
              cpu_build._build_key("2.13.0+cpu", "/venv/a", b"source 2", ["-O3"]),
              cpu_build._build_key("2.13.0+cpu", "/venv/a", b"source", ["-O2"])]
    assert len({key, *others}) == 5
    assert all("/" not in k and " " not in k for k in others)


def test_the_build_folder_is_under_torch_extensions_dir_and_follows_the_install(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = cpu_build.build_directory()
    assert folder.parent == tmp_path / "sattn_mlr_cpu"
    assert folder.name.startswith(f"torch{torch.__version__.replace('+', '_')}-")
    monkeypatch.setattr(sys, "prefix", "/some/other/venv")
    assert cpu_build.build_directory() != folder
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert cpu_build.build_directory().name.startswith("torch9.9.9-")


def test_the_first_build_says_so_in_one_line_and_a_cached_build_says_nothing(monkeypatch, capsys, fresh):
    calls = []
    _fake_build(monkeypatch, calls)
    assert cpu_build.load() is not None
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "building the C++ MLR attention kernel" in err and "minute" in err and "SATTN_CPU_KERNEL=0" in err
    assert str(calls[0]) in err and calls[0].parent.parent == fresh
    assert (calls[0] / "built").read_text().strip() == f"sattn_mlr_cpu_{cpu_build._flags()[0].lower()}.so"

    # A later process finds the build: no message, no compile.
    monkeypatch.setattr(cpu_build, "_module", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_build.load() is not None
    assert capsys.readouterr().err == ""
    assert len(calls) == 1


def test_a_lock_left_by_a_dead_process_does_not_block_the_build(monkeypatch, capsys, fresh):
    """A build killed midway leaves torch's lock file and this module's lock file (holding the dead
    builder's PID) behind; the next load takes over and builds."""
    calls = []
    _fake_build(monkeypatch, calls)
    folder = cpu_build.build_directory()
    folder.mkdir(parents=True)
    pid = _dead_pid()
    (folder / "build.lock").write_text(f"process {pid} on {socket.gethostname()}\n")
    (folder / "lock").write_text("")  # torch.utils.cpp_extension's FileBaton
    seen = []
    compile_ = cpu_build._compile
    monkeypatch.setattr(cpu_build, "_compile", lambda *a: (seen.append((folder / "lock").exists()), compile_(*a))[1])
    start = time.monotonic()
    assert cpu_build.load() is not None
    assert time.monotonic() - start < 5
    assert seen == [False]  # torch's stale lock was gone before torch's build ran
    assert (folder / "build.lock").read_text().strip() == f"process {os.getpid()} on {socket.gethostname()}"
    assert "waiting" not in capsys.readouterr().err


def test_a_live_builder_is_waited_for_with_a_message(monkeypatch, capsys, fresh):
    """Another process holds the build lock: load() says whom it waits for, then builds once the
    lock is free."""
    _fake_build(monkeypatch)
    folder = cpu_build.build_directory()
    folder.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        with open({str(folder / 'build.lock')!r}, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.truncate(0); f.write(f"process {{os.getpid()}} on testhost"); f.flush()
            print("locked", flush=True)
            time.sleep(2)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        start = time.monotonic()
        assert cpu_build.load() is not None
        waited = time.monotonic() - start
    finally:
        holder.wait(timeout=30)
    err = capsys.readouterr().err.splitlines()
    assert waited > 0.5
    assert len(err) == 2, err  # the wait, then the build
    assert f"waiting for process {holder.pid} on testhost" in err[0] and "SATTN_CPU_KERNEL=0" in err[0]
    assert "building" in err[1]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and locks")
def test_a_build_killed_midway_does_not_block_the_next(monkeypatch, capsys, fresh):
    """A real process runs load() with a compile step that leaves torch's lock file and stalls, as
    a compiler does; it is SIGKILLed there, holding both locks, and the next load builds at once."""
    import signal

    folder = cpu_build.build_directory()
    builder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from structured_attention.ops.mlr import cpu_build
        cpu_build._check_toolchain = lambda: None
        def stalls(name, directory, cflags, ldflags):
            (Path(directory) / "lock").write_text("")  # torch's FileBaton, as its build takes it
            print("compiling", flush=True)
            time.sleep(600)
        cpu_build._compile = stalls
        cpu_build.load()
    """)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(fresh), "SATTN_CPU_KERNEL": "1"})
    try:
        assert builder.stdout.readline().strip() == "compiling"
        builder.send_signal(signal.SIGKILL)
        builder.wait(timeout=30)
    finally:
        builder.kill()
    assert (folder / "lock").exists() and (folder / "build.lock").exists()  # what the kill left behind
    _fake_build(monkeypatch)
    start = time.monotonic()
    assert cpu_build.load() is not None
    assert time.monotonic() - start < 5


def test_no_compiler_is_one_line_naming_cxx_and_the_switch(monkeypatch, capsys, fresh):
    monkeypatch.setenv("CXX", "/nonexistent/sattn-c++")

    def compile_(*args):
        raise AssertionError("no build without a compiler")

    monkeypatch.setattr(cpu_build, "_compile", compile_)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu_build.load() is None
        assert not cpu_build.available()  # no second attempt, no second warning
    assert len(caught) == 1
    message = str(caught[0].message)
    if "ninja" in message:
        pytest.skip("ninja is missing here, so the compiler is not reached")
    assert "\n" not in message
    assert "CXX=/nonexistent/sattn-c++" in message and "SATTN_CPU_KERNEL=0" in message
    assert caught[0].filename == __file__  # points at the caller of load()
    assert capsys.readouterr().err == ""  # neither the build line nor torch's banner


def test_sattn_cpu_kernel_0_turns_it_off_without_a_word(monkeypatch, capsys, fresh):
    monkeypatch.setenv("SATTN_CPU_KERNEL", "0")
    _fake_build(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_build.load() is None
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("failure", ["build", "self-check"])
def test_a_failed_build_or_self_check_warns_once_and_mlr_attention_falls_back(monkeypatch, failure, fresh):
    from structured_attention.functional import mlr_attention
    from structured_attention.ops.mlr.cpu import mlr_attention_cpu

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here\nand the rest of the build log")

    _fake_build(monkeypatch)
    monkeypatch.setattr(cpu_build, "_compile" if failure == "build" else "_self_check", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu_build.load() is None
        assert not cpu_build.available()  # no second attempt, no second warning
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "could not be built (no compiler here)" in message and "\n" not in message
    assert "SATTN_CPU_KERNEL=0" in message
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, 8, 4, generator=g, dtype=torch.float64) for _ in range(3))
    with pytest.raises(RuntimeError, match="not available"):
        mlr_attention_cpu(q.float(), k.float(), v.float(), (2, 2))
    torch.testing.assert_close(mlr_attention(q, k, v, (2, 2)), mlr_attention_reference(q, k, v, (2, 2)))


# -- the real kernel --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built() -> Path:
    """The folder of this install's real build (built here if no test has yet)."""
    if cpu_build.load() is None:
        pytest.skip("the C++ kernel cannot be built here (no compiler or ninja)")
    return cpu_build.build_directory()


def _load_in_subprocess(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = "from structured_attention.ops.mlr import cpu_build; assert cpu_build.load() is not None"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)


def test_a_built_kernel_loads_in_a_new_process_without_a_word(built):
    proc = _load_in_subprocess({})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


@pytest.mark.parametrize("context", ["torch.autocast('cpu', dtype=torch.bfloat16)", "torch.device('meta')",
                                     "torch._subclasses.fake_tensor.FakeTensorMode()"])
def test_a_first_load_inside_autocast_a_default_device_or_a_trace_keeps_the_kernel(built, context):
    """The kernel's self-check computes real float32 tensors on the CPU whatever the context of the
    first MLR call: inside a training step's CPU autocast, under a default device or in the fake
    tensors torch.export traces with it failed, and the kernel was built again and then left unused
    for the whole process, with a warning (an exported program then held the blocked path)."""
    code = ("import torch\nfrom structured_attention.ops.mlr import cpu_build\n"
            f"with {context}:\n    assert cpu_build.load() is not None")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


def test_torchs_lock_left_by_a_killed_build_does_not_hang_the_next_load(built):
    """The real torch build path (ninja finds everything up to date) with the lock files a killed
    build leaves, in the suite's own build folder (a copy elsewhere would change ninja's command
    lines and compile again): without the take-over, torch would wait on its lock forever."""
    folder = built
    (folder / "built").unlink()  # so this load goes through torch's build step
    (folder / "lock").write_text("")
    (folder / "build.lock").write_text(f"process {_dead_pid()} on {socket.gethostname()}\n")
    proc = _load_in_subprocess({})
    assert proc.returncode == 0, proc.stderr
    assert "building" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert not (folder / "lock").exists() and (folder / "built").is_file()
