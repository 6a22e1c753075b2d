"""Triton's own launch against ``triton_common.launch``, without a GPU: the host's time per launch of
the prefix-rank forward kernel (``JITFunction.run`` binds, specialises and keys every argument on
every call; ``launch`` calls the compiled kernel's launcher directly once a specialisation is
known), and with ``--check`` that both hand the launcher the same arguments.

    PYTHONPATH=src python3 scripts/launch_cost.py [--seq-len 8192] [--check]

Triton compiles the kernels for sm_90 (no GPU needed); the CUDA driver is replaced by a stand-in and
the compiled kernels' C launchers by a no-op (timing) or a recorder (``--check``), so the times are
Python's alone: the launcher's own argument parsing, a few microseconds, comes on top of both on a
GPU. ``--check`` runs a forward, a backward and a decoding step twice, through Triton's launch the
first time and through the kept launchers the second, and exits 1 unless every launch got the same
grid, stream, kernel and arguments (tensors by dtype and shape). Run without ``TRITON_INTERPRET`` (the
interpreter has no compiled kernels).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch


def per_call_us(fn: Callable[[], object], calls: int = 20000, rounds: int = 5) -> float:
    """The fastest of ``rounds`` rounds of ``calls`` back-to-back calls, in us per call."""
    for _ in range(calls // 10):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return min(times)


def describe(arg: object) -> object:
    """A launcher argument as the check compares it: tensors by dtype and shape, the launch's
    metadata (a fresh object each launch, for Triton's launch hooks) by type, the rest by value."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, tuple(arg.shape)
    return type(arg).__name__ if type(arg).__name__ == "LazyDict" else arg


def stand_in_gpu(launched: list | None) -> None:
    """Triton's CUDA driver replaced by a stand-in for sm_90, each compiled kernel 'loaded' with a
    launcher that records its arguments into ``launched`` (or does nothing, for None)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.runtime.driver import driver

    from structured_attention.ops.mlr import triton_common

    class StandInDriver:  # what JITFunction.run asks of the CUDA driver
        launcher_cls = CudaLauncher

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty

    def load(kernel: triton.compiler.CompiledKernel) -> None:
        kernel.module, kernel.function = object(), 0
        kernel._run = (lambda *a: None) if launched is None else (lambda *a: launched.append(a))

    driver.set_active(StandInDriver())
    triton.compiler.CompiledKernel._init_handles = load
    torch.cuda.current_device = lambda: 0
    triton_common._raw_stream, triton_common._FAST_LAUNCH = (lambda device: 0), True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--check", action="store_true", help="check the launchers' arguments instead of timing")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: the interpreter has no compiled kernels")
    launched: list = []
    stand_in_gpu(launched if args.check else None)
    import triton

    from structured_attention.ops.mlr import triton_common, triton_decode, triton_prefix as tp
    from structured_attention.ops.mlr.contract import mlr_block_sizes

    ranks, T = (8,) * 8, args.seq_len
    torch.manual_seed(0)
    q, k, v, o, do = (torch.randn(1, 8, T, 64, dtype=torch.bfloat16) for _ in range(5))
    plan = tp.PrefixPlan(torch.bfloat16, torch.device("cpu"), 64, ranks, mlr_block_sizes(ranks, T, None),
                         tp.PrefixTiles())
    plan.upcast = False  # the GPU's kernels, not the interpreter's
    if args.check:
        runs = []
        # one new query against a two-level compressed cache of the sequence (its second level
        # holding the last half): the decoding kernels' launches
        keys, starts = [k[..., :32], k[:, :, T // 2:, 32:]], [0, T // 2]
        for _ in range(2):  # through Triton's launch (compiling), then through the kept launchers
            launched.clear()
            out, lse = tp._forward(q, k, v, None, T, plan, True, 0.125, False)
            tp._backward(q, k, v, out, lse, do, None, T, plan, True, 0.125, False)
            triton_decode.mlr_decode_triton(q[:, :, -1:], keys, starts, v, (32, 32), 0.125)
            runs.append([tuple(describe(a) for a in call) for call in launched])
        kept = sum(len(kernels) for kernels in triton_common._launchers.values())
        same = len(runs[0]) == 5 and runs[0] == runs[1] and kept == 5
        print(f"Triton {triton.__version__}: {len(runs[0])} launches, {kept} kept launchers, "
              f"arguments {'the same' if same else 'DIFFERENT'} through Triton's launch and through launch()")
        sys.exit(0 if same else 1)
    lse = torch.empty(1, 8, T)
    launch_args = (q, k, v, o, lse, triton_common.segments_of_rows(1, T, torch.device("cpu")), *plan.tables(),
                   *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
                   8, 1, T, plan.R, plan.R1, plan.RC, plan.SF, plan.DV, 0.125)
    constexprs = plan.constexprs(True, False, 64, 64, plan.fwd_stages)
    grid = (triton_common.cdiv(T, 64), 8)
    fn = tp._prefix_fwd_kernel
    results = {
        "Triton's launch (kernel[grid](...))": per_call_us(lambda: fn[grid](*launch_args, **constexprs)),
        "triton_common.launch": per_call_us(lambda: triton_common.launch(fn, grid, *launch_args, **constexprs)),
    }
    print(f"Triton {triton.__version__}, torch {torch.__version__}, the prefix-rank forward kernel "
          f"({len(launch_args)} arguments and {len(constexprs)} keywords), T = {T}; us per launch, Python only:")
    for name, us in results.items():
        print(f"  {name:40s} {us:6.2f}")


if __name__ == "__main__":
    main()
