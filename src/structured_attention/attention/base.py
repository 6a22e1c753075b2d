"""The interface every attention kind implements, the registry that picks one by name, and the
masked-softmax helper the kinds share."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .._checks import fail, require
from ..functional import scaled_dot_product_attention, sliding_window_attention
from ..functional.decode import decode_full_slots
from .cache import KVCache, StaticKVCache, TokenBuffer, append_all, full_slots, store
from .config import AttentionConfig, check_flags
from .rotary import Rotary
from .segments import CachePadding, Segments, build_segments, left_padding, position_mask


@dataclass(frozen=True)
class AttentionCost:
    """Costs of one layer over a sequence of ``seq_len`` tokens, all heads, batch 1.

    FLOPs are multiply-adds, as in ``structured_attention.matrices``. Element-wise work (softmax,
    LayerNorm, masks) is not counted.
    """

    seq_len: int
    params: int
    projection_flops: int  # query/key/value/output projections
    score_flops: int  # forming the scores of the attended pairs
    mix_flops: int  # attention weights times values
    kv_cache_numel: int  # numbers held by the KV cache after seq_len tokens

    @property
    def total_flops(self) -> int:
        return self.projection_flops + self.score_flops + self.mix_flops

    @property
    def score_flops_per_token(self) -> float:
        return self.score_flops / self.seq_len

    def kv_cache_bytes_per_token(self, element_size: int) -> float:
        return self.kv_cache_numel * element_size / self.seq_len


def causal_pairs(seq_len: int, causal: bool) -> int:
    """Number of (query, key) pairs full attention scores."""
    return seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len


def window_pairs(seq_len: int, window: int, causal: bool) -> int:
    """Number of pairs with ``|i - j| <= window`` (and ``j <= i`` when causal)."""
    w = min(window, seq_len - 1)
    one_side = w * seq_len - w * (w + 1) // 2  # pairs with 1 <= i - j <= w
    return seq_len + one_side * (1 if causal else 2)


# A decoding step scores one query against a key length it has not seen before. PyTorch's cuDNN
# attention builds a new plan for every new length (34 ms a step on an H200 with torch 2.11; see
# pytorch/pytorch#155958), so one-query steps on CUDA leave it out.
DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    causal: bool,
    window: int | None = None,
    q_start: int = 0,
    k_start: int = 0,
    dropout: float = 0.0,
    queries: Segments | None = None,
    keys: Segments | None = None,
) -> torch.Tensor:
    """Softmax attention of queries at slots ``q_start + [0, t_q)`` over keys at slots
    ``k_start + [0, t_k)``; GQA when ``k``/``v`` have fewer heads than ``q``. With the segments of
    the queries and of the keys (see :mod:`.segments`), a query sees only keys of its own segment;
    causality and windows count in slots, which within a segment are positions."""
    t_q, t_k = q.shape[2], k.shape[2]
    # A branch, not the comparison itself: under torch.compile with dynamic shapes the comparison is
    # symbolic, which SDPA rejects, and a branch on it is resolved while tracing.
    gqa = True if k.shape[1] != q.shape[1] else False  # noqa: SIM210
    aligned = q_start == k_start and t_q == t_k
    if window is not None and aligned:
        return sliding_window_attention(q, k, v, window, causal=causal, scale=scale, dropout_p=dropout,
                                        document_ids=None if queries is None else queries.ids)
    if queries is not None and queries is keys and queries.leading is not None and causal and window is None:
        # Padding before or after one sequence per row, causal: roll the padding behind the
        # sequence and take the fused causal kernel with no mask.
        out = scaled_dot_product_attention(*(queries.trailing_padding(x) for x in (q, k, v)), dropout_p=dropout,
                                           is_causal=True, scale=scale, enable_gqa=gqa)
        return queries.trailing_padding(out, undo=True)
    decoding = sdpa_kernel(DECODE_BACKENDS) if q.is_cuda and t_q == 1 else contextlib.nullcontext()
    with decoding:
        if queries is None and window is None and (not causal or aligned or t_q == 1):
            # The plain causal or full pattern: no explicit mask, so SDPA can take a fused kernel.
            is_causal = True if causal and t_q > 1 else False  # noqa: SIM210 (a branch: see gqa)
            return scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=is_causal, scale=scale,
                                                enable_gqa=gqa)
        if queries is not None and keys is not None:
            mask = queries.attention_bias(keys, q_start, k_start, causal, window, q.dtype)
        else:
            q_pos = torch.arange(q_start, q_start + t_q, device=q.device)
            k_pos = torch.arange(k_start, k_start + t_k, device=q.device)
            mask = position_mask(q_pos, k_pos, causal, window)
        return scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=gqa)


def cached_segments(cache: KVCache, lo: int, hi: int) -> Segments | None:
    """Segments of the cache slots ``[lo, hi)``; ``None`` when no row is padded."""
    return None if cache.padding is None else cache.padding.segments(lo, hi)


def bind_padding(caches: list[KVCache], attention_mask: torch.Tensor, batch: int, total: int, device: Any) -> None:
    """Give ``caches`` the left padding of ``attention_mask`` ``(batch, total)``, which covers the
    cached and the new tokens. A row's padding is fixed once the row has a real token; later calls
    are checked against it."""
    offsets = left_padding(attention_mask, batch, total, device)
    for cache in caches:
        held = cache.padding.offsets if cache.padding is not None else (0,) * batch
        for new, old in zip(offsets, held):
            # old < length: the row's sequence had started, so its padding is fixed
            require(cache.length == 0 or new == old or (old >= cache.length and new >= old), "attention_mask",
                    f"the left padding the cache was filled with ({list(held)} padding tokens per row)", offsets)
    padding = CachePadding(offsets, device) if any(offsets) else None  # one for every layer
    for cache in caches:
        cache.padding = padding


def _check_cache_dtype(cache: KVCache | StaticKVCache, x: torch.Tensor) -> None:
    """One-line ``ValueError`` unless the cache's dtype is ``x``'s or autocast is on for its device
    (where the new keys and values come out in autocast's dtype and are stored in the cache's)."""
    if cache.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):  # no message built per step
        fail("cache", f"a cache in the layer's dtype {x.dtype} (a cache of another dtype is read inside "
                      "torch.autocast)", cache.dtype)


class Attention(nn.Module):
    """Base class: ``(B, T, D) -> (B, T, D)`` for any ``T <= max_seq_len``.

    ``forward(x, cache)`` with a cache from :meth:`new_cache` treats ``x`` as the next tokens of a
    causal sequence (a prompt to prefill or one token to decode) and returns their outputs.
    Subclasses set ``self.v_proj``-style layers and implement ``_forward`` and ``_forward_cached``.
    """

    kind: str = ""  # the name specs and configs select this kind by (see .kinds)
    # Spec strings that exercise the kind's options, by name, valid at width 32, 4 heads and a
    # 64-token context: the shape at which the test suite checks every kind in ATTENTION_KINDS
    # against its dense definition, its cache and padded rows.
    examples: dict[str, str] = {}

    @dataclass(frozen=True)
    class Config:
        """The kind's own options (none here); each kind declares its own, read by the spec parser."""

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__()
        options = config.options if config.options is not None else type(self).Config()
        require(isinstance(options, type(self).Config), "options", f"a {type(self).__name__}.Config",
                type(options).__name__)
        check_flags(options)
        self.config = config
        self.options = options
        self.d_model = config.d_model
        self.n_heads = config.n_heads
        # the config's None means the default: as many kv heads as heads, d_model / n_heads dims
        self.n_kv_heads = config.n_heads if config.n_kv_heads is None else config.n_kv_heads
        self.head_dim = config.d_model // config.n_heads if config.head_dim is None else config.head_dim
        self.v_proj = nn.Linear(config.d_model, self.n_kv_heads * self.head_dim, bias=config.bias)
        self.out_proj = nn.Linear(config.n_heads * self.head_dim, config.d_model, bias=config.bias)

    # -- helpers for subclasses ------------------------------------------------------------
    def split_heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """``(B, T, heads * d) -> (B, heads, T, d)``."""
        b, t, _ = x.shape
        return x.view(b, t, heads, -1).transpose(1, 2)

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, H, T, d) -> (B, T, H * d)`` and the output projection."""
        b, h, t, d = x.shape
        return self.out_proj(x.transpose(1, 2).reshape(b, t, h * d))

    def _rotary(self, segments: tuple[int, ...]) -> Rotary | None:
        """The rotary embedding over ``segments`` of the head dims when the config asks for one."""
        if not self.config.rotary:
            return None
        return Rotary(segments, self.config.max_seq_len, self.config.rotary_base)

    def values(self, x: torch.Tensor) -> torch.Tensor:
        return self.split_heads(self.v_proj(x), self.n_kv_heads)

    @property
    def attn_dropout(self) -> float:
        return self.config.dropout if self.training else 0.0

    def _full_buffer(self, batch: int, dim: int, heads: int, dtype: torch.dtype, device: Any) -> TokenBuffer:
        return TokenBuffer(batch, heads, dim, self.config.max_seq_len, dtype, device)

    # -- interface --------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        *,
        segments: Segments | None = None,
    ) -> torch.Tensor:
        """Outputs ``(B, T, D)`` of ``x: (B, T, D)``.

        ``attention_mask`` ``(B, T)`` (1 or True for real tokens; left or right padding) and
        ``document_ids`` ``(B, T)`` (packed documents, non-decreasing) split rows into sequences
        that are each computed as if alone (see :mod:`.segments`); outputs at padding are zero.
        ``segments`` passes them already checked (what a model does once for all its layers).
        With a ``cache``, ``attention_mask`` covers the cached and the new tokens, ``(B, cached +
        T)``, padded on the left; its padding is fixed by the first call.
        """
        require(isinstance(x, torch.Tensor) and x.dim() == 3, "x", "a (batch, seq_len, d_model) tensor",
                tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__)
        require(x.shape[-1] == self.d_model, "x", f"last dimension d_model={self.d_model}", tuple(x.shape))
        weight = self.out_proj.weight
        require(x.dtype == weight.dtype, "x.dtype", f"{weight.dtype} (the dtype of the layer's parameters)", x.dtype)
        require(x.device == weight.device, "x.device", f"{weight.device} (the device of the layer's parameters)", x.device)
        if isinstance(cache, StaticKVCache):
            cache.check_use(self, x.shape[0])
            _check_cache_dtype(cache, x)
            if not cache.prefilled:  # the prompt, into the growing cache; then into the static buffers
                out = self.forward(x, cache.growing, attention_mask)
                self.fill_static(cache)
                return out
            require(x.shape[1] == 1 and attention_mask is None and document_ids is None and segments is None, "x",
                    "one token per row after the prompt, with no mask (a static cache decodes token by token)",
                    tuple(x.shape))
            out = self._forward_static(x, cache)
            cache.slot.add_(1)
            return out
        if cache is not None:
            require(isinstance(cache, KVCache), "cache", "a KVCache from new_cache() or None", type(cache).__name__)
            cache.check_use(self, x.shape[0])
            _check_cache_dtype(cache, x)
        start = 0 if cache is None else cache.length
        require(x.shape[1] >= 1 and start + x.shape[1] <= self.config.max_seq_len, "seq_len",
                f"1 <= cached + new tokens <= max_seq_len={self.config.max_seq_len}", start + x.shape[1])
        if cache is None:
            if segments is None:
                segments = build_segments(attention_mask, document_ids, x.shape[0], x.shape[1], x.device)
            out = self._forward(x, segments)
            return out if segments is None else segments.zero_padding(out)
        require(self.config.causal, "cache", "a causal layer (incremental decoding needs causal=True)", "causal=False")
        require(document_ids is None and segments is None, "document_ids",
                "None with a cache (a cache holds one sequence per row; pad rows with attention_mask)", "ids")
        if attention_mask is not None:
            bind_padding([cache], attention_mask, x.shape[0], start + x.shape[1], x.device)
        out = self._forward_cached(x, cache)
        cache.length += x.shape[1]
        if cache.padding is not None and cache.padding.padded(start):
            out = cache.padding.segments(start, cache.length).zero_padding(out)
        return out

    def new_cache(self, batch_size: int, dtype: torch.dtype | None = None, device: Any = None,
                  static: bool = False) -> KVCache | StaticKVCache:
        """An empty cache for this layer; dtype and device default to the layer's parameters'.
        A cache in another dtype (bfloat16 keys and values for a float32 model, half the memory)
        is read inside ``torch.autocast``, which gives the step's projections that dtype.
        ``static``: a :class:`StaticKVCache` (fixed shapes for compiled decoding steps) instead of
        the growing one (fewer slots touched per step: faster eagerly, on the CPU especially)."""
        dtype = dtype or self.out_proj.weight.dtype
        device = device or self.out_proj.weight.device
        cache = KVCache(self._cache_buffers(batch_size, dtype, device), owner=self)
        return StaticKVCache(cache) if static else cache

    def fill_static(self, cache: StaticKVCache) -> StaticKVCache:
        """Move what ``cache``'s growing cache holds (a prompt) into its static buffers; returns it."""
        cache.load(self._static_buffers(cache.growing))
        return cache

    def static_cache(self, cache: KVCache) -> StaticKVCache:
        """A :class:`StaticKVCache` holding what ``cache``, this layer's growing cache, holds."""
        return self.fill_static(StaticKVCache(cache))

    def cost(self, seq_len: int) -> AttentionCost:
        """Parameters, FLOPs and cache size for a ``seq_len``-token sequence (see AttentionCost)."""
        pairs = causal_pairs(seq_len, self.config.causal)
        projections = sum(m.in_features * m.out_features for m in self.modules() if isinstance(m, nn.Linear))
        return AttentionCost(
            seq_len=seq_len,
            params=sum(p.numel() for p in self.parameters()),
            projection_flops=seq_len * (projections + self._structured_projection_flops()),
            score_flops=self.score_flops(seq_len),
            mix_flops=self.n_heads * self.head_dim * self._mixed_pairs(seq_len, pairs),
            kv_cache_numel=self.kv_cache_numel(seq_len),
        )

    # -- per kind ---------------------------------------------------------------------------
    def _forward(self, x: torch.Tensor, segments: Segments | None) -> torch.Tensor:
        """Outputs of a whole batch; with ``segments``, each segment attends only within itself and
        takes its positions from ``segments.positions`` (outputs at padding may be anything finite)."""
        raise NotImplementedError

    def _forward_cached(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Outputs of the next tokens of the cached rows (left-padded rows: ``cache.padding``)."""
        raise NotImplementedError

    def _cache_buffers(self, batch: int, dtype: torch.dtype, device: Any) -> dict[str, TokenBuffer]:
        raise NotImplementedError

    def _static_buffers(self, cache: KVCache) -> dict[str, torch.Tensor]:
        """The growing cache's content in the static buffers :meth:`_forward_static` reads."""
        raise NotImplementedError

    def _forward_static(self, x: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """Output of one new token per row at ``cache.slot``, written into the static buffers."""
        raise NotImplementedError

    def score_flops(self, seq_len: int) -> int:
        """Multiply-adds that form the scores of a ``seq_len``-token sequence, all heads."""
        raise NotImplementedError

    def kv_cache_numel(self, seq_len: int) -> int:
        """Numbers the cache holds (batch 1) after ``seq_len`` tokens; equals ``new_cache`` usage."""
        raise NotImplementedError

    def _mixed_pairs(self, seq_len: int, pairs: int) -> int:
        """Pairs whose weight multiplies a value vector (full attention: all attended pairs)."""
        return pairs

    def _structured_projection_flops(self) -> int:
        """Per-token multiply-adds of projections that are not ``nn.Linear``."""
        return 0


class FullScoreAttention(Attention):
    """Kinds that score every pair with per-head queries and keys of ``score_dims`` dims and cache
    all keys and values; subclasses define ``qk`` and set ``score_dims`` and ``scale``."""

    score_dims: int
    scale: float

    def qk(self, x: torch.Tensor, positions: int | torch.Tensor = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head queries and keys of tokens at ``positions``: ``start + [0, T)`` for an int, else
        a ``(B, T)`` tensor of positions."""
        raise NotImplementedError

    def _forward(self, x: torch.Tensor, segments: Segments | None) -> torch.Tensor:
        q, k = self.qk(x, 0 if segments is None else segments.positions)
        out = attend(q, k, self.values(x), self.scale, causal=self.config.causal, dropout=self.attn_dropout,
                     queries=segments, keys=segments)
        return self.merge_heads(out)

    def _forward_cached(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        start, end = cache.length, cache.length + x.shape[1]
        new, held = cached_segments(cache, start, end), cached_segments(cache, 0, end)
        q, k = self.qk(x, start if new is None else new.positions)
        k, v = append_all([cache["k"], cache["v"]], [k, self.values(x)])
        return self.merge_heads(attend(q, k, v, self.scale, causal=True, q_start=start, queries=new, keys=held))

    def _cache_buffers(self, batch: int, dtype: torch.dtype, device: Any) -> dict[str, TokenBuffer]:
        return {
            "k": self._full_buffer(batch, self.score_dims, self.n_kv_heads, dtype, device),
            "v": self._full_buffer(batch, self.head_dim, self.n_kv_heads, dtype, device),
        }

    def _static_buffers(self, cache: KVCache) -> dict[str, torch.Tensor]:
        return {name: full_slots(cache[name], self.config.max_seq_len) for name in ("k", "v")}

    def _forward_static(self, x: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        keys, values = cache.buffers["k"], cache.buffers["v"]
        q, k = self.qk(x, (cache.slot - cache.offsets)[:, None])
        store(keys, cache.slot.view(1), k)
        store(values, cache.slot.view(1), self.values(x))
        return self.merge_heads(decode_full_slots(q, keys, values, cache.offsets, cache.slot, self.scale))

    def score_flops(self, seq_len: int) -> int:
        return self.n_heads * self.score_dims * causal_pairs(seq_len, self.config.causal)

    def kv_cache_numel(self, seq_len: int) -> int:
        return seq_len * self.n_kv_heads * (self.score_dims + self.head_dim)
