"""The fused C++ MLR attention kernel for CPU (``mlr_cpu.cpp``): its build and Python interface.

:func:`mlr_attention_cpu` has the contract of :func:`structured_attention.functional.mlr_attention`
and is differentiable in ``q``, ``k`` and ``v``; :func:`mlr_decode_cpu` is one decoding step against
the compressed cache, with the contract of :func:`structured_attention.functional.mlr_decode_reference`.
The kernel is compiled on first use with ``torch.utils.cpp_extension`` (a C++17 compiler and ninja
are needed; the build takes about a minute and is cached under ``$TORCH_EXTENSIONS_DIR``, by
default ``~/.cache/torch_extensions``) for the instruction set
``torch.backends.cpu.get_cpu_capability()`` reports, so the vectorised code matches the machine. If it cannot be built, :func:`load` warns once and returns ``None``, and
``mlr_attention`` falls back to the blocked PyTorch path. ``SATTN_CPU_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from structured_attention.functional.mlr import _HALF_DTYPES, check_mlr_arguments
from structured_attention.functional.mlr_decode import check_mlr_decode_arguments

__all__ = ["available", "load", "mlr_attention_cpu", "mlr_decode_cpu"]

_SOURCE = Path(__file__).with_name("mlr_cpu.cpp")
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
    """One tiny forward against the exact reference: a kernel that cannot run here (the GEMM
    library refusing this CPU) or computes wrongly is never used."""
    from structured_attention.functional.mlr import mlr_attention_reference

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 4, generator=g) for _ in range(3))
    out, _ = module.forward((q * 0.5).reshape(2, 24, 4), k.reshape(2, 24, 4).transpose(1, 2).contiguous(),
                            v.reshape(2, 24, 4), [32, 8], [0, 2, 4], True, False, BLOCK_Q, BLOCK_K)
    ref = mlr_attention_reference(q, k, v, (2, 2), (32, 8), scale=0.5)
    if not torch.allclose(out.reshape(ref.shape), ref, atol=1e-4, rtol=1e-4):
        raise RuntimeError("self-check: the kernel's output differs from the reference")


def available() -> bool:
    """Whether the C++ kernel is (or can be) loaded."""
    return load() is not None


class _MLRCpu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, sizes, offsets, causal, dn):
        ext = load()
        qs = (q * scale).contiguous()
        out, lse = ext.forward(qs, k.transpose(1, 2).contiguous(), v, sizes, offsets, causal, dn, BLOCK_Q, BLOCK_K)
        ctx.save_for_backward(qs, k, v, out, lse)
        ctx.cfg = (scale, sizes, offsets, causal, dn)
        return out

    @staticmethod
    def backward(ctx, gout):
        qs, k, v, out, lse = ctx.saved_tensors
        scale, sizes, offsets, causal, dn = ctx.cfg
        gout = gout.contiguous()
        delta = (gout * out).sum(-1)
        dqT, dk, dv = load().backward(
            qs, qs.transpose(1, 2).contiguous(), k, k.transpose(1, 2).contiguous(), v, gout,
            gout.transpose(1, 2).contiguous(), lse, delta, sizes, offsets, causal, dn, BLOCK_Q, BLOCK_K)
        return dqT.transpose(1, 2).mul_(scale), dk, dv, None, None, None, None, None


def mlr_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranks: Sequence[int],
    block_sizes: Sequence[int] | None = None,
    causal: bool = True,
    scale: float | None = None,
    depth_normalize: bool = False,
) -> torch.Tensor:
    """MLR attention through the fused C++ kernel; same contract as
    :func:`structured_attention.functional.mlr_attention`. Raises ``RuntimeError`` if the kernel
    is not available (see :func:`available`)."""
    ranks, sizes, scale = check_mlr_arguments(q, k, v, ranks, block_sizes, causal, scale, depth_normalize)
    if load() is None:
        raise RuntimeError("the C++ MLR attention kernel is not available here (see the warning when it was built)")
    if q.device.type != "cpu":
        raise ValueError(f"q.device: expected a CPU tensor, got {q.device}")
    B, H, T, R = q.shape
    Hk = k.shape[1]
    Dv = v.shape[-1]
    dtype = torch.float32 if q.dtype in _HALF_DTYPES else q.dtype
    G = H // Hk
    kc, vc = k.to(dtype), v.to(dtype)
    if G > 1:  # GQA: expand k/v over the group (O(T) memory; autograd sums the group back)
        kc, vc = kc.repeat_interleave(G, dim=1), vc.repeat_interleave(G, dim=1)
    out = _MLRCpu.apply(
        q.to(dtype).reshape(B * H, T, R), kc.reshape(B * H, T, R).contiguous(), vc.reshape(B * H, T, Dv).contiguous(),
        scale, list(sizes), list(itertools.accumulate(ranks, initial=0)), causal, depth_normalize)
    return out.reshape(B, H, T, Dv).to(q.dtype)


def mlr_decode_cpu(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    key_starts: Sequence[int],
    v: torch.Tensor,
    ranks: Sequence[int],
    scale: float,
    depth_normalize: bool = False,
) -> torch.Tensor:
    """One MLR decoding step through the C++ kernel, one task per (sequence, query head); same
    contract as :func:`structured_attention.functional.mlr_decode.mlr_decode_reference` (not
    differentiable). Raises ``RuntimeError`` if the kernel is not available."""
    check_mlr_decode_arguments(q, keys, key_starts, v, ranks)
    ext = load()
    if ext is None:
        raise RuntimeError("the C++ MLR attention kernel is not available here (see the warning when it was built)")
    dtype = torch.float32 if v.dtype in _HALF_DTYPES else v.dtype

    def prepared(x: torch.Tensor) -> torch.Tensor:  # cache views are used in place when they can be
        return x if x.dtype == dtype and x.stride(-1) == 1 else x.to(dtype).contiguous()

    out = ext.decode(prepared(q)[:, :, 0], [prepared(k) for k in keys], list(key_starts), prepared(v), float(scale),
                     depth_normalize)
    return out.unsqueeze(2).to(v.dtype)
