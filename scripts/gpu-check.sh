#!/usr/bin/env bash
# The GPU check of the kernels, for a machine with one CUDA GPU: the test suite on the GPU, the
# tile-setting and decoding timings, and the benchmarks in bfloat16.
#   scripts/gpu-check.sh [OUT_DIR] [all|suite|tests|tune|decode|layout|tilings|subtile|varlen|generate|export|captured|ncu|bench|host|graphs|ab] [K/N|TREE]
# (default OUT_DIR runs/gpu-check, or $OUT on the lent device machine; default all). Each step is
# sized for a machine that stops a command after 10 minutes:
# all: the benchmarks (bench: MLR against flash and cuDNN at head dims 64 and 128 and with one level,
# the layers' decoding step, a GPT's training step at context 4096, the host's share of one call),
# then the whole test suite (suite 1/1) in what is left of 9.5 minutes (about 8 in all on an H200;
# GPU_CHECK_SECONDS=N for a shorter call, for suite too).
# suite K/N runs the K-th of N shards of the whole test suite (every N-th test) on 14 workers, one
# line per test as it finishes, so a run stopped by the time limit still names its failures. On an
# H200 the whole suite took about 14 minutes (2026-11-27), when each of the 14 workers ran 16 CPU
# threads; tests/conftest.py now gives each its share, which cut the suite on 2 CPU cores from 7
# minutes to 2.5. Where 1/1 is cut, 1/2 and 2/2 in two calls.
# tests: the Triton and compile tests alone, on 14 workers (one worker had done 39 % of them after
# 6 minutes on an H200, most of it compiling).
# tune (about 5 minutes): the prefix-rank kernels' tile settings and the decoding kernel's, then
# the prefix-rank ones at head dim 128.
# decode (about 5 minutes): the decoding kernel's timings and tests, the per-kernel profile of a
# whole decoding step, and the layers' decoding benchmark.
# layout (about a minute): the decoding kernel in its default setting against SDPA's, level 1 and
# the values alone, and both read from one buffer that holds a token's level-1 key and value in one
# row instead of two buffers; then the same cache as a static cache holds it (what a captured
# generation step reads), in two buffers and in one.
# varlen (about 8 minutes) runs the padded/packed/ragged tests and the kernels' document and row-start
# tests on the GPU, then times packed documents against one call per document and mixed-length generation.
# generate (about 6 minutes) runs the static-cache tests on the GPU and times generation per kind,
# growing and static caches, eager and CUDA-graph-captured.
# export (5 minutes at most): the torch.export tests on CUDA (a model of every kind, its decoding
# step and the step's AOTInductor package, with the Triton kernels and FlexAttention inside the
# trace), then generation at a 16k cache, batch 16, static eager steps against the package.
# captured (about 6 minutes, most of it compiling): the tests of decoding steps captured in one CUDA
# graph with the choice of their token (GPT.generate(cuda_graph=True)), then generation at a 16k
# cache, MHA and MLR, batch 16 (with each mode's per-step profile) then 1: torch.compile's
# reduce-overhead step against that graph (whether the host's calls per token, not the GPU, set the
# reduce-overhead step's time).
# ncu (about 2 minutes) writes Nsight Compute's profile of the decoding and prefill kernels beside
# flash attention's.
# tilings (about 3 minutes): the tilings of check_prefix_tilings.py one by one (which of them Triton
# compiles wrong, output and gradients apart), the one- and two-level ones again with four warps
# (--tile-warps), and T = 4096's candidate tiles timed with their own warps (32 rows, 64 rows with
# one sub-tile level with four and eight warps).
# subtile (about 8 minutes): tilings, then the Triton tests and the lengths below 4096 with 8 levels
# timed against flash and cuDNN.
# host [TREE] (about 5 minutes, 7 with TREE): where a whole call's time beyond its kernels goes: the tests that a training
# call makes no synchronising CUDA call and an MLR GPT's training step no more than an MHA one's, a GPT's training
# step at context 4096 per kind
# (sattn bench lm with profiles, step_ops.py), MLR against flash and cuDNN at T = 8192 (sattn bench mlr, each call
# alone and ten back to back, with each case's profiler timeline, its GPU's idle gaps by
# trace_gaps.py), and profile_host.py's split of
# the host's part at 1024 and 8192 (when each side of one call is done); with TREE (another version's
# src/, prepared as for ab) the whole calls at 8192 and the GPT's step again, that tree's package then this one's.
# graphs (about 3 minutes, most of it compiling): a GPT's training step at context 4096, MHA and MLR,
# eager and under torch.compile(mode="reduce-overhead") (run.compile_mode: the step's kernels
# replayed from CUDA graphs, no host work between them), each step alone and five back to back.
# ab TREE (about 5 minutes) times the kernels of src/ against those of TREE/src, another
# version of the package prepared beforehand where git is (the device machine's copy has no history):
#   mkdir -p runs/ab-before && git archive REV src | tar -x -C runs/ab-before
# then, carrying runs/ab-before: the prefix-rank kernels at 4096, 8192 and 16384 (8 levels of rank 8;
# the other tree with 32- and 64-row tiles, its dispatcher's choices; this one with its dispatcher's
# tiles, 32 and 64 rows with three pipeline stages, the same with two, 64-row tiles with eight warps
# (at 4096 a sub-tile level, launched with eight either way), and the backward stepping 32 rows at
# a time) and the decoding
# step (the kernel's default settings), the same tuning script over each tree, sattn bench mlr
# (whole calls, the host's part included) at 4096 and 8192, and last graph-captured generation at
# batch 16 (the static step), in one call.
# Needs python3 with torch (CUDA), triton, numpy, pyyaml, safetensors, pytest, pytest-xdist, matplotlib;
# the package is used from src/ without installing it.
set -uo pipefail
out=${1:-${OUT:-runs/gpu-check}}
step=${2:-all}
case $step in
    all|suite|tests|tune|decode|layout|tilings|subtile|varlen|generate|export|captured|ncu|bench|host|graphs|ab) ;;
    *) echo "gpu-check.sh: step: expected one of all, suite, tests, tune, decode, layout, tilings, subtile," \
            "varlen, generate, export, captured, ncu, bench, host, graphs, ab; got '$step'" >&2; exit 2 ;;
