"""Static KV caches and compiled generation: every kind decodes through fixed-shape buffers exactly
as the same rows run alone without a cache, and ``GPT.generate(cache="static", compile=...)``
replays one compiled step for every token with the tokens of eager generation."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch

from structured_attention.attention import StaticKVCache
from structured_attention.models import GPT, GPTConfig
from test_attention import CTX, D, SPECS, make

# the generation tests run on the GPU where there is one (scripts/gpu-check.sh OUT generate): float32,
# where graph-captured steps must give the tokens of eager ones
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = 13  # then single tokens up to CTX: crosses the MLR blocks and fills the windows' rings
GENERATION_KINDS = ["mha:n_kv_heads=1", "swa:window=6", "global_swa:window=6", "bilinear_btt", "bilinear_mlr",
                    "mlr:8|4|2|2:depth_normalize=true:rotary=true"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """No graphs of earlier tests (the recompile checks count this test's graphs only)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_static_decoding_matches_each_row_alone(name):
    """Left-padded rows decode through static buffers; each row's outputs equal its own
    full forward without padding or cache."""
    _check_static_decoding_against_rows_alone(name, CTX)


def _check_static_decoding_against_rows_alone(name: str, length: int) -> None:
    """Decode up to ``length`` tokens of the context (the cache's buffers are the context's)."""
    layer = make(SPECS[name])
    x = torch.randn(2, length, D, generator=torch.Generator().manual_seed(1))
    pad = 7
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :pad] = 0
    cache = layer.new_cache(batch_size=2, static=True)
    with torch.no_grad():
        outs = [layer(x[:, :PROMPT], cache, attention_mask=mask[:, :PROMPT])]
        buffers = {name: (t.shape, t.data_ptr()) for name, t in cache.buffers.items()}
        outs += [layer(x[:, i:i + 1], cache) for i in range(PROMPT, length)]
        alone = [layer(x[:1]), layer(x[1:, pad:])]
    out = torch.cat(outs, dim=1)
    assert cache.prefilled and cache.slot.item() == length
    assert {name: (t.shape, t.data_ptr()) for name, t in cache.buffers.items()} == buffers  # never reallocated
    torch.testing.assert_close(out[:1], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[1:, pad:], alone[1], rtol=0, atol=1e-5)


# a sliding window's static buffer is a ring of the window alone: no context for a token to run past
@pytest.mark.parametrize("name", sorted(n for n in SPECS if not n.startswith("swa")))
def test_a_static_cache_refuses_a_token_past_the_context(name):
    """A token past the context raises instead of wrapping round a full buffer."""
    layer = make(SPECS[name])
    x = torch.randn(1, CTX + 1, D, generator=torch.Generator().manual_seed(2))
    cache = layer.new_cache(batch_size=1, static=True)
    with torch.no_grad():
        layer(x[:, :PROMPT], cache)
        for i in range(PROMPT, CTX):
            layer(x[:, i:i + 1], cache)
        with pytest.raises((IndexError, RuntimeError), match="out of bounds|out of range"):
            layer(x[:, CTX:], cache)


@pytest.mark.parametrize("name", ["mha", "mlr", "swa"])
def test_a_static_cache_refilled_in_place_decodes_as_a_fresh_one(name):
    """copy_: a used static cache takes a prompt's cache in place (same tensors: a captured graph
    replays) and then decodes exactly as the prompt's own cache."""
    layer = make(SPECS[name])
    x = torch.randn(1, CTX, D, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        prompt = layer.new_cache(batch_size=1, static=True)
        layer(x[:, :PROMPT], prompt)
        layer(x[:, PROMPT:PROMPT + 1], prompt)  # the first step moves the prompt into the buffers
        used = layer.new_cache(batch_size=1, static=True)
        layer(x[:, 5:PROMPT + 5], used)
        for i in range(PROMPT + 5, CTX - 4):
            layer(x[:, i:i + 1], used)
        addresses = [t.data_ptr() for t in used.buffers.values()]
        used.copy_(prompt)
        want = [layer(x[:, i:i + 1], prompt) for i in range(PROMPT + 1, CTX)]
        got = [layer(x[:, i:i + 1], used) for i in range(PROMPT + 1, CTX)]
    assert [t.data_ptr() for t in used.buffers.values()] == addresses
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="^other: expected a prefilled static cache"):
        used.copy_(layer.new_cache(batch_size=1, static=True))


@pytest.mark.parametrize("name", ["mlr", "mlr_gqa", "mlr_depth_norm", "mlr_rotary"])
def test_static_mlr_step_in_aten_ops_matches_the_kernel(name, monkeypatch):
    """The static MLR step's ATen form (what runs without the C++ kernel, in half precision and on
    CUDA) against each row run alone."""
    from structured_attention.ops.mlr import cpu

    monkeypatch.setattr(cpu, "available", lambda: False)
    test_static_decoding_matches_each_row_alone(name)


