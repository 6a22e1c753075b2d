"""Attention layers against dense references, decoding against the full forward, caches against
their size formulas, and the registry and validation."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from structured_attention.attention import (
    ATTENTION_KINDS,
    AttentionConfig,
    MLRAttention,
    build_attention,
    build_attention_layers,
    parse_attention_pattern,
    parse_attention_spec,
)
from structured_attention.attention.cache import TokenBuffer, append_all
from structured_attention.functional import mlr_depth

D, H, CTX = 32, 4, 64

# Every registered kind's own examples (GQA where it applies; small block sizes so decoding
# crosses blocks): a new kind in ATTENTION_KINDS is checked by every test over SPECS.
SPECS = {name: spec for cls in ATTENTION_KINDS.values() for name, spec in cls.examples.items()}


def make(spec: str, dtype: torch.dtype = torch.float32, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    base = dict(d_model=D, n_heads=H, max_seq_len=CTX)
    base.update(kw)
    return build_attention(spec, **base).to(dtype).eval()


def test_registry_has_every_kind_each_with_examples():
    assert set(ATTENTION_KINDS) == {"mha", "swa", "global_swa", "bilinear_btt", "bilinear_mlr", "mlr"}
    for kind, cls in ATTENTION_KINDS.items():
        assert cls.kind == kind and cls.examples
        assert all(parse_attention_spec(spec)["kind"] == kind for spec in cls.examples.values())


def test_spec_parsing():
    assert parse_attention_spec("mlr:48|16:depth_normalize=true:block_sizes=1024|64") == {
        "kind": "mlr", "ranks": (48, 16), "depth_normalize": True, "block_sizes": (1024, 64)}
    assert parse_attention_spec("swa:128") == {"kind": "swa", "window": 128}
    assert parse_attention_spec("bilinear_mlr:8") == {"kind": "bilinear_mlr", "feature_ranks": (8,)}
    assert parse_attention_spec("bilinear_mlr:ranks=8") == parse_attention_spec("bilinear_mlr:8")  # its old name
    # '+' separates levels too (no shell quoting needed)
    assert parse_attention_spec("mlr:48+16:block_sizes=1024+64") == parse_attention_spec("mlr:48|16:block_sizes=1024|64")
    for bad in ("mlr:48+", "mlr:48|+16", "mlr:+48"):
        with pytest.raises(ValueError, match="^ranks: expected positive integers separated by '\\|' or '\\+'"):
            parse_attention_spec(bad)
    kinds = [s["kind"] for s in parse_attention_pattern("mha,swa:128,swa:128", 6)]
    assert kinds == ["mha", "swa", "swa", "mha", "swa", "swa"]


def naive_attention(q, k, v, scale, mask):
    """Dense softmax attention with explicit GQA copies and a boolean (Tq, Tk) mask."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v


def band(t, causal, window=None):
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    keep = (j <= i) if causal else torch.ones(t, t, dtype=torch.bool)
    if window is not None:
        keep &= (i - j).abs() <= window
    return keep


def heads(x, n):
    b, t, _ = x.shape
    return x.view(b, t, n, -1).transpose(1, 2)


def dense_matrix(matrix, weight_cap):
    """A structured matrix as a dense one; with ``weight_cap`` from a copy whose every weight is
    ``W / max(1, RMS(W) * sqrt(fan_in) / gain)``, written out from the cap's definition."""
    if not weight_cap:
        return matrix.to_dense()
    capped = copy.deepcopy(matrix)
    fans = matrix.parameter_fans()
    with torch.no_grad():
        for name, w in capped.named_parameters():
            rms = w.pow(2).mean().sqrt().item()
            w.div_(max(1.0, rms * math.sqrt(fans[name].fan_in) / fans[name].gain))
    return capped.to_dense()


