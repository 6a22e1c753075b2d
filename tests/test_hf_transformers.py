"""MLR attention inside a Hugging Face model (a tiny Llama built from its config: no download):
one level equals SDPA, several equal the exact reference on the level-ordered dimensions, padded
rows equal the rows alone, generation with a cache equals generation without, and each level's
scores depend on relative position only."""

from __future__ import annotations

import itertools

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")

from structured_attention.attention.segments import left_padding  # noqa: E402
from structured_attention.integrations import transformers as sattn_hf  # noqa: E402
from structured_attention.ops.mlr import mlr_attention_reference  # noqa: E402

sattn_hf.register()


def _llama(implementation: str, ranks: list[int] | None = None, **config: object):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                             attn_implementation=implementation), **config})
    cfg.sattn_ranks = ranks
    return transformers.LlamaForCausalLM(cfg).eval()


IDX = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
# generate()'s cache argument: transformers 5.24 renamed past_key_values to cache
CACHE = "cache" if tuple(int(n) for n in transformers.__version__.split(".")[:2]) >= (5, 24) else "past_key_values"


def test_one_level_equals_sdpa_forward_and_backward():
    sdpa, mlr = _llama("sdpa"), _llama(sattn_hf.ATTN_IMPLEMENTATION, [16])
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :5] = 0
    # no loss on what a padding position predicts (its output is arbitrary): the labels are
    # shifted, so the first real token's label goes too
    labels = IDX.clone()
    labels[0, :6] = -100
    for m in (sdpa, mlr):
        m.train()
        m.zero_grad()
        m(IDX, attention_mask=mask, labels=labels).loss.backward()
    torch.testing.assert_close(mlr(IDX).logits, sdpa(IDX).logits, atol=1e-5, rtol=0)
    for (name, a), b in zip(sdpa.named_parameters(), mlr.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_several_levels_equal_the_reference_on_level_ordered_dimensions(monkeypatch):
    """The attention function's output against mlr_attention_reference on dimensions reordered by
    hand: level l takes rotary pairs (i, i + 8) for i in its own range."""
    model = _llama(sattn_hf.ATTN_IMPLEMENTATION, [8, 4, 4])
    seen = []
    forward = sattn_hf.mlr_attention_forward

    def spy(module, query, key, value, attention_mask, **kwargs):
        out, _ = forward(module, query, key, value, attention_mask, **kwargs)
        seen.append((query, key, value, out))
        return out, None

    transformers.AttentionInterface.register(sattn_hf.ATTN_IMPLEMENTATION, spy)
    try:
        model(IDX)
    finally:
        sattn_hf.register()
    order = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]
    for query, key, value, out in seen:
        key, value = (x.repeat_interleave(2, dim=1) for x in (key, value))  # GQA, by hand
        want = mlr_attention_reference(query[..., order].double(), key[..., order].double(), value.double(),
                                       (8, 4, 4), (64, 32, 16), causal=True, scale=0.25)
        torch.testing.assert_close(out.transpose(1, 2).double(), want, atol=1e-5, rtol=0)


def test_each_level_holds_whole_rotary_pairs():
    """Shift both positions: a level's score is unchanged only if its dimensions are whole pairs."""
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(
        transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=64))
    apply = transformers.models.llama.modeling_llama.apply_rotary_pos_emb
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    order = torch.tensor(sattn_hf.level_permutation(16))
    torch.testing.assert_close(sattn_hf._pair_order(q), q[..., order], atol=0, rtol=0)  # what the forward uses

    def level_scores(i: int, j: int) -> torch.Tensor:
        cos, sin = rotary(q, torch.tensor([[i, j]]))
        rq, _ = apply(q, q, cos[:, :1], sin[:, :1])
        _, rk = apply(k, k, cos[:, 1:], sin[:, 1:])
        parts = zip(rq[..., order].split((8, 4, 4), -1), rk[..., order].split((8, 4, 4), -1))
        return torch.stack([(a * b).sum() for a, b in parts])

    torch.testing.assert_close(level_scores(3, 1), level_scores(40, 38), atol=1e-5, rtol=0)


