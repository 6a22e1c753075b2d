"""MLR attention: the ``T x T`` score matrix is multi-level low-rank over positions.

Query and key dims split by level, ``q = [q_1 | ... | q_L]``; pair ``(i, j)`` is scored with the
levels whose block (size ``s_l``, fixed by ``max_seq_len``) holds both positions, so near pairs
get a higher-rank score than far ones (docs/design.md). Decoding keeps level-1 keys for every
token but keys of level ``l > 1`` only for the current level-``l`` block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._checks import require
from ..ops.mlr import mlr_attention, mlr_block_sizes, mlr_prefill, mlr_prefill_reference, mlr_score_flops
from ..ops.mlr.static import mlr_decode_static, one_allocation, prepare_static
from .base import Attention, cached_segments
from .cache import KVCache, StaticKVCache, TokenBuffer, append_all, full_slots, ring_slots, store
from .config import AttentionConfig, default_scale, positional
from .segments import Segments


_LEVEL_SCALES = ("learned", "inverse_rank", "inverse_rank_learned")


class MLRAttention(Attention):
    """Multi-level low-rank attention over positions, with GQA, per-level scales and KV cache."""

    kind = "mlr"
    examples = {"mlr": "mlr:4|2|1|1", "mlr_one_level": "mlr:8", "mlr_gqa": "mlr:5|3:n_kv_heads=2:block_sizes=64|8",
                "mlr_depth_norm": "mlr:2|2|2|2:depth_normalize=true:block_sizes=64|16|8|4",
                "mlr_qk_norm_mup": "mlr:4|4:qk_norm=true:attn_scale=mup",
                "mlr_rotary": "mlr:4|2|2:rotary=true:block_sizes=64|16|4",
                "mlr_paper": "mlr:4|2|2:qk_norm=true:qk_norm_scope=head:level_scale=inverse_rank:block_sizes=64|16|4"}

    @dataclass(frozen=True)
    class Config:
        # rank of each level over positions, summing to the head dim; None: four equal levels
        ranks: tuple[int, ...] | None = positional(None)
        block_sizes: tuple[int, ...] | None = None  # per level; None: max_seq_len / 2^(l-1)
        depth_normalize: bool = False  # divide a pair's score by the levels it shares
        # with qk_norm: a LayerNorm over each level's dims ("level"), or over the whole head before
        # it is split into levels ("head", the paper authors' code)
        qk_norm_scope: str = "level"
        # per-level score scales: "learned" gains starting at 1 under the global scale (1/sqrt(R),
        # 1/R with attn_scale=mup); "inverse_rank" a fixed 1/r_l per level and no global scale (the
        # paper authors' code); "inverse_rank_learned" gains starting at 1/r_l, no global scale
        level_scale: str = "learned"

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__(config)
        hd = self.head_dim
        ranks = self.options.ranks or ((hd // 4,) * 4 if hd % 4 == 0 else (hd,))
        require(
            all(isinstance(r, int) and r > 0 for r in ranks) and sum(ranks) == hd,
            "ranks",
            f"positive integers summing to head_dim={hd}",
            ranks,
        )
        self.ranks = tuple(ranks)
        self.block_sizes = mlr_block_sizes(self.ranks, config.max_seq_len, self.options.block_sizes)
        self.q_proj = nn.Linear(config.d_model, self.n_heads * hd, bias=config.bias)
        self.k_proj = nn.Linear(config.d_model, self.n_kv_heads * hd, bias=config.bias)
        options = self.options
        require(options.qk_norm_scope in ("level", "head"), "qk_norm_scope", "'level' or 'head'", options.qk_norm_scope)
        require(options.level_scale in _LEVEL_SCALES, "level_scale", f"one of {list(_LEVEL_SCALES)}", options.level_scale)
        # Learned per-level scales start at 1 under the global scale, else at 1/r_l with none: the
        # default keeps the dense-attention logit scale of the whole head at initialisation.
        if options.level_scale == "learned":
            self.level_scale = nn.Parameter(torch.ones(len(self.ranks)))
            self.scale = default_scale(config.attn_scale, hd)
        else:
            inverse = torch.tensor([1.0 / r for r in self.ranks])
            if options.level_scale == "inverse_rank":
                self.register_buffer("level_scale", inverse, persistent=False)
            else:
                self.level_scale = nn.Parameter(inverse)
            self.scale = 1.0
        sizes = self.ranks if options.qk_norm_scope == "level" else (hd,)
        self.q_norms = nn.ModuleList(nn.LayerNorm(r) for r in sizes) if config.qk_norm else None
        self.k_norms = nn.ModuleList(nn.LayerNorm(r) for r in sizes) if config.qk_norm else None
        self.rotary = self._rotary(self.ranks)  # each level rotated on its own
        # output_size lets the layer be built on the meta device (sizes counted, nothing allocated)
        level_index = torch.repeat_interleave(torch.arange(len(self.ranks)), torch.tensor(self.ranks),
                                              output_size=sum(self.ranks))
        self.register_buffer("_level_index", level_index, persistent=False)

    def _per_level_norm(self, x: torch.Tensor, norms: nn.ModuleList | None) -> torch.Tensor:
        if norms is None:
            return x
        if len(norms) == 1 and len(self.ranks) > 1:  # qk_norm_scope="head"
            return norms[0](x)
        return torch.cat([norm(part) for norm, part in zip(norms, x.split(self.ranks, dim=-1))], dim=-1)

    def project(
        self, x: torch.Tensor, positions: int | torch.Tensor = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self._per_level_norm(self.split_heads(self.q_proj(x), self.n_heads), self.q_norms)
        k = self._per_level_norm(self.split_heads(self.k_proj(x), self.n_kv_heads), self.k_norms)
        if self.rotary is not None:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        # per-level scales folded into the queries; with equal ranks as a broadcast product, whose
        # backward is a sum: the gather's is an accumulating index_put (on CUDA a sort and several
        # kernels for a gradient of a few numbers)
        if len(set(self.ranks)) == 1:
            q = (q.unflatten(-1, (len(self.ranks), self.ranks[0])) * self.level_scale[:, None]).flatten(-2)
        else:
            q = q * self.level_scale[self._level_index]
        return q, k, self.values(x)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   document_ids: torch.Tensor | None) -> torch.Tensor:
        out = mlr_attention(q, k, v, self.ranks, block_sizes=self.block_sizes, causal=causal, scale=self.scale,
                            depth_normalize=self.options.depth_normalize, document_ids=document_ids)
        return torch.nn.functional.dropout(out, self.attn_dropout) if self.attn_dropout else out

    def _forward(self, x: torch.Tensor, segments: Segments | None) -> torch.Tensor:
        if segments is None:
            q, k, v = self.project(x)
            return self.merge_heads(self._attention(q, k, v, self.config.causal, None))
        # Each segment is its own sequence: its positions and its blocks start at its first token.
        q, k, v = self.project(x, segments.positions)
        return self.merge_heads(self._attention(q, k, v, self.config.causal, segments.ids))

    def _forward_cached(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        start, t = cache.length, x.shape[1]
        end = start + t
        new = cached_segments(cache, start, end)
        q, k, v = self.project(x, start if new is None else new.positions)
        k_levels = k.split(self.ranks, dim=-1)
        if start == 0:
            # A prompt from position 0 is scored exactly as in training: block sizes are fixed.
            out = self._attention(q, k, v, True, None if new is None else new.ids)
            append_all(self._level_buffers(cache) + [cache["v"]], [*k_levels, v])
        else:
            out = self._attend_to_cache(q, k_levels, v, cache, start)
        for level, s in enumerate(self.block_sizes[1:], start=1):
            # The next token's level block starts here (the earliest over the rows).
            first = end - end % s if cache.padding is None else cache.padding.first_block_start(end, s)
            cache[f"k{level}"].drop_before(first)
        return self.merge_heads(out)

    def _level_buffers(self, cache: KVCache) -> list[TokenBuffer]:
        return [cache[f"k{level}"] for level in range(len(self.ranks))]

    def _attend_to_cache(
        self, q: torch.Tensor, k_levels: tuple[torch.Tensor, ...], v: torch.Tensor, cache: KVCache, start: int,
    ) -> torch.Tensor:
        """New queries at slots ``start + [0, t)`` against every cached key: level ``l`` scores
        only the keys held for it (the current level-``l`` block), the compressed-cache read;
        left-padded rows score from their own blocks (``row_starts``)."""
        buffers = self._level_buffers(cache)
        key_starts = [buffer.start for buffer in buffers]
        *keys, values = append_all(buffers + [cache["v"]], [*k_levels, v])
        row_starts = None
        if cache.padding is not None:
            row_starts = cache.padding.block_start_table(start, start + q.shape[2], self.block_sizes)
            if q.shape[2] == 1 and max(cache.padding.offsets) > start:
                # A single token that is still padding in some row (a prompt prefilled in chunks):
                # the decoding kernels take real queries only; the reference takes any.
                return mlr_prefill_reference(q, keys, key_starts, values, self.ranks, self.scale,
                                             self.options.depth_normalize, self.block_sizes, row_starts)
        return mlr_prefill(q, keys, key_starts, values, self.ranks, self.scale, self.options.depth_normalize,
                           self.block_sizes, row_starts=row_starts)

    def _cache_buffers(self, batch: int, dtype: torch.dtype, device: Any) -> dict[str, TokenBuffer]:
        kv = self.n_kv_heads
        buffers = {
            f"k{level}": TokenBuffer(batch, kv, r, s if level else self.config.max_seq_len, dtype, device)
            for level, (r, s) in enumerate(zip(self.ranks, self.block_sizes))
        }
        buffers["v"] = self._full_buffer(batch, self.head_dim, kv, dtype, device)
        return buffers

    def _static_buffers(self, cache: KVCache) -> dict[str, torch.Tensor]:
        # level 1 and the values for every slot; a finer level's keys in a ring of its block size,
        # which holds every row's current block whatever its padding
        buffers = {"k0": full_slots(cache["k0"], self.config.max_seq_len), "v": full_slots(cache["v"], self.config.max_seq_len)}
        rings = one_allocation([ring_slots(cache[f"k{level}"], s)
                                for level, s in enumerate(self.block_sizes[1:], start=1)])
        buffers.update({f"k{level}": ring for level, ring in enumerate(rings, start=1)})
        prepare_static([buffers[f"k{level}"] for level in range(len(self.ranks))], buffers["v"], list(self.ranks),
                       list(self.block_sizes))
        return buffers

    def _forward_static(self, x: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """The compressed-cache read with fixed shapes (:func:`~..ops.mlr.static.mlr_decode_static`)."""
        slot, offsets = cache.slot, cache.offsets
        q, k, v = self.project(x, (slot - offsets)[:, None])
        k_levels = k.split(self.ranks, dim=-1)
        keys = [cache.buffers[f"k{level}"] for level in range(len(self.ranks))]
        store(keys[0], slot.view(1), k_levels[0])
        for level, s in enumerate(self.block_sizes[1:], start=1):
            store(keys[level], torch.remainder(slot, s).view(1), k_levels[level])
        store(cache.buffers["v"], slot.view(1), v)
        out = mlr_decode_static(q, keys, cache.buffers["v"], slot, offsets, list(self.ranks), list(self.block_sizes),
                                self.scale, self.options.depth_normalize)
        return self.merge_heads(out)

    def score_flops(self, seq_len: int) -> int:
        return self.n_heads * mlr_score_flops(seq_len, self.ranks, self.block_sizes, self.config.causal)

    def kv_cache_numel(self, seq_len: int) -> int:
        """``T (r_1 + Dv)`` plus, for each level ``l > 1``, ``r_l`` times the tokens of the current block."""
        held = sum(r * (seq_len % s) for r, s in zip(self.ranks[1:], self.block_sizes[1:]))
        return self.n_kv_heads * (seq_len * (self.ranks[0] + self.head_dim) + held)