def reference_forward(layer, x, causal):
    """Each kind's definition written out densely from its parameters."""
    options, t = layer.options, x.shape[1]
    v = heads(layer.v_proj(x), layer.n_kv_heads)
    kind = layer.kind
    if kind in ("mha", "swa", "global_swa"):
        q, k = layer.q_norm(heads(layer.q_proj(x), layer.n_heads)), layer.k_norm(heads(layer.k_proj(x), layer.n_kv_heads))
        if layer.rotary is not None:
            q, k = layer.rotary(q), layer.rotary(k)
        if kind == "mha":
            out = naive_attention(q, k, v, layer.scale, band(t, causal))
        elif kind == "swa":
            out = naive_attention(q, k, v, layer.scale, band(t, causal, layer.window))
        else:
            g = layer.global_dims
            out = naive_attention(q[..., :g], k[..., :g], v, 1 / math.sqrt(g), band(t, causal)) + naive_attention(
                q[..., g:], k[..., g:], v, 1 / math.sqrt(layer.window_dims), band(t, causal, layer.window))
    elif kind == "bilinear_btt" or (kind == "bilinear_mlr" and options.key_map):
        m = dense_matrix(layer.key_map, options.weight_cap).view(layer.n_heads, D, D)  # M_h: rows of head h's keys
        keys = torch.einsum("hed,btd->bhte", m, x)
        if getattr(options, "key_norm", "head") == "shared":  # one LayerNorm(D), its gain and bias shared by the heads
            keys = torch.nn.functional.layer_norm(keys, (D,), layer.key_norm.weight, layer.key_norm.bias)
        else:
            keys = torch.nn.functional.layer_norm(keys, (D,)) * layer.key_gain.view(layer.n_heads, 1, D)
        q = x.unsqueeze(1).expand(-1, layer.n_heads, -1, -1)
        scale = {"sp": 1 / math.sqrt(D), "mup": 1 / D, "mup8": 8 / D}[layer.config.attn_scale]
        out = naive_attention(q, keys, v, scale, band(t, causal))
    elif kind == "bilinear_mlr":
        qs, ks = [], []
        fixed = options.level_scale == "inverse_sqrt_dims"  # 1/sqrt(p_l r_l) per level, no global scale
        for lvl, (p, r) in enumerate(zip(layer.n_blocks, layer.ranks)):
            for maps, lst, nh in ((layer.q_maps, qs, layer.n_heads), (layer.k_maps, ks, layer.n_kv_heads)):
                dense = dense_matrix(maps[lvl], options.weight_cap)  # (p*nh*r, D), block-diagonal over p chunks
                y = (x @ dense.T).view(*x.shape[:2], p, nh, r).permute(0, 3, 1, 2, 4).flatten(-2)
                y = torch.nn.functional.layer_norm(y, (p * r,))
                gain = 1 / math.sqrt(p * r) if fixed else layer.level_scale[lvl]
                lst.append(y * gain if lst is qs else y)
        scale = 1.0 if fixed else 1 / math.sqrt(sum(p * r for p, r in zip(layer.n_blocks, layer.ranks)))
        out = naive_attention(torch.cat(qs, -1), torch.cat(ks, -1), v, scale, band(t, causal))
    else:  # mlr: dense per-level masks
        q, k = layer.project(x)[:2]
        g = layer.n_heads // layer.n_kv_heads
        k = k.repeat_interleave(g, 1)
        scores, depth, off = 0, 0, 0
        dep = mlr_depth(t, layer.block_sizes)
        for lvl, r in enumerate(layer.ranks):
            within = dep > lvl
            scores = scores + (q[..., off:off + r] @ k[..., off:off + r].transpose(-1, -2)) * within
            off += r
        scores = scores * layer.scale
        if options.depth_normalize:
            scores = scores / dep
        a = torch.softmax(scores.masked_fill(~band(t, causal), float("-inf")), -1)
        out = a @ v.repeat_interleave(g, 1)
    b, h, tt, dv = out.shape
    return layer.out_proj(out.transpose(1, 2).reshape(b, tt, h * dv))


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("causal", [True, False])
def test_forward_matches_dense_reference(name, causal):
    layer = make(SPECS[name], torch.float64, causal=causal)
    for t in (1, 7, 24, CTX):
        x = torch.randn(2, t, D, dtype=torch.float64)
        torch.testing.assert_close(layer(x), reference_forward(layer, x, causal), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", [n for n in sorted(SPECS) if "weight_cap=true" in SPECS[n]])
@pytest.mark.parametrize("factor", [0.5, 3.0])
def test_weight_cap_matches_its_definition_above_and_below_the_init_scale(name, factor):
    """With weight_cap, weights grown past their init scale are pulled back and smaller ones are
    left alone, in the forward pass only (the parameters keep their values)."""
    layer = make(SPECS[name], torch.float64)
    matrices = [m for m in layer.modules() if hasattr(m, "parameter_fans") and m is not layer]
    with torch.no_grad():
        for m in matrices:
            for w in m.parameters():
                w.mul_(factor)
    before = {k: w.clone() for k, w in layer.named_parameters()}
    x = torch.randn(2, 24, D, dtype=torch.float64)
    torch.testing.assert_close(layer(x), reference_forward(layer, x, True), rtol=1e-9, atol=1e-9)
    for k, w in layer.named_parameters():
        assert torch.equal(w, before[k]), k


@pytest.mark.parametrize("name", sorted(SPECS))
def test_causal_output_ignores_future_tokens(name):
    layer = make(SPECS[name])
    x = torch.randn(1, 40, D)
    y = x.clone()
    y[:, 25:] = torch.randn(1, 15, D)
    torch.testing.assert_close(layer(x)[:, :25], layer(y)[:, :25], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_decoding_token_by_token_matches_full_forward(name):
    layer = make(SPECS[name])
    x = torch.randn(2, CTX, D)
    full = layer(x)
    cache = layer.new_cache(batch_size=2)
    steps = [layer(x[:, i:i + 1], cache) for i in range(CTX)]
    assert (torch.cat(steps, 1) - full).abs().max().item() <= 1e-5
    assert cache.length == CTX


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_cache_in_another_dtype_decodes_under_autocast_and_is_refused_outside(name, static):
    """A bfloat16 cache for a float32 layer: outside autocast one line naming the cache (not an
    error of mismatched dtypes from inside an attention op); inside CPU autocast, whose projections
    give the step bfloat16 keys and values, the steps decode as the layer without a cache does."""
    layer = make(SPECS[name])
    x = torch.randn(1, 20, D, generator=torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match=r"^cache: expected a cache in the layer's dtype torch.float32 .*"
                                         r"got torch.bfloat16$"):
        layer(x[:, :12], layer.new_cache(batch_size=1, dtype=torch.bfloat16, static=static))
    cache = layer.new_cache(batch_size=1, dtype=torch.bfloat16, static=static)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        steps = [layer(x[:, :12], cache)] + [layer(x[:, i:i + 1], cache) for i in range(12, 20)]
        full = layer(x)
    assert cache.dtype == torch.bfloat16
    torch.testing.assert_close(torch.cat(steps, 1).float(), full.float(), atol=0.1, rtol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="checks which CUDA kernel SDPA picks")
def test_decoding_on_cuda_avoids_cudnn_attention():
    # cuDNN's attention builds a plan per key length, so each decoding step would build one.
    layer = build_attention("mha", d_model=128, n_heads=2, max_seq_len=64).cuda().bfloat16().eval()
    x = torch.randn(2, 24, 128, device="cuda", dtype=torch.bfloat16)
    cache = layer.new_cache(batch_size=2)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        layer(x[:, :16], cache)
        steps = [layer(x[:, i:i + 1], cache) for i in range(16, 24)]
        full = layer(x)
    calls = sum(e.name == "aten::_scaled_dot_product_cudnn_attention" for e in prof.events())
    assert calls <= 2, calls  # the prompt and the full forward may take cuDNN; the 8 steps may not
    torch.testing.assert_close(torch.cat(steps, 1).float(), full[:, 16:].float(), atol=3e-2, rtol=0)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_prefill_then_chunks_matches_full_forward(name):
    layer = make(SPECS[name])
    x = torch.randn(1, 50, D)
    full = layer(x)
    cache = layer.new_cache(batch_size=1)
    pieces, i = [], 0
    for n in (13, 1, 9, 1, 1, 20, 5):  # a prompt, then chunks that straddle level blocks and windows
        pieces.append(layer(x[:, i:i + n], cache))
        i += n
    assert (torch.cat(pieces, 1) - full).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", sorted(SPECS))
def test_cache_size_equals_formula(name):
    layer = make(SPECS[name])
    cache = layer.new_cache(batch_size=1)
    x = torch.randn(1, CTX, D)
    for t in range(1, CTX + 1):
        layer(x[:, t - 1:t], cache)
        assert cache.nbytes == layer.kv_cache_numel(t) * 4, t


def test_mlr_cache_keeps_only_current_block_above_level_one():
    layer = make("mlr:5|3:block_sizes=64|8:n_kv_heads=2")
    cache = layer.new_cache(batch_size=3)
    x = torch.randn(3, 29, D)
    layer(x[:, :20], cache)
    for t in range(20, 29):
        layer(x[:, t:t + 1], cache)
    level2 = cache["k1"]
    assert (level2.start, level2.end) == (24, 29)  # block [24, 32) of size 8
    assert level2.data.shape[2] <= 20  # the level-2 buffer never holds the whole context
    # T r_1 + sum_{l>1} (T mod s_l) r_l numbers per kv head for keys, T * Dv for values
    assert cache.nbytes == 3 * 2 * (29 * 5 + (29 % 8) * 3 + 29 * 8) * 4
    # and never more than the bound of docs/design.md, 'Compressed KV cache': T r_1 + sum s_l r_l
    assert layer.kv_cache_numel(29) <= 2 * (29 * 5 + 8 * 3 + 29 * 8)


def test_token_buffers_append_together_as_one_by_one_and_grow_past_their_capacity():
    gen = torch.Generator().manual_seed(3)
    dims, capacities = (3, 1, 5), (4, 2, 9)
    buffers = [TokenBuffer(2, 2, d, c, torch.float32, "cpu") for d, c in zip(dims, capacities)]
    held = [torch.empty(2, 2, 0, d) for d in dims]  # what each buffer should hold, by concatenation
    for step, (t, drop) in enumerate([(3, 0), (1, 2), (6, 0), (2, 9), (1, 0)]):
        xs = [torch.randn(2, 2, t, d, generator=gen, dtype=torch.float64) for d in dims]  # cast on copy
        if step % 2:
            views = append_all(buffers, xs)
        else:
            views = [buffer.append(x) for buffer, x in zip(buffers, xs)]
        held = [torch.cat([h, x.float()], dim=2) for h, x in zip(held, xs)]
        for view, h in zip(views, held):
            torch.testing.assert_close(view, h, rtol=0, atol=0)
        for i, buffer in enumerate(buffers):
            start = buffer.start
            buffer.drop_before(start + drop)
            held[i] = held[i][:, :, min(drop, held[i].shape[2]):]
            assert len(buffer) == held[i].shape[2]
    with pytest.raises(ValueError):
        append_all(buffers, xs[:2])  # one tensor per buffer


SMALL_SPECS = [
    "mha:n_kv_heads=1", "swa:2", "global_swa:2|2:window=2", "bilinear_btt:1", "bilinear_mlr:2|1",
    "bilinear_mlr:2|1:key_map=true",
    "mlr:2|1|1:block_sizes=16|4|2:n_kv_heads=1", "mlr:2|1|1:block_sizes=16|4|2:depth_normalize=true:qk_norm=true",
]


@pytest.mark.parametrize("spec", SMALL_SPECS)
@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck(spec, causal):
    torch.manual_seed(0)
    layer = build_attention(spec, d_model=8, n_heads=2, max_seq_len=16, causal=causal).double()
    x = torch.randn(1, 6, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x,))


def test_score_flops_match_counted_pairs():
    t = 40
    mlr = make("mlr:4|2|1|1:block_sizes=64|16|8|4")
    dep = mlr_depth(t, mlr.block_sizes)
    causal = band(t, True)
    counted = sum(r * int(((dep > lvl) & causal).sum()) for lvl, r in enumerate(mlr.ranks))
    assert mlr.score_flops(t) == H * counted
    swa = make("swa:5")
    assert swa.score_flops(t) == H * swa.head_dim * int(band(t, True, 5).sum())
    swa_bi = make("swa:5", causal=False)
    assert swa_bi.score_flops(t) == H * swa.head_dim * int(band(t, False, 5).sum())
    mha = make("mha")
    assert mha.score_flops(t) == H * mha.head_dim * t * (t + 1) // 2
    # MLR scores fewer numbers than MHA at equal head dims
    assert mlr.score_flops(CTX) < mha.score_flops(CTX)


def test_cost_counts_parameters_and_flops():
    for spec in SPECS.values():
        layer = make(spec)
        c = layer.cost(CTX)
        assert c.params == sum(p.numel() for p in layer.parameters())
        assert c.total_flops == c.projection_flops + c.score_flops + c.mix_flops > 0
        assert c.kv_cache_numel == layer.kv_cache_numel(CTX)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(spec="mha", d_model=30, n_heads=4), "n_heads"),
        (dict(spec="mha:n_kv_heads=3"), "n_kv_heads"),
        (dict(spec="mlr:4|2"), "ranks"),
        (dict(spec="mlr:4|2|1|1:block_sizes=64|24|8|4"), "block_sizes"),
        (dict(spec="mlr:4|4:block_sizes=32|16"), "block_sizes"),
        (dict(spec="mlr:4|4:block_sizes=64|64"), "block_sizes"),
        (dict(spec="global_swa:4|2"), "split"),
        (dict(spec="swa:-1"), "window"),
        (dict(spec="bilinear_btt:n_kv_heads=2"), "n_kv_heads"),
        (dict(spec="bilinear_mlr:4|2:n_blocks=1|3"), "n_blocks"),
        (dict(spec="bilinear_mlr:4|2:key_map=true:n_kv_heads=2"), "n_kv_heads"),
        (dict(spec="mha:attn_scale=xp"), "attn_scale"),
        (dict(spec="nope"), "kind"),
        (dict(spec="mha:colour=red"), "attention spec key"),
        (dict(spec="bilinear_btt:rotary=true"), "rotary"),
        (dict(spec="mlr:3|5:rotary=true"), "rotary"),
        # flags given as Python values are bools, not truthy values: causal="false" ran causal
        (dict(spec="mha", causal="false"), "^causal: expected True or False, got 'false'$"),
        (dict(spec="mlr:4|4", qk_norm=1), "^qk_norm: expected True or False"),
        (dict(spec="mha", d_model=True), "^d_model: expected a positive integer"),
    ],
)
def test_bad_configuration_names_the_parameter(kwargs, param):
    base = dict(d_model=D, n_heads=H, max_seq_len=CTX)
    spec = kwargs.pop("spec")
    base.update(kwargs)
    with pytest.raises(ValueError, match=param):
        build_attention(spec, **base)


