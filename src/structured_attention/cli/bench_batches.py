"""``sattn bench varlen`` and ``sattn bench ragged``: what variable-length batches cost.

- ``varlen``: MLR attention forward+backward over packed rows (``document_ids``, one call) against
  the same documents run one call each (the sum of their times), and against the documents padded
  to the longest one as a batch of their own.
- ``ragged``: ``GPT.generate`` tokens/s for a batch of prompts of mixed lengths (left-padded,
  ``attention_mask``) against the same batch size of prompts that all have the longest length:
  of the whole call, and of the decoding steps alone (the call minus a prefill timed on its own).

Both write ``<out>/<what>.json`` (environment and records) and print a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch

from .._cli import parse_device
from .._files import check_folder, make_folder
from ..models import GPT, GPTConfig
from ..ops.mlr import mlr_attention
from .common import (add_timing_options, bench_environment, check_bench_memory, check_positive_options, parse_ranks,
                     records_table, time_ms)

VARLEN_RANKS = "8|8|8|8|8|8|8|8"
RAGGED_KINDS = "mha,mlr:16|16|16|16"


def add_parsers(what: argparse._SubParsersAction) -> None:
    varlen = what.add_parser("varlen", help="time MLR attention over packed documents against one call per document")
    varlen.add_argument("--seq-len", type=int, default=4096, help="tokens per packed row (default 4096)")
    varlen.add_argument("--batch", type=int, default=2, help="packed rows (default 2)")
    varlen.add_argument("--min-doc", type=int, default=64, help="shortest document (default 64)")
    varlen.add_argument("--max-doc", type=int, default=1024, help="longest document (default 1024)")
    varlen.add_argument("--n-heads", type=int, default=8, help="heads (default 8)")
    varlen.add_argument("--ranks", default=VARLEN_RANKS, help=f"MLR ranks per level (default {VARLEN_RANKS})")
    varlen.add_argument("--v-dim", type=int, default=64, help="value head dim (default 64)")
    varlen.add_argument("--seed", type=int, default=0, help="seed of the document lengths (default 0)")
    varlen.add_argument("--lengths", default=None,
                        help="explicit document lengths instead of random ones: rows separated by ';', lengths by ',', "
                             "'NxL' for N documents of L tokens, every row the same total (e.g. '4096;64x64')")
    ragged = what.add_parser("ragged", help="GPT generation tokens/s: prompts of mixed lengths against equal ones")
    ragged.add_argument("--kinds", default=RAGGED_KINDS, help=f"comma-separated attention specs (default {RAGGED_KINDS})")
    ragged.add_argument("--batch", type=int, default=8, help="prompts (default 8)")
    ragged.add_argument("--min-len", type=int, default=64, help="shortest prompt of the mixed batch (default 64)")
    ragged.add_argument("--max-len", type=int, default=1024, help="longest prompt, and every equal prompt (default 1024)")
    ragged.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    ragged.add_argument("--d-model", type=int, default=256, help="width (default 256)")
    ragged.add_argument("--n-layers", type=int, default=4, help="layers (default 4)")
    ragged.add_argument("--n-heads", type=int, default=4, help="heads (default 4)")
    for p in (varlen, ragged):
        add_timing_options(p)
        p.set_defaults(run=run)


def parse_lengths(text: str) -> list[list[int]]:
    """``'4096;64x64'`` -> ``[[4096], [64] * 64]``: rows of document lengths, equal totals."""
    rows = []
    for row in text.split(";"):
        lengths = []
        for item in row.split(","):
            count, _, length = item.strip().rpartition("x")
            try:
                lengths += [int(length)] * (int(count) if count else 1)
            except ValueError:
                raise ValueError(f"--lengths: expected lengths such as '4096;64x64', got {text!r}") from None
        rows.append(lengths)
    if any(n <= 0 for row in rows for n in row) or len({sum(row) for row in rows}) != 1:
        raise ValueError(f"--lengths: expected positive lengths with the same total in every row, got {text!r}")
    return rows


def _check(args: argparse.Namespace) -> None:
    check_positive_options(args, "batch", "n_heads", "repeats")
    if args.warmup < 0:
        raise ValueError(f"--warmup: expected a non-negative integer, got {args.warmup}")
    parse_device(args.device)
    if args.what == "varlen":
        if args.lengths is not None:
            rows = parse_lengths(args.lengths)
            args.batch, args.seq_len = len(rows), sum(rows[0])
        check_positive_options(args, "seq_len", "min_doc", "max_doc", "v_dim")
        if args.lengths is None and not args.min_doc <= args.max_doc <= args.seq_len:
            raise ValueError(f"--max-doc: expected min-doc <= max-doc <= seq-len, got {args.max_doc}")
        ranks = parse_ranks(args.ranks)
        # packed, per-document and padded copies of q, k and v: three sets at least
        check_bench_memory("--seq-len", args.seq_len,
                           3 * args.batch * args.n_heads * args.seq_len * (2 * sum(ranks) + args.v_dim), args)
    else:
        check_positive_options(args, "min_len", "max_len", "new_tokens", "d_model", "n_layers")
        if args.min_len > args.max_len:
            raise ValueError(f"--min-len: expected at most --max-len={args.max_len}, got {args.min_len}")
        # the prompts' input, queries, keys and values in every layer's prefill
        check_bench_memory("--max-len", args.max_len,
                           4 * args.batch * (args.max_len + args.new_tokens) * args.d_model * args.n_layers, args)
        for kind in args.kinds.split(","):
            GPTConfig(d_model=args.d_model, n_heads=args.n_heads, n_layers=1, attention=kind,
                      max_seq_len=args.max_len + args.new_tokens).check_attention()


def document_lengths(seq_len: int, min_doc: int, max_doc: int, seed: int) -> list[int]:
    """Lengths drawn uniformly in ``[min_doc, max_doc]`` until ``seq_len`` is filled; the last
    document takes the rest (at least one token)."""
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], seq_len
    while left > 0:
        n = int(torch.randint(min_doc, max_doc + 1, (1,), generator=g))
        lengths.append(min(n, left))
        left -= lengths[-1]
    return lengths


def measure_varlen(args: argparse.Namespace) -> list[dict[str, Any]]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    ranks = parse_ranks(args.ranks)
    if args.lengths is not None:
        rows = parse_lengths(args.lengths)
    else:
        rows = [document_lengths(args.seq_len, args.min_doc, args.max_doc, args.seed + b) for b in range(args.batch)]
    torch.manual_seed(0)
    shape = (args.batch, args.n_heads, args.seq_len)
    q, k = (torch.randn(*shape, sum(ranks), device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(*shape, args.v_dim, device=device, dtype=dtype, requires_grad=True)
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in rows]).to(device)
    # The call's block sizes are those of the packed row, for every way of running the documents.
    sizes = tuple(args.seq_len // 2**level for level in range(len(ranks)))

    def fwd_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None) -> None:
        mlr_attention(q, k, v, ranks, sizes, document_ids=document_ids).float().sum().backward()

    def leaf(x: torch.Tensor) -> torch.Tensor:
        return x.detach().clone().requires_grad_()

    documents = []
    for b, row in enumerate(rows):
        start = 0
        for n in row:
            documents.append((b, start, n))
            start += n
    alone = [[leaf(x[b : b + 1, :, start : start + n]) for x in (q, k, v)] for b, start, n in documents]
    longest = max(n for _, _, n in documents)
    padded = [torch.zeros(len(documents), args.n_heads, longest, x.shape[-1], device=device, dtype=dtype)
              for x in (q, k, v)]
    for i, (b, start, n) in enumerate(documents):
        for dst, src in zip(padded, (q, k, v)):
            dst[i, :, :n] = src[b, :, start : start + n].detach()
    padded = [leaf(x) for x in padded]
    cases = {
        "packed": lambda: fwd_bwd(q, k, v, ids),
        "per_document_sum": lambda: [fwd_bwd(*parts, None) for parts in alone],
        "padded": lambda: fwd_bwd(*padded, None),  # right padding: causal rows never see it
    }
    # Round after round, every case once; ratios are the medians of the per-round ratios, so a
    # machine whose speed drifts still compares fairly.
    times: dict[str, list[float]] = {name: [] for name in cases}
    for run in range(args.warmup + args.repeats):
        for name, fn in cases.items():
            ms = time_ms(fn, device)
            if run >= args.warmup:
                times[name].append(ms)
    record: dict[str, Any] = {"seq_len": args.seq_len, "batch": args.batch, "documents": len(documents),
                              "longest_document": longest}
    record.update({f"{name}_ms": statistics.median(ms) for name, ms in times.items()})
    for other in ("per_document_sum", "padded"):
        record[f"packed_over_{other}"] = statistics.median(a / b for a, b in zip(times["packed"], times[other]))
    return [record]


def prompt_lengths(batch: int, min_len: int, max_len: int) -> list[int]:
    """``batch`` lengths evenly spaced from ``min_len`` to ``max_len``."""
    if batch == 1:
        return [max_len]
    return [round(min_len + (max_len - min_len) * i / (batch - 1)) for i in range(batch)]


def measure_ragged(args: argparse.Namespace) -> list[dict[str, Any]]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    lengths = prompt_lengths(args.batch, args.min_len, args.max_len)
    mask = torch.zeros(args.batch, args.max_len, dtype=torch.long, device=device)
    for row, n in enumerate(lengths):
        mask[row, args.max_len - n :] = 1
    records = []
    for kind in args.kinds.split(","):
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=256, n_layers=args.n_layers, d_model=args.d_model, n_heads=args.n_heads,
                           max_seq_len=args.max_len + args.new_tokens, attention=kind)
        model = GPT(config).to(device=device, dtype=dtype).eval()
        prompts = torch.randint(0, 256, (args.batch, args.max_len), device=device)
        tokens = args.batch * args.new_tokens
        cases = {}
        for name, attention_mask in (("equal", None), ("mixed", mask)):
            cases[f"{name}_prefill"] = lambda m=attention_mask: model(prompts, caches=model.new_caches(args.batch),
                                                                      attention_mask=m)
            cases[name] = lambda m=attention_mask: model.generate(prompts, args.new_tokens, temperature=0,
                                                                  attention_mask=m)
        # Round after round, every case once; ratios are medians of the per-round ratios.
        times: dict[str, list[float]] = {name: [] for name in cases}
        with torch.no_grad():
            for run in range(args.warmup + args.repeats):
                for name, fn in cases.items():
                    ms = time_ms(fn, device)
                    if run >= args.warmup:
                        times[name].append(ms)
        # tokens/s of the whole call (prefill included), and of the decoding steps alone (the call
        # minus the prefill of the same round)
        decode = {name: [t - p for t, p in zip(times[name], times[f"{name}_prefill"])] for name in ("equal", "mixed")}
        record: dict[str, Any] = {"case": kind, "prompt_lengths": lengths, "new_tokens": args.new_tokens}
        for name in ("equal", "mixed"):
            record[f"{name}_tokens_per_s"] = tokens / (statistics.median(times[name]) / 1e3)
            record[f"{name}_decode_tokens_per_s"] = tokens / (statistics.median(decode[name]) / 1e3)
        record["mixed_over_equal"] = statistics.median(e / m for e, m in zip(times["equal"], times["mixed"]))
        record["decode_mixed_over_equal"] = statistics.median(e / m for e, m in zip(decode["equal"], decode["mixed"]))
        records.append(record)
        print(f"  {kind:28s} tok/s equal {record['equal_tokens_per_s']:9.1f} mixed {record['mixed_tokens_per_s']:9.1f} "
              f"(ratio {record['mixed_over_equal']:.3f}; decoding alone {record['decode_mixed_over_equal']:.3f})",
              flush=True)
    return records


def run(args: argparse.Namespace) -> int:
    _check(args)
    check_folder(args.out, "--out")
    env = bench_environment(args)
    print(f"sattn bench {args.what} on {env['device']} ({env['threads']} threads), torch {env['torch']}, {args.dtype}")
    records = measure_varlen(args) if args.what == "varlen" else measure_ragged(args)
    out = make_folder(args.out, "--out")
    (out / f"{args.what}.json").write_text(json.dumps({"environment": env, "results": records}, indent=2))
    print(f"wrote {out / f'{args.what}.json'}")
    print(records_table(records, skip=("prompt_lengths",)))
    return 0
