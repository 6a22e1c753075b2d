"""Tests for what an install gets: the wheel's files and metadata, and (in CI) a wheel installed in a
clean virtual environment building and using the C++ kernel (scripts/check_wheel.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from importlib import resources
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_holds_the_kernel_source_and_py_typed():
    assert (resources.files("structured_attention.ops.mlr") / "cpu_kernel.cpp").is_file()
    assert (resources.files("structured_attention") / "py.typed").is_file()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built offline (no build isolation) from a copy of what it is made of, so nothing in
    the work tree (build/, egg-info) is touched or leaks in; a few seconds."""
    pytest.importorskip("setuptools", minversion="77")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (path,) = (tmp / "dist").glob("*.whl")
    return path


def test_the_wheel_ships_the_kernel_source_and_py_typed(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        source = z.read("structured_attention/ops/mlr/cpu_kernel.cpp")
    assert "structured_attention/py.typed" in names
    shipped = sorted(p.name for p in (ROOT / "src/structured_attention/configs").glob("*.yaml"))
    assert shipped and {f"structured_attention/configs/{name}" for name in shipped} <= names
    assert source == (ROOT / "src/structured_attention/ops/mlr/cpu_kernel.cpp").read_bytes()
    assert not any("__pycache__" in n or n.endswith(".so") for n in names)


def test_the_wheel_declares_the_mit_license(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        text = z.read(metadata).decode()
        (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        license_text = z.read(license_file).decode()
    assert "License-Expression: MIT" in text.splitlines()
    assert "License-File: LICENSE" in text.splitlines()
    assert "MIT License" in license_text and "Copyright (c) 2026 the structured-attention developers" in license_text


# About 1.5 minutes on the 2-core machine (the kernel build is most of it), so CI runs it and a
# local run does not unless asked; SATTN_TEST_WHEEL=0 leaves it out of CI too.
_WHEEL_CHECK = os.environ.get("SATTN_TEST_WHEEL", "1" if os.environ.get("CI") == "true" else "0") == "1"


@pytest.mark.skipif(not _WHEEL_CHECK, reason="builds a wheel, installs it with torch in a fresh venv and builds the "
                                             "kernel there (about 1.5 minutes on 2 cores): runs under CI=true or "
                                             "SATTN_TEST_WHEEL=1")
def test_a_wheel_in_a_clean_environment_builds_and_uses_the_kernel(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    proc = subprocess.run(["bash", str(ROOT / "scripts/check_wheel.sh")], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "wheel check passed" in proc.stdout
