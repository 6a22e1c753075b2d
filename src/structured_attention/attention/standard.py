"""Standard scoring: multi-head attention (with GQA), sliding-window attention and the
Global+SWA split of the head dimensions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._checks import require
from ..functional.decode import decode_full_slots, masked_decode
from .base import (
    Attention,
    FullScoreAttention,
    attend,
    cached_segments,
    causal_pairs,
    window_pairs,
)
from .cache import KVCache, StaticKVCache, TokenBuffer, append_all, full_slots, ring_slots, store
from .config import AttentionConfig, default_scale, positional
from .segments import Segments


class _QKAttention(Attention):
    """Shared parts of the kinds that project queries and keys to ``head_dim`` dims per head."""

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__(config)
        self.q_proj = nn.Linear(config.d_model, self.n_heads * self.head_dim, bias=config.bias)
        self.k_proj = nn.Linear(config.d_model, self.n_kv_heads * self.head_dim, bias=config.bias)
        self.q_norm = nn.LayerNorm(self.head_dim) if config.qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if config.qk_norm else nn.Identity()
        self.rotary = self._rotary(self.rotary_segments())

    def rotary_segments(self) -> tuple[int, ...]:
        return (self.head_dim,)

    def qk(self, x: torch.Tensor, positions: int | torch.Tensor = 0) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.q_norm(self.split_heads(self.q_proj(x), self.n_heads))
        k = self.k_norm(self.split_heads(self.k_proj(x), self.n_kv_heads))
        if self.rotary is not None:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        return q, k


class MultiHeadAttention(_QKAttention, FullScoreAttention):
    """Softmax attention with scores ``q_h(i) . k_h(j)``; GQA when ``n_kv_heads < n_heads``."""

    kind = "mha"
    examples = {"mha": "mha", "gqa": "mha:n_kv_heads=2", "mha_qk_norm_mup": "mha:qk_norm=true:attn_scale=mup",
                "mha_rotary": "mha:rotary=true:n_kv_heads=2"}

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__(config)
        self.score_dims = self.head_dim
        self.scale = default_scale(config.attn_scale, self.head_dim)


class SlidingWindowAttention(_QKAttention):
    """Query ``i`` sees keys ``i - window <= j <= i`` (``|i - j| <= window`` when bidirectional)."""

    kind = "swa"
    examples = {"swa": "swa:5", "swa_gqa": "swa:3:n_kv_heads=1", "swa_rotary": "swa:5:rotary=true"}

    @dataclass(frozen=True)
    class Config:
        window: int = positional(128)  # query i sees keys i - window <= j <= i

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__(config)
        window = self.options.window
        require(isinstance(window, int) and window >= 0, "window", "a non-negative integer", window)
        self.window = window
        self.scale = default_scale(config.attn_scale, self.head_dim)

    def _forward(self, x: torch.Tensor, segments: Segments | None) -> torch.Tensor:
        (q, k), v = self.qk(x, 0 if segments is None else segments.positions), self.values(x)
        out = attend(q, k, v, self.scale, causal=self.config.causal, window=self.window, dropout=self.attn_dropout,
                     queries=segments, keys=segments)
        return self.merge_heads(out)

    def _forward_cached(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        start, k_start = cache.length, cache["k"].start
        new, held = cached_segments(cache, start, start + x.shape[1]), cached_segments(cache, k_start, start + x.shape[1])
        (q, k), v = self.qk(x, start if new is None else new.positions), self.values(x)
        k, v = append_all([cache["k"], cache["v"]], [k, v])
        out = attend(q, k, v, self.scale, causal=True, window=self.window, q_start=start, k_start=k_start,
                     queries=new, keys=held)
        for name in ("k", "v"):
            cache[name].drop_before(start + x.shape[1] - self.window)
        return self.merge_heads(out)

    def _cache_buffers(self, batch: int, dtype: torch.dtype, device: Any) -> dict[str, TokenBuffer]:
        size = min(self.window + 1, self.config.max_seq_len)  # the window plus the token being decoded
        return {
            name: TokenBuffer(batch, self.n_kv_heads, self.head_dim, size, dtype, device) for name in ("k", "v")
        }

    def _static_buffers(self, cache: KVCache) -> dict[str, torch.Tensor]:
        return {name: ring_slots(cache[name], self.window + 1) for name in ("k", "v")}

    def _forward_static(self, x: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        keys, values = cache.buffers["k"], cache.buffers["v"]
        size = keys.shape[2]  # the window and the new token: every slot of the ring is in the window
        q, k = self.qk(x, (cache.slot - cache.offsets)[:, None])
        at = torch.remainder(cache.slot, size).view(1)
        store(keys, at, k)
        store(values, at, self.values(x))
        return self.merge_heads(masked_decode(q, keys, values, cache.real(cache.ring_positions(size)), self.scale))

    def score_flops(self, seq_len: int) -> int:
        return self.n_heads * self.head_dim * window_pairs(seq_len, self.window, self.config.causal)

    def _mixed_pairs(self, seq_len: int, pairs: int) -> int:
        return window_pairs(seq_len, self.window, self.config.causal)

    def kv_cache_numel(self, seq_len: int) -> int:
        return min(seq_len, self.window) * self.n_kv_heads * 2 * self.head_dim


class GlobalSlidingWindowAttention(_QKAttention):
    """Head dims split ``global | windowed``: a full map on the first dims and a windowed map on
    the rest; the two softmax maps are added before multiplying the values (as the authors did)."""

    kind = "global_swa"
    examples = {"global_swa": "global_swa:4|4:window=6", "global_swa_gqa": "global_swa:6|2:window=3:n_kv_heads=2",
                "global_swa_rotary": "global_swa:6|2:window=3:rotary=true"}

    @dataclass(frozen=True)
    class Config:
        split: tuple[int, ...] | None = positional(None)  # head dims (global, windowed); None: half and half
        window: int = 128  # the windowed part's window

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__(config)
        window = self.options.window
        require(isinstance(window, int) and window >= 0, "window", "a non-negative integer", window)
        self.global_dims, self.window_dims = self.rotary_segments()
        self.window = window
        self.global_scale = default_scale(config.attn_scale, self.global_dims)
        self.window_scale = default_scale(config.attn_scale, self.window_dims)

    def rotary_segments(self) -> tuple[int, ...]:
        """The ``(global, windowed)`` split of the head dims, each part rotated on its own."""
        hd = self.head_dim
        split = self.options.split or (hd // 2, hd - hd // 2)
        require(len(split) == 2 and min(split) > 0 and sum(split) == hd, "split",
                f"two positive dims (global|windowed) summing to head_dim={hd}", split)
        return tuple(split)

    def _both_maps(
        self, q: torch.Tensor, k_global: torch.Tensor, k_window: torch.Tensor, v: torch.Tensor,
        v_window: torch.Tensor, q_start: int, k_window_start: int,
        segments: tuple[Segments, Segments, Segments] | None,
    ) -> torch.Tensor:
        """Both maps; ``segments``: those of the queries, of every key and of the windowed keys."""
        g = self.global_dims
        causal, dropout = self.config.causal, self.attn_dropout
        queries, keys, window_keys = (None, None, None) if segments is None else segments
        full = attend(q[..., :g], k_global, v, self.global_scale, causal=causal, q_start=q_start, dropout=dropout,
                      queries=queries, keys=keys)
        local = attend(q[..., g:], k_window, v_window, self.window_scale, causal=causal, window=self.window,
                       q_start=q_start, k_start=k_window_start, dropout=dropout, queries=queries, keys=window_keys)
        return self.merge_heads(full + local)

    def _forward(self, x: torch.Tensor, segments: Segments | None) -> torch.Tensor:
        (q, k), v = self.qk(x, 0 if segments is None else segments.positions), self.values(x)
        g = self.global_dims
        return self._both_maps(q, k[..., :g], k[..., g:], v, v, 0, 0, None if segments is None else (segments,) * 3)

    def _forward_cached(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        g, start = self.global_dims, cache.length
        end = start + x.shape[1]
        k_window_start = cache["k_window"].start
        new = cached_segments(cache, start, end)
        (q, k), v = self.qk(x, start if new is None else new.positions), self.values(x)
        k_window, k_global, v = append_all([cache["k_window"], cache["k_global"], cache["v"]], [k[..., g:], k[..., :g], v])
        segments = None
        if new is not None:
            segments = (new, cached_segments(cache, 0, end), cached_segments(cache, k_window_start, end))
        out = self._both_maps(q, k_global, k_window, v, v[:, :, k_window_start:], start, k_window_start, segments)
        cache["k_window"].drop_before(end - self.window)
        return out

    def _cache_buffers(self, batch: int, dtype: torch.dtype, device: Any) -> dict[str, TokenBuffer]:
        kv = self.n_kv_heads
        return {
            "k_global": self._full_buffer(batch, self.global_dims, kv, dtype, device),
            "k_window": TokenBuffer(batch, kv, self.window_dims, self.window + 1, dtype, device),
            "v": self._full_buffer(batch, self.head_dim, kv, dtype, device),
        }

    def _static_buffers(self, cache: KVCache) -> dict[str, torch.Tensor]:
        context = self.config.max_seq_len
        return {"k_global": full_slots(cache["k_global"], context), "k_window": ring_slots(cache["k_window"], self.window + 1),
                "v": full_slots(cache["v"], context)}

    def _forward_static(self, x: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        g = self.global_dims
        k_global, k_window, values = cache.buffers["k_global"], cache.buffers["k_window"], cache.buffers["v"]
        (q, k), v = self.qk(x, (cache.slot - cache.offsets)[:, None]), self.values(x)
        size = k_window.shape[2]
        store(k_global, cache.slot.view(1), k[..., :g])
        store(k_window, torch.remainder(cache.slot, size).view(1), k[..., g:])
        store(values, cache.slot.view(1), v)
        full = decode_full_slots(q[..., :g], k_global, values, cache.offsets, cache.slot, self.global_scale)
        window = cache.ring_positions(size)  # the values of the window's keys: at their slots
        local = masked_decode(q[..., g:], k_window, values.index_select(2, window.clamp_min(0)), cache.real(window),
                              self.window_scale)
        return self.merge_heads(full + local)

    def score_flops(self, seq_len: int) -> int:
        causal = self.config.causal
        return self.n_heads * (
            self.global_dims * causal_pairs(seq_len, causal)
            + self.window_dims * window_pairs(seq_len, self.window, causal)
        )

    def _mixed_pairs(self, seq_len: int, pairs: int) -> int:
        return pairs + window_pairs(seq_len, self.window, self.config.causal)

    def kv_cache_numel(self, seq_len: int) -> int:
        kv = self.n_kv_heads
        return seq_len * kv * (self.global_dims + self.head_dim) + min(seq_len, self.window) * kv * self.window_dims
