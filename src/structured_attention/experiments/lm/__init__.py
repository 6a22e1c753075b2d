"""Language modelling: a GPT trained on a text corpus, evaluated in bits per byte (docs/design.md,
'Language modelling').

- :class:`LMConfig` (``model: GPTConfig``, ``data: DataConfig``, ``optim: OptimConfig``,
  ``run: LMRunConfig``), read with :func:`load_lm_config` (YAML + ``section.key=value`` overrides);
- :class:`LMTask`, the corpus and the GPT as the shared loop (:func:`training.fit`) sees them;
  with ``data.pack_documents`` every window's tokens attend only within their own document and
  their positions restart at its first token (training and evaluation alike);
- :func:`train_lm` -> :class:`LMResult` (the loop's result, the final validation loss and bits per
  byte, a sample);
- :func:`evaluate_lm`, :func:`generate_sample` and :func:`load_lm` (a trained GPT and its
  tokenizer from a checkpoint, for ``sattn eval`` and ``sattn generate``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from torch import nn

from ..._checks import require
from ...data import Corpus, Tokenizer, eval_batches, load_corpus, sample_batch, tokenizer_from_json
from ...models.gpt import GPT, GPTConfig
from ...models.protocol import TrainableModel
from ...models.transformer import TransformerConfig
from ...training.checkpoint import LoadedCheckpoint
from ...training.config import OptimConfig, RunConfig, load_config
from ...training.distributed import DistInfo
from ...training.loop import FitResult, Task, autocast_context, fit
from .. import load_trained

__all__ = [
    "DataConfig",
    "LMConfig",
    "LMResult",
    "LMRunConfig",
    "LMTask",
    "evaluate_lm",
    "generate_sample",
    "load_lm",
    "load_lm_config",
    "train_lm",
]


@dataclass(frozen=True)
class DataConfig:
    source: str | None = None  # None: the embedded default corpus (the Python stdlib source)
    tokenizer: str = "byte"  # "byte", "char" or "hf:PATH" (a local Hugging Face tokenizer.json or its folder)
    val_fraction: float = 0.1
    cache_dir: str | None = None  # None: $SATTN_CACHE_DIR or ~/.cache/structured-attention
    # True: reset attention and positions at document boundaries (GPT's document_ids); False: a
    # window runs across them as one sequence (the default, and what configs without it meant).
    pack_documents: bool = False

    def __post_init__(self) -> None:
        require(0 < self.val_fraction < 1, "data.val_fraction", "a number in (0, 1)", self.val_fraction)
        require(isinstance(self.pack_documents, bool), "data.pack_documents", "a boolean (true/false)",
                self.pack_documents)


@dataclass(frozen=True)
class LMRunConfig(RunConfig):
    out_dir: str = "runs/lm"
    seq_len: int = 256
    sample_tokens: int = 200  # length of the sample generated at the end (0: none)
    sample_prompt: str = "def "

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.seq_len, int) and self.seq_len > 0, "run.seq_len", "a positive integer", self.seq_len)
        require(isinstance(self.sample_tokens, int) and self.sample_tokens >= 0, "run.sample_tokens",
                "a non-negative integer", self.sample_tokens)


@dataclass(frozen=True)
class LMConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: LMRunConfig = field(default_factory=LMRunConfig)

    def __post_init__(self) -> None:
        require(
            self.run.seq_len <= self.model.max_seq_len,
            "run.seq_len",
            f"at most model.max_seq_len={self.model.max_seq_len}",
            self.run.seq_len,
        )
        self.model.check_attention()
        self.optim.check_model_mup(self.model.mup_base_width)


def load_lm_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> LMConfig:
    """An :class:`LMConfig` from a YAML file (``None``: defaults) and ``section.key=value`` overrides."""
    return load_config(LMConfig, path, overrides)


@torch.no_grad()
def evaluate_lm(
    model: nn.Module,
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    max_batches: int | None = None,
    device: torch.device | str = "cpu",
    autocast: str = "auto",
    document_starts: np.ndarray | None = None,
) -> float:
    """Mean cross-entropy (nats per token) over consecutive windows of ``tokens``; given the
    split's ``document_starts``, with documents packed (each token sees only its own document)."""
    was_training = model.training
    model.eval()
    seq_len = min(seq_len, len(tokens) - 1)
    total, count = 0.0, 0
    device = torch.device(device)
    for x, y, *ids in eval_batches(tokens, batch_size, seq_len, max_batches=max_batches, device=device,
                                   document_starts=document_starts):
        with autocast_context(autocast, device):
            _, loss = model(x, y, document_ids=ids[0] if ids else None)
        total += float(loss) * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / count