def test_a_kinds_own_flag_is_a_bool():
    from structured_attention.attention.config import AttentionConfig
    from structured_attention.attention.mlr import MLRAttention

    options = MLRAttention.Config(ranks=(4, 4), depth_normalize="yes")
    with pytest.raises(ValueError, match="^depth_normalize: expected True or False, got 'yes'$"):
        MLRAttention(AttentionConfig(d_model=D, n_heads=H, max_seq_len=CTX, kind="mlr", options=options))


def test_bad_inputs_name_the_parameter():
    layer = make("mlr:4|2|1|1")
    with pytest.raises(ValueError, match="seq_len"):
        layer(torch.randn(1, CTX + 1, D))
    with pytest.raises(ValueError, match="x"):
        layer(torch.randn(CTX, D))
    with pytest.raises(ValueError, match="x"):
        layer(torch.randn(1, 4, D + 1))
    with pytest.raises(ValueError, match="x.dtype"):
        layer(torch.randn(1, 4, D, dtype=torch.float64))
    with pytest.raises(ValueError, match="x.device"):
        layer(torch.randn(1, 4, D, device="meta"))
    cache = layer.new_cache(1)
    layer(torch.randn(1, CTX - 1, D), cache)
    with pytest.raises(ValueError, match="seq_len"):
        layer(torch.randn(1, 2, D), cache)
    bidirectional = make("mha", causal=False)
    with pytest.raises(ValueError, match="cache"):
        bidirectional(torch.randn(1, 2, D), bidirectional.new_cache(1))