def test_padded_rows_equal_each_row_alone_and_generation_with_a_cache_equals_without():
    model = _llama(sattn_hf.ATTN_IMPLEMENTATION, [8, 4, 4])
    for side in ("left", "right"):
        mask = torch.ones(2, 20, dtype=torch.long)
        real = slice(7, 20) if side == "left" else slice(0, 13)
        mask[0] = 0
        mask[0, real] = 1
        logits = model(IDX, attention_mask=mask).logits
        torch.testing.assert_close(logits[0, real], model(IDX[:1, real]).logits[0], atol=1e-5, rtol=0)
    prompts, mask = IDX[:, :10], torch.tensor([[0] * 4 + [1] * 6, [1] * 10])
    out = model.generate(prompts, attention_mask=mask, max_new_tokens=12, do_sample=False)
    no_cache = model.generate(prompts, attention_mask=mask, max_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(out, no_cache)
    assert torch.equal(out[0, 10:], model.generate(IDX[:1, 4:10], max_new_tokens=12, do_sample=False)[0, 6:])
    assert torch.equal(out[1, 10:], model.generate(IDX[1:, :10], max_new_tokens=12, do_sample=False)[0, 10:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_training_and_generation_equal_the_cpu():
    """The CUDA path (Triton kernels, dims gathered into the levels' order): a padded batch's loss,
    logits and gradients equal the CPU kernel's, and cached generation equals uncached there."""
    cpu_model = _llama(sattn_hf.ATTN_IMPLEMENTATION, [8, 4, 4]).train()
    cuda_model = _llama(sattn_hf.ATTN_IMPLEMENTATION, [8, 4, 4]).cuda().train()
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :5] = 0
    labels = IDX.clone()
    labels[0, :6] = -100
    results = []
    for model, device in ((cpu_model, "cpu"), (cuda_model, "cuda")):
        out = model(IDX.to(device), attention_mask=mask.to(device), labels=labels.to(device))
        out.loss.backward()
        results.append((out.logits[1].detach().cpu(), [p.grad.cpu() for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-4, rtol=1e-4)
    for got, want in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)
    cuda_model.eval()
    prompts, prompt_mask = IDX[:, :10].cuda(), torch.tensor([[0] * 4 + [1] * 6, [1] * 10]).cuda()
    out = cuda_model.generate(prompts, attention_mask=prompt_mask, max_new_tokens=12, do_sample=False)
    no_cache = cuda_model.generate(prompts, attention_mask=prompt_mask, max_new_tokens=12, do_sample=False,
                                   use_cache=False)
    assert torch.equal(out, no_cache)


@pytest.mark.parametrize("ranks,match", [
    ([8, 4], r"^sattn_ranks: expected a list of even positive ranks summing to the head dimension 16"),
    ([8, 5, 3], r"^sattn_ranks: expected"),
    (None, r"^sattn_ranks: expected"),
])
def test_bad_ranks_are_one_line(ranks, match):
    model = _llama(sattn_hf.ATTN_IMPLEMENTATION, ranks)
    with pytest.raises(ValueError, match=match) as err:
        model(IDX)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family,extra", [("Mistral", {}), ("Qwen2", {}), ("Qwen3", {"head_dim": 32}),
                                          ("Gemma", {"head_dim": 16})])
def test_other_families_with_one_level_equal_sdpa_and_generate_with_a_cache(family, extra):
    """The families the README names (and Gemma): with one level MLR attention is softmax attention,
    so the logits of a padded batch equal SDPA's; cached generation equals uncached."""
    config_class, model_class = getattr(transformers, f"{family}Config"), getattr(transformers, f"{family}ForCausalLM")
    settings = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    sdpa = model_class(config_class(**settings, attn_implementation="sdpa")).eval()
    config = config_class(**settings, attn_implementation=sattn_hf.ATTN_IMPLEMENTATION)
    sattn_hf.configure(config, [extra.get("head_dim", 16)])
    mlr = model_class(config).eval()
    mlr.load_state_dict(sdpa.state_dict())
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :5] = 0
    real = mask.bool()
    torch.testing.assert_close(mlr(IDX, attention_mask=mask).logits[real], sdpa(IDX, attention_mask=mask).logits[real],
                               atol=1e-5, rtol=0)
    settings = dict(attention_mask=mask[:, :8], max_new_tokens=8, do_sample=False)
    assert torch.equal(mlr.generate(IDX[:, :8], **settings), mlr.generate(IDX[:, :8], use_cache=False, **settings))


def test_a_sliding_window_is_refused_not_dropped():
    """Mistral's sliding window reaches the attention function as an argument: MLR attention has
    none, so a model configured with one is refused rather than scored over every earlier token."""
    config = transformers.MistralConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        sliding_window=8, attn_implementation=sattn_hf.ATTN_IMPLEMENTATION)
    sattn_hf.configure(config, [8, 4, 4])
    with pytest.raises(ValueError, match=r"^sliding_window: expected None or at least max_position_embeddings=64 with sattn_mlr .*, got 8$"):
        transformers.MistralForCausalLM(config)(IDX)


