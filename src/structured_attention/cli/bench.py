"""``sattn bench attention|mlr|lm``: timings in one run, next to standard attention
(``varlen`` and ``generate``, the costs of variable-length batches, live in :mod:`.bench_batches`).

``attention`` times whole layers of each kind (``mha`` runs PyTorch SDPA); ``mlr`` times the MLR
primitive on ``(B, H, T, R)`` tensors against ``scaled_dot_product_attention`` at the same dims;
``lm`` times a training step's forward and backward of a whole GPT per attention kind (its
training tokens/s).
For each case and sequence length: forward ms and forward+backward ms, peak memory of
forward+backward (CUDA allocator peak; on the CPU the growth of the resident set, sampled in a
fresh process per case), and, for layers, decode ms per token at a given cache length.

A call is timed alone, between two synchronisations: the host's work before its first kernel and
between its kernels counts in full, as in a step whose host is the slower side. With
``--back-to-back N`` each round also times ``N`` calls issued one after another between two
synchronisations (ms per call), as a training loop issues its layers and steps: there the host
prepares the next kernels while the GPU runs the current ones, and only what it cannot hide counts.
On the CPU, where nothing runs ahead, the two agree.

The cases run interleaved, one after another in every round, and the speed-up over the first case
is the median of the per-round ratios, so a machine whose speed drifts still compares fairly.
Writes ``<what>.json``, ``<what>.png`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import multiprocessing
import re
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .._files import check_folder, make_folder
from ..attention import build_attention
from ..ops.mlr import mlr_attention, mlr_attention_reference
from ..ops.mlr.blocked import mlr_attention_blocked
from ..models import GPT, GPTConfig
from ..models.gpt import COMPILE_MODES, check_compile_backend
from . import bench_batches, bench_generate, bench_hf
from .._cli import parse_device, pyplot
from .common import add_timing_options, bench_environment, check_bench_memory, parse_ranks, time_ms

LAYER_KINDS = "mha,swa:128,global_swa:32|32:window=128,mlr:8|8|8|8|8|8|8|8"
LM_KINDS = "mha,swa:128,global_swa:32|32:window=128,mlr:16|16|16|16,mlr:32|16|8|8"
COMPILED = "+compile"  # suffix of a case timed under torch.compile (sattn bench lm --compile)
MLR_PATHS = "sdpa,mlr,mlr_blocked,mlr_reference"
# SDPA cases: PyTorch's own choice of fused kernel, or its flash-attention kernel alone.
_SDPA_BACKENDS = {"sdpa": None, "sdpa_flash": SDPBackend.FLASH_ATTENTION}
_MLR_FUNCTIONS = {"mlr": mlr_attention, "mlr_blocked": mlr_attention_blocked, "mlr_reference": mlr_attention_reference}

Step = Callable[[], Any]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    what = p.add_subparsers(dest="what", required=True)
    layers = what.add_parser("attention", help="time attention layers of each kind against mha (SDPA)")
    layers.add_argument("--kinds", default=LAYER_KINDS, help=f"comma-separated attention specs, the first is the baseline (default {LAYER_KINDS})")
    layers.add_argument("--d-model", type=int, default=512, help="width (default 512)")
    layers.add_argument("--decode-cache", type=int, default=None, help="cache length for decode timing (default: longest seq-len minus decode steps)")
    layers.add_argument("--decode-steps", type=int, default=16, help="tokens decoded per timed run (default 16)")
    lm = what.add_parser("lm", help="time a GPT's training forward+backward per attention kind against mha")
    lm.add_argument("--kinds", default=LM_KINDS, help=f"comma-separated attention specs, the first is the baseline (default {LM_KINDS})")
    lm.add_argument("--d-model", type=int, default=256, help="width (default 256)")
    lm.add_argument("--n-layers", type=int, default=4, help="layers (default 4)")
    lm.add_argument("--compile", action="store_true",
                    help=f"also time every kind's model under torch.compile, as the case '<kind>{COMPILED}' "
                         "(the training loop's run.compile=true)")
    lm.add_argument("--backend", default="inductor", help="torch.compile backend of the --compile cases (default inductor)")
    lm.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                    help="torch.compile mode of the --compile cases (the training loop's run.compile_mode): default, "
                         "reduce-overhead (each step's kernels replayed from CUDA graphs), ... (default default)")
    mlr = what.add_parser("mlr", help="time the MLR attention primitive against scaled_dot_product_attention")
    mlr.add_argument("--paths", default=MLR_PATHS, help=f"comma-separated: sdpa (PyTorch's choice of fused kernel), sdpa_flash (its flash-attention kernel), mlr (dispatched: the C++ kernel on CPU, Triton on CUDA), mlr_blocked (the PyTorch fallback), mlr_reference (default {MLR_PATHS})")
    mlr.add_argument("--ranks", default="8|8|8|8|8|8|8|8", help="MLR ranks per level; their sum is the q/k head dim (default 8|8|8|8|8|8|8|8)")
    mlr.add_argument("--v-dim", type=int, default=64, help="value head dim Dv (default 64)")
    for p in (layers, mlr, lm):
        p.add_argument("--seq-lens", default="1024,2048,4096" if p is not lm else "1024",
                       help="comma-separated sequence lengths (default 1024,2048,4096; lm: 1024)")
        p.add_argument("--n-heads", type=int, default=8 if p is not lm else 4, help="heads (default 8; lm: 4)")
        p.add_argument("--batch", type=int, default=1 if p is not lm else 4, help="batch size (default 1; lm: 4)")
        add_timing_options(p)
        p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
        p.add_argument("--profile", action="store_true", help="also write <what>-profile.txt: torch.profiler's top operators of one forward+backward per case at the longest seq-len")
        p.add_argument("--back-to-back", type=int, default=0, metavar="N",
                       help="also time N calls issued back to back between two synchronisations, per call (default 0: off)")
        p.set_defaults(run=run)
    bench_batches.add_parsers(what)
    bench_generate.add_parser(what)
    bench_hf.add_parser(what)


# -- cases ------------------------------------------------------------------------------------------

def _case_names(args: argparse.Namespace) -> list[str]:
    names = (args.paths if args.what == "mlr" else args.kinds).split(",")
    if getattr(args, "compile", False):
        names += [name + COMPILED for name in names]
    return names


def _build_case(name: str, args: argparse.Namespace, seq_len: int) -> tuple[Step, Step]:
    """(forward, forward+backward) closures of one case at one sequence length."""
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.what == "attention":
        layer = build_attention(name, d_model=args.d_model, n_heads=args.n_heads, max_seq_len=seq_len)
        layer = layer.to(device=device, dtype=dtype)
        x = torch.randn(args.batch, seq_len, args.d_model, device=device, dtype=dtype, requires_grad=True)
        call: Step = lambda: layer(x)  # noqa: E731
        params: list[torch.Tensor] = [x, *layer.parameters()]
    elif args.what == "lm":
        kind = name.removesuffix(COMPILED)
        config = GPTConfig(vocab_size=256, n_layers=args.n_layers, d_model=args.d_model, n_heads=args.n_heads,
                           max_seq_len=seq_len, attention=kind)
        model = GPT(config).to(device=device, dtype=dtype)
        # compiled in the warm-up rounds
        step_model = model
        if name != kind:
            step_model = torch.compile(model, backend=args.backend, mode=args.compile_mode)
        idx = torch.randint(0, 256, (args.batch, seq_len + 1), device=device)

        def call() -> torch.Tensor:
            if step_model is not model:  # as the training loop marks each step (CUDA graphs)
                torch.compiler.cudagraph_mark_step_begin()
            return step_model(idx[:, :-1], idx[:, 1:])[1]
        params = list(model.parameters())
    else:
        ranks = parse_ranks(args.ranks)
        shape = (args.batch, args.n_heads, seq_len)
        q, k = (torch.randn(*shape, sum(ranks), device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        v = torch.randn(*shape, args.v_dim, device=device, dtype=dtype, requires_grad=True)
        params = [q, k, v]
        if name in _SDPA_BACKENDS:
            # SDPA needs equal q/k/v head dims: pad q and k to Dv when the ranks sum to less.
            pad = max(args.v_dim - sum(ranks), 0)
            backend = _SDPA_BACKENDS[name]

            def call() -> torch.Tensor:
                with sdpa_kernel(backend) if backend else contextlib.nullcontext():
                    return F.scaled_dot_product_attention(F.pad(q, (0, pad)), F.pad(k, (0, pad)), v, is_causal=True)
        elif name in _MLR_FUNCTIONS:
            fn = _MLR_FUNCTIONS[name]
            call = lambda: fn(q, k, v, ranks)  # noqa: E731
        else:
            raise ValueError(f"--paths: expected names among {', '.join([*_SDPA_BACKENDS, *_MLR_FUNCTIONS])}, "
                             f"got {name!r}")

    def forward() -> None:
        with torch.no_grad():
            call()

    def forward_backward() -> None:
        for p in params:
            p.grad = None
        call().float().sum().backward()

    return forward, forward_backward


# -- measurements ------------------------------------------------------------------------------------
def _peak_memory_mib(name: str, args: argparse.Namespace, seq_len: int) -> float:
    """Peak memory of one forward+backward above what the case held before it, in MiB."""
    if torch.device(args.device).type == "cuda":
        _, forward_backward = _build_case(name, args, seq_len)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        forward_backward()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_cpu_rss_growth, (name, vars(args), seq_len))


def _cpu_rss_growth(name: str, arg_dict: dict[str, Any], seq_len: int) -> float:
    """In a fresh process: resident-set growth during forward+backward, sampled every 0.2 ms."""
    _, forward_backward = _build_case(name, argparse.Namespace(**arg_dict), seq_len)
    from ..training.loop import resident_mib as rss  # current resident set, MiB (the peak without /proc)

    before, peak, done = rss(), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    forward_backward()
    done.set()
    sampler.join()
    return max(peak[0], rss()) - before


def _decode_ms(spec: str, args: argparse.Namespace, cache_len: int, context: int) -> float:
    """Median ms of one of ``--decode-steps`` one-token steps of the batch after a ``cache_len``
    prompt: the time per token of each sequence."""
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    layer = build_attention(spec, d_model=args.d_model, n_heads=args.n_heads, max_seq_len=context)
    layer = layer.to(device=device, dtype=dtype).eval()
    times = []
    with torch.no_grad():
        tokens = torch.randn(args.batch, args.decode_steps, args.d_model, device=device, dtype=dtype)
        prefilled = layer.new_cache(args.batch)
        layer(torch.randn(args.batch, cache_len, args.d_model, device=device, dtype=dtype), prefilled)
        for run in range(args.warmup + args.repeats):
            cache = copy.deepcopy(prefilled)

            def steps() -> None:
                for t in range(args.decode_steps):
                    layer(tokens[:, t : t + 1], cache)

            ms = time_ms(steps, device) / args.decode_steps
            if run >= args.warmup:
                times.append(ms)
    return statistics.median(times)


def _measures(args: argparse.Namespace) -> dict[str, str]:
    """The record keys of the timings each round takes (each call alone; back to back when asked),
    each with the key of its speed-up over the first case."""
    keys = {"forward_ms": "speedup_forward", "forward_backward_ms": "speedup_forward_backward"}
    if args.back_to_back:
        keys |= {f"{ms}_back_to_back": f"{speedup}_back_to_back" for ms, speedup in keys.items()}
    return keys


def _time_round(steps: tuple[Step, Step], args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """One round of one case: ms of a forward and of a forward+backward, each alone between two
    synchronisations, then (``--back-to-back N``) ms per call of N of each issued back to back."""
    forward, forward_backward = steps
    ms = {"forward_ms": time_ms(forward, device), "forward_backward_ms": time_ms(forward_backward, device)}
    n = args.back_to_back
    if n:
        for key, step in (("forward_ms", forward), ("forward_backward_ms", forward_backward)):
            ms[f"{key}_back_to_back"] = time_ms(lambda step=step: [step() for _ in range(n)], device) / n
    return ms


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    names = _case_names(args)
    seq_lens = [int(t) for t in args.seq_lens.split(",")]
    records = []
    measures = _measures(args)
    for seq_len in seq_lens:
        cases = {name: _build_case(name, args, seq_len) for name in names}
        # per measure (alone, and back to back when asked), per case: the ms of each timed round
        times: dict[str, dict[str, list[float]]] = {key: {n: [] for n in names} for key in measures}
        for round_ in range(args.warmup + args.repeats):
            for name, steps in cases.items():
                for key, ms in _time_round(steps, args, device).items():
                    if round_ >= args.warmup:
                        times[key][name].append(ms)
        base = names[0]
        for name in names:
            record: dict[str, Any] = {"case": name, "seq_len": seq_len}
            for key, speedup in measures.items():
                record[key] = statistics.median(times[key][name])
                record[speedup] = statistics.median(x / y for x, y in zip(times[key][base], times[key][name]))
            if args.back_to_back:
                record["back_to_back_calls"] = args.back_to_back
            if args.what == "lm":
                record["train_tokens_per_s"] = args.batch * seq_len / (record["forward_backward_ms"] / 1e3)
                if args.back_to_back:
                    record["train_tokens_per_s_back_to_back"] = (
                        args.batch * seq_len / (record["forward_backward_ms_back_to_back"] / 1e3))
            if not args.no_memory:
                record["peak_memory_mib"] = _peak_memory_mib(name, args, seq_len)
            records.append(record)
            b2b = (f"  back to back: fwd {record['forward_ms_back_to_back']:9.2f} ms  "
                   f"fwd+bwd {record['forward_backward_ms_back_to_back']:9.2f} ms" if args.back_to_back else "")
            print(f"  {name:28s} T={seq_len:6d}  fwd {record['forward_ms']:9.2f} ms  "
                  f"fwd+bwd {record['forward_backward_ms']:9.2f} ms{b2b}", flush=True)
        del cases
    if args.what == "attention":
        context = max(seq_lens)
        cache_len = args.decode_cache or context - args.decode_steps
        for name in names:
            ms = _decode_ms(name, args, cache_len, context)
            for r in records:
                if r["case"] == name:
                    r.update(decode_ms_per_token=ms, decode_cache_len=cache_len)
        base_ms = records[0]["decode_ms_per_token"]
        for r in records:
            r["speedup_decode"] = base_ms / r["decode_ms_per_token"]
    return records


# -- output -----------------------------------------------------------------------------------------
def plot(records: list[dict[str, Any]], path: Path, title: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "forward_ms", "forward"), (axes[1], "forward_backward_ms", "forward + backward")):
        for name in dict.fromkeys(r["case"] for r in records):
            pts = [(r["seq_len"], r[key]) for r in records if r["case"] == name]
            (line,) = ax.plot(*zip(*pts), marker="o", label=name)
            if f"{key}_back_to_back" in records[0]:
                pts = [(r["seq_len"], r[f"{key}_back_to_back"]) for r in records if r["case"] == name]
                ax.plot(*zip(*pts), marker=".", linestyle="--", color=line.get_color(), label=f"{name}, back to back")
        ax.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="ms", title=f"{title}: {label}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def markdown_table(records: list[dict[str, Any]]) -> str:
    cols = [
        ("case", "case", "{}"), ("seq_len", "T", "{}"), ("forward_ms", "fwd ms", "{:.2f}"),
        ("forward_backward_ms", "fwd+bwd ms", "{:.2f}"), ("peak_memory_mib", "peak MiB", "{:.1f}"),
        ("decode_ms_per_token", "decode ms/token", "{:.3f}"), ("train_tokens_per_s", "train tokens/s", "{:.0f}"),
        ("speedup_forward", "fwd speed-up", "{:.2f}x"),
        ("speedup_forward_backward", "fwd+bwd speed-up", "{:.2f}x"), ("speedup_decode", "decode speed-up", "{:.2f}x"),
        ("forward_ms_back_to_back", "fwd ms, back to back", "{:.2f}"),
        ("forward_backward_ms_back_to_back", "fwd+bwd ms, back to back", "{:.2f}"),
        ("train_tokens_per_s_back_to_back", "train tokens/s, back to back", "{:.0f}"),
        ("speedup_forward_back_to_back", "fwd speed-up, back to back", "{:.2f}x"),
        ("speedup_forward_backward_back_to_back", "fwd+bwd speed-up, back to back", "{:.2f}x"),
    ]
    cols = [c for c in cols if any(c[0] in r for r in records)]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        cells = (c[2].format(r[c[0]]).replace("|", "\\|") if c[0] in r else "" for c in cols)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _check_args(args: argparse.Namespace) -> None:
    """Every argument, before anything is timed: one ValueError line naming the bad one."""
    for name in ("n_heads", "batch", "repeats", "d_model", "decode_steps", "v_dim"):
        value = getattr(args, name, 1)
        if value <= 0:
            raise ValueError(f"--{name.replace('_', '-')}: expected a positive integer, got {value}")
    if args.back_to_back < 0:
        raise ValueError(f"--back-to-back: expected a non-negative integer (0: off), got {args.back_to_back}")
    if args.warmup < 0:
        raise ValueError(f"--warmup: expected a non-negative integer, got {args.warmup}")
    if args.what == "lm" and args.compile_mode != "default" and not args.compile:
        raise ValueError(f"--compile-mode: expected default without --compile (the mode of the --compile cases), "
                         f"got {args.compile_mode}")
    if args.what == "lm" and args.compile:
        check_compile_backend(args.backend, "--backend")
    try:
        seq_lens = [int(t) for t in args.seq_lens.split(",")]
    except ValueError:
        seq_lens = []
    if not seq_lens or min(seq_lens) <= 0:
        raise ValueError(f"--seq-lens: expected comma-separated positive integers, got {args.seq_lens!r}")
    parse_device(args.device)
    if args.what in ("attention", "lm"):
        with torch.device("meta"):  # a malformed spec, or one that does not fit the width or a length, fails here
            for kind, seq_len in itertools.product(_case_names(args), seq_lens):
                try:
                    build_attention(kind.removesuffix(COMPILED), d_model=args.d_model, n_heads=args.n_heads,
                                    max_seq_len=seq_len)
                except ValueError as err:
                    raise ValueError(f"--kinds: {kind.removesuffix(COMPILED)!r} at --seq-lens {seq_len}: {err}") from None
        # the input, queries, keys and values of the longest length
        check_bench_memory("--seq-lens", args.seq_lens, 4 * args.batch * max(seq_lens) * args.d_model, args)
    if args.what == "lm" and args.n_layers <= 0:
        raise ValueError(f"--n-layers: expected a positive integer, got {args.n_layers}")
    if args.what == "attention":
        limit = max(seq_lens) - args.decode_steps
        if limit <= 0:  # the decoding steps follow a cache within the longest length
            raise ValueError(f"--decode-steps: expected fewer than the longest --seq-lens, {max(seq_lens)}, "
                             f"got {args.decode_steps}")
        if args.decode_cache is not None:
            if not 0 < args.decode_cache <= limit:
                raise ValueError(f"--decode-cache: expected 1..{limit} (longest seq-len minus decode steps), got {args.decode_cache}")
    if args.what == "mlr":
        ranks = parse_ranks(args.ranks)
        check_bench_memory("--seq-lens", args.seq_lens,
                           args.batch * args.n_heads * max(seq_lens) * (2 * sum(ranks) + args.v_dim), args)
        unknown = [p for p in _case_names(args) if p not in _SDPA_BACKENDS and p not in _MLR_FUNCTIONS]
        if unknown:
            raise ValueError(f"--paths: expected names among {', '.join([*_SDPA_BACKENDS, *_MLR_FUNCTIONS])}, "
                             f"got {unknown[0]!r}")


def profile(args: argparse.Namespace, path: Path) -> None:
    """Where the time of one forward+backward goes, per case, at the longest sequence length. For
    ``bench mlr`` on CUDA each case's timeline is written beside it too (``trace-CASE.json``, Chrome's
    trace format): the table sums each operator's time, the timeline shows where the GPU waits for
    the host."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    seq_len = max(int(t) for t in args.seq_lens.split(","))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(args.device).type == "cuda" else [])
    sort_by = "self_cuda_time_total" if torch.device(args.device).type == "cuda" else "self_cpu_time_total"
    sections = []
    from ..ops.mlr import blocked as mlr_blocked

    for name in _case_names(args):
        _, forward_backward = _build_case(name, args, seq_len)
        forward_backward()  # warm-up
        # The tiled MLR path splits heads over Python threads the profiler does not follow; profile
        # the same tiles on the calling thread so every operator shows.
        threaded, mlr_blocked._THREADED = mlr_blocked._THREADED, False
        try:
            with torch_profile(activities=activities) as prof:
                forward_backward()
        finally:
            mlr_blocked._THREADED = threaded
        if args.what == "mlr" and torch.device(args.device).type == "cuda":
            prof.export_chrome_trace(str(path.with_name(f"trace-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.json")))
        table = prof.key_averages().table(sort_by=sort_by, row_limit=15)
        sections.append(f"== {name}, T={seq_len}, forward+backward ==\n{table}")
    path.write_text("\n\n".join(sections) + "\n")


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    check_folder(args.out, "--out")
    env = bench_environment(args)
    print(f"sattn bench {args.what} on {env['device']} ({env['threads']} threads), torch {env['torch']}, {args.dtype}")
    records = measure(args)
    out = make_folder(args.out, "--out")
    (out / f"{args.what}.json").write_text(json.dumps({"environment": env, "results": records}, indent=2))
    print(f"wrote {out / f'{args.what}.json'}")
    if plot(records, out / f"{args.what}.png", f"sattn bench {args.what}"):
        print(f"wrote {out / f'{args.what}.png'}")
    if args.profile:
        profile(args, out / f"{args.what}-profile.txt")
        print(f"wrote {out / f'{args.what}-profile.txt'}")
    print(markdown_table(records))
    return 0
