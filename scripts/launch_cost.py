"""The host's time per Triton launch of the prefix-rank forward kernel, without a GPU: Triton's own
launch (``JITFunction.run``: binding and specialising every argument, the cache key) against
``triton_common.launch`` (the compiled kernel's launcher called directly once a specialisation is
known).

    PYTHONPATH=src python3 scripts/launch_cost.py [--seq-len 8192]

Triton compiles the kernel for sm_90 (no GPU needed); the CUDA driver is replaced by a stand-in and
the compiled kernel's C launcher by a no-op, so the figures are Python's alone: the launcher's own
argument parsing, a few microseconds, comes on top of both on a GPU. Run it without
``TRITON_INTERPRET`` (the interpreter has no compiled kernels).
"""

from __future__ import annotations

import argparse
import os
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=8192)
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: the interpreter has no compiled kernels")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.runtime.driver import driver

    class StandInDriver:  # what JITFunction.run asks of the CUDA driver, without one
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

    driver.set_active(StandInDriver())
    from structured_attention.ops.mlr import triton_common, triton_prefix as tp
    from structured_attention.ops.mlr.contract import mlr_block_sizes

    ranks, T = (8,) * 8, args.seq_len
    q, k, v, o = (torch.empty(1, 8, T, 64, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.empty(1, 8, T)
    plan = tp.PrefixPlan(torch.bfloat16, torch.device("cpu"), 64, ranks, mlr_block_sizes(ranks, T, None),
                         tp.PrefixTiles())
    plan.upcast = False  # the GPU's kernel, not the interpreter's
    launch_args = (q, k, v, o, lse, triton_common.segments_of_rows(1, T, torch.device("cpu")), *plan.tables(),
                   *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
                   8, 1, T, plan.R, plan.R1, plan.RC, plan.SF, plan.DV, 0.125)
    constexprs = plan.constexprs(True, False, 64, 64)
    grid = (triton_common.cdiv(T, 64), 8)
    kernel = tp._prefix_fwd_kernel.run(*launch_args, grid=grid, warmup=True, **constexprs)  # compiled for sm_90
    kernel.module, kernel.function, kernel._run = object(), 0, lambda *a: None  # loaded, launcher a no-op

    torch.cuda.current_device = lambda: 0
    triton_common._raw_stream, triton_common._FAST_LAUNCH = (lambda device: 0), True
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