def test_logit_soft_capping_is_refused_not_dropped():
    config = transformers.Gemma2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=64, sliding_window=64,
                                       attn_implementation=sattn_hf.ATTN_IMPLEMENTATION)
    sattn_hf.configure(config, [8, 4, 4])
    with pytest.raises(ValueError, match=r"^softcap: expected None with sattn_mlr .*, got 50.0$"):
        transformers.Gemma2ForCausalLM(config)(IDX)


def test_attention_dropout_is_refused_in_training():
    model = _llama(sattn_hf.ATTN_IMPLEMENTATION, [8, 4, 4], attention_dropout=0.1).train()
    with pytest.raises(ValueError, match=r"^attention_dropout: expected 0 with sattn_mlr"):
        model(IDX)


def test_the_compressed_cache_generates_exactly_and_holds_what_mlr_reads():
    """Greedy generation through MLRCache equals generation without a cache, across several
    blocks of every level; the cache holds level 1's keys for all 49 cached tokens, level l's
    for the last s_l only, and every value: counted here by hand."""
    model = _llama(sattn_hf.ATTN_IMPLEMENTATION, [8, 4, 4])  # block sizes 64, 32, 16
    prompts, mask = IDX[:, :10], torch.tensor([[0] * 4 + [1] * 6, [1] * 10])
    cache = sattn_hf.MLRCache(model.config)
    out = model.generate(prompts, attention_mask=mask, max_new_tokens=40, do_sample=False, **{CACHE: cache})
    no_cache = model.generate(prompts, attention_mask=mask, max_new_tokens=40, do_sample=False, use_cache=False)
    assert torch.equal(out, no_cache)
    tokens, batch, kv_heads, layers = 49, 2, 2, 2
    assert cache.memory_bytes() == layers * batch * kv_heads * _cache_floats(tokens) * 4
    assert cache.memory_bytes() < layers * batch * kv_heads * tokens * (16 + 16) * 4  # transformers' cache
    beams = dict(attention_mask=mask, max_new_tokens=20, num_beams=3, do_sample=False)  # the cache reordered
    assert torch.equal(model.generate(prompts, **beams, **{CACHE: sattn_hf.MLRCache(model.config)}),
                       model.generate(prompts, **beams, use_cache=False))


def _cache_floats(tokens: int) -> int:
    """What MLRCache keeps per head of the [8, 4, 4] model (block sizes 64, 32, 16) holding ``tokens``."""
    return tokens * 8 + min(tokens, 32) * 4 + min(tokens, 16) * 4 + tokens * 16


@pytest.mark.skipif(not hasattr(transformers.cache_utils.Cache, "activate_past_recording"),
                    reason="transformers before 5.14 has no past recording for a cache to be cropped by")
def test_the_compressed_cache_takes_assisted_and_prompt_lookup_decoding(monkeypatch):
    """Drafts that the model rejects are cropped off the cache (generate() records the finer levels'
    keys until then): assisted and prompt-lookup greedy decoding through MLRCache give the tokens of
    greedy decoding without a cache, across every level's block ends, and a crop leaves the cache
    holding what plain generation does."""
    model = _llama(sattn_hf.ATTN_IMPLEMENTATION, [8, 4, 4])
    torch.manual_seed(3)
    assistant = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64)).eval()
    # drafts of six tokens whatever the assistant's confidence, so that rejected ones are long
    assistant.generation_config.update(num_assistant_tokens=6, num_assistant_tokens_schedule="constant",
                                       assistant_confidence_threshold=0.0)
    prompt = IDX[:1, :10].repeat(1, 2)  # repeated, so prompt lookup finds drafts
    crops = []
    layer_class = sattn_hf._cache_classes()[0]
    crop = layer_class.crop
    monkeypatch.setattr(layer_class, "crop", lambda self, n: crops.append(n) or crop(self, n))
    want = model.generate(prompt, max_new_tokens=40, do_sample=False, use_cache=False)
    for drafts in (dict(assistant_model=assistant), dict(prompt_lookup_num_tokens=3)):
        cache, crops[:] = sattn_hf.MLRCache(model.config), []
        assert torch.equal(model.generate(prompt, max_new_tokens=40, do_sample=False, **drafts, **{CACHE: cache}), want)
        assert min(crops) <= -2  # rejected drafts of several tokens, some across a block's end
        cache.crop(0)  # what a crop leaves: each finer level's last s_l tokens (the last step may add more)
        assert cache.memory_bytes() == 2 * 2 * _cache_floats(cache.get_seq_length()) * 4


