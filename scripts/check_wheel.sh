#!/usr/bin/env bash
# A wheel of this repo, installed in a clean virtual environment, ships cpu_kernel.cpp, builds the
# C++ MLR attention kernel and uses it (tests/test_packaging.py runs this under CI=true).
#
#   scripts/check_wheel.sh               build the wheel, install it with torch in a fresh venv, check
#   scripts/check_wheel.sh --bench [OUT] then time `sattn bench mlr` in that venv and in the editable
#                                        install, alternately, and write OUT/wheel-vs-editable.md
#                                        (OUT defaults to runs/wheel-bench)
#
# Environment: PYTHON (the interpreter for the fresh venv, default python3), TORCH_SPEC (as in the
# Makefile, default torch==2.13.0), EDITABLE_PYTHON (the editable install's interpreter for --bench,
# default .venv/bin/python), BENCH_ARGS (the `sattn bench mlr` arguments for --bench), BENCH_ROUNDS
# (runs per install for --bench, default 2), KEEP=1 keeps the temporary folder. Needs the package index pip is set up with (torch and the dependencies).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
BENCH=0
OUT="$ROOT/runs/wheel-bench"
if [[ "${1:-}" == "--bench" ]]; then
  BENCH=1
  OUT="$(mkdir -p "${2:-$OUT}" && cd "${2:-$OUT}" && pwd)"