def test_config_is_typed_and_validated():
    cfg = AttentionConfig(d_model=64, n_heads=4, max_seq_len=128, kind="mlr", options=MLRAttention.Config(ranks=(8, 8)))
    layer = build_attention(cfg)
    assert (layer.head_dim, layer.n_kv_heads) == (16, 4) and (cfg.head_dim, cfg.n_kv_heads) == (None, None)
    with pytest.raises(ValueError, match="dropout"):
        AttentionConfig(d_model=64, n_heads=4, max_seq_len=128, dropout=1.5)


def test_per_layer_mix_builds_each_kind_and_decodes():
    torch.manual_seed(0)
    layers = build_attention_layers("mha,swa:4,swa:4", 6, d_model=D, n_heads=H, max_seq_len=CTX).eval()
    assert [layer.kind for layer in layers] == ["mha", "swa", "swa", "mha", "swa", "swa"]
    assert [layer.window for layer in layers if layer.kind == "swa"] == [4] * 4
    x = torch.randn(1, 12, D)
    full, h = x, x
    for layer in layers:
        full = full + layer(full)
    caches = [layer.new_cache(1) for layer in layers]
    steps = []
    for t in range(12):
        h = x[:, t:t + 1]
        for layer, cache in zip(layers, caches):
            h = h + layer(h, cache)
        steps.append(h)
    assert (torch.cat(steps, 1) - full).abs().max().item() <= 1e-5


