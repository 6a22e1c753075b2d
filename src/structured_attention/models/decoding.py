"""Choosing the next token, decoding steps captured in one CUDA graph, and a decoding step as a module.

:class:`CapturedDecoding` records a model's one-token step on static caches, together with the
choice of the next token, in one CUDA graph, and replays it for every token: a token then costs the
host one ``CUDAGraph.replay()``. ``torch.compile(mode="reduce-overhead")`` replays a captured step
as well, but every call still runs dynamo's guards, the compiled function's wrappers and the graph
tree's checks of its inputs in Python, and the choice of the token runs eagerly beside it. Where the
host is slower than the GPU's step (small batches, or a step that reads few bytes, as MLR's
compressed cache does) that host work, not the GPU, sets the time per token.

:class:`DecodingStep` is the same one-token step as an ``nn.Module`` whose buffers are the static
caches' tensors, which is what ``torch.export`` needs to export it: a cache is a Python object the
trace does not see into, so its tensors, read through it, would be traced as constants and its
writes done once, at export time, instead of at every call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from .._checks import require
from ..attention import StaticKVCache

if TYPE_CHECKING:
    from .gpt import GPT

__all__ = ["CapturedDecoding", "DecodingStep", "next_token"]


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None,
               generator: torch.Generator | None) -> torch.Tensor:
    """The next token ``(B,)`` of each row from its last position's logits ``(B, vocab)``:
    the largest at ``temperature`` 0, else sampled from the softmax of ``logits / temperature``
    restricted to the ``top_k`` largest (all when None)."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]


class CapturedDecoding:
    """Up to ``steps`` decoding steps of ``batch`` rows, each ``step(tokens (B, 1)) -> logits
    (B, 1, vocab)`` (a model's one-token step on static caches it closes over) followed by
    ``choose(logits (B, vocab)) -> (B,)``, captured in one CUDA graph on their first call.

    :meth:`start` sets the token before the first step; each call then returns the next token,
    ``(B,)``, a view of :attr:`tokens` (column 0 the start token, column ``i`` the ``i``-th new
    one), which holds every token until the next :meth:`start`. The graph reads the current token
    from :attr:`tokens` and writes the next one there, so a call passes nothing in and copies
    nothing out. The first call runs its step (on a side stream, as CUDA graphs need: it compiles
    what the step compiles and initialises the libraries it calls) and then records it; later calls
    replay it, also after :meth:`start`, on whatever the caches hold: they must keep their tensors
    (refill them in place with :meth:`~..attention.StaticKVCache.copy_`) and outlive this object.
    A ``generator`` the choice samples from is registered with the graph, so replays draw what
    eager steps would. Tensors on the CPU, where there are no CUDA graphs, run the step at every
    call (the same bookkeeping, uncaptured).
    """

    def __init__(self, step: Callable[[torch.Tensor], torch.Tensor], choose: Callable[[torch.Tensor], torch.Tensor],
                 batch: int, steps: int, device: torch.device | str,
                 generator: torch.Generator | None = None) -> None:
        require(isinstance(steps, int) and steps >= 1, "steps", "a positive integer", steps)
        self.step, self.choose, self.generator = step, choose, generator
        self.device = torch.device(device)
        self.tokens = torch.zeros(batch, steps + 1, dtype=torch.long, device=self.device)
        # the column of the current token, on the device: the graph advances it itself
        self._column = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self._taken = 0  # the host's count of the same, to refuse a step past `steps`
        self.graph: torch.cuda.CUDAGraph | None = None

    def start(self, token: torch.Tensor) -> None:
        """Decode from ``token`` ``(B,)``, the last token the caches do not hold yet."""
        require(tuple(token.shape) == (self.tokens.shape[0],), "token", f"shape ({self.tokens.shape[0]},)",
                tuple(token.shape))
        self.tokens[:, 0].copy_(token)
        self._column.zero_()
        self._taken = 0

    def __call__(self) -> torch.Tensor:
        require(self._taken < self.tokens.shape[1] - 1, "steps", f"at most {self.tokens.shape[1] - 1} calls after "
                "start()", self._taken + 1)
        if self.device.type != "cuda":
            self._advance()
        elif self.graph is None:
            self.graph = self._capture()
        else:
            self.graph.replay()
        self._taken += 1
        return self.tokens[:, self._taken]

    def _advance(self) -> None:
        rows = self.tokens.shape[0]
        current = self.tokens.gather(1, self._column.expand(rows, 1))
        token = self.choose(self.step(current)[:, -1])
        self._column.add_(1)
        self.tokens.scatter_(1, self._column.expand(rows, 1), token[:, None])

    def _capture(self) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._advance()  # this call's step, run
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.generator is not None:
            graph.register_generator_state(self.generator)
        with torch.cuda.graph(graph):
            self._advance()  # recorded, not run: the next call's step
        return graph


