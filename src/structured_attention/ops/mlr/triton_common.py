"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .contract import device_table, document_segments, heads_inner

__all__ = ["INTERPRETED", "blocks_meet", "cdiv", "cuda_properties", "dense_rows", "device_table", "dot", "dot_acc",
           "empty_rows", "launch", "load_segment", "pow2", "row_dots", "segments_of_documents", "segments_of_rows"]


@triton.jit
def dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot`` (2-D or batched 3-D) with a float32 result.

    ``UPCAST`` (interpreter only) multiplies in float32: Triton's CPU interpreter mishandles
    bfloat16 ``tl.dot`` operands. bf16 products are exact in float32, so the result matches the GPU.
    """
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PREC)
    return out


@triton.jit
def dot_acc(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` as one ``tl.dot`` that accumulates in place (the matrix units add into ``acc``)."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc, input_precision=PREC)
    return out


@triton.jit
def blocks_meet(size, m0, m_last, n0, n_last):
    """Whether rows ``[m0, m_last]`` and columns ``[n0, n_last]`` share a block of ``size`` anywhere."""
    return (n0 // size <= m_last // size) & (m0 // size <= n_last // size)


@triton.jit
def load_segment(SEG, pid):
    """Segment ``pid``'s batch row, first position and length (``SEG`` is ``(S, 3)`` int32)."""
    return tl.load(SEG + 3 * pid), tl.load(SEG + 3 * pid + 1), tl.load(SEG + 3 * pid + 2)


# Triton's interpreter (TRITON_INTERPRET=1 when triton.jit ran) swaps kernels for interpreted ones.
INTERPRETED = "interpret" in type(dot).__name__.lower()


def _compiled_kernels_take_every_parameter() -> bool:
    """Whether this Triton's compiled kernels are launched with every parameter of the kernel, its
    compile-time ones included, as ``JITFunction.run`` launches them from Triton 3.3 on (read from
    that method's source: the fast launch below passes exactly what it passes, or is not used)."""
    import inspect

    from triton.runtime.jit import JITFunction

    try:
        return "*bound_args.values()" in inspect.getsource(JITFunction.run)
    except (OSError, TypeError):
        return False


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's CUDA driver reads
# Launches without Triton's per-launch Python: on by default on a GPU where this Triton's launch
# convention is the known one (never under the interpreter, whose kernels are Python).
_FAST_LAUNCH = not INTERPRETED and _raw_stream is not None and _compiled_kernels_take_every_parameter()
_launchers: dict[object, dict[tuple, tuple]] = {}  # kernel -> specialisation -> (bound launcher, constexprs)