def test_rotary_scores_depend_on_relative_position_only():
    from structured_attention.attention.rotary import Rotary

    torch.manual_seed(0)
    rot = Rotary((4, 2, 2), max_seq_len=64).double()
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)

    def score(i, j, seg):
        qi = rot(q.expand(64, 8).contiguous())[i]
        kj = rot(k.expand(64, 8).contiguous())[j]
        return (qi[seg] * kj[seg]).sum()

    for seg in (slice(0, 4), slice(4, 6), slice(6, 8)):  # each segment on its own
        torch.testing.assert_close(score(10, 3, seg), score(40, 33, seg))
        assert not torch.allclose(score(10, 3, seg), score(10, 4, seg))
    # against the complex form: pair (x0 + i x1) times exp(i * pos * base^(-2j/d))
    x = torch.randn(64, 8, dtype=torch.float64)
    z = torch.view_as_complex(x.view(64, 4, 2).contiguous())
    freq = torch.tensor([1.0, 10000 ** -0.5, 1.0, 1.0], dtype=torch.float64)
    expect = torch.view_as_real(z * torch.polar(torch.ones(64, 4, dtype=torch.float64), torch.arange(64.0)[:, None] * freq)).flatten(-2)
    torch.testing.assert_close(rot(x), expect.to(rot.cos.dtype).double(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("mha:head_dim=abc", r"^head_dim: expected an integer, got 'abc'$"),
        ("mha:dropout=abc", r"^dropout: expected a number"),
        ("mha:causal=maybe", r"^causal: expected a boolean \(true/false/1/0\), got 'maybe'$"),
        ("mha:qk_norm=yes", r"^qk_norm: expected a boolean"),
        ("mlr:", r"^ranks: expected positive integers separated by '\|'"),
        ("mlr:4|x", r"^ranks: expected positive integers"),
        ("global_swa:split=0|4", r"^split: expected positive integers"),
        ("mha:rotary_base=0", r"^rotary_base: expected a finite number above 1"),
    ],
)
def test_spec_values_are_parsed_by_their_declared_type(spec, needle):
    with pytest.raises(ValueError, match=needle):
        build_attention(spec, d_model=16, n_heads=2, max_seq_len=8)


