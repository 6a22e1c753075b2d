"""A GPT-style decoder: token embeddings, the shared :class:`Transformer` backbone, a language head.

Pre-LayerNorm blocks (attention, then a GELU MLP), attention kind per layer from the config,
learned or rotary positions, optional tied input/output embeddings, KV-cache generation through
the attention layers' own caches, and Hugging Face's folder layout (``save_pretrained`` /
``from_pretrained``: ``config.json`` and ``model.safetensors``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .._checks import fail, require
from .._files import atomic_write
from ..attention import KVCache, StaticKVCache
from ..matrices.base import Fan
from .decoding import CapturedDecoding, next_token
from .transformer import Transformer, TransformerConfig, init_gpt2_, mup_init_, parameter_fans

__all__ = ["GPT", "GPTConfig"]

# torch.compile's modes (of inductor); any other string given as generate(compile=...) is a backend
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# the modes whose compiled code replays CUDA graphs of its own (inductor's triton.cudagraphs)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_compile_backend(value: str, name: str, modes: bool = False) -> None:
    """One-line ``ValueError`` naming ``name`` unless ``value`` is one of torch.compile's
    registered backends (or, with ``modes``, one of its modes): else the first compiled call fails
    deep inside dynamo, after the work before it is done."""
    if (modes and value in COMPILE_MODES) or value in torch._dynamo.list_backends(exclude_tags=()):
        return
    # named: the usual ones; accepted: any registered, the debugging and testing ones too
    usual = ", ".join(["inductor", "eager", "aot_eager", *sorted(set(torch._dynamo.list_backends()) - {"inductor"})])
    fail(name, (f"a torch.compile mode ({', '.join(COMPILE_MODES)}) or backend ({usual}, ...)" if modes
                else f"a torch.compile backend ({usual}, ...)"), value)

# Hugging Face's file names and this model's type in its config.json (GPT.save_pretrained)
HF_CONFIG, HF_WEIGHTS, HF_MODEL_TYPE = "config.json", "model.safetensors", "sattn_gpt"


@dataclass(frozen=True)
class GPTConfig(TransformerConfig):
    vocab_size: int = 256
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.vocab_size, int) and self.vocab_size > 0, "vocab_size", "a positive integer", self.vocab_size)
        require(self.causal, "causal", "True (a GPT is a causal decoder)", self.causal)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.backbone = Transformer(config)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        init_gpt2_(self, config)
        if config.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        # muP's output multiplier on a tied read-out (the embedding keeps an input weight's init
        # and learning rate, so the logits shrink with the width instead); 1 without muP
        self.logit_scale = 1.0
        if config.mup_base_width is not None:
            mup_init_(self, config, GPT, readout=None if config.tie_embeddings else "head.weight")
            if config.tie_embeddings:
                self.logit_scale = config.mup_base_width / config.d_model

    @property
    def blocks(self) -> nn.ModuleList:
        return self.backbone.blocks

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        caches: list[KVCache] | None = None,
        attention_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(B, T, vocab)`` of tokens ``idx: (B, T)`` and, given ``targets``, the mean
        cross-entropy in nats over the real tokens. With ``caches`` the tokens continue the cached
        sequence. ``attention_mask`` (padding) and ``document_ids`` (packed documents): see
        :meth:`Transformer.forward`; logits at padding are zero and padding targets are ignored."""
        require(idx.dim() == 2 and not idx.is_floating_point(), "idx", "a (batch, seq_len) integer tensor", tuple(idx.shape))
        logits = self.head(self.backbone(self.tok_emb(idx), caches, attention_mask, document_ids))
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        loss = None
        if targets is not None:
            require(tuple(targets.shape) == tuple(idx.shape), "targets", f"shape {tuple(idx.shape)} (that of idx)",
                    tuple(targets.shape))
            if attention_mask is not None and caches is None:
                targets = targets.masked_fill(~attention_mask.bool(), -100)  # cross_entropy's ignore_index
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss

    def new_caches(self, batch_size: int, static: bool = False) -> list[KVCache] | list[StaticKVCache]:
        """One cache per layer: growing ones, or ``static`` ones for compiled decoding steps."""
        return self.backbone.new_caches(batch_size, static=static)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write Hugging Face's layout into folder ``path``: ``config.json`` (``model_type``
        ``"sattn_gpt"`` and the :class:`GPTConfig` fields) and ``model.safetensors`` (a tied head
        stored once, as transformers does). Each file is written atomically."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()
                 if not (self.config.tie_embeddings and k == "head.weight")}
        atomic_write(folder / HF_WEIGHTS, lambda p: save_file(state, p, metadata={"format": "pt"}))
        config = {"model_type": HF_MODEL_TYPE, "architectures": ["GPT"], **self.config.to_dict()}
        text = json.dumps(config, indent=2) + "\n"
        atomic_write(folder / HF_CONFIG, lambda p: Path(p).write_text(text, encoding="utf-8"))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> GPT:
        """The model :meth:`save_pretrained` wrote in folder ``path`` (on the CPU, in eval mode);
        one-line ``ValueError`` for another model type, unknown config fields or weights that do
        not fit the config."""
        folder = Path(path)
        for name in (HF_CONFIG, HF_WEIGHTS):
            if not (folder / name).is_file():
                raise FileNotFoundError(f"path: expected a folder holding {HF_CONFIG} and {HF_WEIGHTS}, "
                                        f"{str(folder / name)!r} is missing")
        try:
            config = json.loads((folder / HF_CONFIG).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{folder / HF_CONFIG}: not a JSON config ({e})") from None
        require(isinstance(config, dict) and config.get("model_type") == HF_MODEL_TYPE, f"{folder / HF_CONFIG}",
                f"model_type {HF_MODEL_TYPE!r}", config.get("model_type") if isinstance(config, dict) else config)
        fields = {f.name for f in dataclasses.fields(GPTConfig)}
        unknown = sorted(set(config) - fields - {"model_type", "architectures"})
        require(not unknown, f"{folder / HF_CONFIG}", f"GPTConfig fields ({', '.join(sorted(fields))})", unknown)
        model = cls(GPTConfig(**{k: v for k, v in config.items() if k in fields})).eval()
        try:
            state = load_file(folder / HF_WEIGHTS)
        except Exception as e:  # safetensors' own error types for a malformed file
            raise ValueError(f"{folder / HF_WEIGHTS}: cannot read tensors ({e})") from None
        if model.config.tie_embeddings and "tok_emb.weight" in state:
            state["head.weight"] = state["tok_emb.weight"]
        own = model.state_dict()
        bad = sorted(set(own) ^ set(state)) or [k for k in own if own[k].shape != state[k].shape
                                                 or own[k].dtype != state[k].dtype]
        require(not bad, f"{folder / HF_WEIGHTS}", "the tensors of the model config.json describes", bad[:3])
        model.load_state_dict(state)
        return model

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        on_token: Callable[[torch.Tensor], None] | None = None,
        generator: torch.Generator | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: str = "growing",
        compile: bool | str = False,
        cuda_graph: bool = False,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` after the prompt ``idx: (B, T)`` with KV-cache decoding;
        ``temperature`` 0 is greedy; ``on_token`` gets each new ``(B,)`` token (for streaming).

        Prompts of different lengths go left-padded with ``attention_mask`` ``(B, T)`` (0 or False
        at the padding): every row then generates what it generates alone, and the result is the
        padded prompts followed by the new tokens.

        ``cache``: ``"growing"`` (each step touches only the tokens it attends to) or ``"static"``
        (:class:`StaticKVCache`: buffers preallocated to the context, positions on the device).
        ``compile``: ``True`` (inductor), a ``torch.compile`` mode (``"reduce-overhead"``: CUDA
        graphs, the step captured once and replayed) or a backend name (``"aot_eager"``) compiles
        the one-token step once (``fullgraph``) and replays it for every token; it takes static
        caches. ``cuda_graph`` (CUDA, static caches): the one-token step, compiled by ``compile``
        if given (a mode without CUDA graphs of its own), and the choice of the next token
        captured in one CUDA graph (:class:`~.decoding.CapturedDecoding`) and replayed: one call
        of the host per token."""
        require(idx.dim() == 2 and idx.shape[1] >= 1, "prompt", "at least one token", tuple(idx.shape))
        room = self.config.max_seq_len - idx.shape[1]
        require(0 <= max_new_tokens <= room, "max_new_tokens", f"0..{room} (max_seq_len minus the prompt)", max_new_tokens)
        require(temperature >= 0, "temperature", "a non-negative number", temperature)
        require(top_k is None or top_k > 0, "top_k", "a positive integer or None", top_k)
        require(cache in ("growing", "static"), "cache", "'growing' or 'static'", cache)
        require(not compile or cache == "static", "compile", "False with cache='growing' (a compiled step takes "
                "static caches, whose shapes do not change from one token to the next)", compile)
        if isinstance(compile, str):
            check_compile_backend(compile, "compile", modes=True)
        if cuda_graph:
            require(cache == "static", "cuda_graph", "False with cache='growing' (a captured step takes static caches)",
                    cuda_graph)
            require(compile not in CUDA_GRAPH_MODES, "compile", f"a mode other than {' or '.join(CUDA_GRAPH_MODES)} "
                    "with cuda_graph=True (those capture graphs of their own)", compile)
            require(self.tok_emb.weight.is_cuda, "cuda_graph", "False for a model on the CPU (CUDA graphs need a "
                    "CUDA device)", cuda_graph)
        was_training = self.training
        self.eval()
        caches = self.new_caches(idx.shape[0], static=cache == "static")
        logits, _ = self(idx, caches=caches, attention_mask=attention_mask)
        decode = self._decode_step
        if compile:
            mode = compile if compile in COMPILE_MODES else None
            backend = "inductor" if compile is True or mode else compile
            decode = torch.compile(decode, fullgraph=True, dynamic=False, backend=backend, mode=mode)

        def choose(logits: torch.Tensor) -> torch.Tensor:
            return next_token(logits, temperature, top_k, generator)

        def stepped() -> Iterator[torch.Tensor]:
            nonlocal logits
            for i in range(max_new_tokens):
                token = choose(logits[:, -1])
                yield token
                if i + 1 < max_new_tokens:
                    logits = decode(token[:, None], caches)

        def captured() -> Iterator[torch.Tensor]:
            steps = CapturedDecoding(lambda token: decode(token, caches), choose, idx.shape[0], max_new_tokens - 1,
                                     idx.device, generator)
            steps.start(choose(logits[:, -1]))
            yield steps.tokens[:, 0]
            for _ in range(max_new_tokens - 1):
                yield steps()

        out = [idx]
        for token in captured() if cuda_graph and max_new_tokens > 1 else stepped():
            out.append(token[:, None])
            if on_token is not None:
                on_token(token)
        self.train(was_training)
        return torch.cat(out, dim=1)

    def _decode_step(self, token: torch.Tensor, caches: list[KVCache] | list[StaticKVCache]) -> torch.Tensor:
        """Logits of one token per row continuing ``caches`` (what ``generate(compile=...)`` compiles)."""
        return self(token, caches=caches)[0]

    # -- accounting ----------------------------------------------------------------------------
    def forward_flops_per_token(self, seq_len: int | None = None) -> float:
        """Multiply-adds of one forward pass per token of a ``seq_len``-token sequence: the
        backbone (:meth:`Transformer.forward_flops_per_position`) and the output head."""
        return self.backbone.forward_flops_per_position(seq_len) + self.head.weight.numel()

    def training_flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 2 FLOPs per multiply-add, times 3 for forward and backward."""
        return 6 * self.forward_flops_per_token(seq_len)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel() if not self.config.tie_embeddings else 0
            pos = self.backbone.pos_emb
            n -= pos.weight.numel() if pos is not None else 0
        return n

    def parameter_fans(self) -> dict[str, Fan]:
        """Fan-in/fan-out of every matrix-like parameter (for muP); see :func:`parameter_fans`."""
        return parameter_fans(self)
