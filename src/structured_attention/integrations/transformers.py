"""MLR attention inside Hugging Face transformers models, through ``AttentionInterface``.

::

    from transformers import AutoConfig, AutoModelForCausalLM
    from structured_attention.integrations import transformers as sattn_hf

    sattn_hf.register()
    config = AutoConfig.from_pretrained("path/to/a/llama-like/model")
    sattn_hf.configure(config, ranks=[64, 32, 16, 16])   # per level; they sum to the head dimension
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sattn_mlr")

Any model whose attention layers call ``ALL_ATTENTION_FUNCTIONS`` (Llama, Qwen, Mistral and most
decoder models of transformers 5) then scores queries and keys with MLR attention: the model's
projections, rotary embeddings, GQA, caches and ``generate()`` stay as they are.

- **Config.** ``sattn_ranks``: the ranks of the levels, even, summing to the head dimension.
  ``sattn_block_sizes`` (optional): the block sizes, ``max_position_embeddings / 2^(l-1)`` by
  default. One level is plain softmax attention (it equals ``attn_implementation="sdpa"``).
  :func:`configure` also sets ``attn_implementation``, which ``config.json`` keeps, so
  ``from_pretrained`` loads a saved model with MLR attention.
- **Head dimensions and rotary pairs.** transformers rotates dimension ``i`` of a head together
  with ``i + head_dim/2`` (``rotate_half``). A level must hold whole pairs, or its scores would
  lose their dependence on relative position alone, so the scores see the head dimensions pair by
  pair: ``0, head_dim/2, 1, head_dim/2 + 1, ...`` (:func:`level_permutation`), and level ``l``
  takes the next ``r_l`` of them, that is pairs ``a_l .. a_l + r_l/2 - 1`` (``a_l`` the sum of
  the earlier ranks, halved). ``mlr_attention`` takes this order as its ``dim_order``: the C++
  kernel reads the queries and keys in it where they lie, other paths gather them first. Only the
  scores see this order; values are untouched. Families that rotate neighbouring dimensions
  together (``_ADJACENT_PAIRS``: Cohere, GLM...) keep the dimensions as they lie; a rotary
  embedding over part of the head (Phi, GPT-NeoX) takes one level.
- **Masks.** ``register()`` also registers the mask function, which hands the attention function
  the ``(batch, keys)`` padding mask (``None`` without padding, outside ``torch.compile``); left
  or right padding is scored as the package's layers do: each row's real tokens attend only among
  themselves and their MLR blocks count from the row's first real token. (Without the mask function transformers would
  build no mask this implementation reads, and padding would be attended silently.) Without a
  mask, packed sequences (a padding-free batch, as ``DataCollatorWithFlattening`` makes) are read
  from ``cu_seq_lens_q`` or from ``position_ids`` that restart, as flash attention reads them, and
  each is scored alone; swapped models too.
- **Queries after a cache** (``generate()``, chunked prefill) go to ``mlr_prefill`` with each row's
  block starts; every other call, training included, to ``mlr_attention``. Attention dropout is
  not supported (``attention_dropout`` must be 0).
- **The compressed cache.** ``generate(..., cache=MLRCache(model.config))`` (``past_key_values=``
  before transformers 5.24) keeps what MLR attention can still read: level 1's keys for every
  token, a finer level's keys only for the
  last ``s_l`` tokens (the current block of any row, whatever its left padding) and the values in
  full; ``memory_bytes()`` says how much that is. Like transformers' quantized caches it hands the
  attention function full-length keys each step, rebuilt with zeros where a level was dropped:
  a query never reads a level before its current block there, so the result is exact. It is
  refused for a model not running ``"sattn_mlr"``, which would read those zeros. Assisted and
  prompt-lookup decoding crop it: ``generate()`` has it record the finer levels' keys until then.
- **Kinds with their own projections** (``bilinear_btt``, ``bilinear_mlr``, ``swa``,
  ``global_swa``, ``mlr`` with its per-level norms and scales): ``swap_attention(model,
  "bilinear_btt:1")`` puts the package's layer (fresh weights) in each decoder layer's place and
  makes the model ``Sattn<Family>ForCausalLM`` (``SWAP_FAMILIES``: Llama, Mistral, Qwen2, Qwen3), registered with
  ``AutoConfig``/``AutoModelForCausalLM`` by ``register()``: ``save_pretrained`` writes model type
  ``sattn_<family>`` and ``sattn_attention``, and ``AutoModelForCausalLM.from_pretrained`` rebuilds
  the swapped model with no remote code.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._autocast import autocast_inputs
from .._checks import require
from .._compiler import memoized
from .._memo import TensorMemo
from ..attention.segments import Segments, build_segments, left_padding
from ..ops.mlr import mlr_attention, mlr_prefill
from ..ops.mlr.contract import mlr_block_sizes

__all__ = ["ATTN_IMPLEMENTATION", "MLRCache", "SWAP_FAMILIES", "SwappedAttention", "configure", "level_permutation",
           "mlr_attention_forward", "register", "swap_attention"]

ATTN_IMPLEMENTATION = "sattn_mlr"
# The families swap_attention takes: register() registers their swapped classes, which
# from_pretrained needs to rebuild a saved swapped model.
SWAP_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")


def register() -> None:
    """Register the attention implementation ``"sattn_mlr"`` and its mask function with transformers,
    and the model classes of swapped models (``sattn_llama``, ``sattn_mistral``, ``sattn_qwen2``,
    ``sattn_qwen3``) with its Auto classes (idempotent)."""
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, mlr_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _padding_mask)
    for family in SWAP_FAMILIES:
        config_class = getattr(transformers, f"{family}Config", None)
        model_class = getattr(transformers, f"{family}ForCausalLM", None)
        if config_class is not None and model_class is not None:
            _swapped_classes(config_class, model_class)


def configure(config: Any, ranks: Sequence[int], block_sizes: Sequence[int] | None = None) -> Any:
    """Set ``sattn_ranks`` (and ``sattn_block_sizes``) on a transformers model config after
    checking them against its head dimension, ``max_position_embeddings`` and its rotary
    embedding: a mistake is one line naming the attribute here, not at the first forward. The
    config also records ``attn_implementation="sattn_mlr"``, so the folder ``save_pretrained``
    writes loads with MLR attention (``from_pretrained`` reads it from ``config.json``; without it
    the model would load as ``"sdpa"``, scoring every dimension over the whole context). Returns
    ``config``."""
    ranks = [int(r) if isinstance(r, numbers.Integral) and not isinstance(r, bool) else r for r in ranks]  # NumPy ints
    _check_levels(ranks, block_sizes, getattr(config, "max_position_embeddings", None), _head_dim(config))
    _check_rotary(config, ranks)
    config.sattn_ranks = list(ranks)
    config.sattn_block_sizes = None if block_sizes is None else list(block_sizes)
    config.attn_implementation = ATTN_IMPLEMENTATION  # written to config.json; read by from_pretrained
    return config


def _head_dim(config: Any) -> int:
    require(hasattr(config, "num_attention_heads") and (hasattr(config, "head_dim") or hasattr(config, "hidden_size")),
            "config", "a decoder's config with num_attention_heads and hidden_size (a composite model's text config, "
            "such as config.text_config)", type(config).__name__)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    require(isinstance(head_dim, int) and head_dim > 0, "head_dim", "a positive integer", head_dim)
    return head_dim


# Families whose rotary embedding rotates neighbouring dimensions together (2i, 2i + 1), where
# Llama's rotate_half pairs i with i + head_dim/2: their levels are consecutive dimensions.
_ADJACENT_PAIRS = frozenset({"cohere", "cohere2", "cohere2_moe", "glm", "glm4", "helium", "ernie4_5", "ernie4_5_moe",
                             "deepseek_v4", "llama4", "llama4_text", "gptj", "codegen"})


def _check_rotary(config: Any, ranks: Sequence[int]) -> None:
    """Several levels need every rotary pair inside one level (:func:`_score_order` orders the
    dimensions so); a rotary embedding over part of the head (``partial_rotary_factor`` < 1: Phi,
    GPT-NeoX) pairs dimensions this cannot see, so such a model takes one level only."""
    rope = getattr(config, "rope_parameters", None)
    partial = next((v for v in (getattr(config, "partial_rotary_factor", None),
                                rope.get("partial_rotary_factor") if isinstance(rope, dict) else None,
                                getattr(config, "rotary_pct", None)) if v is not None), 1.0)
    require(len(ranks) == 1 or partial == 1, "sattn_ranks",
            f"one level for a model whose rotary embedding covers part of each head (partial_rotary_factor="
            f"{partial}): several levels would split its rotary pairs", list(ranks))


def _score_order(config: Any, head_dim: int) -> tuple[int, ...] | None:
    """The head dimensions in the order the levels take them: pair after rotary pair
    (:func:`level_permutation`) for ``rotate_half`` models; as they lie (``None``) where
    neighbouring dimensions are the pairs."""
    return None if getattr(config, "model_type", None) in _ADJACENT_PAIRS else level_permutation(head_dim)


@memoized(maxsize=None)
def level_permutation(head_dim: int) -> tuple[int, ...]:
    """The head dimensions in the order the scores see them, rotary pair after rotary pair
    ``(i, i + head_dim/2)``: each level's ``r_l`` dimensions are whole pairs (see the module
    docstring)."""
    half = head_dim // 2
    return tuple(d for i in range(half) for d in (i, half + i))


def _pair_order(x: torch.Tensor) -> torch.Tensor:
    """``x[..., level_permutation(x.shape[-1])]`` as one strided copy."""
    return x.unflatten(-1, (2, x.shape[-1] // 2)).transpose(-1, -2).flatten(-2)


def _levels(config: Any, head_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A model config's checked MLR ranks and block sizes."""
    levels = _check_levels(getattr(config, "sattn_ranks", None), getattr(config, "sattn_block_sizes", None),
                           getattr(config, "max_position_embeddings", None), head_dim)
    _check_rotary(config, levels[0])
    return levels