esac
mkdir -p "$out"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
sattn() { python3 -m structured_attention.cli.main "$@"; }
status=0

python3 - <<'PY' | tee "$out/env.txt"
import platform, torch, triton
print(f"python {platform.python_version()} | torch {torch.__version__} | triton {triton.__version__} | "
      f"{torch.cuda.get_device_name()} | CUDA {torch.version.cuda}")
PY

if [[ $step == tests ]]; then
    # the backend grid (its Triton subset), the kernels' own tests, and opcheck and the compiled
    # graphs of the custom ops on CUDA
    python3 -m pytest -q -p no:cacheprovider -n 14 tests/test_mlr_grid.py tests/test_mlr_triton.py \
        tests/test_mlr_decode.py tests/test_compile.py -k "not inductor and not training_step" 2>&1 \
        | tee "$out/tests.log" | tail -n 5 || status=1
fi
if [[ $step == bench || $step == all ]]; then
    # --back-to-back: also ten calls a round issued without a synchronisation between them, as a
    # training loop issues them (the host's work then hides behind the GPU's where it can)
    sattn bench mlr --device cuda --dtype bfloat16 --seq-lens 4096,8192,16384 --paths sdpa_flash,sdpa,mlr \
        --repeats 10 --back-to-back 10 --profile --out "$out/mlr" || status=1
    python3 scripts/trace_gaps.py "$out"/mlr/trace-*.json | tee "$out/mlr-gaps.txt" || status=1
    sattn bench attention --device cuda --dtype bfloat16 --seq-lens 16384 --decode-cache 16368 --batch 16 \
        --kinds "mha,mlr:8|8|8|8|8|8|8|8,mlr:16|16|16|16" --repeats 5 --no-memory --out "$out/decode-b16" || status=1
    # head dim 128: 4 levels of rank 32, Dv = 128, batch 4, 16 heads
    sattn bench mlr --device cuda --dtype bfloat16 --seq-lens 4096 --ranks "32|32|32|32" --v-dim 128 --batch 4 \
        --n-heads 16 --paths sdpa_flash,sdpa,mlr --repeats 10 --back-to-back 10 --out "$out/mlr-d128" || status=1
    # one level of rank 64 is full causal attention: the kernels' quality against flash apart from the structure
    sattn bench mlr --device cuda --dtype bfloat16 --seq-lens 8192,16384 --ranks 64 --paths sdpa_flash,sdpa,mlr \
        --repeats 10 --no-memory --out "$out/mlr-one-level" || status=1
    # a GPT's training step at context 4096 (tokens/s per kind), and where each kind's step goes (the
    # MLR GPT ran at 0.53x MHA's: which operators make the difference)
    sattn bench lm --device cuda --dtype bfloat16 --seq-lens 4096 --kinds "mha,mlr:16|16|16|16,mlr:8|8|8|8|8|8|8|8" \
        --repeats 5 --back-to-back 5 --profile --out "$out/lm" || status=1
    # the host's share of one call (Python, the custom op, the Triton launches) against flash's
    timeout 60 python3 scripts/profile_host.py --out "$out/host.txt" | head -n 9 || status=1
