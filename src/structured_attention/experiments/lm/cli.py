"""``sattn train lm``, ``sattn eval`` (of a language-model checkpoint), ``sattn generate`` and
``sattn sweep lm``: the language model.

```
sattn train lm [--config FILE] [section.key=value ...] [--resume]
sattn eval --checkpoint DIR [--source PATH] [--max-batches N] [--pack-documents | --no-pack-documents]
sattn generate --checkpoint DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S]
sattn sweep lm [--config FILE] --widths 64,128,256 --kinds "mha;swa:128;mlr:16|8|4|4" --lrs 1e-3,3e-3
```

Mistakes in what the user gave (a missing or empty corpus, an unknown attention kind or config
key, a missing, corrupt or mismatched checkpoint) raise ``ValueError`` / ``FileNotFoundError``,
which ``sattn`` prints as one line before exiting with status 2.

The sweep matches training FLOPs per width: the budget is what ``--base-steps`` steps of the first
kind cost (``steps x tokens per step x GPT.training_flops_per_token``, 2 FLOPs per multiply-add,
forward and backward, counting each attention kind's own cost); every other kind trains for as
many steps as the same budget buys. ``sattn plot`` draws loss versus FLOPs and a markdown table.
"""

from __future__ import annotations

import argparse
import codecs
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from . import LMConfig, LMTask
from ...models.gpt import GPT, check_compile_backend
from ...training.budget import steps_for_flops
from ...training.checkpoint import LoadedCheckpoint
from ...training import memory
from ..._cli import kind_list, markdown_cell, number_list, one_line_warnings, parse_device, pyplot
from ..common import add_sweep_parser, add_train_parser, best_per_kind_width, slug, run_sweep as sweep

EXPERIMENT = LMTask.experiment  # the name its checkpoints record
NOUN = "a language model"  # in messages: "expected a language model's checkpoint"
# sattn eval's own flags for this experiment's checkpoints (flag -> argparse keywords)
EVAL_FLAGS: dict[str, dict[str, Any]] = {
    "--source": {"help": "evaluate on this corpus's validation split instead of the training one"},
    "--max-batches": {"type": int, "help": "cap on validation batches (default: the whole split)"},
    "--pack-documents": {"action": argparse.BooleanOptionalAction,
                         "help": "reset attention and positions at document boundaries, or not "
                                 "(default: as the checkpoint trained, its data.pack_documents)"},
}


def add_parsers(top: argparse._SubParsersAction, train: argparse._SubParsersAction,
                sweep: argparse._SubParsersAction) -> None:
    add_train_parser(train, EXPERIMENT, "train a GPT language model",
                     "Train a GPT language model from a YAML config plus section.key=value overrides, "
                     "e.g. model.attention=mlr:16|16|16|16 optim.lr=3e-3 run.steps=2000.", run_train_lm, LMConfig)

    g = top.add_parser("generate", help="sample text from a language-model checkpoint, streamed to stdout")
    g.add_argument("--checkpoint", required=True, help="checkpoint folder, its ckpt/ folder or the run's out_dir")
    g.add_argument("--prompt", required=True, help="the text to continue")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    g.add_argument("--cache", choices=["growing", "static"], default=None,
                   help="KV caches: growing (touch only what a token attends to) or static (fixed shapes; "
                        "default: static with --compile or --cuda-graph, else growing)")
    g.add_argument("--compile", nargs="?", const=True, default=False, metavar="MODE_OR_BACKEND",
                   help="compile the one-token step once and replay it (torch.compile; optionally a mode such as "
                        "reduce-overhead, CUDA graphs, or a backend name)")
    g.add_argument("--cuda-graph", action="store_true",
                   help="capture the one-token step (compiled with --compile) and the choice of the next token in "
                        "one CUDA graph and replay it: one call of the host per token (CUDA, static caches)")
    g.set_defaults(run=run_generate)

    s = add_sweep_parser(sweep, EXPERIMENT, "widths x attention kinds x learning rates at matched training FLOPs",
                         "runs/sweep-lm", run_sweep)
    s.add_argument("--widths", default="64,128,256", help="comma-separated d_model values (default 64,128,256)")
    s.add_argument("--head-dim", type=int, default=32, help="head dim; heads = width / head-dim (default 32)")
    s.add_argument("--kinds", default="mha;swa:128;global_swa:16|16;mlr:16|8|4|4",
                   help="';'-separated attention specs; the first sets the FLOP budget (default mha;swa:128;global_swa:16|16;mlr:16|8|4|4)")
    s.add_argument("--lrs", default="1e-3,3e-3", help="comma-separated learning rates (default 1e-3,3e-3)")
    s.add_argument("--base-steps", type=int, default=300, help="steps of the first kind at each width (default 300)")


