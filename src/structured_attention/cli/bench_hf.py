"""``sattn bench hf``: MLR attention inside a Hugging Face Llama (the ``[hf]`` extra).

- a training step (forward, backward, AdamW step) of the same Llama with
  ``attn_implementation="sattn_mlr"`` against ``"sdpa"``, round after round, the ratio the median
  of the per-round ratios (MLR's block sizes ``seq_len / 2^(l-1)``);
- the memory of the compressed cache (``MLRCache.memory_bytes()``) against transformers'
  ``DynamicCache`` holding the same ``--cache-len`` tokens, each filled through its own ``update``.

Writes ``<out>/hf.json`` (environment and records) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from .._cli import parse_device
from .._files import make_folder
from .common import (add_timing_options, bench_environment, check_bench_memory, check_positive_options, parse_ranks,
                     records_table, time_ms)

HF_RANKS = "8|8|8|8|8|8|8|8"


def add_parser(what: argparse._SubParsersAction) -> None:
    p = what.add_parser("hf", help="a Hugging Face Llama's training step with sattn_mlr against sdpa, and the "
                                   "compressed cache's memory against DynamicCache")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    p.add_argument("--hidden", type=int, default=512, help="hidden size (default 512)")
    p.add_argument("--n-heads", type=int, default=8, help="heads; hidden / heads is the head dim (default 8)")
    p.add_argument("--intermediate", type=int, default=None,
                   help="the MLP's intermediate size (default 4 x hidden; Llama's own models use about 2.7 x)")
    p.add_argument("--n-layers", type=int, default=2, help="layers (default 2)")
    p.add_argument("--ranks", default=HF_RANKS, help=f"MLR ranks per level (default {HF_RANKS})")
    p.add_argument("--cache-len", type=int, default=16384, help="tokens in the compared caches (default 16384)")
    p.add_argument("--profile", action="store_true",
                   help="also write hf-profile.txt: torch.profiler's top operators of one step per implementation")
    add_timing_options(p)
    p.set_defaults(run=run)


def _check(args: argparse.Namespace) -> list[int]:
    if args.intermediate is None:
        args.intermediate = 4 * args.hidden
    check_positive_options(args, "seq_len", "batch", "hidden", "n_heads", "intermediate", "n_layers", "cache_len",
                           "repeats")
    parse_device(args.device)
    if args.hidden % args.n_heads:
        raise ValueError(f"--n-heads: expected a divisor of --hidden={args.hidden}, got {args.n_heads}")
    ranks = list(parse_ranks(args.ranks))
    if sum(ranks) != args.hidden // args.n_heads:
        raise ValueError(f"--ranks: expected ranks summing to the head dim {args.hidden // args.n_heads}, "
                         f"got {args.ranks!r}")
    check_bench_memory("--seq-len", args.seq_len, 8 * args.batch * args.seq_len * args.hidden * args.n_layers, args)
    check_bench_memory("--cache-len", args.cache_len, 4 * args.cache_len * args.hidden * args.n_layers, args)
    return ranks


def _llama(args: argparse.Namespace, implementation: str, ranks: list[int], context: int) -> Any:
    """The benchmark's Llama; MLR's block sizes are ``context / 2^(l-1)``."""
    import transformers

    from ..integrations import transformers as sattn_hf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.intermediate,
                                      num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                                      num_key_value_heads=args.n_heads, max_position_embeddings=context)
    sattn_hf.configure(config, ranks)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=implementation,
                                                       dtype=getattr(torch, args.dtype))
    return model.to(args.device).train()


def measure(args: argparse.Namespace, ranks: list[int], profile_path: Path | None = None) -> list[dict[str, Any]]:
    from transformers import DynamicCache

    from ..integrations import transformers as sattn_hf

    sattn_hf.register()
    device = torch.device(args.device)
    idx = torch.randint(0, 256, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(1)).to(device)
    cases = {}
    for name in ("sdpa", sattn_hf.ATTN_IMPLEMENTATION):
        model = _llama(args, name, ranks, args.seq_len)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model: Any = model, optimizer: torch.optim.Optimizer = optimizer) -> None:
            model(idx, labels=idx).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        cases[name] = step
    times: dict[str, list[float]] = {name: [] for name in cases}
    for run in range(args.warmup + args.repeats):
        for name, fn in cases.items():
            ms = time_ms(fn, device)
            if run >= args.warmup:
                times[name].append(ms)
    record: dict[str, Any] = {"seq_len": args.seq_len, "batch": args.batch, "head_dim": args.hidden // args.n_heads,
                              "intermediate": args.intermediate, "ranks": args.ranks}
    record.update({f"{name}_step_ms": statistics.median(ms) for name, ms in times.items()})
    record["speedup"] = statistics.median(s / m for s, m in zip(times["sdpa"], times[sattn_hf.ATTN_IMPLEMENTATION]))
    if profile_path is not None:
        _profile(cases, profile_path, device)

    # Both caches filled with the same keys and values, chunk by chunk, through their own update.
    config = _llama(args, sattn_hf.ATTN_IMPLEMENTATION, ranks, args.cache_len).config
    mlr, dynamic = sattn_hf.MLRCache(config), DynamicCache(config=config)
    head_dim, dtype = args.hidden // args.n_heads, getattr(torch, args.dtype)
    for start in range(0, args.cache_len, 1024):
        n = min(1024, args.cache_len - start)
        for layer in range(args.n_layers):
            k, v = (torch.randn(1, args.n_heads, n, head_dim, dtype=dtype, device=device) for _ in range(2))
            mlr.update(k, v, layer)
            dynamic.update(k, v, layer)
    dynamic_bytes = sum(x.numel() * x.element_size() for layer in dynamic.layers for x in (layer.keys, layer.values))
    record.update({"cache_len": args.cache_len, "mlr_cache_bytes": mlr.memory_bytes(),
                   "dynamic_cache_bytes": dynamic_bytes, "cache_ratio": mlr.memory_bytes() / dynamic_bytes})
    return [record]


def _profile(cases: dict[str, Any], path: Path, device: torch.device) -> None:
    """Where one training step's time goes, per implementation (self time of the top operators)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sections = []
    for name, step in cases.items():
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            step()
        table = prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                          row_limit=15)
        sections.append(f"== {name}, one training step ==\n{table}")
    path.write_text("\n\n".join(sections) + "\n")


def run(args: argparse.Namespace) -> int:
    ranks = _check(args)
    env = bench_environment(args)
    print(f"sattn bench hf on {env['device']} ({env['threads']} threads), torch {env['torch']}, {args.dtype}")
    out = make_folder(args.out, "--out")
    records = measure(args, ranks, out / "hf-profile.txt" if args.profile else None)
    if args.profile:
        print(f"wrote {out / 'hf-profile.txt'}")
    (out / "hf.json").write_text(json.dumps({"environment": env, "results": records}, indent=2))
    print(f"wrote {out / 'hf.json'}")
    print(records_table(records))
    return 0
