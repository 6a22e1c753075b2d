"""The package's Triton kernels compiled for an NVIDIA GPU without one: each kernel's shared memory,
registers, spill stack and compile time, the numbers that decide occupancy and local-memory traffic.

    python3 scripts/triton_resources.py [--case general|prefix|prefix-d128|sub-tile|one-sub-tile|decode|decode-static]
                                        [--dtype bfloat16] [--arch 90]
                                        [--num-warps N] [--tile N] [--step N] [--stages N] [--recorder PYTHON]

Step 1 runs one call of the case (forward and backward for ``general`` and ``prefix``, one decoding
step for the decoding cases) on CPU tensors in a child process under ``TRITON_INTERPRET=1`` and
records every kernel launch: its arguments' types, the 16-divisibility Triton specialises on, the
compile-time constants and the launch options. Step 2 compiles each launch with ``triton.compile``
for ``sm_<arch>`` (Triton ships ptxas) and reads the resources and the machine instructions' count
(SASS, straight-line: a loop's body counts once) from the cubin with cuobjdump, and
from the TTGIR the structure of its loops: the warp-group matrix products (``mma``, Hopper's
asynchronous ``wgmma``), how many of their waits leave none in flight (``waited at once``: a
product's result awaited before anything else is issued, so the matrix units do not run beside the
softmax), the loads issued ahead into shared memory (asynchronous and TMA copies), and whether the
compiler split the kernel into warp-specialised partitions. Nothing runs on a GPU, so speed itself
still has to be measured on one (``scripts/gpu-check.sh``).
The compile time is a first compile's: a kernel in Triton's cache (``TRITON_CACHE_DIR``) reads 0.

Cases (8 levels of rank 8, ``Dv = 64``, GPU tiles of 64, or ``--tile`` and ``--step`` (the backward's
step over the walked axis) for the prefix-rank ones, with the software-pipeline stages the
dispatcher's tiles launch with on the target (``pipeline_stages``) or ``--stages``):
- ``general``: T = 640 with the default block sizes (finest block 5, not a multiple of a tile),
  bidirectional with ``depth_normalize``: the general kernels;
- ``prefix``: causal with the block sizes of T = 8192 (finest block 64, a tile; run on 1024 tokens):
  the prefix-rank kernels of ``sattn bench mlr``;
- ``prefix-d128``: head dim 128, 4 levels of rank 32 and ``Dv = 128``, causal with the block sizes
  of T = 4096 (run on 1024 tokens): the prefix-rank kernels of ``sattn bench mlr``'s head-dim-128 case;
- ``sub-tile``: causal with the block sizes of T = 2048 (blocks of 32 and 16 finer than a tile; run
  on 1024 tokens): the prefix-rank kernels with sub-tile levels;
- ``one-sub-tile``: the same with the block sizes of T = 4096 (one level, of 32-token blocks, finer
  than a tile);
- ``decode``: one query against a 4096-token compressed cache (batch 2, 8 heads, 2 kv heads);
- ``decode-static``: the same against a static cache (``decode_static``: level 1 and the values
  as long as the context, each finer level in a ring of its block size; what a graph-captured
  generation step reads).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time

CASES = ("general", "prefix", "prefix-d128", "sub-tile", "one-sub-tile", "decode", "decode-static")
_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64", "int32": "i32",
          "int64": "i64", "bool": "i1", "int8": "i8", "uint8": "u8"}
_OPTIONS = ("num_warps", "num_stages", "maxnreg")


def record(case: str, dtype: str, tile: int, step: int, stages: int) -> list[dict]:
    """Step 1 (TRITON_INTERPRET=1): run the case and return every distinct kernel launch."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    launches: dict[str, dict] = {}
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        names, params = self.arg_names, inspect.signature(self.fn).parameters
        values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
        signature, constants, attrs = {}, {}, []
        for i, name in enumerate(names):
            value = values[name]
            if "constexpr" in str(params[name].annotation) or value is None:
                signature[name], constants[name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = "*" + _TYPES[str(value.dtype).removeprefix("torch.")]
                if value.data_ptr() % 16 == 0:
                    attrs.append(i)
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
                if value % 16 == 0 and value != 0:
                    attrs.append(i)
            else:
                signature[name] = "fp32"
        launch = {"module": self.fn.__module__, "name": self.fn.__name__, "signature": signature,
                  "constants": constants, "divisible_by_16": attrs,
                  "options": {k: kwargs[k] for k in _OPTIONS if kwargs.get(k) is not None}}
        launches[json.dumps(launch, sort_keys=True, default=str)] = launch
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    ranks = (8,) * 8
    if case == "decode":
        from structured_attention.ops.mlr.contract import mlr_block_sizes
        from structured_attention.ops.mlr.triton_decode import mlr_decode_triton

        B, H, Hk, n = 2, 8, 2, 4096
        sizes = mlr_block_sizes(ranks, n)
        starts = [0] + [(n - 1) // s * s for s in sizes[1:]]
        keys = [torch.randn(B, Hk, n - start, r, dtype=dt) for r, start in zip(ranks, starts)]
        mlr_decode_triton(torch.randn(B, H, 1, sum(ranks), dtype=dt), keys, starts,
                          torch.randn(B, Hk, n, 64, dtype=dt), ranks, 0.125)
    elif case == "decode-static":
        from structured_attention.ops.mlr.contract import mlr_block_sizes
        from structured_attention.ops.mlr.static import one_allocation
        from structured_attention.ops.mlr.triton_decode import decode_static

        B, H, Hk, n = 2, 8, 2, 4096
        sizes = mlr_block_sizes(ranks, n)
        keys = [torch.randn(B, Hk, n, ranks[0], dtype=dt),
                *one_allocation([torch.randn(B, Hk, s, r, dtype=dt) for r, s in zip(ranks[1:], sizes[1:])])]
        decode_static(torch.randn(B, H, 1, sum(ranks), dtype=dt), keys, torch.randn(B, Hk, n, 64, dtype=dt),
                      torch.tensor(n - 5), torch.zeros(B, dtype=torch.long), ranks, sizes, 0.125, False)
    else:
        from structured_attention.ops.mlr.triton_general import mlr_attention_triton
        from structured_attention.ops.mlr.triton_prefix import PrefixTiles, mlr_attention_prefix

        dim = 64
        if case == "prefix-d128":
            ranks, dim = (32,) * 4, 128
        q, k, v = (torch.randn(1, 2, 1024, dim, dtype=dt, requires_grad=True) for _ in range(3))
        if case == "general":
            out = mlr_attention_triton(q[:, :, :640], k[:, :, :640], v[:, :, :640], ranks, causal=False,
                                       depth_normalize=True, block_m=64, block_n=64)
        else:  # the sizes of a longer T on a shorter sequence: the same kernels, the GPU's tiles
            context = {"prefix": 8192, "prefix-d128": 4096, "sub-tile": 2048, "one-sub-tile": 4096}[case]
            sizes = tuple(context >> i for i in range(len(ranks)))
            tiles = PrefixTiles(tile, tile, tile, step, tile, step, num_stages=stages)
            out = mlr_attention_prefix(q, k, v, ranks, sizes, True, 0.125, False, tiles)
        out.sum().backward()
    return list(launches.values())


def compile_launch(launch: dict, arch: int) -> dict:
    """Step 2 (no interpreter, no GPU): compile one recorded launch for ``sm_<arch>``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch["module"]), launch["name"])
    names = list(launch["signature"])
    if "UPCAST" in launch["constants"]:  # the interpreter's work-around for bfloat16 products, never on a GPU
        launch["constants"]["UPCAST"] = False
    source = ASTSource(fn=fn, signature=launch["signature"],
                       constexprs={(names.index(k),): v for k, v in launch["constants"].items()},
                       attrs={(i,): [["tt.divisibility", 16]] for i in launch["divisible_by_16"]})
    start = time.perf_counter()
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=launch["options"])
    seconds = time.perf_counter() - start
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([cuobjdump, "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout
    found = {key: int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK")}
    ttgir = kernel.asm["ttgir"]
    return {"kernel": launch["name"], "shared_bytes": kernel.metadata.shared, "registers": found["REG"],
            "spill_stack_bytes": found["STACK"], "compile_s": round(seconds, 1),
            "instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S", sass, re.MULTILINE)),
            # Hopper's asynchronous warp-group products, and how many of their waits leave none in
            # flight (the product's result waited for at once: no overlap with what follows)
            "mma": len(re.findall(r"ttng\.warp_group_dot ", ttgir)),
            "mma_waited_at_once": len(re.findall(r"ttng\.warp_group_dot_wait .*pendings = 0\b", ttgir)),
            # loads issued ahead into shared memory: asynchronous copies and TMA (tensor descriptor) copies
            "async_loads": len(re.findall(r"ttn?g\.async(?:_tma)?_copy_global_to_local", ttgir)),
            "warp_specialized": "ttg.warp_specialize" in ttgir,
            "options": launch["options"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=CASES, default="general")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100/H200)")
    p.add_argument("--num-warps", type=int, default=None, help="compile with this many warps instead of the launch's")
    p.add_argument("--tile", type=int, default=64, help="the prefix-rank kernels' square tiles (default 64)")
    p.add_argument("--stages", type=int, default=None,
                   help="the prefix-rank kernels' software-pipeline stages (default the ones the dispatcher's tiles "
                        "launch with on the target, kernel by kernel: pipeline_stages)")
    p.add_argument("--step", type=int, default=None,
                   help="the backward's step over the walked axis (the dK/dV kernel's query rows, the dQ kernel's "
                        "keys; default the tile)")
    p.add_argument("--recorder", default=sys.executable,
                   help="the Python that runs step 1 (default this one): another environment's, where this "
                        "one's Triton interpreter cannot run the case (Triton 3.6's, with NumPy 2)")
    p.add_argument("--record", action="store_true", help=argparse.SUPPRESS)  # step 1, in the child
    args = p.parse_args()
    if args.record:
        json.dump(record(args.case, args.dtype, args.tile, args.step or args.tile, args.stages), sys.stdout)
        return
    child = subprocess.run([args.recorder, __file__, "--record", "--case", args.case, "--dtype", args.dtype,
                            "--tile", str(args.tile), "--step", str(args.step or args.tile),
                            "--stages", str(args.stages or 2)],
                           env=os.environ | {"TRITON_INTERPRET": "1"}, capture_output=True, text=True)
    if child.returncode != 0:
        sys.exit(f"triton_resources.py: the recording run failed:\n{child.stderr}")
    import triton

    print(f"case {args.case}, {args.dtype}, sm_{args.arch} (Triton {triton.__version__}'s compiler, no GPU)")
    print(f"{'kernel':32s} {'shared B':>9s} {'regs':>5s} {'spill B':>8s} {'instrs':>7s} {'compile s':>9s} {'mma':>4s} "
          f"{'waited at once':>14s} {'async loads':>11s} {'warp-specialised':>16s}")
    stages = {}
    if args.stages is None:  # the stages the dispatcher's tiles launch with on this target, kernel by kernel
        import torch

        from structured_attention.ops.mlr.triton_prefix import HOPPER_SHARED_PER_BLOCK, pipeline_stages

        # the shared memory a block may take on the target: Hopper and B200 227 KiB, A100 163, others 99
        shared = HOPPER_SHARED_PER_BLOCK if args.arch in (90, 100) else (163 if args.arch == 80 else 99) * 1024
        fwd, bwd = pipeline_stages(getattr(torch, args.dtype), "cuda", 128 if args.case == "prefix-d128" else 64,
                                   shared)
        stages = {"_prefix_fwd_kernel": fwd, "_prefix_dkdv_kernel": bwd, "_prefix_dq_kernel": bwd}
    for launch in json.loads(child.stdout):
        if args.num_warps is not None:
            launch["options"]["num_warps"] = args.num_warps
        if launch["name"] in stages:
            launch["options"]["num_stages"] = stages[launch["name"]]
        r = compile_launch(launch, args.arch)
        print(f"{r['kernel']:32s} {r['shared_bytes']:9d} {r['registers']:5d} {r['spill_stack_bytes']:8d} "
              f"{r['instructions']:7d} "
              f"{r['compile_s']:9.1f} {r['mma']:4d} {r['mma_waited_at_once']:14d} {r['async_loads']:11d} "
              f"{'yes' if r['warp_specialized'] else 'no':>16s}")


if __name__ == "__main__":
    main()
