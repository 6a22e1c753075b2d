"""``sattn bench generate``: GPT generation speed per attention kind, cache and compilation.

For every kind, batch size and cache length: a GPT prefills a prompt of ``cache_len`` tokens
(timed once), then decodes ``--new-tokens`` tokens greedily, round after round from a copy of the
prefilled caches, in each mode (every mode once per round, in an order rotated from round to round):

- ``eager``: growing caches (:class:`~structured_attention.attention.KVCache`), eager steps;
- ``static``: static caches (:class:`~structured_attention.attention.StaticKVCache`), eager steps;
- ``compiled``: static caches, the one-token step compiled once (``torch.compile``, ``fullgraph``;
  ``--backend``, ``--compile-mode reduce-overhead`` for CUDA graphs) and replayed, what
  ``GPT.generate(cache="static", compile=True)`` does;
- ``exported``: static caches, the one-token step exported once (``torch.export`` of
  :class:`~structured_attention.models.decoding.DecodingStep`) and its program's module called;
- ``aoti`` (not in the default modes: its build takes about a minute a case on a 2-core CPU): the
  exported step, taking the caches as inputs, compiled by AOTInductor into a package, which is
  loaded and called;
- ``graph`` (CUDA only): static caches, the step compiled by ``--backend`` in torch.compile's
  default mode and the choice of the token captured together in one CUDA graph and replayed, one
  call of the host per token, what ``GPT.generate(cache="static", compile=True, cuda_graph=True)``
  does.

Writes ``<out>/generate.json`` (``environment`` and ``results``: one record per case with
``case, batch, cache_len, tokens_per_s, ms_per_token, cache_bytes``, the cache's own report of its
bytes after the run, ``tokens_match_first_mode``: whether the greedy tokens of the mode's last
round are the first mode's, as they are in float32 on the CPU, and more), ``<out>/generate.png``
and a markdown table. ``ms_per_token`` is
the time between two tokens of one sequence, one decoding step of the whole batch (what serving
calls inter-token latency); ``tokens_per_s`` counts every sequence's tokens, ``batch x 1000 /
ms_per_token``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from .._files import check_folder, make_folder
from ..models import GPT, GPTConfig
from ..models.decoding import CapturedDecoding, DecodingStep
from ..models.gpt import COMPILE_MODES, check_compile_backend
from .._cli import number_list, parse_device, pyplot
from .common import (add_timing_options, bench_environment, check_bench_memory, check_positive_options, records_table,
                     time_ms)

GENERATE_KINDS = "mha,mlr:8|8|8|8|8|8|8|8"
MODES = ("eager", "static", "compiled", "exported", "aoti", "graph")


def add_parser(what: argparse._SubParsersAction) -> None:
    p = what.add_parser("generate", help="GPT generation tokens/s per attention kind: growing or static caches, "
                                         "eager or compiled steps")
    p.add_argument("--kinds", default=GENERATE_KINDS, help=f"comma-separated attention specs, the first is the "
                                                           f"baseline (default {GENERATE_KINDS})")
    p.add_argument("--batches", default="1", help="comma-separated batch sizes (default 1)")
    p.add_argument("--cache-lens", default="4096", help="comma-separated prompt lengths, the cache before decoding "
                                                        "(default 4096)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens decoded per timed round (default 16)")
    p.add_argument("--modes", default=None, help=f"comma-separated among {', '.join(MODES)} (default all but aoti; "
                                                 "graph on CUDA only)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled mode (default inductor)")
    p.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                   help="torch.compile mode of the compiled mode: default, or reduce-overhead (CUDA graphs), ...")
    p.add_argument("--d-model", type=int, default=512, help="width (default 512)")
    p.add_argument("--n-heads", type=int, default=8, help="heads (default 8)")
    p.add_argument("--n-layers", type=int, default=2, help="layers (default 2)")
    add_timing_options(p)
    p.set_defaults(run=run)


def _check(args: argparse.Namespace) -> tuple[list[int], list[int], list[str]]:
    check_positive_options(args, "new_tokens", "d_model", "n_heads", "n_layers", "repeats")
    parse_device(args.device)
    if args.warmup < 0:
        raise ValueError(f"--warmup: expected a non-negative integer, got {args.warmup}")
    batches, lens = number_list(args.batches, "--batches"), number_list(args.cache_lens, "--cache-lens")
    cuda = torch.device(args.device).type == "cuda"
    modes = args.modes.split(",") if args.modes is not None else [m for m in MODES if m != "aoti" and (cuda or m != "graph")]
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"--modes: expected names among {', '.join(MODES)}, got {args.modes!r}")
    if "graph" in modes and not cuda:
        raise ValueError(f"--modes: expected no graph on device {args.device} (CUDA graphs need a CUDA device)")
    if "compiled" in modes or "graph" in modes:
        check_compile_backend(args.backend, "--backend")
    if args.compile_mode != "default" and "compiled" not in modes:
        raise ValueError(f"--compile-mode: expected default without the compiled mode in --modes (the mode of "
                         f"the compiled steps), got {args.compile_mode}")
    # the prefill's queries, keys and values in every layer, for the largest case
    check_bench_memory("--cache-lens", max(lens),
                       4 * max(batches) * (max(lens) + args.new_tokens) * args.d_model * args.n_layers, args)
    for kind in args.kinds.split(","):
        GPTConfig(d_model=args.d_model, n_heads=args.n_heads, n_layers=1, attention=kind,
                  max_seq_len=max(lens) + args.new_tokens).check_attention()
    return batches, lens, modes


def _cache_bytes(caches: list[Any]) -> int:
    return sum(cache.nbytes for cache in caches)


def measure(args: argparse.Namespace, batches: list[int], lens: list[int], modes: list[str]) -> list[dict[str, Any]]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    records: list[dict[str, Any]] = []
    for cache_len in lens:
        for batch in batches:
            for kind in args.kinds.split(","):
                torch.manual_seed(0)
                config = GPTConfig(vocab_size=256, n_layers=args.n_layers, d_model=args.d_model, n_heads=args.n_heads,
                                   max_seq_len=cache_len + args.new_tokens, attention=kind)
                model = GPT(config).to(device=device, dtype=dtype).eval()
                records += _measure_kind(model, kind, batch, cache_len, modes, args)
    base: dict[tuple[Any, ...], float] = {}
    for r in records:  # each mode's speed against the first kind's in the same mode, batch and cache
        key = (r["mode"], r["batch"], r["cache_len"])
        r["over_first_kind"] = r["tokens_per_s"] / base.setdefault(key, r["tokens_per_s"])
    return records


@torch.no_grad()
def _measure_kind(model: GPT, kind: str, batch: int, cache_len: int, modes: list[str],
                  args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    prompt = torch.randint(0, 256, (batch, cache_len), generator=torch.Generator().manual_seed(1)).to(device)
    prefilled = model.new_caches(batch)
    prefill_ms = time_ms(lambda: model(prompt, caches=prefilled), device)
    first = prompt[:, -1:]
    steps = {mode: model._decode_step for mode in modes}
    if "compiled" in modes:
        torch._dynamo.reset()  # every case's step compiled afresh: no case adds to another's recompile limit
        steps["compiled"] = torch.compile(model._decode_step, fullgraph=True, dynamic=False, backend=args.backend,
                                          mode=args.compile_mode)
    if "graph" in modes:  # a function of its own: its compiled code is not the compiled mode's
        steps["graph"] = torch.compile(lambda token, caches: model._decode_step(token, caches), fullgraph=True,
                                       dynamic=False, backend=args.backend)

    # Static caches are made once per mode and refilled in place each round, as a server reuses
    # them: a graph captured on their tensors then replays instead of being recorded again.
    prompt_static = [block.attn.static_cache(c) for block, c in zip(model.blocks, copy.deepcopy(prefilled))]
    static = {mode: copy.deepcopy(prompt_static) for mode in modes if mode != "eager"}

    if "exported" in modes:  # the program's buffers are the mode's caches, which fresh() refills in place
        exported = torch.export.export(DecodingStep(model, static["exported"]), (first,)).module()
        steps["exported"] = lambda token, caches: exported(token)
    if "aoti" in modes:  # a package reads its inputs with the example's strides: contiguous tokens
        step = DecodingStep(model, static["aoti"], inputs=True)
        with tempfile.TemporaryDirectory() as folder:
            package = torch._inductor.aoti_load_package(torch._inductor.aoti_compile_and_package(
                torch.export.export(step, (first.contiguous(), step.tensors())), package_path=f"{folder}/step.pt2"))
        steps["aoti"] = lambda token, caches: package(token.contiguous(), step.tensors())

    def fresh(mode: str) -> list[Any]:
        if mode == "eager":
            return copy.deepcopy(prefilled)
        return [live.copy_(prompt) for live, prompt in zip(static[mode], prompt_static)]

    # the graph mode's steps, captured in its first round on its static caches (refilled in place)
    graphed = CapturedDecoding(lambda token: steps["graph"](token, static["graph"]), lambda x: x.argmax(-1), batch,
                               args.new_tokens, device) if "graph" in modes else None
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    held: dict[str, int] = {}
    generated: dict[str, torch.Tensor] = {}  # each mode's tokens of its latest round
    for run in range(args.warmup + args.repeats):
        # round after round, every mode once, the order rotated: on the Xeon a round's first mode
        # ran its steps about 1.07x faster than its last, whichever it was
        for mode in modes[run % len(modes):] + modes[:run % len(modes)]:
            caches, made = fresh(mode), []

            def generate(caches: list[Any] = caches, step: Any = steps[mode], graph: bool = mode == "graph",
                         made: list[torch.Tensor] = made) -> None:
                if graph:
                    graphed.start(first[:, 0])
                    for _ in range(args.new_tokens):
                        graphed()
                    return
                token = first
                for _ in range(args.new_tokens):
                    token = step(token, caches)[:, -1].argmax(-1, keepdim=True)
                    made.append(token)

            ms = time_ms(generate, device)
            generated[mode] = graphed.tokens[:, 1:].clone() if mode == "graph" else torch.cat(made, dim=1)
            held[mode] = _cache_bytes(caches)
            if run >= args.warmup:
                times[mode].append(ms)
    records = []
    for mode in modes:
        ms = statistics.median(times[mode]) / args.new_tokens
        case = kind if mode == "eager" else f"{kind}+{mode}"
        records.append({"case": case, "kind": kind, "mode": mode, "batch": batch, "cache_len": cache_len,
                        "tokens_per_s": batch * 1e3 / ms, "ms_per_token": ms, "prefill_ms": prefill_ms,
                        "cache_bytes": held[mode], "cache_bytes_per_token": held[mode] / (cache_len + args.new_tokens),
                        "tokens_match_first_mode": torch.equal(generated[mode], generated[modes[0]])})
        print(f"  {case:36s} batch {batch:3d} cache {cache_len:6d}: {records[-1]['tokens_per_s']:10.1f} tok/s "
              f"({ms:.3f} ms/step)" + ("" if records[-1]["tokens_match_first_mode"] else
                                       f"; other tokens than {modes[0]}'s"), flush=True)
    return records


def plot(records: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Tokens/s per case, one panel per (batch, cache length)."""
    plt = pyplot()
    if plt is None:
        return False
    panels = sorted({(r["batch"], r["cache_len"]) for r in records})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (batch, cache_len) in zip(axes[0], panels):
        rows = [r for r in records if (r["batch"], r["cache_len"]) == (batch, cache_len)]
        ax.barh([r["case"] for r in rows], [r["tokens_per_s"] for r in rows])
        ax.set_xlabel("tokens/s")
        ax.set_title(f"batch {batch}, cache {cache_len}")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> int:
    batches, lens, modes = _check(args)
    check_folder(args.out, "--out")
    env = bench_environment(args)
    print(f"sattn bench generate on {env['device']} ({env['threads']} threads), torch {env['torch']}, {args.dtype}")
    records = measure(args, batches, lens, modes)
    out = make_folder(args.out, "--out")
    (out / "generate.json").write_text(json.dumps({"environment": env, "results": records}, indent=2))
    print(f"wrote {out / 'generate.json'}")
    if plot(records, out / "generate.png", f"sattn bench generate ({env['device']}, {args.dtype})"):
        print(f"wrote {out / 'generate.png'}")
    print(records_table(records, skip=("kind",)))
    return 0
