"""``sattn train lm``, ``sattn eval`` and ``sattn generate``.

```
sattn train lm [--config FILE] [section.key=value ...] [--resume]
sattn eval --checkpoint DIR [--source PATH] [--max-batches N]
sattn generate --checkpoint DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S]
```

Mistakes in what the user gave (a missing or empty corpus, an unknown attention kind or config
key, a missing, corrupt or mismatched checkpoint) raise ``ValueError`` / ``FileNotFoundError``,
which ``sattn`` prints as one line before exiting with status 2.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import sys
import warnings
from collections.abc import Iterator

__all__ = ["add_parser"]


@contextlib.contextmanager
def _one_line_warnings(command: str) -> Iterator[None]:
    old = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        print(f"sattn {command}: warning: {message}", file=sys.stderr, flush=True)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = old


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model (sattn train lm ...)")
    tsub = p.add_subparsers(dest="task", required=True)
    lm = tsub.add_parser(
        "lm",
        help="train a GPT language model",
        description="Train a GPT language model from a YAML config plus section.key=value overrides, "
        "e.g. model.attention=mlr:16|16|16|16 optim.lr=3e-3 run.steps=2000.",
    )
    lm.add_argument("--config", default=None, help="YAML config file (default: built-in defaults)")
    lm.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    lm.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in run.out_dir/ckpt")
    lm.set_defaults(run=run_train_lm)

    e = sub.add_parser("eval", help="validation loss and bits per byte of a checkpoint")
    e.add_argument("--checkpoint", required=True, help="checkpoint folder, its ckpt/ folder or the run's out_dir")
    e.add_argument("--source", default=None, help="evaluate on this corpus's validation split instead of the training one")
    e.add_argument("--max-batches", type=int, default=None, help="cap on validation batches (default: the whole split)")
    e.add_argument("--batch-size", type=int, default=None, help="sequences per batch (default: the run's)")
    e.set_defaults(run=run_eval)

    g = sub.add_parser("generate", help="sample text from a checkpoint, streamed to stdout")
    g.add_argument("--checkpoint", required=True, help="checkpoint folder, its ckpt/ folder or the run's out_dir")
    g.add_argument("--prompt", required=True, help="the text to continue")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(run=run_generate)


def run_train_lm(args: argparse.Namespace) -> int:
    from ..experiments.lm import load_lm_config, train_lm
    from ..training import NonFiniteLossError

    config = load_lm_config(args.config, args.overrides)
    with _one_line_warnings("train"):
        try:
            result = train_lm(config, resume=args.resume)
        except NonFiniteLossError as err:
            print(f"sattn train: error: {err}", file=sys.stderr)
            return 1
    if result["rank"] == 0:
        print(f"final validation loss {result['final_val_loss']:.4f} nats/token, {result['final_val_bpb']:.4f} bits per byte")
        print(f"trained {result['steps']} steps, {result['tokens']:,} tokens in {result['wall_s']:.1f} s; checkpoint {result['checkpoint']}")
        if result["sample"]:
            print("sample:")
            print(result["sample"])
    return 0


def run_eval(args: argparse.Namespace) -> int:
    import numpy as np

    from ..data import load_corpus
    from ..experiments.lm import evaluate_lm, load_lm

    with _one_line_warnings("eval"):
        model, tokenizer, config, ckpt = load_lm(args.checkpoint)
    d = config.data
    corpus = load_corpus(args.source if args.source is not None else d.source, tokenizer=d.tokenizer,
                         val_fraction=d.val_fraction, cache_dir=d.cache_dir)
    val = corpus.val
    if corpus.tokenizer != tokenizer:  # a char vocabulary built from another text: re-encode with the model's
        val = tokenizer.encode_array(corpus.tokenizer.decode(np.asarray(val)))
    if len(val) < 2:
        raise ValueError(f"--source: the validation split has {len(val)} tokens; at least 2 are needed")
    batch_size = args.batch_size or config.run.batch_size
    loss = evaluate_lm(model, val, batch_size, config.run.seq_len, args.max_batches, "cpu", "none")
    bpb = corpus.bits_per_byte(loss)
    print(f"checkpoint {ckpt.path} (step {ckpt.step}) on {corpus.source} validation split ({len(val):,} tokens)")
    print(f"val loss {loss:.4f} nats/token, {bpb:.4f} bits per byte")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from ..experiments.lm import load_lm

    if not args.prompt:
        raise ValueError("--prompt: expected at least one character, got ''")
    with _one_line_warnings("generate"):
        model, tokenizer, _, _ = load_lm(args.checkpoint)
    ids = tokenizer.encode(args.prompt)
    room = model.config.max_seq_len - len(ids)
    if room < args.max_new_tokens:
        raise ValueError(
            f"--max-new-tokens: the prompt takes {len(ids)} of the model's {model.config.max_seq_len} positions, "
            f"so at most {max(room, 0)} new tokens fit, got {args.max_new_tokens}"
        )
    if args.top_k is not None and args.top_k <= 0:
        raise ValueError(f"--top-k: expected a positive integer, got {args.top_k}")
    if args.temperature < 0:
        raise ValueError(f"--temperature: expected a non-negative number, got {args.temperature}")
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

    gen = torch.Generator().manual_seed(args.seed)
    model.generate(
        torch.tensor([ids]), args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        on_token=emit, generator=gen,
    )
    if tokenizer.name == "byte":
        out.write(decoder.decode(b"", final=True))
    out.write("\n")
    out.flush()
    return 0
