"""``sattn describe``: parameters, FLOPs and KV-cache size of each attention kind at one shape,
from the layers' own cost formulas (``Attention.cost``)."""

from __future__ import annotations

import argparse

from ..attention import build_attention

DEFAULT_KINDS = "mha,swa:128,global_swa,bilinear_btt,bilinear_mlr,mlr:16|16|16|16,mlr:32|8|6|4|4|4|4|2"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("describe", help="cost table of the attention kinds at one width and context")
    p.add_argument("--d-model", type=int, default=512, help="model width D (default 512)")
    p.add_argument("--n-heads", type=int, default=8, help="query heads (default 8)")
    p.add_argument("--n-kv-heads", type=int, default=None, help="key/value heads for GQA (default n-heads)")
    p.add_argument("--context", type=int, default=1024, help="sequence length T = max_seq_len (default 1024)")
    p.add_argument("--kinds", default=DEFAULT_KINDS, help=f"comma-separated attention specs (default {DEFAULT_KINDS})")
    p.add_argument("--bidirectional", action="store_true", help="count bidirectional instead of causal pairs")
    p.add_argument("--bytes-per-number", type=int, default=2, help="KV-cache element size in bytes (default 2, bf16)")
    p.set_defaults(run=run)


def _si(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def describe_rows(args: argparse.Namespace) -> list[list[str]]:
    rows = []
    for spec in args.kinds.split(","):
        layer = build_attention(
            spec, d_model=args.d_model, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
            max_seq_len=args.context, causal=not args.bidirectional,
        )
        c = layer.cost(args.context)
        rows.append([
            spec, _si(c.params), _si(c.score_flops_per_token), _si(c.total_flops),
            f"{c.kv_cache_bytes_per_token(args.bytes_per_number):.1f}",
        ])
    return rows


def run(args: argparse.Namespace) -> int:
    if args.bytes_per_number <= 0:
        raise ValueError(f"--bytes-per-number: expected a positive integer, got {args.bytes_per_number}")
    header = ["kind", "params", "score FLOPs/token", "attention FLOPs", "KV bytes/token"]
    rows = describe_rows(args)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    mode = "bidirectional" if args.bidirectional else "causal"
    print(f"one attention layer: d_model={args.d_model} n_heads={args.n_heads} n_kv_heads={args.n_kv_heads or args.n_heads}"
          f" T={args.context} ({mode}); FLOPs are multiply-adds for the whole T-token sequence,"
          f" KV cache at {args.bytes_per_number} bytes/number after T tokens")
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))))
    return 0
