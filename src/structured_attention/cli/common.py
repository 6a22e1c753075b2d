"""What the ``sattn bench`` commands share: timing options and medians, the environment a
benchmark ran on, memory checks of its sizes, tables of its records."""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from typing import Any

from .._cli import markdown_cell

__all__ = ["add_timing_options", "bench_environment", "check_bench_memory", "check_positive_options", "parse_ranks",
           "records_table", "time_ms"]


def add_timing_options(p: argparse.ArgumentParser) -> None:
    """The options every ``sattn bench`` benchmark takes: dtype, device, rounds and output folder."""
    import torch

    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; medians are reported (default 3)")
    p.add_argument("--out", default="runs/bench", help="folder for the results (default runs/bench)")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def time_ms(fn: Callable[[], Any], device: Any) -> float:
    """Milliseconds of one call of ``fn``, the device synchronised before and after (CUDA)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def check_positive_options(args: argparse.Namespace, *names: str) -> None:
    """One-line ``ValueError`` naming the first of ``names`` (option dests) that is not a positive integer."""
    for name in names:
        value = getattr(args, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"--{name.replace('_', '-')}: expected a positive integer, got {value}")


def records_table(records: list[dict[str, Any]], skip: tuple[str, ...] = ()) -> str:
    """A markdown table of benchmark records, one column per key of the first (floats to 3 places;
    the ``|`` of attention specs such as ``mlr:8|8`` escaped, which would otherwise split cells)."""
    def cell(value: Any) -> str:
        return f"{value:.3f}" if isinstance(value, float) else markdown_cell(str(value))

    keys = [k for k in records[0] if k not in skip]
    lines = ["| " + " | ".join(map(cell, keys)) + " |", "|" + "---|" * len(keys)]
    for r in records:
        lines.append("| " + " | ".join(cell(r[k]) for k in keys) + " |")
    return "\n".join(lines)


def parse_ranks(text: str) -> tuple[int, ...]:
    """``'8|8|4'`` or ``'8+8+4'`` -> ``(8, 8, 4)``: the ``--ranks`` option of the benchmarks; one-line
    ``ValueError`` naming ``--ranks`` otherwise."""
    from ..attention.config import parse_levels

    ranks = parse_levels(text)
    if not ranks:
        raise ValueError(f"--ranks: expected positive integers separated by '|' or '+', got {text!r}")
    return ranks


def check_bench_memory(option: str, value: object, floats: int, args: argparse.Namespace) -> None:
    """One-line ``ValueError`` naming ``option`` when a benchmark's inputs and their gradients,
    ``floats`` numbers of ``args.dtype``, alone exceed the memory available on the device."""
    import torch

    from ..training.memory import available_memory, format_bytes

    device = torch.device(args.device)
    need, have = 2 * floats * getattr(torch, args.dtype).itemsize, available_memory(device)
    if need > have:
        raise ValueError(f"{option}: expected sizes that fit the memory available on the {device.type} device "
                         f"({format_bytes(have)}), "
                         f"got {value}, whose inputs and their gradients alone take {format_bytes(need)}")


def bench_environment(args: argparse.Namespace) -> dict[str, Any]:
    """What a benchmark ran on: the device's name, threads, versions and every setting."""
    import torch

    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    settings = {k: v for k, v in vars(args).items() if k not in ("run", "command", "out")}
    return {"device": name, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "settings": settings}