@pytest.mark.parametrize("name", ["mha", "gqa", "bilinear_btt", "bilinear_mlr"])
def test_a_cpu_static_step_reads_no_slot_past_the_last_real_one(name):
    """On the CPU the static read stops at the last real slot (a static cache early in its context
    costs what a growing one does): slots past it hold NaN here, and the steps still equal those
    of a growing cache, for a padded batch too (the mask then stays for the padding)."""
    layer = make(SPECS[name])
    x = torch.randn(2, CTX, D, generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, CTX, dtype=torch.long)
    mask[1, :3] = 0
    for rows in (mask, None):
        outs = []
        for static in (False, True):
            cache = layer.new_cache(batch_size=2, static=static)
            with torch.no_grad():
                layer(x[:, :PROMPT], cache, attention_mask=None if rows is None else rows[:, :PROMPT])
                steps = [layer(x[:, PROMPT:PROMPT + 1], cache)]
                if static:
                    for buffer in cache.buffers.values():
                        buffer[:, :, PROMPT + 1:] = float("nan")
                steps += [layer(x[:, i:i + 1], cache) for i in range(PROMPT + 1, PROMPT + 6)]
            outs.append(torch.cat(steps, dim=1))
        assert outs[1].isfinite().all()
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("offsets", [[0, 0, 0], [0, 5, 20]])
def test_full_slot_reads_equal_a_softmax_over_each_rows_real_slots(offsets):
    """Both forms of a full buffer's read, the CPU's bounds (``prefix_decode``) and the mask built
    in the caller's graph elsewhere (``masked_decode`` over ``real_slots``), against a softmax over
    each row's slots ``offsets[b]..slot`` written out; the slots past ``slot`` hold NaN."""
    from structured_attention.functional.decode import masked_decode, prefix_decode, real_slots

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, h, n, 8, generator=g) for h, n in ((4, 1), (2, 32), (2, 32)))
    slot, first = torch.tensor(20), torch.tensor(offsets)
    k[:, :, 21:], v[:, :, 21:] = float("nan"), float("nan")
    want = torch.empty(3, 4, 1, 8)
    for b in range(3):
        for h in range(4):
            keys, values = k[b, h // 2, offsets[b]:21], v[b, h // 2, offsets[b]:21]
            want[b, h] = torch.softmax(q[b, h] @ keys.T * 0.3, dim=-1) @ values
    real = real_slots(torch.arange(32), first, slot)
    torch.testing.assert_close(prefix_decode(q, k, v, first, slot, 0.3), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(masked_decode(q, k, v, real, 0.3), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("spec", ["mlr:8|8|8|8", "mlr:16|8|8", "mlr:8|8|8|8:depth_normalize=true"])
def test_static_and_growing_caches_decode_to_the_same_bits_in_the_cpu_kernel(spec):
    """The C++ kernel gets a static cache's finer levels in ring runs that start elsewhere than a
    growing cache's (here a padded row wraps them): each key's score must not depend on where its
    run starts, so both caches give the same bits (ranks that are multiples of 8, which the vector
    path takes, on AVX2 and AVX-512)."""
    from structured_attention.ops.mlr import cpu

    if not cpu.available() or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("needs the C++ kernel's AVX2 or AVX-512 build")
    layer = make(spec, d_model=64, n_heads=2)
    x = torch.randn(2, CTX, 64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, CTX, dtype=torch.long)
    mask[1, :5] = 0
    outs = []
    for static in (False, True):
        cache = layer.new_cache(batch_size=2, static=static)
        with torch.no_grad():
            layer(x[:, :PROMPT], cache, attention_mask=mask[:, :PROMPT])
            outs.append(torch.cat([layer(x[:, i:i + 1], cache) for i in range(PROMPT, CTX)], dim=1))
    assert torch.equal(outs[0], outs[1])


def test_static_mlr_step_in_the_triton_kernel_matches_each_row_alone(monkeypatch):
    """The static MLR step through the Triton decoding kernel (what runs on CUDA; here under
    Triton's interpreter, which is slow: one case, with GQA, padding and block crossings, 19 steps
    to slot 32; depth normalisation and splits past the slot are in test_mlr_decode): rings read in
    place, the slot and each row's block starts read on the device, against each row run alone."""
    pytest.importorskip("triton", reason="triton is not installed")
    from structured_attention.ops.mlr import static
    from structured_attention.ops.mlr.triton_common import INTERPRETED

    if not INTERPRETED:
        pytest.skip("these layers are on the CPU, which Triton runs only interpreted; on CUDA the generation "
                    "tests below take the kernel")
    monkeypatch.setattr(static, "on_triton", lambda v: True)
    _check_static_decoding_against_rows_alone("mlr_gqa", 32)


def test_a_copied_static_mlr_cache_reads_the_same_kernel_tables():
    """The rings share one allocation, so the Triton kernel's tables (offsets from the first ring)
    depend on shapes alone: a deep copy, or another cache of the layer, reuses them instead of
    making new ones (which, first made while a CUDA graph is recorded, would outlive its pool)."""
    pytest.importorskip("triton", reason="triton is not installed")
    from structured_attention.ops.mlr import triton_decode

    layer = make(SPECS["mlr_depth_norm"])
    cache = layer.new_cache(batch_size=2, static=True)
    with torch.no_grad():
        layer(torch.randn(2, PROMPT, D), cache)
    keys = [cache.buffers[f"k{level}"] for level in range(len(layer.ranks))]
    copied = copy.deepcopy(cache)
    copies = [copied.buffers[f"k{level}"] for level in range(len(layer.ranks))]
    assert copies[1].data_ptr() != keys[1].data_ptr()
    ours, theirs = (triton_decode._tables(k, [0] * len(k), layer.ranks, layer.block_sizes[1:]) for k in (keys, copies))
    assert ours.offsets is theirs.offsets and ours.strides is theirs.strides


def _gpt(attention: str) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_seq_len=64,
                         attention=attention, positions="learned")).to(DEVICE).eval()


def _ragged_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, :2] = 0
    return idx.to(DEVICE), mask.to(DEVICE)