def run_train_lm(args: argparse.Namespace) -> int:
    from . import load_lm_config, train_lm

    config = load_lm_config(args.config, args.overrides)
    with one_line_warnings("train"):
        result = train_lm(config, resume=args.resume)
    if result.rank == 0:
        print(f"final validation loss {result.val_loss:.4f} nats/token, {result.val_bpb:.4f} bits per byte")
        print(f"trained {result.steps} steps, {result.tokens:,} tokens in {result.wall_s:.1f} s; checkpoint {result.checkpoint}")
        if result.sample:
            print("sample:")
            print(result.sample)
    return 0


def _check_eval_memory(batch_size: int, name: str, n_tokens: int, seq_len: int, vocab_size: int,
                       device: Any) -> None:
    """One line naming the batch size when a batch's logits and their log-softmax (float32, both
    held at once by the loss) cannot fit the memory available, instead of an allocator error or a
    swap storm; a batch holds at most the split's windows."""
    seq_len = min(seq_len, n_tokens - 1)
    per_row = 8 * seq_len * vocab_size
    rows = min(batch_size, (n_tokens - 1) // seq_len)
    limit = memory.available_memory(device)
    if rows * per_row > limit:
        raise ValueError(f"{name}: expected at most {max(limit // per_row, 1):,} sequences per batch on this "
                         f"{device.type} device (each of {seq_len} tokens with a vocabulary of {vocab_size:,}: "
                         f"{memory.format_bytes(per_row)} of logits), got {batch_size:,}, whose {rows:,} sequences need "
                         f"{memory.format_bytes(rows * per_row)} against the {memory.format_bytes(limit)} available")


def run_eval(args: argparse.Namespace, ckpt: LoadedCheckpoint) -> int:
    """``sattn eval`` on a language-model checkpoint: validation loss and bits per byte."""
    from ...data import load_corpus
    from . import evaluate_lm, load_lm

    model, tokenizer, config, ckpt = load_lm(ckpt, device=args.device)
    d = config.data
    # Encoded with the model's own tokenizer (the checkpoint's): another text's char vocabulary, or
    # a tokenizer.json changed since training, would encode the text otherwise.
    corpus = load_corpus(args.source if args.source is not None else d.source, tokenizer=tokenizer,
                         val_fraction=d.val_fraction, cache_dir=d.cache_dir)
    val = corpus.val
    if len(val) < 2:
        raise ValueError(f"--source: the validation split has {len(val)} tokens; at least 2 are needed")
    batch_size = args.batch_size or config.run.batch_size
    _check_eval_memory(batch_size, "--batch-size" if args.batch_size else f"run.batch_size of {ckpt.path}",
                       len(val), config.run.seq_len, model.config.vocab_size, args.device)
    packed = d.pack_documents if args.pack_documents is None else args.pack_documents
    starts = corpus.val_document_starts if packed else None
    loss = evaluate_lm(model, val, batch_size, config.run.seq_len, args.max_batches, args.device, "none",
                       document_starts=starts)
    bpb = corpus.bits_per_byte(loss)
    print(f"checkpoint {ckpt.path} (step {ckpt.step}) on {corpus.source} validation split ({len(val):,} tokens, "
          f"{len(corpus.val_document_starts):,} documents, {'packed' if packed else 'not packed'})")
    print(f"val loss {loss:.4f} nats/token, {bpb:.4f} bits per byte")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from . import load_lm

    if not args.prompt:
        raise ValueError("--prompt: expected at least one character, got ''")
    # the flags' own checks before the model loads and the prompt is echoed (generate's would name
    # its parameters, not the flags, after the prompt had been printed)
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens: expected a non-negative integer, got {args.max_new_tokens}")
    if args.top_k is not None and args.top_k <= 0:
        raise ValueError(f"--top-k: expected a positive integer, got {args.top_k}")
    if not args.temperature >= 0:  # NaN too
        raise ValueError(f"--temperature: expected a non-negative number, got {args.temperature}")
    if isinstance(args.compile, str):
        check_compile_backend(args.compile, "--compile", modes=True)
    device = parse_device(args.device)
    cache = args.cache or ("static" if args.compile or args.cuda_graph else "growing")
    if (args.compile or args.cuda_graph) and cache != "static":
        raise ValueError("--cache: expected static with --compile or --cuda-graph (a compiled or captured step takes "
                         "fixed shapes), got growing")
    if args.cuda_graph and device.type != "cuda":
        raise ValueError(f"--cuda-graph: expected a CUDA --device (CUDA graphs), got {args.device}")
    with one_line_warnings("generate"):
        model, tokenizer, _, _ = load_lm(args.checkpoint, device=device)
    ids = tokenizer.encode(args.prompt)
    room = model.config.max_seq_len - len(ids)
    if room < 1:
        raise ValueError(f"--prompt: expected fewer tokens than the model's {model.config.max_seq_len} positions "
                         f"(room for one new token at least), got {len(ids)} tokens")
    if room < args.max_new_tokens:
        raise ValueError(
            f"--max-new-tokens: the prompt takes {len(ids)} of the model's {model.config.max_seq_len} positions, "
            f"so at most {room} new tokens fit, got {args.max_new_tokens}"
        )
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    if tokenizer.name == "byte":  # multi-byte UTF-8 characters arrive one byte at a time
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def emit(token: torch.Tensor) -> None:
            out.write(decoder.decode(bytes([int(token[0])])))
            out.flush()
    else:

        def emit(token: torch.Tensor) -> None:
            out.write(tokenizer.decode([int(token[0])]))
            out.flush()

    gen = torch.Generator(device).manual_seed(args.seed)
    model.generate(
        torch.tensor([ids], device=device), args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        on_token=emit, generator=gen, cache=cache, compile=args.compile, cuda_graph=args.cuda_graph,
    )
    if tokenizer.name == "byte":
        out.write(decoder.decode(b"", final=True))
    out.write("\n")
    out.flush()
    return 0


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every run of the sweep: its name, overrides, steps and training FLOPs."""
    from . import load_lm_config

    base = load_lm_config(args.config, args.overrides)
    kinds = kind_list(args.kinds, "sweep")
    widths = number_list(args.widths, "--widths")
    lrs = number_list(args.lrs, "--lrs", float, minimum=1e-12)
    if args.head_dim <= 0:
        raise ValueError(f"--head-dim: expected a positive integer, got {args.head_dim}")
    for w in widths:
        if w <= 0 or w % args.head_dim:
            raise ValueError(f"--widths: expected multiples of --head-dim={args.head_dim}, got {w}")
    if args.base_steps <= 0:
        raise ValueError(f"--base-steps: expected a positive integer, got {args.base_steps}")
    tokens_per_step = base.run.batch_size * base.run.grad_accum * base.run.seq_len
    runs = []
    for width in widths:
        shape = {"d_model": width, "n_heads": width // args.head_dim}
        per_token = {}
        for kind in kinds:
            model_cfg = base.model.__class__(**{**base.model.to_dict(), **shape, "attention": kind})
            per_token[kind] = GPT(model_cfg).training_flops_per_token(base.run.seq_len)
        budget = args.base_steps * tokens_per_step * per_token[kinds[0]]
        for kind in kinds:
            steps = steps_for_flops(budget, lambda s, k=kind: s * tokens_per_step * per_token[k])
            for lr in lrs:
                name = f"{slug(kind)}-w{width}-lr{lr:g}"
                overrides = [*args.overrides, f"model.d_model={width}", f"model.n_heads={shape['n_heads']}",
                             f"model.attention={kind}", f"optim.lr={lr}", f"run.steps={steps}",
                             f"run.out_dir={Path(args.out) / name}", "run.sample_tokens=0"]
                load_lm_config(args.config, overrides)  # every run's config is valid before any trains
                runs.append({"name": name, "kind": kind, "width": width, "lr": lr, "steps": steps,
                             "flops": steps * tokens_per_step * per_token[kind], "overrides": overrides})
    return runs


def _result(run_dir: Path) -> dict[str, Any] | None:
    """Final validation numbers, the steps and training FLOPs done (fewer than planned when
    ``run.patience`` stopped the run early) and median throughput from a run's metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "val_loss" in r]
    if not evals:
        return None
    speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    last = evals[-1]
    return {"step": last["step"], "val_loss": last["val_loss"], "val_bpb": last.get("val_bpb"),
            "steps_done": rows[-1]["step"], "flops": rows[-1]["flops"],
            "tokens_per_s": statistics.median(speeds) if speeds else None}


def run_sweep(args: argparse.Namespace) -> int:
    from . import load_lm_config, train_lm

    def train_one(r: dict[str, Any], resume: bool) -> dict[str, Any]:
        train_lm(load_lm_config(args.config, r["overrides"]), resume=resume)
        result = _result(Path(args.out) / r["name"])
        if result is None:
            raise ValueError(f"sweep: run {r['name']} left no validation metrics in {Path(args.out) / r['name']}")
        return result

    return sweep(args, EXPERIMENT, plan(args), train_one, lambda r: f"{r['val_bpb']:.4f} bits/byte")


def plot(results: list[dict[str, Any]], out: Path) -> int:
    """``lm.png`` (validation bits per byte versus training FLOPs, best learning rate per kind and
    width), ``lm.md`` (the table) and, for a sweep over learning rates, ``lm-lr.png`` (each width's
    loss against the rate) in ``out`` from a sweep's results."""
    best = best_per_kind_width(results, "val_loss")
    out.mkdir(parents=True, exist_ok=True)
    lines = ["| kind | width | best lr | steps | training FLOPs | val bits/byte | tokens/s |", "|---|---|---|---|---|---|---|"]
    for r in best:
        tps = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else ""
        # steps trained: fewer than planned where run.patience stopped the run (older results lack the key)
        lines.append(f"| {markdown_cell(r['kind'])} | {r['width']} | {r['lr']:g} | {r.get('steps_done', r['steps'])} | "
                     f"{r['flops']:.3e} | {r['val_bpb']:.4f} | {tps} |")
    table = "\n".join(lines)
    (out / "lm.md").write_text(table + "\n")
    print(table)
    plt = pyplot()
    if plt is None:
        return 0
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for kind in dict.fromkeys(r["kind"] for r in best):
        pts = sorted((r["flops"], r["val_bpb"]) for r in best if r["kind"] == kind)
        ax.plot(*zip(*pts), marker="o", label=kind)
    ax.set(xscale="log", xlabel="training FLOPs", ylabel="validation bits per byte", title="loss vs training FLOPs (best lr)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "lm.png", dpi=120)
    plt.close(fig)
    print(f"wrote {out / 'lm.png'} and {out / 'lm.md'}")
    if len({r["lr"] for r in results}) > 1:
        _plot_lr(plt, results, out / "lm-lr.png")
    return 0


def _plot_lr(plt: Any, results: list[dict[str, Any]], path: Path) -> None:
    """Validation bits per byte against the learning rate, a line per width and a panel per kind:
    where muP transfers, every width's minimum is at the same rate."""
    kinds = list(dict.fromkeys(r["kind"] for r in results))
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.5 * len(kinds), 3.8), squeeze=False, sharey=True)
    for ax, kind in zip(axes[0], kinds):
        for width in sorted({r["width"] for r in results if r["kind"] == kind}):
            pts = sorted((r["lr"], r["val_bpb"]) for r in results if r["kind"] == kind and r["width"] == width)
            ax.plot(*zip(*pts), marker="o", label=f"width {width}")
        ax.set(xscale="log", xlabel="learning rate", title=kind)
        lrs = sorted({r["lr"] for r in results if r["kind"] == kind})
        ax.minorticks_off()
        ax.set_xticks(lrs, [f"{lr:g}" for lr in lrs])
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("validation bits per byte")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