def test_spec_booleans_take_1_and_0():
    assert parse_attention_spec("mha:rotary=1:bias=0:dropout=0.5") == {"kind": "mha", "rotary": True, "bias": False,
                                                                       "dropout": 0.5}


def test_mlr_with_the_paper_authors_conventions_follows_their_equations():
    """qk_norm_scope=head and level_scale=inverse_rank, written from the equations: score(i, j) =
    sum over the levels l whose block holds both i and j of <LN(q_i)_l, LN(k_j)_l> / r_l, the
    LayerNorm over the whole head and no other scale; causal softmax over the values."""
    spec = "mlr:4|2|2:qk_norm=true:qk_norm_scope=head:level_scale=inverse_rank:block_sizes=64|16|4"
    layer, x = make(spec), torch.randn(2, 40, D, generator=torch.Generator().manual_seed(1))
    b, t, hd = x.shape[0], x.shape[1], D // H
    norm = layer.q_norms[0], layer.k_norms[0]
    q = torch.nn.functional.layer_norm(heads(layer.q_proj(x), H), (hd,), norm[0].weight, norm[0].bias)
    k = torch.nn.functional.layer_norm(heads(layer.k_proj(x), H), (hd,), norm[1].weight, norm[1].bias)
    pos, scores, start = torch.arange(t), torch.zeros(b, H, t, t), 0
    for r, s in zip((4, 2, 2), (64, 16, 4)):
        shared = (pos // s)[:, None] == (pos // s)[None, :]
        scores = scores + (q[..., start:start + r] @ k[..., start:start + r].transpose(-1, -2)) / r * shared
        start += r
    weights = torch.softmax(scores.masked_fill(~band(t, True), float("-inf")), -1)
    out = (weights @ heads(layer.v_proj(x), H)).transpose(1, 2).reshape(b, t, D)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), layer.out_proj(out), rtol=1e-5, atol=1e-5)
        # learned scales starting at 1/r_l give the same layer at initialisation
        learned = make(spec.replace("inverse_rank", "inverse_rank_learned"))
        assert isinstance(learned.level_scale, torch.nn.Parameter) and "level_scale" not in dict(layer.named_parameters())
        torch.testing.assert_close(learned(x), layer(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"^level_scale: expected one of \['learned', 'inverse_rank', 'inverse_rank_learned'\]"):
        make("mlr:4|4:level_scale=fixed")
    with pytest.raises(ValueError, match=r"^qk_norm_scope: expected 'level' or 'head'"):
        make("mlr:4|4:qk_norm_scope=all")


@pytest.mark.parametrize("spec", ["mha", "swa:5", "global_swa:6|2:window=3"])
def test_the_paper_authors_mup_logits_are_8_over_d(spec):
    """attn_scale=mup8: scores q.k * 8/d (d the score dims of each map), the authors' muP logits,
    against the layer's dense definition written with that scale."""
    layer, x = make(f"{spec}:attn_scale=mup8"), torch.randn(1, 20, D, generator=torch.Generator().manual_seed(2))
    q, k, v = (heads(p(x), H) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    t = x.shape[1]
    if layer.kind == "global_swa":
        g, w = layer.global_dims, layer.window_dims
        out = (naive_attention(q[..., :g], k[..., :g], v, 8 / g, band(t, True))
               + naive_attention(q[..., g:], k[..., g:], v, 8 / w, band(t, True, 3)))
    else:
        out = naive_attention(q, k, v, 8 / (D // H), band(t, True, 5 if layer.kind == "swa" else None))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), layer.out_proj(out.transpose(1, 2).reshape(1, t, D)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["mlr:2|2|2|2", "mlr:4|2|1|1"], ids=["equal_ranks", "unequal_ranks"])
def test_mlr_level_scales_scale_each_levels_query_dims(spec):
    """The learned per-level scales multiply each level's query dims (with equal ranks a broadcast
    product over the levels, else a gather per dim): the queries and the scales' gradient against
    each level scaled on its own."""
    layer = make(spec, torch.float64)
    with torch.no_grad():
        layer.level_scale.copy_(torch.tensor([0.5, -1.5, 2.0, 3.0], dtype=torch.float64))
    x = torch.randn(2, 9, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    q = layer.project(x)[0]
    plain = heads(layer.q_proj(x), H)  # no qk_norm, no rotary in these specs
    want = torch.cat([part * layer.level_scale[level] for level, part in enumerate(plain.split(layer.ranks, -1))], -1)
    torch.testing.assert_close(q, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(q)
    (got,), (expected,) = (torch.autograd.grad(y, layer.level_scale, g, retain_graph=True) for y in (q, want))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