class LMTask(Task):
    """Next-token prediction on a corpus: random windows for training, the validation split's
    first ``run.eval_batches`` batches of consecutive windows for evaluation; with
    ``data.pack_documents`` a batch is ``(x, y, document_ids)`` and both use the document ids."""

    experiment = "lm"

    config: LMConfig

    def __init__(self, config: LMConfig) -> None:
        super().__init__(config)
        self.corpus: Corpus | None = None

    def setup(self, info: DistInfo) -> None:
        d, run = self.config.data, self.config.run
        corpus = load_corpus(d.source, tokenizer=d.tokenizer, val_fraction=d.val_fraction, cache_dir=d.cache_dir)
        need = run.seq_len + 1
        if len(corpus.train) < need:
            raise ValueError(
                f"data.source: the training split has {len(corpus.train)} tokens; run.seq_len={run.seq_len} "
                f"needs at least {need} (use a larger corpus or a shorter run.seq_len)"
            )
        if len(corpus.val) < 2:
            raise ValueError(f"data.source: the validation split has {len(corpus.val)} tokens; at least 2 are needed")
        self.corpus = corpus

    def resolve(self) -> LMConfig:
        """The model's vocabulary is the tokenizer's (a char vocabulary depends on the corpus)."""
        assert self.corpus is not None
        return dataclasses.replace(self.requested,
                                   model=dataclasses.replace(self.requested.model, vocab_size=self.corpus.vocab_size))

    def describe(self) -> str:
        c = self.corpus
        assert c is not None
        packed = " | documents packed" if self.config.data.pack_documents else ""
        return (f"data: {c.source} | tokenizer {c.tokenizer.name} (vocab {c.vocab_size}) | "
                f"train {len(c.train):,} tokens ({len(c.train_document_starts):,} documents), "
                f"val {len(c.val):,} tokens ({len(c.val_document_starts):,} documents){packed} | "
                f"attention {self.config.model.attention}")

    def build_model(self) -> GPT:
        return GPT(self.config.model)

    def batch(self, index: int, rank: int, world_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``(x, y)``, or ``(x, y, document_ids)`` with ``data.pack_documents``."""
        assert self.corpus is not None
        run = self.config.run
        starts = self.corpus.train_document_starts if self.config.data.pack_documents else None
        return sample_batch(self.corpus.train, run.batch_size, run.seq_len, seed=run.seed, step=index,
                            rank=rank, world_size=world_size, device=device, document_starts=starts)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y, *ids = batch
        return model(x, y, document_ids=ids[0] if ids else None)[1]

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        assert self.corpus is not None
        run = self.config.run
        starts = self.corpus.val_document_starts if self.config.data.pack_documents else None
        loss = evaluate_lm(model, self.corpus.val, run.batch_size, run.seq_len, run.eval_batches * self.world_size,
                           device, "none", document_starts=starts)
        return {"val_loss": loss, "val_bpb": self.corpus.bits_per_byte(loss)}

    def backbone_config(self) -> TransformerConfig:
        return self.config.model

    def tokens_per_batch(self) -> int:
        return self.config.run.batch_size * self.config.run.seq_len

    def flops_per_token(self, model: TrainableModel) -> float:
        return model.training_flops_per_token(self.config.run.seq_len)

    def state(self) -> dict[str, Any]:
        assert self.corpus is not None
        return {"tokenizer": self.corpus.tokenizer.to_json(), "source": self.corpus.source}


def generate_sample(
    model: GPT, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, *, temperature: float = 0.8,
    top_k: int | None = 40, seed: int = 0, device: torch.device | str = "cpu",
) -> str:
    """``prompt`` followed by ``max_new_tokens`` sampled tokens (fewer if the context is short)."""
    ids = tokenizer.encode(prompt) or [0]
    ids = ids[-(model.config.max_seq_len - 1):]
    n = min(max_new_tokens, model.config.max_seq_len - len(ids))
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(torch.tensor([ids], device=device), n, temperature=temperature, top_k=top_k, generator=gen)
    return tokenizer.decode(out[0].tolist())


@dataclass(kw_only=True)
class LMResult(FitResult):
    """What :func:`train_lm` returns: the loop's :class:`~structured_attention.training.FitResult`
    (steps, per-step losses, tokens, FLOPs, time, folders, ranks) and the final evaluation's
    numbers, with a sample of the trained model (``''`` when ``run.sample_tokens`` is 0 and on
    ranks other than 0)."""

    val_loss: float  # nats per token, the last evaluation's
    val_bpb: float  # bits per byte of the corpus's text
    sample: str = ""


def train_lm(config: LMConfig, *, resume: bool = False, stream: TextIO | None = None) -> LMResult:
    """Train a GPT language model as ``config`` says (see :func:`training.fit`); ``losses`` holds
    every optimizer step's from step 1, those before a resume too."""
    task = LMTask(config)
    result = fit(task, resume=resume, stream=stream)
    run = config.run
    sample = ""
    if run.sample_tokens > 0 and result.model is not None:
        assert task.corpus is not None
        device = next(result.model.parameters()).device
        sample = generate_sample(result.model, task.corpus.tokenizer, run.sample_prompt, run.sample_tokens,
                                 seed=run.seed, device=device)
    return LMResult.extend(result, val_loss=result.final["val_loss"], val_bpb=result.final["val_bpb"], sample=sample)


def load_lm(path: str | Path | LoadedCheckpoint, device: str | torch.device = "cpu"
            ) -> tuple[GPT, Tokenizer, LMConfig, LoadedCheckpoint]:
    """``(model in eval mode, tokenizer, config, checkpoint)`` from a language model's checkpoint:
    :func:`~structured_attention.experiments.load_trained` and the tokenizer the run recorded."""
    model, config, ckpt = load_trained(path, "lm", LMConfig, lambda c: GPT(c.model), device)
    if "tokenizer" not in ckpt.state:
        raise ValueError(f"checkpoint {ckpt.path}: state.json lacks 'tokenizer'")
    return model, tokenizer_from_json(ckpt.state["tokenizer"]), config, ckpt