def launch(kernel: triton.runtime.JITFunction, grid: tuple[int, ...], *args: object, **constexprs: object) -> None:
    """``kernel[grid](*args, **constexprs)``: tensors and scalars positional, the compile-time
    arguments and launch options by keyword.

    Triton's own launch (``JITFunction.run``) binds and specialises every argument and builds a
    cache key on every call: 16 us of the host's time for the prefix-rank forward's 31 arguments
    on the 2-core Xeon, against 9.5 here (``scripts/launch_cost.py``, Triton 3.6 and 3.9), paid
    three times in each forward+backward, before kernels the GPU waits for. Here the first launch
    of each specialisation goes through Triton, and the compiled kernel it returns is kept with its
    launcher bound to the grid; later launches with the same key call it directly. The key is finer
    than Triton's specialisation: the device, the grid, each tensor's dtype and whether its address
    is a multiple of 16 (what Triton specialises a pointer on), every scalar by value, and every
    keyword argument by value. At most 64 kept per kernel (emptied when full). The launchers get
    what Triton's launch gives them (``scripts/launch_cost.py --check``, run by the tests)."""
    if not _FAST_LAUNCH:
        kernel[grid](*args, **constexprs)
        return
    device = torch.cuda.current_device()
    key = (device, grid, *[(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args],
           *constexprs.items())
    kept = _launchers.get(kernel)
    if kept is None:
        kept = _launchers[kernel] = {}
    found = kept.get(key)
    if found is not None:
        launcher, compile_time = found
        launcher(*args, *compile_time, stream=_raw_stream(device))
        return
    compiled = kernel[grid](*args, **constexprs)
    if compiled is None:
        return
    if len(kept) >= 64:
        kept.clear()
    # the compile-time parameters after the positional ones, in the kernel's order, defaults applied
    # (what JITFunction.run's binder passes the launcher)
    names = kernel.arg_names[len(args):]
    defaults = {p.name: p.default for p in kernel.params}
    compile_time = tuple(constexprs[n] if n in constexprs else defaults[n] for n in names)
    kept[key] = (compiled[(*grid, 1, 1)[:3]], compile_time)


@functools.lru_cache(maxsize=16)
def cuda_properties(device: torch.device) -> torch._C._CudaDeviceProperties | None:
    """``torch.cuda.get_device_properties(device)``, read once per device (the launches size their
    grids and pipelines by it on every call); None for a device that is not a CUDA one."""
    return torch.cuda.get_device_properties(device) if device.type == "cuda" else None


# Host-side arithmetic in plain Python: Triton's own cdiv and next_power_of_2 are constexpr
# functions whose call wrapper costs microseconds, paid on every decoding step.
def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-a // b)


def pow2(n: int, floor: int = 1) -> int:
    """The smallest power of two >= ``n`` and >= ``floor`` (``tl.dot`` wants dims of 16 or more)."""
    return max(floor, 1 << (max(int(n), 1) - 1).bit_length())


def dense_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself where its last dim is contiguous and its elements fill the memory they span (a
    transposed view of a projection's output, ``(B, T, H, D) -> (B, H, T, D)``), else a contiguous
    copy. The kernels take any strides of the other dims, and buffers made with ``empty_like``
    have the same strides as such an ``x``, which the kernels use for its gradient too."""
    if x.is_contiguous() or (x.stride(-1) == 1 and 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride()))
                             == x.numel()):
        return x
    return x.contiguous()


def empty_rows(q: torch.Tensor, dim: int) -> torch.Tensor:
    """An uninitialised ``(B, H, T, dim)`` tensor of ``q``'s dtype and device laid out as ``q``
    ``(B, H, T, R)`` is: for a layer's transposed view of ``(B, T, H, R)``, a transposed view of
    ``(B, T, H, dim)``, so the output the kernels write there merges its heads (``(B, T, H * dim)``,
    the output projection's input) without a copy, and its gradient arrives in the same layout;
    else contiguous."""
    B, H, T, _ = q.shape
    if heads_inner(q):
        return torch.empty(B, T, H, dim, dtype=q.dtype, device=q.device).transpose(1, 2)
    return torch.empty(B, H, T, dim, dtype=q.dtype, device=q.device)


@functools.lru_cache(maxsize=64)
def segments_of_rows(B: int, T: int, device: torch.device) -> torch.Tensor:
    """The kernels' ``(B, 3)`` int32 segment table ``(batch row, start, length)`` of whole rows, made
    once per shape. The kernels' ops make it themselves, so ``torch.compile`` never traces it."""
    return device_table(tuple(x for b in range(B) for x in (b, 0, T)), torch.int32, device).view(B, 3)


def segments_of_documents(document_ids: torch.Tensor | None, T: int,
                          device: torch.device) -> tuple[torch.Tensor | None, int]:
    """The kernels' ``(S, 3)`` int32 segment table of every document of every row, each scored as a
    sequence of its own, and the longest length (read on the host once per ids tensor: see
    :func:`~.contract.document_segments`); ``(None, T)`` without documents or where each row is one,
    for which the kernels use :func:`segments_of_rows`. Called inside the kernels' ops, so
    ``torch.compile`` never traces it."""
    if document_ids is None:
        return None, T
    table, longest = document_segments(document_ids, device, torch.int32)
    return (None, T) if len(table) == document_ids.shape[0] else (table, longest)


@triton.jit
def _row_dots_kernel(A, B, OUT, ZEROED, H, T, D, n_zeroed, stride_ab, stride_ah, stride_at, stride_bb, stride_bh,
                     stride_bt, BLOCK: tl.constexpr, DP: tl.constexpr, ZBLOCK: tl.constexpr):
    bh = tl.program_id(1)  # one (batch, head) per column of programs, BLOCK positions per program
    batch = (bh // H).to(tl.int64)
    head = (bh % H).to(tl.int64)
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, DP)
    ok = (t < T)[:, None] & (cols < D)[None, :]
    x = tl.load(A + batch * stride_ab + head * stride_ah + t[:, None].to(tl.int64) * stride_at + cols[None, :],
                mask=ok, other=0.0).to(tl.float32)
    y = tl.load(B + batch * stride_bb + head * stride_bh + t[:, None].to(tl.int64) * stride_bt + cols[None, :],
                mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + bh.to(tl.int64) * T + t, tl.sum(x * y, axis=1), mask=t < T)
    if ZBLOCK > 0:  # this program's run of the zeroed buffer's memory
        program = bh.to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
        at = program * ZBLOCK + tl.arange(0, ZBLOCK)
        tl.store(ZEROED + at, tl.zeros([ZBLOCK], dtype=tl.float32), mask=at < n_zeroed)


def row_dots(a: torch.Tensor, b: torch.Tensor, zeroed: torch.Tensor | None = None) -> torch.Tensor:
    """``(a * b).sum(-1)`` in float32 for two ``(B, H, T, D)`` tensors, each read through its own
    strides (the output and its gradient, transposed views where :func:`empty_rows` made them so):
    the backward's ``delta = rowsum(dO * O)`` in one kernel, where PyTorch takes four (two casts, a
    product, a sum) and writes two float32 copies of the operands. Returns ``(B, H, T)``,
    contiguous. ``zeroed``, a float32 tensor whose elements fill the memory they span (as
    :func:`dense_rows`' and ``empty_like``'s do), is set to zeros in the same launch: the buffer the
    next kernel adds into, without a launch of its own for it."""
    a, b = (x if x.stride(-1) == 1 else x.contiguous() for x in (a, b))
    B, H, T, d = a.shape
    out = torch.empty(B, H, T, dtype=torch.float32, device=a.device)
    dp = pow2(d)
    block = min(max(1, 8192 // dp), pow2(T))  # up to 8192 numbers of each operand per program
    grid = (cdiv(T, block), B * H)
    n_zeroed = 0 if zeroed is None else zeroed.numel()
    launch(_row_dots_kernel, grid, a, b, out, out if zeroed is None else zeroed, H, T, d, n_zeroed,
           *a.stride()[:3], *b.stride()[:3],
           BLOCK=block, DP=dp, ZBLOCK=pow2(cdiv(n_zeroed, grid[0] * grid[1])) if n_zeroed else 0)
    return out