fi
if [[ $step == suite || $step == all ]]; then
    shard=${3:-1/1}
    [[ $step == all ]] && shard=1/1
    # the suite in what is left of the run's budget (all: after the benchmarks), less about a minute
    # for collecting the tests and the kill's grace; the budget is a call's limit, less a little for
    # the archive
    budget=${GPU_CHECK_SECONDS:-570}
    limit=$(( budget - SECONDS - 60 > 60 ? budget - SECONDS - 60 : 60 ))
    # every N-th test of the collected suite (by test, not by file: the backend grid alone is most of it)
    python3 -m pytest -o addopts= -p no:cacheprovider --collect-only -q tests 2>/dev/null | grep "::" \
        | awk -v k="${shard%/*}" -v n="${shard#*/}" '(NR - k) % n == 0' > "$out/suite-tests.txt"
    mapfile -t ids < "$out/suite-tests.txt"  # one argument per test id (some hold spaces)
    # the project's addopts say -q, which would cancel -v: cleared here so every test is named
    # SIGINT at the limit: pytest then still prints the tracebacks of the failures so far
    # --durations: where the suite's time goes on the GPU machine (it has to fit one call of 10 minutes)
    timeout -s INT -k 30 "$limit" python3 -m pytest -o addopts= -p no:cacheprovider -n 14 -v -rfE --tb=short \
        --durations=40 "${ids[@]}" > "$out/suite-${shard/\//of}.log" 2>&1 || status=1
    grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed)" "$out/suite-${shard/\//of}.log" | tail -n 40
fi
if [[ $step == tilings || $step == subtile ]]; then
    timeout 200 python3 scripts/check_prefix_tilings.py --out "$out/tilings.txt" || status=1
    timeout 100 python3 scripts/check_prefix_tilings.py --cases 0,5,6 --tile-warps --out "$out/tilings-4-warps.txt" \
        || status=1
    timeout 100 python3 scripts/tune_mlr_triton.py --seq-lens 4096 --ranks "8|8|8|8|8|8|8|8" --tile-warps \
        --settings 32/w4/s2,64/w4/s2,64/w8/s2 --no-decode --no-general --out "$out/tune-4096.json" 2>&1 \
        | grep -v Warn | tee "$out/tune-4096.log" || status=1
fi
if [[ $step == subtile ]]; then
    timeout 300 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 14 tests/test_mlr_grid.py \
        tests/test_mlr_triton.py tests/test_mlr_documents.py -k "triton or cuda or documents" 2>&1 \
        | tee "$out/subtile-tests.log" | tail -n 5 || status=1
    timeout 240 python3 scripts/tune_mlr_triton.py --seq-lens 1024,2048,3072 --ranks "8|8|8|8|8|8|8|8" \
        --settings 64/w4/s2 --no-decode --out "$out/subtile.json" 2>&1 | tee "$out/subtile.log" || status=1
fi
if [[ $step == host ]]; then
    # a synchronising call in a training call's forward+backward fails these tests with its stack,
    # and one more in an MLR GPT's training step than in an MHA GPT's with each call named
    timeout 180 python3 -m pytest -o addopts= -q -p no:cacheprovider tests/test_mlr_triton.py tests/test_models.py \
        -k "never_waits or waits_for_the_gpu" -rA 2>&1 | tee "$out/host-sync-test.log" | tail -n 5 || status=1
    # a GPT's training step at context 4096 (MLR's was 0.53x MHA's tokens/s), with each kind's
    # profile, and the ATen operations and saved memory of its step
    timeout 200 python3 -m structured_attention.cli.main bench lm --device cuda --dtype bfloat16 --seq-lens 4096 \
        --kinds "mha,mlr:8|8|8|8|8|8|8|8,mlr:16|16|16|16" --repeats 5 --back-to-back 5 --profile \
        --out "$out/host-lm" 2>&1 | tail -n 5 || status=1
    timeout 60 python3 scripts/step_ops.py --seq-len 4096 2>&1 | tee "$out/host-step-ops.txt" || status=1
    sattn bench mlr --device cuda --dtype bfloat16 --seq-lens 8192 --paths sdpa_flash,sdpa,mlr --repeats 10 \
        --back-to-back 10 --no-memory --profile --out "$out/host-mlr" | tail -n 4 || status=1
    python3 scripts/trace_gaps.py "$out"/host-mlr/trace-*.json | tee "$out/host-gaps.txt" || status=1
    for t in 1024 8192; do
        timeout 60 python3 scripts/profile_host.py --seq-len $t --calls 50 --out "$out/host-$t.txt" \
            | head -n 14 || status=1
    done
    if [[ -n ${3:-} ]]; then  # the same whole calls with another tree's package, in this call (the host's speed varies by machine)
        [[ -d $3/src/structured_attention ]] || { echo "host: expected $3/src/structured_attention" >&2; exit 2; }
        for package in "$3/src" src; do
            PYTHONPATH=$package timeout 90 python3 -m structured_attention.cli.main bench mlr --device cuda \
                --dtype bfloat16 --seq-lens 8192 --paths sdpa_flash,mlr --repeats 10 --back-to-back 10 --no-memory \
                --out "$out/host-ab-${package//\//_}" | tail -n 3 || status=1
            PYTHONPATH=$package timeout 120 python3 -m structured_attention.cli.main bench lm --device cuda \
                --dtype bfloat16 --seq-lens 4096 --kinds "mha,mlr:8|8|8|8|8|8|8|8" --repeats 5 --back-to-back 5 \
                --out "$out/host-ab-lm-${package//\//_}" | tail -n 3 || status=1
        done
    fi
fi
if [[ $step == graphs ]]; then
    timeout 300 python3 -m structured_attention.cli.main bench lm --device cuda --dtype bfloat16 --seq-lens 4096 \
        --kinds "mha,mlr:8|8|8|8|8|8|8|8" --compile --compile-mode reduce-overhead --repeats 5 --back-to-back 5 \
        --no-memory --out "$out/lm-graphs" 2>&1 | tail -n 8 || status=1
fi
if [[ $step == ab ]]; then
    tree=${3:?"ab: expected the other tree's folder (holding src/) as the third argument"}
    [[ -d $tree/src/structured_attention ]] || { echo "ab: expected $tree/src/structured_attention" >&2; exit 2; }
    for side in now before; do
        # this tree: the dispatcher's tiles (three stages) and the same with two, eight warps, and
        # the backward stepping 32 rows
        package=src settings=32/w4/s3,64/w4/s3,32/w4/s2,64/w4/s2,64/w8/s2,bwd32/w4/s2
        # the other tree: the tiles its dispatcher picks (32 rows at 4096, 64 above, two stages), the
        # reference point on the same machine
        [[ $side == before ]] && package=$tree/src settings=32/w4/s2,64/w4/s2
        PYTHONPATH=$package timeout 240 python3 scripts/tune_mlr_triton.py --seq-lens 4096,8192,16384 \
            --ranks "8|8|8|8|8|8|8|8" --settings "$settings" --no-decode --no-general \
            --out "$out/ab-prefill-$side.json" 2>&1 \
            | tee "$out/ab-prefill-$side.log" || status=1
        PYTHONPATH=$package timeout 100 python3 scripts/tune_mlr_triton.py --decode-only --decode-settings default \
            --out "$out/ab-decode-$side.json" 2>&1 | tee "$out/ab-decode-$side.log" || status=1
        # whole calls, host included (the tuning script times the kernels alone)
        PYTHONPATH=$package timeout 100 python3 -m structured_attention.cli.main bench mlr --device cuda \
            --dtype bfloat16 --seq-lens 4096,8192 --paths sdpa_flash,mlr --repeats 10 --no-memory \
            --out "$out/ab-bench-$side" 2>&1 | tail -n 6 || status=1
    done
    for side in now before; do  # last: graph-captured generation, MHA and MLR, batch 16, 16k cache
        package=src
        [[ $side == before ]] && package=$tree/src
        PYTHONPATH=$package timeout 120 python3 -m structured_attention.cli.main bench generate --device cuda \
            --dtype bfloat16 --batches 16 --cache-lens 16368 --modes compiled --compile-mode reduce-overhead \
            --repeats 3 --out "$out/ab-generate-$side" 2>&1 | tail -n 4 || status=1
    done
fi
if [[ $step == tune ]]; then
    python3 scripts/tune_mlr_triton.py --out "$out/tune.json" 2>&1 | tee "$out/tune.log" || status=1
    # head dim 128 (sattn bench mlr's second target: 4 levels of rank 32, Dv 128, B 4, H 16, T 4096),
    # where the dK/dV kernel with 64-row tiles spills 632 bytes a thread compiled for sm_90 (296 at
    # head dim 64): the tiles that hold fewer of its keys at once beside the default
    timeout 200 python3 scripts/tune_mlr_triton.py --ranks "32|32|32|32" --v-dim 128 --batch 4 --heads 16 \
        --seq-lens 4096 --settings 64/w4/auto,64/w4/s2,64/w4/s3,64/w8/s2,dkdv32/w4/s2,bwd32/w4/s2 --no-decode --no-general \
        --out "$out/tune-d128.json" 2>&1 | tee "$out/tune-d128.log" || status=1
fi
if [[ $step == decode ]]; then
    python3 scripts/tune_mlr_triton.py --decode-only --out "$out/decode.json" 2>&1 | tee "$out/decode.log" || status=1
    python3 -m pytest -q -p no:cacheprovider tests/test_mlr_decode.py \
        tests/test_attention.py::test_decoding_on_cuda_avoids_cudnn_attention 2>&1 | tail -n 5 || status=1
fi
if [[ $step == layout ]]; then
    timeout 150 python3 scripts/tune_mlr_triton.py --decode-only --decode-settings default \
        --out "$out/decode-layout.json" 2>&1 | tee "$out/decode-layout.log" || status=1
fi
if [[ $step == tune || $step == decode ]]; then
    python3 scripts/profile_decode_step.py --device cuda --out "$out/decode-profile.txt" || status=1
fi
if [[ $step == decode ]]; then
    sattn bench attention --device cuda --dtype bfloat16 --seq-lens 16384 --decode-cache 16368 --batch 16 \
        --kinds "mha,mlr:8|8|8|8|8|8|8|8,mlr:16|16|16|16" --repeats 5 --no-memory --out "$out/decode-b16" || status=1
fi
if [[ $step == varlen ]]; then
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_varlen.py tests/test_mlr_documents.py \
        tests/test_mlr_decode.py 2>&1 | tee "$out/varlen-tests.log" | tail -n 15 || status=1
    for bench in "varlen --seq-len 16384 --batch 4 --repeats 10 --out $out/varlen-random" \
                 "varlen --lengths 16384;64x256 --repeats 10 --out $out/varlen-short" \
                 "ragged --repeats 5 --out $out/ragged"; do
        # shellcheck disable=SC2086  # the words of each benchmark's command line
        timeout 75 python3 -m structured_attention.cli.main bench $bench --device cuda --dtype bfloat16 2>&1 | tee -a "$out/varlen-bench.log" || status=1
    done
fi
if [[ $step == generate ]]; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_static_cache.py tests/test_mlr_decode.py 2>&1 \
        | tee "$out/generate-tests.log" | tail -n 5 || status=1
    timeout 360 python3 -m structured_attention.cli.main bench generate --device cuda --dtype bfloat16 \
        --batches 1,16,64 --cache-lens 16368 --modes eager,static,compiled --compile-mode reduce-overhead \
        --repeats 5 --out "$out/generate" \
        || status=1
    timeout 70 python3 scripts/profile_generate_step.py --batch 16 --out "$out/generate-profile-b16.txt" || status=1
fi
if [[ $step == export ]]; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_export.py -k cuda -rfE 2>&1 \
        | tee "$out/export-tests.log" | tail -n 5 || status=1
    # the package's build, a case at a time, takes most of this
    timeout 170 python3 -m structured_attention.cli.main bench generate --device cuda --dtype bfloat16 \
        --batches 16 --cache-lens 16368 --modes static,aoti --repeats 5 --out "$out/generate-aoti" || status=1
fi
if [[ $step == captured ]]; then
    timeout 150 python3 -m pytest -o addopts= -q -p no:cacheprovider tests/test_static_cache.py tests/test_bench.py \
        -k "captured or cuda_graph or bad_use or bench_generate" -rfE 2>&1 | tee "$out/captured-tests.log" | tail -n 5 || status=1
    for batch in 16 1; do  # each batch compiles four steps (two kinds, two modes)
        timeout 240 python3 -m structured_attention.cli.main bench generate --device cuda --dtype bfloat16 \
            --batches $batch --cache-lens 16368 --modes compiled,graph --compile-mode reduce-overhead --repeats 5 \
            --out "$out/captured-b$batch" 2>&1 | tee "$out/captured-b$batch.log" | tail -n 8 || status=1
        if [[ $batch == 16 ]]; then  # each mode's kernels and the GPU's time in one step
            timeout 150 python3 scripts/profile_generate_step.py --batch 16 --out "$out/captured-profile-b16.txt" \
                || status=1
        fi
    done
fi
if [[ $step == ncu ]]; then  # Nsight Compute's profile of the decoding and prefill kernels against flash
    for case in decode prefill; do
        ncu --profile-from-start off --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
            --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
            python3 scripts/ncu_kernels.py $case > "$out/ncu-$case.txt" 2>&1 || status=1
        tail -n 3 "$out/ncu-$case.txt"
    done
fi
# The device machine hands back 8 files at most: there, more than that go back as one archive.
if [[ -n ${OUT:-} && $out == "$OUT" ]] && (( $(find "$out" -type f | wc -l) > 8 )); then
    tar -czf /tmp/gpu-check.tgz -C "$out" . && find "$out" -mindepth 1 -delete && mv /tmp/gpu-check.tgz "$out/" \
        && echo "files: $out/gpu-check.tgz"
fi
exit $status