class _CacheTensors(nn.Module):
    """One static cache's tensors as buffers (not persistent: a cache's content is not a weight)."""

    def __init__(self, cache: StaticKVCache) -> None:
        super().__init__()
        for name, tensor in cache.tensors().items():
            self.register_buffer(name, tensor, persistent=False)


class DecodingStep(nn.Module):
    """``model``'s one-token step on the static ``caches`` (``model.new_caches(batch, static=True)``)
    as a module: ``forward(token (B, 1)) -> logits (B, 1, vocab)`` writes the token into the caches
    and advances them, as ``model(token, caches=caches)`` does. Its buffers are the caches' tensors
    (``caches.<layer>.<name>``: each kind's buffers, ``slot`` and ``offsets``), so
    ``torch.export.export(DecodingStep(model, caches), (token,))`` gives a program whose buffer
    mutations are the caches' writes; its ``module()`` holds the caches' own tensors, so it
    continues them, and a program saved and loaded again holds copies of them.

    With ``inputs=True`` the caches' tensors are the step's inputs instead, ``forward(token,
    tensors)`` with ``tensors`` :meth:`tensors` (a dict per layer), written in place: what
    AOTInductor needs, whose packages (torch 2.13) keep no buffer's writes from one call to the
    next; the package then takes its caches at every call, and its file holds no cache.

    Caches a prompt filled (``model(prompt, caches=caches, attention_mask=...)``, left-padded rows
    included) are continued; caches no prompt filled are made empty, at position 0, for a program
    that reads its prompt token by token (rows of equal length). Setting every ``slot`` to 0 starts
    again: a step reads only the slots up to its own.
    """

    def __init__(self, model: GPT, caches: list[StaticKVCache], inputs: bool = False) -> None:
        super().__init__()
        blocks = model.blocks
        require(isinstance(caches, list) and len(caches) == len(blocks)
                and all(isinstance(c, StaticKVCache) for c in caches), "caches",
                f"a list of {len(blocks)} static caches (model.new_caches(batch, static=True))",
                type(caches).__name__ if not isinstance(caches, list) else f"{len(caches)} caches")
        require(len({c.prefilled for c in caches}) == 1, "caches", "all prefilled by one prompt or none",
                "a mix")
        if not caches[0].prefilled:
            for block, cache in zip(blocks, caches):
                block.attn.fill_static(cache)
        self.model, self.inputs = model, inputs
        self.caches = None if inputs else nn.ModuleList(_CacheTensors(c) for c in caches)
        self._caches = caches

    def tensors(self) -> list[dict[str, torch.Tensor]]:
        """The caches' tensors by layer and name (what ``forward`` takes with ``inputs=True``)."""
        return [cache.tensors() for cache in self._caches]

    def forward(self, token: torch.Tensor, tensors: list[dict[str, torch.Tensor]] | None = None) -> torch.Tensor:
        require((tensors is not None) == self.inputs, "tensors", "the caches' tensors (DecodingStep.tensors()) "
                "with inputs=True, else None", "None" if tensors is None else "tensors")
        if tensors is None:  # this module's buffers, which the export's trace replaces by its own
            tensors = [dict(buffers.named_buffers()) for buffers in self.caches]
        require(len(tensors) == len(self._caches), "tensors", f"{len(self._caches)} dicts, one per layer",
                len(tensors))
        own = self.tensors()
        for cache, bound in zip(self._caches, tensors):
            cache.bind(bound)
        try:
            return self.model(token, caches=self._caches)[0]
        finally:
            for cache, tensors in zip(self._caches, own):
                cache.bind(tensors)
