"""Where a GPU waits in a profiler timeline: its idle gaps and what the host ran during each.

    python3 scripts/trace_gaps.py TRACE.json [TRACE.json ...] [--top 6]

Reads the Chrome-format timelines ``sattn bench mlr --profile`` writes on CUDA (``trace-CASE.json``,
one forward+backward) and prints, per file: the span from the host's first operator to the GPU's
last kernel, the GPU's busy time (kernels, copies and fills, overlaps counted once), the wait
before its first kernel, and the longest gaps between its kernels with the host's operators and
CUDA runtime and driver calls (Triton launches through the driver) that overlap each (a
synchronisation or a slow launch shows there).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def _spans(events: list[dict], categories: set[str]) -> list[tuple[float, float, str]]:
    return sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "?")) for e in events
                  if e.get("ph") == "X" and e.get("cat") in categories)


def _busy(spans: list[tuple[float, float, str]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop, _ in spans:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summary(path: Path, top: int) -> str:
    data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    gpu = _spans(events, GPU_CATEGORIES)
    host = _spans(events, {"cpu_op", "cuda_runtime", "cuda_driver", "python_function"})
    if not gpu or not host:
        return f"{path.name}: no GPU or no host events"
    first, last = host[0][0], max(stop for _, stop, _ in gpu)
    lines = [f"{path.name}: span {(last - first) / 1e3:.3f} ms, GPU busy {_busy(gpu) / 1e3:.3f} ms, "
             f"first kernel after {(gpu[0][0] - first) / 1e3:.3f} ms, {len(gpu)} GPU events"]
    gaps, end = [], gpu[0][1]
    for start, stop, name in gpu[1:]:
        if start > end:
            gaps.append((start - end, end, start, name))
        end = max(end, stop)
    for width, start, stop, name in sorted(gaps, reverse=True)[:top]:
        # the host's events overlapping the gap, the longest overlap first (the enclosing phase), then
        # the shorter ones inside it
        during = sorted(((min(b, stop) - max(a, start), a - b, n) for a, b, n in host if a < stop and b > start),
                        reverse=True)
        lines.append(f"  idle {width:8.1f} us before {name[:60]}: "
                     + ", ".join(f"{n[:60]} ({overlap:.0f} us)" for overlap, _, n in during[:8]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=6, help="how many of the longest gaps to list (default 6)")
    args = parser.parse_args()
    for path in args.traces:
        print(summary(path, args.top))


if __name__ == "__main__":
    main()