def test_a_crop_without_past_recording_takes_back_what_the_levels_kept():
    """Without past recording the finest level keeps its last 16 tokens' keys: a crop that the next
    queries' blocks can still read gives the logits of the sequence run whole; one farther back is
    refused in one line. After activate_past_recording() the tokens added since can be taken back."""
    model = _llama(sattn_hf.ATTN_IMPLEMENTATION, [8, 4, 4])
    cache = sattn_hf.MLRCache(model.config)
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = model(ids).logits
        model(ids[:, :19], **{CACHE: cache})  # level 3 keeps tokens 3..18: a query at 18 reads from 16
        with pytest.raises(ValueError, match=r"^crop: expected at most 1 tokens taken back from this MLRCache "
                                             r"\(level 3 keeps the keys of the last 16 tokens; .*\), got 3$"):
            cache.crop(-3)
        cache.crop(-1)
        torch.testing.assert_close(model(ids[:, 18:19], **{CACHE: cache}).logits[0, -1], whole[0, 18],
                                   atol=1e-5, rtol=0)
        for layer in cache.layers:  # what Cache.activate_past_recording() does (transformers 5.14 and later)
            layer.activate_past_recording()
        model(ids[:, 19:23], **{CACHE: cache})
        cache.crop(-4)  # back to 19 tokens: level 3 holds the last 16 again
        assert cache.get_seq_length() == 19 and cache.memory_bytes() == 2 * 2 * _cache_floats(19) * 4
        torch.testing.assert_close(model(ids[:, 19:23], **{CACHE: cache}).logits[0], whole[0, 19:23],
                                   atol=1e-5, rtol=0)


def test_a_decoding_step_reads_the_padding_once_for_all_layers(monkeypatch):
    """Each row's block starts after a cache come from the padding mask, which is read on the host
    (a wait for the device): once per forward step for every layer, not once per layer, with the
    tokens of generation without a cache."""
    model = _llama(sattn_hf.ATTN_IMPLEMENTATION, [8, 4, 4])  # two layers
    prompts, mask = IDX[:, :10], torch.tensor([[0] * 4 + [1] * 6, [1] * 10])
    reads = []
    monkeypatch.setattr(sattn_hf, "left_padding", lambda *a: reads.append(1) or left_padding(*a))
    out = model.generate(prompts, attention_mask=mask, max_new_tokens=12, do_sample=False,
                         **{CACHE: sattn_hf.MLRCache(model.config)})
    assert len(reads) == 11  # the 11 steps after the prompt's
    assert torch.equal(out, model.generate(prompts, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                           use_cache=False))


def test_transformers_static_cache_generates_what_no_cache_does():
    """cache_implementation="static" hands the attention function every slot of its fixed-length
    buffers, the unfilled ones too: generation equals generation without a cache, padded or not."""
    model = _llama(sattn_hf.ATTN_IMPLEMENTATION, [8, 4, 4])
    prompts = IDX[:, :10]
    for mask in (torch.tensor([[0] * 4 + [1] * 6, [1] * 10]), torch.ones(2, 10, dtype=torch.long)):
        settings = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
        assert torch.equal(model.generate(prompts, cache_implementation="static", **settings),
                           model.generate(prompts, use_cache=False, **settings))


def test_compiled_static_cache_generation_traces_three_graphs_and_generates_what_eager_does(no_dynamo_warnings):
    """transformers compiles the forward of static-cache generation (on a GPU by itself, with
    fullgraph=True if asked): a padded batch's prompt, first step and every later step run as three
    whole graphs, the last with the cache's length symbolic, across the ends of MLR blocks (the
    rows' block starts were read on the host: an error under fullgraph; a check's message fixed
    the length: a graph per step), and give eager generation's tokens."""
    model = _llama(sattn_hf.ATTN_IMPLEMENTATION, [8, 4, 4], num_hidden_layers=1)  # one layer: quicker to trace
    prompts, mask = IDX[:, :10], torch.tensor([[0] * 4 + [1] * 6, [1] * 10])
    # 10 + 9 tokens: across the ends of the blocks of 16 (sizes 64, 32, 16) of both rows
    settings = dict(attention_mask=mask, max_new_tokens=9, do_sample=False, cache_implementation="static")
    expected = model.generate(prompts, **settings)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, fullgraph=True, backend=backend)
    try:
        assert torch.equal(model.generate(prompts, **settings), expected)
    finally:
        del model.forward
        torch._dynamo.reset()
    assert len(graphs) == 3