@pytest.mark.parametrize("attention", GENERATION_KINDS)
def test_compiled_static_generation_gives_the_tokens_of_eager_generation(attention, no_dynamo_warnings):
    """Greedy tokens of a ragged batch: growing caches (eager), static caches (eager) and the
    compiled one-token step (aot_eager: traced forward, no code generation) agree."""
    model = _gpt(attention)
    idx, mask = _ragged_prompts()
    want = model.generate(idx, 40, temperature=0, attention_mask=mask)
    static = model.generate(idx, 40, temperature=0, attention_mask=mask, cache="static")
    with torch._dynamo.config.patch(error_on_recompile=True):  # one graph for every token
        compiled = model.generate(idx, 40, temperature=0, attention_mask=mask, cache="static", compile="aot_eager")
    assert torch.equal(static, want)
    assert torch.equal(compiled, want)


def test_inductor_compiles_the_step_once_for_every_token_and_every_call():
    model = _gpt("mlr:8|4|2|2")
    idx, mask = _ragged_prompts()
    want = model.generate(idx, 30, temperature=0, attention_mask=mask)
    with torch._dynamo.config.patch(error_on_recompile=True):
        first = model.generate(idx, 30, temperature=0, attention_mask=mask, cache="static", compile=True)
        again = model.generate(idx, 30, temperature=0, attention_mask=mask, cache="static", compile=True)
    assert torch.equal(first, want) and torch.equal(again, want)


@pytest.mark.parametrize("attention", ["mha", "global_swa:window=6", "mlr:8|4|2|2"])
def test_the_compiled_step_writes_the_cache_in_place(attention):
    """The compiled step's code allocates nothing as large as a cache buffer: the token's write
    goes into the static buffers in place, with no copy of the cache (a functionalised write that
    torch.compile did not turn back into an in-place one would copy a buffer every step)."""
    from torch._inductor.utils import run_and_get_code

    model = _gpt(attention)
    idx, mask = _ragged_prompts()
    want = model.generate(idx, 6, temperature=0, attention_mask=mask)
    got, codes = run_and_get_code(
        lambda: model.generate(idx, 6, temperature=0, attention_mask=mask, cache="static", compile=True))
    assert torch.equal(got, want)
    caches = model.new_caches(3, static=True)
    with torch.no_grad():
        model(idx, caches=caches, attention_mask=mask)
        model(idx[:, :1], caches=caches)
    smallest = min(t.numel() for t in caches[0].buffers.values() if t.shape[2] == 64)  # a full buffer
    sizes = [math.prod(int(n) for n in dims.split(",") if n.strip())
             for code in codes for dims in re.findall(r"empty_strided_\w+\(\(([\d, ]+)\)", code)]
    assert sizes and max(sizes) < smallest


@pytest.mark.parametrize("compile, backend, mode", [(True, "inductor", None), ("aot_eager", "aot_eager", None),
                                                    ("reduce-overhead", "inductor", "reduce-overhead")])
