"""``sattn coordcheck``: muP's coordinate check (Yang et al. 2022, Tensor Programs V, section 7).

A GPT of each attention kind is built at several widths (the head dim kept, heads in proportion),
in the standard parametrisation (``sp``: N(0, 0.02) weights, one learning rate, ``1/sqrt(d)``
logits) and in muP (``mup``: :func:`~structured_attention.models.transformer.mup_init_`, muP's Adam
learning rates from ``optim.mup``, ``8/d`` attention logits and the tied read-out's output
multiplier), and trained a few Adam steps on random tokens from one seed. After each step the
mean absolute value of every layer's output on a fixed batch is recorded: the size of a
coordinate. Under muP it stays the same whatever the width; under SP the outputs that updates
reach grow with it (logits about in proportion).

Writes ``coordcheck.json`` (one row per kind, parametrisation, width, step and layer),
``coordcheck.png`` (each layer's coordinate size after the last step against the width) and prints
the spread (largest over smallest across widths) of every kind and parametrisation.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._files import check_folder, make_folder
from ..models.gpt import GPT, GPTConfig
from ..training.config import OptimConfig
from ..training.optim import build_optimizer
from .._cli import kind_list, number_list, one_line_warnings, pyplot

DEFAULT_KINDS = "mha;mlr:8|8|8|8;bilinear_btt:1"
PARAMETRISATIONS = ("sp", "mup")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coordcheck", help="muP's coordinate check: each layer's activation size against width")
    p.add_argument("--kinds", default=DEFAULT_KINDS, help=f"';'-separated attention specs (default {DEFAULT_KINDS})")
    p.add_argument("--widths", default="64,128,256,512,1024", help="comma-separated d_model values (default 64..1024)")
    p.add_argument("--head-dim", type=int, default=32, help="head dim; heads = width / head-dim (default 32)")
    p.add_argument("--base-width", type=int, default=64, help="muP's base width (default 64)")
    p.add_argument("--steps", type=int, default=5, help="Adam steps (default 5)")
    p.add_argument("--lr", type=float, default=1e-2, help="learning rate (muP: at the base width; default 1e-2)")
    p.add_argument("--seeds", type=int, default=3, help="seeds averaged (default 3)")
    p.add_argument("--out", default="runs/coordcheck", help="folder for the JSON and PNG (default runs/coordcheck)")
    p.set_defaults(run=run)


def model_config(spec: str, width: int, head_dim: int, parametrisation: str, base_width: int) -> GPTConfig:
    mup = parametrisation == "mup"
    return GPTConfig(d_model=width, n_heads=width // head_dim, n_layers=2, max_seq_len=64, vocab_size=256,
                     attention=spec, attn_scale="mup8" if mup else "sp", mup_base_width=base_width if mup else None)


def coordinate_sizes(config: GPTConfig, steps: int, lr: float, seed: int) -> list[dict[str, Any]]:
    """The mean absolute value of each layer's output (the embeddings, every block's attention, MLP
    and output, the logits) on a fixed batch, before training and after each of ``steps`` Adam
    steps (warm-up and decay off, no clipping or weight decay) on random tokens."""
    torch.manual_seed(seed)
    model = GPT(config)
    settings = OptimConfig(lr=lr, warmup_steps=0, schedule="constant", weight_decay=0.0, grad_clip=0.0)
    if config.mup_base_width is not None:
        settings = dataclasses.replace(settings, mup=True, mup_base_width=config.mup_base_width)
    optim = build_optimizer(model, settings)
    for group in optim.param_groups:  # muP's multipliers, as the training loop applies them
        group["lr"] = lr * group["lr_mult"]
    sites: dict[str, nn.Module] = {"embedding": model.tok_emb}
    for i, block in enumerate(model.blocks):
        sites.update({f"block{i}.attn": block.attn, f"block{i}.mlp": block.mlp, f"block{i}": block})
    seen: dict[str, float] = {}
    for name, module in sites.items():
        module.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, out.abs().mean().item()))
    gen = torch.Generator().manual_seed(seed)
    probe = torch.randint(0, config.vocab_size, (8, config.max_seq_len), generator=gen)
    rows = []
    for step in range(steps + 1):
        with torch.no_grad():
            logits, _ = model(probe)
        rows += [{"step": step, "site": site, "size": size} for site, size in {**seen, "logits": logits.abs().mean().item()}.items()]
        if step < steps:
            tokens = torch.randint(0, config.vocab_size, (8, config.max_seq_len + 1), generator=gen)
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
            optim.zero_grad()
            loss.backward()
            optim.step()
    return rows


def coord_check(kinds: list[str], widths: list[int], head_dim: int = 32, base_width: int = 64, steps: int = 5,
                lr: float = 1e-2, seeds: int = 3) -> list[dict[str, Any]]:
    """Every kind x parametrisation x width's :func:`coordinate_sizes`, averaged over ``seeds``."""
    out = []
    for spec in kinds:
        for parametrisation in PARAMETRISATIONS:
            for width in widths:
                config = model_config(spec, width, head_dim, parametrisation, base_width)
                runs = [coordinate_sizes(config, steps, lr, seed) for seed in range(seeds)]
                for rows in zip(*runs):
                    out.append({"kind": spec, "parametrisation": parametrisation, "width": width, "step": rows[0]["step"],
                                "site": rows[0]["site"], "size": sum(r["size"] for r in rows) / len(rows)})
    return out