def test_inside_bfloat16_autocast_it_trains_and_the_compressed_cache_generates():
    """Inside autocast (Trainer's bf16=True) Llama's rotary embedding leaves the keys float32 beside
    bfloat16 values: training runs, and greedy generation through MLRCache equals generation
    without a cache."""
    model = _llama(sattn_hf.ATTN_IMPLEMENTATION, [8, 4, 4]).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(IDX, labels=IDX).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
    model.eval()
    prompts, mask = IDX[:, :10], torch.tensor([[0] * 4 + [1] * 6, [1] * 10])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.generate(prompts, attention_mask=mask, max_new_tokens=12, do_sample=False,
                             **{CACHE: sattn_hf.MLRCache(model.config)})
        no_cache = model.generate(prompts, attention_mask=mask, max_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(out, no_cache)


@pytest.mark.parametrize("ranks,sizes,match", [
    ([8, 4], None, r"^sattn_ranks: expected a list of even positive ranks summing to the head dimension 16"),
    ([8, 4, 4], [64, 24, 16], r"^sattn_block_sizes: "),
    ([8, 4, 4], [64, 32], r"^sattn_block_sizes: "),
])
def test_configure_checks_at_config_time(ranks, sizes, match):
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=64)
    with pytest.raises(ValueError, match=match) as err:
        sattn_hf.configure(config, ranks, sizes)
    assert "\n" not in str(err.value) and not hasattr(config, "sattn_ranks")
    assert sattn_hf.configure(config, [8, 4, 4], [64, 16, 8]).sattn_block_sizes == [64, 16, 8]


def test_save_load_round_trip_and_trainer_runs_five_steps(tmp_path):
    model = _llama(sattn_hf.ATTN_IMPLEMENTATION, [8, 4, 4])
    model.save_pretrained(tmp_path / "model")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "model",
                                                           attn_implementation=sattn_hf.ATTN_IMPLEMENTATION).eval()
    assert loaded.config.sattn_ranks == [8, 4, 4]
    torch.testing.assert_close(loaded(IDX).logits, model(IDX).logits, atol=0, rtol=0)

    class Windows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    args = transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), max_steps=5, per_device_train_batch_size=4,
                                          learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                                          use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model.train(), args=args, train_dataset=Windows())
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert trainer.state.global_step == 5 and len(losses) == 5 and all(map(torch.isfinite, torch.tensor(losses)))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_bench_hf_times_both_and_reports_the_caches(tmp_path, capsys):
    import json

    from structured_attention.cli.main import main

    assert main(["bench", "hf", "--seq-len", "32", "--hidden", "64", "--n-heads", "4", "--ranks", "4|4|4|4",
                 "--intermediate", "96", "--cache-len", "256", "--repeats", "1", "--warmup", "0", "--profile",
                 "--device", "cpu", "--out", str(tmp_path)]) == 0  # the profile names the CPU kernel
    record = json.loads((tmp_path / "hf.json").read_text())["results"][0]
    assert record["sdpa_step_ms"] > 0 and record["sattn_mlr_step_ms"] > 0 and record["intermediate"] == 96
    profile = (tmp_path / "hf-profile.txt").read_text()
    assert "== sdpa, one training step ==" in profile and "sattn::mlr_cpu_backward" in profile
    # 256 tokens, block sizes 256/128/64/32: level l keeps min(256, s_l) keys of rank 4, values 16 wide;
    # 4 heads, 2 layers, float32
    assert record["mlr_cache_bytes"] == (256 * 4 + 128 * 4 + 64 * 4 + 32 * 4 + 256 * 16) * 4 * 2 * 4
    assert record["dynamic_cache_bytes"] == 256 * (16 + 16) * 4 * 2 * 4


@pytest.mark.parametrize("spec", ["bilinear_btt:1", "bilinear_mlr:4|2", "swa:4", "global_swa:window=2", "mlr:8|4|4"])
def test_swapped_attention_pads_generates_saves_and_loads(tmp_path, spec):
    model = sattn_hf.swap_attention(_llama("sdpa"), spec).eval()
    layers = model.model.layers
    assert all(isinstance(layer.self_attn, sattn_hf.SwappedAttention) for layer in layers)
    assert type(model).__name__ == "SattnLlamaForCausalLM" and model.config.model_type == "sattn_llama"
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :7] = 0
    logits = model(IDX, attention_mask=mask).logits
    torch.testing.assert_close(logits[0, 7:], model(IDX[:1, 7:]).logits[0], atol=1e-5, rtol=0)
    prompt_mask = torch.tensor([[0] * 4 + [1] * 6, [1] * 10])
    out = model.generate(IDX[:, :10], attention_mask=prompt_mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, model.generate(IDX[:, :10], attention_mask=prompt_mask, max_new_tokens=8,
                                           do_sample=False, use_cache=False))
    beams = dict(attention_mask=prompt_mask, max_new_tokens=8, num_beams=3, do_sample=False)  # caches reordered
    assert torch.equal(model.generate(IDX[:, :10], **beams), model.generate(IDX[:, :10], use_cache=False, **beams))
    model.save_pretrained(tmp_path / "swapped")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "swapped").eval()
    assert type(loaded).__name__ == "SattnLlamaForCausalLM" and loaded.config.sattn_attention == spec
    assert torch.equal(loaded(IDX).logits, model(IDX).logits)