def test_generate_compile_takes_a_mode_or_a_backend(compile, backend, mode, monkeypatch):
    seen = {}

    def fake_compile(fn, **kwargs):
        seen.update(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = _gpt("mha")
    idx, mask = _ragged_prompts()
    model.generate(idx, 2, temperature=0, attention_mask=mask, cache="static", compile=compile)
    assert seen == dict(fullgraph=True, dynamic=False, backend=backend, mode=mode)


@pytest.mark.parametrize("attention", ["mha:n_kv_heads=1", "swa:window=6", "bilinear_btt", "mlr:8|4|2|2:depth_normalize=true"])
def test_captured_decoding_gives_the_tokens_of_eager_generation_again_after_a_refill(attention):
    """CapturedDecoding (its graph on CUDA; on the CPU the same bookkeeping, uncaptured) keeps the
    tokens of eager generation in its buffer, and started again on caches refilled in place (a
    server's reuse, no new graph) gives them again."""
    from structured_attention.models.decoding import CapturedDecoding, next_token

    model = _gpt(attention)
    idx, mask = _ragged_prompts()
    want = model.generate(idx, 20, temperature=0, attention_mask=mask)
    caches = model.new_caches(3, static=True)
    with torch.no_grad():
        logits, _ = model(idx, caches=caches, attention_mask=mask)
        prompt = copy.deepcopy(caches)
        steps = CapturedDecoding(lambda token: model._decode_step(token, caches),
                                 lambda x: next_token(x, 0, None, None), 3, 19, DEVICE)
        first = next_token(logits[:, -1], 0, None, None)
        for _ in range(2):
            for live, held in zip(caches, prompt):
                live.copy_(held)
            steps.start(first)
            new = [steps() for _ in range(19)]
            graph = steps.graph
            assert torch.equal(torch.cat([idx, steps.tokens], dim=1), want)
            assert torch.equal(torch.stack(new, dim=1), want[:, 13:])
        assert steps.graph is graph and (graph is not None) == (DEVICE == "cuda")
        with pytest.raises(ValueError, match="^steps: expected at most 19 calls after start"):
            steps()
        with pytest.raises(ValueError, match=r"^token: expected shape \(3,\)"):
            steps.start(first[:2])


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("attention", GENERATION_KINDS)
def test_generate_with_a_cuda_graph_gives_the_tokens_of_static_generation(attention):
    """One captured step replayed per token gives the greedy tokens of eager static generation, of
    a ragged batch; on_token sees every new token."""
    model = _gpt(attention)
    idx, mask = _ragged_prompts()
    want = model.generate(idx, 30, temperature=0, attention_mask=mask, cache="static")
    seen = []
    got = model.generate(idx, 30, temperature=0, attention_mask=mask, cache="static", cuda_graph=True,
                         on_token=lambda t: seen.append(t.clone()))
    assert torch.equal(got, want)
    assert torch.equal(torch.stack(seen, dim=1), want[:, 12:])


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device")
def test_a_cuda_graph_of_the_compiled_step_and_of_sampling_gives_their_tokens():
    """Captured, the compiled step gives the compiled step's tokens, and sampling from a generator
    (registered with the graph) draws the tokens eager sampling draws from the same seed."""
    model = _gpt("mlr:8|4|2|2")
    idx, mask = _ragged_prompts()
    compiled = model.generate(idx, 30, temperature=0, attention_mask=mask, cache="static", compile=True)
    assert torch.equal(model.generate(idx, 30, temperature=0, attention_mask=mask, cache="static", compile=True,
                                      cuda_graph=True), compiled)

    def sampled(**kwargs):
        return model.generate(idx, 30, temperature=0.8, top_k=20, attention_mask=mask, cache="static",
                              generator=torch.Generator(DEVICE).manual_seed(3), **kwargs)

    assert torch.equal(sampled(cuda_graph=True), sampled())


def test_bad_use_is_one_line():
    model = _gpt("mlr:8|4|2|2")
    idx = torch.randint(0, 50, (2, 5), device=DEVICE)
    with pytest.raises(ValueError, match="^compile: expected False with cache='growing'"):
        model.generate(idx, 3, compile=True)
    with pytest.raises(ValueError, match="^cache: expected 'growing' or 'static'"):
        model.generate(idx, 3, cache="paged")
    with pytest.raises(ValueError, match="^cuda_graph: expected False with cache='growing'"):
        model.generate(idx, 3, cuda_graph=True)
    with pytest.raises(ValueError, match="^compile: expected a mode other than reduce-overhead or max-autotune"):
        model.generate(idx, 3, cache="static", compile="reduce-overhead", cuda_graph=True)
    with pytest.raises(ValueError, match=r"^compile: expected a torch.compile mode \(default, .*\) or backend "
                                         r"\(inductor, eager, aot_eager, .*got 'inductr'$"):
        model.generate(idx, 3, cache="static", compile="inductr")
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="^cuda_graph: expected False for a model on the CPU"):
            model.generate(idx, 3, cache="static", cuda_graph=True)
    caches = model.new_caches(2, static=True)
    assert all(isinstance(c, StaticKVCache) for c in caches)
    with torch.no_grad():
        model(idx, caches=caches)
        with pytest.raises(ValueError, match="^x: expected one token per row after the prompt"):
            model(idx[:, :2], caches=caches)
