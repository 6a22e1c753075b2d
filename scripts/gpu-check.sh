#!/usr/bin/env bash
# The whole GPU check of the kernels in one command, for a machine with one CUDA GPU (about 10
# minutes on an H100): the Triton tests on the GPU, then the issue-3 benchmarks in bfloat16.
#   scripts/gpu-check.sh [OUT_DIR]        (default runs/gpu-check; $OUT on the lent device machine)
# Needs python3 with torch (CUDA), triton, numpy, pyyaml, safetensors, pytest, matplotlib; the
# package is used from src/ without installing it.
set -uo pipefail
out=${1:-${OUT:-runs/gpu-check}}
mkdir -p "$out"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
sattn() { python3 -m structured_attention.cli.main "$@"; }
status=0

python3 - <<'PY' | tee "$out/env.txt"
import platform, torch, triton
print(f"python {platform.python_version()} | torch {torch.__version__} | triton {triton.__version__} | "
      f"{torch.cuda.get_device_name()} | CUDA {torch.version.cuda}")
PY

python3 -m pytest -q -p no:cacheprovider tests/test_mlr_triton.py tests/test_mlr_decode.py 2>&1 | tail -n 40 | tee "$out/tests.log" || status=1

sattn bench mlr --device cuda --dtype bfloat16 --seq-lens 2048,4096,8192,16384 --paths sdpa,mlr \
    --repeats 10 --profile --out "$out/mlr" || status=1
sattn bench attention --device cuda --dtype bfloat16 --seq-lens 4096,16384 --decode-cache 16368 \
    --repeats 10 --out "$out/attention" || status=1
sattn bench attention --device cuda --dtype bfloat16 --seq-lens 16384 --decode-cache 16368 --batch 16 \
    --kinds "mha,mlr:8|8|8|8|8|8|8|8" --repeats 10 --out "$out/decode-b16" || status=1
exit $status