@pytest.mark.parametrize("spec", ["bilinear_btt:1", "swa:4", "mlr:8|4|4"])
def test_a_swapped_model_trains_with_transformers_default_cache(spec):
    """In training transformers passes a cache (use_cache=True by default): the loss and gradients
    equal those of use_cache=False, and that cache, which kept nothing, refuses to be continued."""
    model = sattn_hf.swap_attention(_llama("sdpa"), spec).train()
    grads = []
    for use_cache in (False, True):
        model.zero_grad(set_to_none=True)
        out = model(IDX, labels=IDX, use_cache=use_cache)
        out.loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert out.past_key_values is not None
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for grad_enabled in (True, False):
        with torch.set_grad_enabled(grad_enabled), pytest.raises(ValueError, match=r"^cache: expected a cache filled under"):
            model(IDX[:, :2], **{CACHE: out.past_key_values})


@pytest.mark.parametrize("packing", ["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("model", ["sattn_mlr", "swapped"])
def test_packed_sequences_are_each_scored_alone(model, packing):
    """A padding-free batch (``DataCollatorWithFlattening``: sequences packed in one row, no mask,
    position ids that restart, or flash-attention's ``cu_seq_lens_q``) gives each sequence the
    logits and the gradients it has alone, as transformers' own attention does (they attended to
    the sequences before them). Eval with transformers' default cache too; a swapped model's cache
    filled by packed sequences refuses to be continued."""
    m = (_llama(sattn_hf.ATTN_IMPLEMENTATION, [4, 4, 4, 4]) if model == "sattn_mlr"
         else sattn_hf.swap_attention(_llama("sdpa"), "mlr:8|4|4"))
    lengths = [7, 9, 4]
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 64, (1, n), generator=g) for n in lengths]
    weights = [torch.randn(1, n, 64, generator=g) for n in lengths]
    packed = torch.cat(docs, dim=1)
    if packing == "position_ids":
        kwargs = {"position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
    else:
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)}
    m.train()
    m.zero_grad(set_to_none=True)
    logits = m(packed, **kwargs).logits
    (logits * torch.cat(weights, dim=1)).sum().backward()
    packed_grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    alone = [m(doc).logits for doc in docs]
    sum((out * w).sum() for out, w in zip(alone, weights)).backward()
    torch.testing.assert_close(logits, torch.cat(alone, dim=1), atol=1e-5, rtol=0)
    for (name, p), want in zip(m.named_parameters(), packed_grads):
        torch.testing.assert_close(want, p.grad, atol=1e-5, rtol=1e-4, msg=lambda msg, name=name: f"{name}: {msg}")
    m.eval()
    with torch.no_grad():
        out = m(packed, use_cache=True, **kwargs)
        torch.testing.assert_close(out.logits, torch.cat(alone, dim=1), atol=1e-5, rtol=0)
        if model == "swapped":
            with pytest.raises(ValueError, match=r"^cache: expected a cache filled under torch.no_grad\(\) by a batch of "
                                                 r"one sequence per row"):
                m(packed[:, :1], **{CACHE: out.past_key_values})


def test_a_padded_or_packed_training_step_compiles_whole_and_equals_eager(no_dynamo_warnings):
    """torch.compile(fullgraph=True) of a "sattn_mlr" model's training step on padded batches of
    three lengths and on a padding-free packed one: whole graphs (the mask function read the mask
    on the host: a graph break, an error under fullgraph), two for the three lengths (the first,
    then one with the length symbolic; a check's message fixed it: a graph per length), the
    logits and gradients of eager."""
    model = _llama(sattn_hf.ATTN_IMPLEMENTATION, [4, 4, 4, 4], num_hidden_layers=1).train()  # one layer: quicker to trace
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    def padded(length):
        mask = torch.ones(2, length, dtype=torch.long)
        mask[0, :5] = 0
        return IDX[:, :length].clone(), {"attention_mask": mask}

    packed = (IDX[:1].clone(), {"position_ids": torch.cat([torch.arange(8), torch.arange(12)])[None]})
    for batches in ([padded(12), padded(16), padded(20)], [packed]):
        torch._dynamo.reset()
        graphs.clear()
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        for idx, batch in batches:
            results = []
            for forward in (compiled, model):
                model.zero_grad(set_to_none=True)
                out = forward(idx, labels=idx, use_cache=False, **batch)
                out.loss.backward()
                results.append((out.logits.detach(), [p.grad for p in model.parameters()]))
            (logits, grads), (eager_logits, eager_grads) = results
            torch.testing.assert_close(logits, eager_logits, atol=1e-5, rtol=0)
            for a, b in zip(grads, eager_grads):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        assert len(graphs) == min(len(batches), 2)
    torch._dynamo.reset()