elif [[ $# -gt 0 ]]; then
  echo "usage: $0 [--bench [OUT]]" >&2
  exit 2
fi

TMP="$(mktemp -d "${TMPDIR:-/tmp}/sattn-wheel.XXXXXX")"
if [[ "${KEEP:-0}" != 1 ]]; then trap 'rm -rf "$TMP"' EXIT; else echo "keeping $TMP"; fi
VENV="$TMP/venv"
step() { echo "[check_wheel ${SECONDS}s] $*"; }

# A clean environment: nothing from the caller's Python setup, and the kernel built from scratch
# in a folder of its own (removed with the rest); the editable install (--bench) keeps its own.
unset PYTHONPATH PYTHONHOME VIRTUAL_ENV
export PIP_DISABLE_PIP_VERSION_CHECK=1
in_wheel_env() { TORCH_EXTENSIONS_DIR="$TMP/torch_extensions" "$@"; }

step "fresh venv in $VENV with $TORCH_SPEC"
"$PYTHON" -m venv "$VENV"
# --no-compile: Python compiles the modules a check imports when it imports them; byte-compiling all
# of torch's at install took 20 s of the 49 it took to install.
"$VENV/bin/python" -m pip install -q --no-compile "$TORCH_SPEC" "setuptools>=77"

# Built from a copy of what the wheel is made of, so stale build/ folders or other work in the tree
# cannot leak into it.
step "building the wheel"
mkdir -p "$TMP/src" "$TMP/dist"
tar -C "$ROOT" --exclude=__pycache__ --exclude='*.egg-info' -cf - pyproject.toml README.md LICENSE src | tar -C "$TMP/src" -xf -
"$VENV/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$TMP/dist" "$TMP/src"
WHEEL="$(ls "$TMP"/dist/*.whl)"
step "installing $(basename "$WHEEL")"
"$VENV/bin/python" -m pip install -q --no-compile "$WHEEL"

step "checking the installed package (outside the repo)"
mkdir -p "$TMP/outside"
cd "$TMP/outside"
in_wheel_env "$VENV/bin/python" - "$ROOT" <<'EOF'
import sys
from pathlib import Path

import torch

import structured_attention
from structured_attention.ops.mlr import cpu, cpu_build, mlr_attention, mlr_attention_reference

repo = Path(sys.argv[1]).resolve()
package = Path(structured_attention.__file__).resolve().parent
assert repo not in package.parents, f"structured_attention was imported from the repo: {package}"
source = package / "ops" / "mlr" / "cpu_kernel.cpp"
assert source.is_file(), f"the wheel did not install {source}"
assert (package / "py.typed").is_file(), "the wheel did not install py.typed"
from structured_attention.training.config import load_config
from structured_attention.experiments.lm import LMConfig
assert load_config(LMConfig, "lm-default").run.out_dir == "runs/lm-default", "the shipped config lm-default"
assert cpu_build._SOURCE.resolve() == source, cpu_build._SOURCE
assert cpu.available(), "the C++ kernel did not build from the installed wheel"
assert cpu_build._module is not None

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 96, 12, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
with torch.profiler.profile() as prof:
    out = mlr_attention(q, k, v, (4, 4, 4))
    out.sum().backward()
ops = {e.name for e in prof.events()}
assert {"sattn::mlr_cpu_forward_kernel", "sattn::mlr_cpu_backward_kernel"} <= ops, "mlr_attention did not run the C++ kernel"
grads = [x.grad for x in (q, k, v)]
for x in (q, k, v):
    x.grad = None
expected = mlr_attention_reference(q, k, v, (4, 4, 4))
expected.sum().backward()
torch.testing.assert_close(out, expected)
for got, want in zip(grads, (q.grad, k.grad, v.grad)):
    torch.testing.assert_close(got, want)
print(f"ok: {package} (torch {torch.__version__}) built and ran the C++ kernel {cpu_build._module.__file__}")
EOF
step "wheel check passed"

if [[ $BENCH == 1 ]]; then
  EDITABLE_PYTHON="${EDITABLE_PYTHON:-$ROOT/.venv/bin/python}"
  BENCH_ARGS="${BENCH_ARGS:---paths sdpa,mlr --seq-lens 1024,2048,4096 --warmup 2 --repeats 5 --no-memory}"
  ROUNDS="${BENCH_ROUNDS:-2}"
  # Which library each install loads (building the editable's if it must, untimed). The bytes
  # differ (the source's path is in the library, through __FILE__ in torch's checks), so the sizes
  # of their machine code are compared.
  library() {
    "$1" -c "import structured_attention, sys; from pathlib import Path; from structured_attention.ops.mlr import cpu_build
p = Path(structured_attention.__file__).resolve()
if (Path(sys.argv[1]) in p.parents) != (sys.argv[2] == 'editable'): sys.exit(f'{sys.argv[2]}: structured_attention from {p}')
if cpu_build.load() is None: sys.exit(f'{sys.argv[2]}: no C++ kernel')
print(cpu_build._module.__file__)" "$ROOT" "$2"
  }
  EDITABLE_LIB="$(library "$EDITABLE_PYTHON" editable)"
  WHEEL_LIB="$(in_wheel_env library "$VENV/bin/python" wheel)"
  text_size() { size -A "$1" 2>/dev/null | awk '$1 == ".text" {print $2}'; }
  SAME="$(text_size "$EDITABLE_LIB") and $(text_size "$WHEEL_LIB") bytes"
  step "kernel libraries' .text: $SAME ($EDITABLE_LIB, $WHEEL_LIB)"
  LOAD_BEFORE="$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)"
  # Each install in several runs, alternating, so a machine whose speed drifts hurts neither alone.
  for round in $(seq "$ROUNDS"); do
    for install in editable wheel; do
      step "sattn bench mlr: $install, round $round"
      # shellcheck disable=SC2086
      if [[ $install == editable ]]; then
        "$(dirname "$EDITABLE_PYTHON")/sattn" bench mlr $BENCH_ARGS --out "$OUT/editable-$round" > "$OUT/editable-$round.log"
      else
        in_wheel_env "$VENV/bin/sattn" bench mlr $BENCH_ARGS --out "$OUT/wheel-$round" > "$OUT/wheel-$round.log"
      fi
    done
  done
  LOAD_AFTER="$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)"
  "$VENV/bin/python" - "$OUT" "$BENCH_ARGS" "$ROUNDS" "$LOAD_BEFORE" "$LOAD_AFTER" "$SAME" <<'EOF'
import json
import statistics
import sys
from pathlib import Path

out, args, rounds, load_before, load_after, same = Path(sys.argv[1]), *sys.argv[2:]
rows = {}
for install in ("editable", "wheel"):
    for run in sorted(out.glob(f"{install}-*/mlr.json")):
        data = json.loads(run.read_text())
        env = data["environment"]
        for r in data["results"]:
            rows.setdefault((r["case"], r["seq_len"]), {}).setdefault(install, []).append(r)
lines = [f"`sattn bench mlr {args}`, {rounds} runs per install, alternating; each cell is the median over the runs "
         f"of each run's median (speed-up: of each run's median per-round ratio to the first case). "
         f"{env['device']}, {env['threads']} threads, Python {env['python']}, torch {env['torch']}; load average "
         f"(1, 5, 15 min) {load_before} before, {load_after} after; the kernel libraries' .text (editable and wheel): "
         f"{same}.", "",
         "| case | T | fwd ms, editable | fwd ms, wheel | fwd+bwd ms, editable | fwd+bwd ms, wheel "
         "| wheel / editable (fwd+bwd) | fwd+bwd speed-up, editable | fwd+bwd speed-up, wheel |",
         "|---|---|---|---|---|---|---|---|---|"]
for (case, t), by in rows.items():
    e, w = ([statistics.median(r[key] for r in by[i]) for key in ("forward_ms", "forward_backward_ms", "speedup_forward_backward")]
            for i in ("editable", "wheel"))
    lines.append(f"| {case} | {t} | {e[0]:.1f} | {w[0]:.1f} | {e[1]:.1f} | {w[1]:.1f} | {w[1] / e[1]:.2f} "
                 f"| {e[2]:.2f}x | {w[2]:.2f}x |")
text = "\n".join(lines) + "\n"
(out / "wheel-vs-editable.md").write_text(text)
print(text)
EOF
  step "wrote $OUT/wheel-vs-editable.md"
fi