def spreads(rows: list[dict[str, Any]]) -> dict[tuple[str, str, str], float]:
    """Largest over smallest coordinate size across widths after the last step, per (kind,
    parametrisation, layer)."""
    last = max(r["step"] for r in rows)
    sizes: dict[tuple[str, str, str], list[float]] = {}
    for r in rows:
        if r["step"] == last:
            sizes.setdefault((r["kind"], r["parametrisation"], r["site"]), []).append(r["size"])
    return {key: max(v) / min(v) for key, v in sizes.items()}


def run(args: argparse.Namespace) -> int:
    kinds = kind_list(args.kinds, "coordcheck")
    widths = number_list(args.widths, "--widths", minimum=1)
    for name in ("head_dim", "base_width", "steps", "seeds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    bad = [w for w in [*widths, args.base_width] if w % args.head_dim]
    if bad:
        raise ValueError(f"--widths: expected multiples of --head-dim={args.head_dim}, got {bad[0]}")
    for spec, width in itertools.product(kinds, widths):  # every model, before any trains
        try:
            model_config(spec, width, args.head_dim, "mup", args.base_width).check_attention()
        except ValueError as err:
            raise ValueError(f"--kinds: {spec!r} at width {width}: {err}") from None
    check_folder(args.out, "--out")
    with one_line_warnings("coordcheck"):
        rows = coord_check(kinds, widths, args.head_dim, args.base_width, args.steps, args.lr, args.seeds)
    out = make_folder(args.out, "--out")
    (out / "coordcheck.json").write_text(json.dumps({"widths": widths, "steps": args.steps, "lr": args.lr,
                                                      "base_width": args.base_width, "rows": rows}, indent=1) + "\n")
    print(f"| kind | parametrisation | largest spread across widths {widths[0]}..{widths[-1]} (layer) | logits' spread |")
    print("|---|---|---|---|")
    spread = spreads(rows)
    for spec in kinds:
        for parametrisation in PARAMETRISATIONS:
            mine = {site: s for (k, p, site), s in spread.items() if k == spec and p == parametrisation}
            worst = max(mine, key=mine.get)
            print(f"| `{spec}` | {parametrisation} | {mine[worst]:.2f}x ({worst}) | {mine['logits']:.2f}x |")
    _plot(rows, kinds, widths, out / "coordcheck.png")
    print(f"wrote {out / 'coordcheck.json'} and {out / 'coordcheck.png'}")
    return 0


def _plot(rows: list[dict[str, Any]], kinds: list[str], widths: list[int], path: Path) -> None:
    plt = pyplot()
    last = max(r["step"] for r in rows)
    fig, axes = plt.subplots(len(kinds), len(PARAMETRISATIONS), figsize=(9, 3 * len(kinds)), squeeze=False, sharey="row",
                             sharex=True)
    for i, spec in enumerate(kinds):
        for j, parametrisation in enumerate(PARAMETRISATIONS):
            ax = axes[i][j]
            mine = [r for r in rows if r["kind"] == spec and r["parametrisation"] == parametrisation and r["step"] == last]
            for site in dict.fromkeys(r["site"] for r in mine):
                points = sorted((r["width"], r["size"]) for r in mine if r["site"] == site)
                ax.plot(*zip(*points), marker="o", label=site)
            ax.set(xscale="log", yscale="log", title=f"{spec}, {parametrisation}")
            ax.set_xticks(widths, [str(w) for w in widths])
            if i == len(kinds) - 1:
                ax.set_xlabel("width (d_model)")
            if j == 0:
                ax.set_ylabel(f"mean |output| after {last} steps")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