def test_forward_and_generation_run_under_inference_mode_as_under_no_grad():
    """Serving code runs models under torch.inference_mode(), whose tensors have no version
    counter: a padded forward and generation give what they give under no_grad (reading the
    mask's version to keep what was read from it raised a RuntimeError), packed documents too."""
    model = _llama(sattn_hf.ATTN_IMPLEMENTATION, [8, 4, 4])
    mask = torch.tensor([[0] * 4 + [1] * 16, [1] * 20])
    positions = {"position_ids": torch.cat([torch.arange(8), torch.arange(12)])[None]}
    results = []
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            results.append((model(IDX, attention_mask=mask).logits, model(IDX[:1], **positions).logits,
                            model.generate(IDX, attention_mask=mask, max_new_tokens=4, do_sample=False)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_bad_swap_is_one_line_at_swap_time():
    with pytest.raises(ValueError, match=r"^sattn_attention='nope:1': ") as err:
        sattn_hf.swap_attention(_llama("sdpa"), "nope:1")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^sattn_attention='mlr:8\|4': ranks"):
        sattn_hf.swap_attention(_llama("sdpa"), "mlr:8|4")


@pytest.mark.skipif(CACHE != "cache", reason="the example calls generate(cache=...), transformers 5.24's name")
def test_the_readme_example_trains_and_generates(tmp_path):
    """examples/hf_llama.py, as the README runs it, for two steps: Trainer, then generation through
    the compressed cache."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "hf_llama.py"
    run = subprocess.run([sys.executable, str(example), "--steps", "2", "--out", str(tmp_path / "out")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    # 123 cached tokens ("def " and 119 of the 120 new), ranks 16|8|8 in blocks 256|128|64, values 32
    # wide; 2 key heads, 2 layers, float32
    floats = 123 * 16 + min(123, 128) * 8 + min(123, 64) * 8 + 123 * 32
    assert run.stdout.splitlines()[-1] == f"MLR cache: {floats * 4 * 2 * 2:,} bytes for 123 tokens"


def test_a_configured_model_saved_loads_with_mlr_attention_by_itself(tmp_path):
    """configure() records the implementation in config.json: from_pretrained(path) with no
    attn_implementation scores with MLR attention (it loaded as "sdpa": other logits, no warning)."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    sattn_hf.configure(config, [8, 4, 4])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=sattn_hf.ATTN_IMPLEMENTATION).eval()
    model.save_pretrained(tmp_path / "model")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    assert loaded.config._attn_implementation == sattn_hf.ATTN_IMPLEMENTATION
    torch.testing.assert_close(loaded(IDX).logits, model(IDX).logits, atol=0, rtol=0)
    loaded.save_pretrained(tmp_path / "again")  # a loaded model that has run saves it again
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    torch.testing.assert_close(again(IDX).logits, model(IDX).logits, atol=0, rtol=0)


def _level_scores(model, ranks, i: int, j: int) -> torch.Tensor:
    """Each level's score q_i . k_j of head 0, through the model's own rotary embedding and the
    level order the forward uses."""
    seen = []
    forward = sattn_hf.mlr_attention_forward
    transformers.AttentionInterface.register(sattn_hf.ATTN_IMPLEMENTATION,
                                             lambda module, q, k, *a, **kw: seen.append((q, k)) or forward(module, q, k, *a, **kw))
    try:
        with torch.no_grad():
            model(torch.tensor([[5, 9]]), position_ids=torch.tensor([[j, i]]))
    finally:
        sattn_hf.register()
    q, k = seen[0]
    order = sattn_hf._score_order(model.config, q.shape[-1])
    order = list(range(q.shape[-1])) if order is None else list(order)
    return torch.stack([(a * b).sum() for a, b in zip(q[0, 0, 1, order].split(ranks), k[0, 0, 0, order].split(ranks))])


def test_levels_hold_whole_rotary_pairs_of_neighbouring_dimensions_and_partial_rotary_takes_one_level():
    """Cohere rotates dimensions 2i and 2i + 1 together: its levels are consecutive dimensions, and
    each level's score depends on the relative position alone (with Llama's order it did not).
    Phi's rotary covers half of each head: several levels are refused in one line."""
    ranks = [8, 4, 4]
    config = transformers.CohereConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=4, max_position_embeddings=64)
    sattn_hf.configure(config, ranks)
    torch.manual_seed(0)
    model = transformers.CohereForCausalLM._from_config(config, attn_implementation=sattn_hf.ATTN_IMPLEMENTATION).eval()
    torch.testing.assert_close(_level_scores(model, ranks, 3, 1), _level_scores(model, ranks, 40, 38), atol=1e-5, rtol=0)
    phi = transformers.PhiConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
                                 partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match=r"^sattn_ranks: expected one level for a model whose rotary embedding covers "
                                         r"part of each head \(partial_rotary_factor=0.5\)"):
        sattn_hf.configure(phi, ranks)
    assert sattn_hf.configure(phi, [16]).sattn_ranks == [16]