def _check_levels(ranks: Any, block_sizes: Any, context: Any, head_dim: int
                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    require(isinstance(ranks, Sequence) and len(ranks) > 0
            and all(isinstance(r, int) and not isinstance(r, bool) and r > 0 and r % 2 == 0 for r in ranks)
            and sum(ranks) == head_dim, "sattn_ranks",
            f"a list of even positive ranks summing to the head dimension {head_dim} (a model config attribute)", ranks)
    require(isinstance(context, int) and context > 0, "max_position_embeddings", "a positive integer", context)
    try:
        sizes = mlr_block_sizes(ranks, context, block_sizes)
    except ValueError as e:  # mlr_block_sizes names its own argument, block_sizes, and the context
        reason = str(e).removeprefix("block_sizes: ").replace("context=", "max_position_embeddings=")
        raise ValueError(f"sattn_block_sizes: {reason}") from None
    return tuple(ranks), sizes


def _padding_mask(kv_length: int, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """The mask function of ``"sattn_mlr"`` (transformers' ``AttentionMaskInterface`` contract,
    whose arguments come by name; the batch size, the queries' length, the offsets and the mask
    pattern are not read): the 2-D padding mask sliced to the keys, what the segments of this
    implementation are built from, or None when nothing is padded, as flash attention's mask
    function gives. Under
    ``torch.compile`` the mask is handed over even where nothing is padded: telling would read it
    on the host, a data-dependent branch that breaks the graph (flash attention's does), and the
    segments of a mask with no padding give the unmasked result."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if not torch.compiler.is_compiling() and attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


# every layer of a forward passes the same tensors (position_ids, the padding mask): what is read
# from them on the host is read once per forward
_filled_memo, _row_starts_memo, _segments_memo = TensorMemo(), TensorMemo(), TensorMemo()


def _filled_slots(position_ids: torch.Tensor | None, keys: int) -> int:
    """The last query's position + 1 (``keys`` without ``position_ids``), read once per forward."""
    if not isinstance(position_ids, torch.Tensor):
        return keys
    return _filled_memo.get(position_ids, (), lambda: int(position_ids[:, -1].max()) + 1)


def _row_starts(attention_mask: torch.Tensor | None, batch: int, keys: int, first: int, sizes: tuple[int, ...],
                device: torch.device) -> torch.Tensor:
    """Each row's first key at each level for queries from position ``first`` after a cache of
    ``keys``: its left padding, then its current block's start; made once per forward (reading the
    mask, checking that it is left-padded and copying the answer to the device each wait for the
    device, which per layer would hold back every layer's kernels)."""

    def starts(offsets: torch.Tensor) -> torch.Tensor:  # offsets (B, 1): each row's left padding
        block = torch.tensor(sizes, device=device)
        return offsets + (first - offsets) // block * block

    if torch.compiler.is_compiling():  # from the mask on the device (taken as left padding, unchecked)
        return starts(torch.zeros(batch, 1, dtype=torch.long, device=device) if attention_mask is None
                      else keys - attention_mask.long().sum(dim=1, keepdim=True))

    def read() -> torch.Tensor:  # eagerly: the mask read and checked on the host
        offsets = [0] * batch if attention_mask is None else left_padding(attention_mask, batch, keys, device)
        return starts(torch.tensor(offsets, device=device)[:, None])

    return _row_starts_memo.get(attention_mask, (batch, keys, first, sizes, device), read)


def _segments(attention_mask: torch.Tensor | None, position_ids: object, cu_seq_lens: object, batch: int,
              keys: int, device: torch.device) -> Segments | None:
    """The call's sequences, as transformers' own attention functions read them: the padding mask's
    rows; without a mask, packed sequences (a padding-free batch, as ``DataCollatorWithFlattening``
    makes) from ``cu_seq_lens_q`` (one row) or from ``position_ids`` that restart (a token whose
    position is not the previous one's + 1 starts a sequence). Made once per forward: every layer
    passes the same tensors, and reading them on the host waits for the device."""
    if attention_mask is not None:
        key, make = attention_mask, lambda: build_segments(attention_mask, None, batch, keys, device)
    elif isinstance(cu_seq_lens, torch.Tensor):
        key, make = cu_seq_lens, lambda: build_segments(None, _ids_of_lengths(cu_seq_lens, batch, keys), batch,
                                                         keys, device)
    elif isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and keys > 1:
        key, make = position_ids, lambda: build_segments(None, _ids_of_positions(position_ids, batch), batch, keys,
                                                          device)
    else:
        return None
    if torch.compiler.is_compiling():
        return make()
    return _segments_memo.get(key, (batch, keys, device), make)


def _ids_of_positions(position_ids: torch.Tensor, batch: int) -> torch.Tensor:
    positions = position_ids.expand(batch, -1)  # transformers may pass (1, T) for a batch
    restarts = positions[:, 1:] != positions[:, :-1] + 1
    return torch.cat([restarts.new_zeros(batch, 1), restarts], dim=1).long().cumsum(dim=1)


def _ids_of_lengths(cu_seq_lens: torch.Tensor, batch: int, keys: int) -> torch.Tensor:
    require(batch == 1 and cu_seq_lens.dim() == 1, "cu_seq_lens_q",
            "the cumulative lengths of the sequences packed in one row (batch 1)",
            f"shape {tuple(cu_seq_lens.shape)} for a batch of {batch}")
    starts = torch.zeros(keys + 1, dtype=torch.long, device=cu_seq_lens.device)
    starts[cu_seq_lens.long()] = 1  # every sequence's first token (and one past the last)
    return starts[:keys].cumsum(dim=0)[None] - 1


# Arguments transformers passes to attention functions that change the scores: Gemma 2's logit
# soft-capping, the attention sinks of gpt-oss (s_aux, sinks), T5-style position biases.
_SCORE_CHANGES = ("softcap", "s_aux", "sinks", "position_bias")


def mlr_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query (B, H, Tq, D)``, ``key``/``value``
    ``(B, Hkv, Tk, D)`` (the whole cache when there is one), ``attention_mask`` from the mask
    function (``(B, Tk)`` or ``None``); returns ``(B, Tq, H, Dv)`` and no attention weights."""
    require(dropout == 0.0, "attention_dropout", "0 with sattn_mlr (MLR attention has no attention dropout)", dropout)
    for name in _SCORE_CHANGES:  # what some families add to the scores, which MLR attention would drop
        require(kwargs.get(name) is None, name, "None with sattn_mlr (MLR attention scores q.k alone)",
                "a value" if isinstance(kwargs.get(name), torch.Tensor) else kwargs.get(name))
    window, context = kwargs.get("sliding_window"), getattr(module.config, "max_position_embeddings", None)
    require(window is None or (context is not None and window >= context), "sliding_window",
            f"None or at least max_position_embeddings={context} with sattn_mlr (MLR attention scores every "
            "earlier token; swap_attention(model, 'swa:W') gives a sliding window)", window)
    require(attention_mask is None or attention_mask.dim() == 2, "attention_mask",
            "a (batch, keys) padding mask, as the mask function register() adds hands over (a 4-D mask of one's "
            "own cannot be read by MLR attention)", None if attention_mask is None else tuple(attention_mask.shape))
    head_dim = query.shape[-1]
    ranks, sizes = _levels(module.config, head_dim)
    order = _score_order(module.config, head_dim)
    if module.config.__dict__.get("attn_implementation") != ATTN_IMPLEMENTATION and not torch.compiler.is_compiling():
        # what save_pretrained writes to config.json, so a model loaded by from_pretrained (whose
        # config transformers gives the implementation but not this attribute) saves it again
        module.config.attn_implementation = ATTN_IMPLEMENTATION
    scale = head_dim**-0.5 if scaling is None else scaling
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    batch, t_q, t_k = query.shape[0], query.shape[2], key.shape[2]
    if t_q < t_k:
        # A cache of fixed length (cache_implementation="static") hands over its unfilled slots too:
        # the filled ones are the padding mask's columns, or without one the last query's position + 1.
        filled = attention_mask.shape[1] if attention_mask is not None else _filled_slots(kwargs.get("position_ids"), t_k)
        if filled < t_k:
            key, value, t_k = key[:, :, :filled], value[:, :, :filled], filled
    # MLR blocks tile max_position_embeddings (or the first block size): a longer sequence has no level 1
    require(t_k <= sizes[0], "input length", f"at most {sizes[0]} tokens with sattn_mlr (the coarsest MLR block: "
            f"max_position_embeddings, or sattn_block_sizes[0])", t_k)
    if t_q == t_k:
        segments = _segments(attention_mask, kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"), batch, t_k,
                             query.device)
        out = mlr_attention(query, key, value, ranks, sizes, causal=causal, scale=scale,
                            document_ids=None if segments is None else segments.ids, dim_order=order)
    else:  # new queries after a cache of t_k - t_q keys; rows are left-padded
        require(causal, "is_causal", "True when queries follow a cache", causal)
        # inside autocast the rotated keys are float32 beside bfloat16 values: read as SDPA would
        query, key, value = autocast_inputs(query, key, value)
        q, k = (query, key) if order is None else (_pair_order(query), _pair_order(key))
        row_starts = _row_starts(attention_mask, batch, t_k, t_k - t_q, sizes, q.device)
        out = mlr_prefill(q, list(k.split(ranks, dim=-1)), [0] * len(ranks), value, ranks, scale, False, sizes,
                          row_starts)
    return out.transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=1)
def _cache_classes() -> tuple[type, type]:
    """The cache classes, made on first use: their bases come from transformers, which this
    module imports only when asked to."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class MLRCacheLayer(CacheLayerMixin):
        """One layer's compressed MLR cache (see the module docstring)."""

        is_sliding = False
        is_croppable = True

        def __init__(self, level_dims: list[torch.Tensor], block_sizes: Sequence[int]) -> None:
            super().__init__()
            self.level_dims, self.block_sizes = level_dims, tuple(block_sizes)
            self.levels: list[torch.Tensor] = []
            self.level_starts: list[int] = []
            self.length = 0
            # set by generate() before assisted, prompt-lookup or deferred-stop decoding: the finer
            # levels keep every key until the next crop(), which may then take back any number of tokens
            self.record_past = False

        def activate_past_recording(self, **kwargs: Any) -> None:
            self.record_past = True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.device = key_states.device
            self.level_dims = [d.to(self.device) for d in self.level_dims]
            self.levels = [key_states.new_empty(*key_states.shape[:2], 0, len(d)) for d in self.level_dims]
            self.level_starts = [0] * len(self.level_dims)
            self.values = value_states.new_empty(*value_states.shape[:2], 0, value_states.shape[-1])
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            start, end = self.length, self.length + key_states.shape[2]
            keys = key_states.new_zeros(*key_states.shape[:2], end, key_states.shape[-1])
            keys[:, :, start:] = key_states
            for i, (dims, first) in enumerate(zip(self.level_dims, self.level_starts)):
                keys[:, :, first:start, dims] = self.levels[i]
                # keep the last s_l tokens: the current block of every row, whatever its padding
                keep = first if i == 0 or self.record_past else max(first, end - self.block_sizes[i])
                level = torch.cat([self.levels[i], key_states[..., dims]], dim=2)
                self.levels[i], self.level_starts[i] = level[:, :, keep - first:], keep
            self.values = torch.cat([self.values, value_states], dim=2)
            self.length = end
            return keys, self.values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.length + query_length, 0

        def get_seq_length(self) -> int:
            return self.length

        def get_max_length(self) -> int:
            return -1

        get_max_cache_shape = get_max_length  # its name before transformers 5.13

        def reset(self) -> None:
            self.levels, self.level_starts, self.values, self.length = [], [], None, 0
            self.is_initialized = False

        def crop(self, tokens_to_remove: int) -> None:
            """Take back the last ``-tokens_to_remove`` tokens (a positive value is the length to keep,
            as transformers before 5.14 passes it); the finer levels then keep their last ``s_l`` tokens
            again. The next queries read level ``l`` from the start of their block, at most
            ``s_l - 1`` tokens back, so without past recording a level that dropped those keys refuses."""
            if not self.is_initialized:
                return
            length = min(self.length, tokens_to_remove if tokens_to_remove > 0 else self.length + tokens_to_remove)
            require(length >= 0, "crop", f"at most the {self.length} cached tokens taken back", -tokens_to_remove)
            for i, (first, size) in enumerate(zip(self.level_starts, self.block_sizes)):  # all checked, then cut
                require(first <= max(length - size + 1, 0), "crop", (
                    f"at most {self.length - first - size + 1} tokens taken back from this MLRCache (level {i + 1} "
                    f"keeps the keys of the last {size} tokens; after activate_past_recording(), as generate()'s "
                    "assisted and prompt-lookup decoding call it, it keeps them all until the next crop)"),
                    self.length - length)
            for i, (first, size) in enumerate(zip(self.level_starts, self.block_sizes)):
                keep = first if i == 0 else max(first, length - size)
                self.levels[i], self.level_starts[i] = self.levels[i][:, :, keep - first:length - first], keep
            self.values = self.values[:, :, :length]
            self.length = length

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            if self.length:
                self.levels = [level.index_select(0, beam_idx.to(level.device)) for level in self.levels]
                self.values = self.values.index_select(0, beam_idx.to(self.values.device))

        def memory_bytes(self) -> int:
            held = [*self.levels, self.values] if self.is_initialized else []
            return sum(t.numel() * t.element_size() for t in held)

    class MLRCache(Cache):
        """A transformers ``Cache`` holding MLR attention's compressed keys (see the module
        docstring); ``config`` is the model's, with ``sattn_ranks``."""

        def __init__(self, config: Any) -> None:
            # It hands back keys with the dropped levels zeroed, which only MLR attention may read.
            require(getattr(config, "sattn_attention", None) is None, "cache",
                    "transformers' own cache for a model changed by swap_attention (its layers keep their own caches "
                    "in it); MLRCache is for models running attn_implementation='sattn_mlr'", "MLRCache")
            require(getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION, "cache",
                    f"MLRCache only for a model running attn_implementation={ATTN_IMPLEMENTATION!r} (another "
                    f"implementation would read the levels it drops as zeros)",
                    f"a config with attn_implementation={getattr(config, '_attn_implementation', None)!r}")
            head_dim = _head_dim(config)
            ranks, sizes = _levels(config, head_dim)
            order = torch.tensor(_score_order(config, head_dim) or range(head_dim))
            level_dims = list(order.split(ranks))
            super().__init__(layers=[MLRCacheLayer(level_dims, sizes) for _ in range(config.num_hidden_layers)])

        def memory_bytes(self) -> int:
            """Bytes of every layer's kept keys and values."""
            return sum(layer.memory_bytes() for layer in self.layers)

    return MLRCacheLayer, MLRCache


def __getattr__(name: str) -> Any:
    if name == "MLRCache":
        return _cache_classes()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- kinds with their own projections: swap_attention --------------------------------------------------


class _LengthOnly:
    """What a swapped layer keeps of a forward with gradients: the number of tokens it saw."""

    def __init__(self, length: int) -> None:
        self.length = length


class SwappedAttention(torch.nn.Module):
    """One of the package's attention layers in a transformers decoder layer's place: it keeps its
    own projections (and its own rotary embedding, except for the bilinear kinds, whose queries are
    the inputs themselves), reads the 2-D padding mask the ``"sattn_mlr"`` mask function gives,
    and keeps its own KV cache inside transformers' cache object, whose length it advances with
    empty tensors so that ``generate()`` counts positions as usual."""

    def __init__(self, config: Any, layer_idx: int, spec: str) -> None:
        super().__init__()
        self.layer_idx, self.is_causal = layer_idx, True
        kind = spec.split(":", 1)[0]
        self._settings = dict(d_model=config.hidden_size, n_heads=config.num_attention_heads,
                              max_seq_len=config.max_position_embeddings, causal=True,
                              rotary=kind not in ("bilinear_btt", "bilinear_mlr"), rotary_base=_rope_theta(config))
        self._spec = spec
        self.attn = self._fresh_layer()

    def _fresh_layer(self) -> torch.nn.Module:
        from ..attention import build_attention

        try:
            return build_attention(self._spec, **self._settings)
        except ValueError as e:
            raise ValueError(f"sattn_attention={self._spec!r}: {e}") from None

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, cache: Any = None,
                past_key_values: Any = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        cache = past_key_values if cache is None else cache  # transformers before 5.24 names it past_key_values
        require(attention_mask is None or attention_mask.dim() == 2, "attention_mask",
                "a (batch, keys) padding mask (a swapped model runs with attn_implementation='sattn_mlr')",
                None if attention_mask is None else tuple(attention_mask.shape))
        batch, new = hidden_states.shape[:2]
        own = {} if cache is None else cache.__dict__.setdefault("_sattn_caches", {})
        kv = own.get(self.layer_idx)
        fresh = cache is None or kv is None or kv.length != cache.get_seq_length(self.layer_idx)  # new or reset
        # Packed sequences (a padding-free batch: no mask, position ids that restart) in a forward
        # that continues no cache, as the "sattn_mlr" function reads them. Compiled, a forward
        # filling a cache without gradients takes each row as one sequence, as transformers' SDPA
        # attention does with a cache (telling would read the positions on the host).
        packed = None
        if attention_mask is None and fresh and (cache is None or torch.is_grad_enabled()
                                                 or not torch.compiler.is_compiling()):
            packed = _segments(None, kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"), batch, new,
                               hidden_states.device)
        if cache is None:
            return self.attn(hidden_states, attention_mask=attention_mask, segments=packed), None
        # Training, where transformers passes a cache (use_cache=True is its default): the package's
        # caches fill in place, which autograd cannot follow, so with gradients the layer runs
        # uncached and the cache records the length only; such a cache is never continued. So does
        # a packed batch, whose rows hold several sequences that a cache cannot continue.
        uncached = torch.is_grad_enabled() or packed is not None
        require(fresh or not (uncached or isinstance(kv, _LengthOnly)), "cache",
                "a cache filled under torch.no_grad() by a batch of one sequence per row, to continue (a swapped "
                "layer keeps nothing of a forward with gradients or of packed sequences)",
                "a continuation with gradients enabled" if uncached else "one filled with gradients enabled or "
                "packed sequences")
        if uncached:
            out = self.attn(hidden_states, attention_mask=attention_mask, segments=packed)
            own[self.layer_idx] = _LengthOnly(new)
        else:
            if fresh:
                kv = own[self.layer_idx] = self.attn.new_cache(batch)
            out = self.attn(hidden_states, kv, attention_mask=attention_mask)
        # one number per token (transformers counts an empty cache as length 0): its length only
        marker = hidden_states.new_zeros(batch, 1, new, 1)
        cache.update(marker, marker, self.layer_idx)
        return out, None

    def restore_buffers(self) -> None:
        """Recompute the layer's non-persistent buffers (rotary tables, level indices), which
        ``from_pretrained`` leaves uninitialised: it builds the model without memory first and
        loads only what the weights file holds."""
        fresh = dict(self._fresh_layer().named_buffers())
        for name, buffer in self.attn.named_buffers():
            buffer.copy_(fresh[name])


def _rope_theta(config: Any) -> float:
    """The model's rotary base: ``rope_parameters["rope_theta"]`` (transformers 5) or ``rope_theta``;
    a swapped layer's own rotary embedding is the plain one, so a scaled one (YaRN, Llama 3's) is
    refused rather than dropped."""
    rope = getattr(config, "rope_parameters", None)
    rope = rope if isinstance(rope, dict) else {}
    kind = rope.get("rope_type", "default")
    require(kind == "default", "rope_parameters", "rope_type 'default' for swap_attention (a swapped layer's rotary "
            "embedding is the plain one)", kind)
    return float(rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and all(hasattr(m, "self_attn") for m in module):
            return module
    raise ValueError(f"model: expected a transformers decoder whose layers hold self_attn, got {type(model).__name__}")


def _swap_layers(model: torch.nn.Module, spec: str) -> None:
    for i, layer in enumerate(_decoder_layers(model)):
        like = next(layer.parameters())  # the layer's device and dtype (a bfloat16 model's layers are bfloat16)
        layer.self_attn = SwappedAttention(model.config, i, spec).to(like.device, like.dtype)


@functools.lru_cache(maxsize=None)
def _swapped_classes(config_class: type, model_class: type) -> tuple[type, type]:
    """``Sattn<Family>Config`` (model type ``sattn_<family>``, the field ``sattn_attention``) and
    ``Sattn<Family>ForCausalLM``, which builds the family's model and swaps its attention;
    registered with ``AutoConfig`` and ``AutoModelForCausalLM``, so ``from_pretrained`` rebuilds a
    swapped model from its folder with no remote code."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = f"sattn_{config_class.model_type}"
    swapped_config = type(f"Sattn{config_class.__name__}", (config_class,), {"model_type": model_type})

    def __init__(self: Any, config: Any) -> None:
        model_class.__init__(self, config)
        _swap_layers(self, config.sattn_attention)
        self.config._attn_implementation = ATTN_IMPLEMENTATION

    def _reorder_cache(self: Any, cache: Any, beam_idx: torch.Tensor) -> Any:
        # beam search: transformers reorders its own cache, not the layers' caches kept on it
        cache.reorder_cache(beam_idx)
        for kv in cache.__dict__.get("_sattn_caches", {}).values():
            if not isinstance(kv, _LengthOnly):
                kv.select_rows(beam_idx)
        return cache

    @classmethod  # type: ignore[misc]
    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        model = super(swapped_model, cls).from_pretrained(*args, **kwargs)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, SwappedAttention):
                    module.restore_buffers()
        return model

    swapped_model = type(f"Sattn{model_class.__name__}", (model_class,),
                         {"config_class": swapped_config, "__init__": __init__, "from_pretrained": from_pretrained,
                          "_reorder_cache": _reorder_cache})
    AutoConfig.register(model_type, swapped_config, exist_ok=True)
    AutoModelForCausalLM.register(swapped_config, swapped_model, exist_ok=True)
    return swapped_config, swapped_model


def swap_attention(model: Any, spec: str) -> Any:
    """Replace each decoder layer's attention module of a transformers causal language model, in
    place, with the package's layer for ``spec`` (``"bilinear_btt:1"``, ``"swa:128"``,
    ``"mlr:32|16|16"``...; fresh weights), and make the model one of the registered
    ``Sattn<Family>ForCausalLM`` classes, so ``save_pretrained`` writes a folder that
    ``AutoModelForCausalLM.from_pretrained`` rebuilds. Returns ``model``."""
    import transformers

    register()
    require(isinstance(spec, str) and spec != "", "spec", "an attention spec such as 'bilinear_btt:1'", spec)
    config_class, model_class = type(model.config), type(model)
    if not config_class.model_type.startswith("sattn_"):
        families = {getattr(transformers, f"{f}ForCausalLM", None): f for f in SWAP_FAMILIES}
        require(model_class in families, "model", f"a causal LM of a family whose swapped model register() makes "
                f"loadable ({', '.join(f + 'ForCausalLM' for f in SWAP_FAMILIES)})", model_class.__name__)
        config_class, model_class = _swapped_classes(config_class, model_class)
    _swap_layers(model, spec)
    model.config.__class__, model.__class__ = config_class, model_class
    model.config.sattn_attention = spec
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    return model