def test_the_compressed_cache_is_refused_where_its_dropped_levels_would_be_read():
    """MLRCache hands back keys with the dropped levels zeroed: an "sdpa" model read them as they
    were (other logits, no error), a swapped model's layers crashed inside it (IndexError)."""
    sdpa = _llama("sdpa", [8, 4, 4])
    with pytest.raises(ValueError, match=r"^cache: expected MLRCache only for a model running "
                                         r"attn_implementation='sattn_mlr'.*got \"a config with attn_implementation='sdpa'\""):
        sattn_hf.MLRCache(sdpa.config)
    swapped = sattn_hf.swap_attention(_llama("sdpa", [8, 4, 4]), "swa:4")
    with pytest.raises(ValueError, match=r"^cache: expected transformers' own cache for a model changed by swap_attention"):
        sattn_hf.MLRCache(swapped.config)


def test_a_swap_takes_the_models_dtype_and_rotary_base_and_refuses_what_it_cannot_keep():
    """A bfloat16 model's swapped layers are bfloat16 (they stayed float32 and the forward failed);
    the rotary base is transformers 5's rope_parameters["rope_theta"] (10000 was used); a scaled
    rotary embedding, and a family whose swapped model could not be loaded, are refused in one line."""
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    model = sattn_hf.swap_attention(transformers.Qwen2ForCausalLM(config).to(torch.bfloat16), "swa:4")
    layer = model.model.layers[0].self_attn
    assert layer._settings["rotary_base"] == 1e6 and {p.dtype for p in layer.parameters()} == {torch.bfloat16}
    assert model(IDX).logits.dtype == torch.bfloat16
    scaled = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, vocab_size=64,
                                      intermediate_size=128, max_position_embeddings=64,
                                      rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match=r"^rope_parameters: expected rope_type 'default'"):
        sattn_hf.swap_attention(transformers.LlamaForCausalLM(scaled), "swa:4")
    gemma = transformers.GemmaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"^model: expected a causal LM of a family .* got 'GemmaForCausalLM'"):
        sattn_hf.swap_attention(transformers.GemmaForCausalLM(gemma), "swa:4")
    with pytest.raises(ValueError):  # nothing was registered for it
        transformers.AutoConfig.for_model("sattn_gemma")


def test_inputs_past_the_context_and_configs_without_a_head_are_one_line():
    model = _llama(sattn_hf.ATTN_IMPLEMENTATION, [8, 4, 4])
    long = torch.randint(0, 64, (1, 80))
    with pytest.raises(ValueError, match=r"^input length: expected at most 64 tokens with sattn_mlr \(the coarsest MLR "
                                         r"block: max_position_embeddings"):
        model(long)
    with pytest.raises(ValueError, match=r"^input length: expected at most 64"):  # generation past it too
        model.generate(long[:, :60], max_new_tokens=8, do_sample=False)
    right = torch.tensor([[1] * 6 + [0] * 3, [1] * 9])  # generation appends after the padding: a gap
    with pytest.raises(ValueError, match=r"^attention_mask: .*generation appends to each row's end, so its prompts "
                                         r"are left-padded\), got a gap in row 0"):
        model.generate(IDX[:, :9], attention_mask=right, max_new_tokens=3, do_sample=False)
    with pytest.raises(ValueError, match=r"^config: expected a decoder's config with num_attention_heads"):
        sattn_hf.configure(transformers.LlavaConfig(), [8, 8])
    np = pytest.importorskip("numpy")
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=100)
    assert sattn_hf.configure(config, np.array([8, 4, 4])).sattn_ranks == [8, 4, 4]
    with pytest.raises(ValueError, match=r"^sattn_block_sizes: expected .*max_position_embeddings=100") as err:
        sattn_hf.configure(config, [4, 4, 4, 4])
    assert "block_sizes: block_sizes" not in str(err.value)
