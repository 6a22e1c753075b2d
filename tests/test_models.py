"""The GPT decoder: loss, cached generation against recomputation, FLOPs and muP fans."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from structured_attention.models import GPT, GPTConfig

KINDS = ["mha", "swa:6", "global_swa:4|4:window=5", "mlr:4|2|2:block_sizes=32|8|2", "bilinear_btt:1", "bilinear_mlr:4|2", "mha,swa:4"]


def tiny(attention: str = "mha", **kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=40, n_layers=2, d_model=32, n_heads=4, max_seq_len=32, attention=attention)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg)).eval()


def test_loss_is_the_mean_cross_entropy():
    model = tiny()
    idx = torch.randint(0, 40, (3, 20))
    tgt = torch.randint(0, 40, (3, 20))
    logits, loss = model(idx, tgt)
    assert logits.shape == (3, 20, 40)
    expect = -torch.log_softmax(logits, -1).gather(-1, tgt[..., None]).mean()
    torch.testing.assert_close(loss, expect)


@pytest.mark.parametrize("attention", KINDS)
@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_greedy_generation_with_cache_matches_recomputation(attention, positions):
    if positions == "rotary" and attention.startswith("bilinear"):
        pytest.skip("bilinear kinds take learned positions only")
    model = tiny(attention, positions=positions)
    prompt = torch.randint(0, 40, (2, 5))
    fast = model.generate(prompt, 20, temperature=0)
    slow = prompt
    for _ in range(20):  # no cache: the full sequence every step
        logits, _ = model(slow)
        slow = torch.cat([slow, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(fast, slow)


def test_sampling_streams_every_token_and_respects_top_k():
    model = tiny()
    seen = []
    out = model.generate(torch.zeros(1, 1, dtype=torch.long), 10, temperature=1.0, top_k=1, on_token=seen.append)
    assert torch.equal(torch.stack(seen, 1), out[:, 1:])
    assert torch.equal(out, model.generate(torch.zeros(1, 1, dtype=torch.long), 10, temperature=0))  # top-1 is greedy


def test_forward_flops_count_every_matmul_of_an_mha_model():
    model = tiny("mha", tie_embeddings=False)
    d, t, v, layers = 32, 32, 40, 2
    pairs = t * (t + 1) // 2
    attention = 4 * d * d * t + 2 * d * pairs  # q, k, v, out projections; scores and mixing (H * hd = d)
    mlp = 2 * d * 4 * d * t
    assert model.forward_flops_per_token(t) == (layers * (attention + mlp) + d * v * t) / t
    assert model.training_flops_per_token(t) == 6 * model.forward_flops_per_token(t)
    assert tiny("mlr:4|2|1|1").forward_flops_per_token(t) < model.forward_flops_per_token(t)


def test_parameter_fans_cover_every_matrix():
    model = tiny("bilinear_btt:1,mlr:4|4")
    fans = model.parameter_fans()
    matrices = {n for n, p in model.named_parameters() if p.dim() >= 2}
    assert matrices <= set(fans)
    assert fans["backbone.blocks.0.attn.out_proj.weight"].fan_in == 32
    assert "backbone.blocks.0.attn.key_map.R" in fans  # a structured matrix declares its own fans


def test_structured_factors_start_at_the_dense_weights_std():
    from structured_attention.matrices import BTT, BlockDiag

    model = tiny("bilinear_btt:1,bilinear_mlr:4|2", d_model=64, n_heads=2)
    structured = [m for m in model.modules() if isinstance(m, (BTT, BlockDiag))]
    assert len(structured) == 1 + 4  # the BTT key map; two query and two key maps per MLR level
    for m in structured:
        for p in m.parameters():
            assert abs(p.std().item() - 0.02) < 0.1 * 0.02
    own = BTT(64, 2 * 64)  # the matrix's own variance-preserving init: N(0, 1/fan_in) per factor
    kept = tiny("bilinear_btt:1", d_model=64, n_heads=2, structured_std=None).backbone.blocks[0].attn.key_map
    for name, fan in own.parameter_fans().items():
        assert abs(kept.get_parameter(name).std().item() - fan.fan_in**-0.5) < 0.1 * fan.fan_in**-0.5


def test_tied_embeddings_share_storage():
    model = tiny()
    assert model.head.weight is model.tok_emb.weight
    assert tiny(tie_embeddings=False).head.weight is not tiny(tie_embeddings=False).tok_emb.weight


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(positions="sinusoid"), "positions"),
        (dict(attention="mha,nope"), "kind"),
        (dict(n_heads=5), "n_heads"),
        (dict(attention="bilinear_btt:1", positions="rotary"), "rotary"),
        (dict(structured_std=0.0), "structured_std"),
    ],
)
def test_bad_config_names_the_parameter(kw, param):
    with pytest.raises(ValueError, match=param):
        tiny(**kw)


def test_too_long_inputs_name_the_parameter():
    model = tiny()
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(torch.zeros(1, 30, dtype=torch.long), 5)


@pytest.mark.parametrize("kind", ["mha", "mlr:8|4|4", "swa:4", "bilinear_btt:1"])
def test_cache_misuse_is_one_line_naming_the_cache(kind):
    model = GPT(GPTConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, attention=kind)).eval()
    other = GPT(GPTConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, attention="mlr:8|8")).eval()
    idx = torch.randint(0, 40, (2, 4))
    cases = [
        (lambda: model(idx[:1], caches=model.new_caches(2)), r"^cache: expected a batch of 2 rows .*, got 1$"),
        (lambda: model(idx, caches=model.new_caches(2)[:1]), r"^caches: expected a list of 2 caches .*, got 1$"),
        (lambda: model(idx, caches=[]), r"^caches: expected a list of 2 caches"),
        (lambda: model(idx, caches=5), r"^caches: expected a list of 2 caches .*, got 'int'$"),
        (lambda: model(idx, caches=other.new_caches(2)), r"^cache: expected the cache this layer's new_cache\(\) made"),
        (lambda: model.blocks[0].attn(torch.randn(2, 4, 32), cache={"k": 1}), r"^cache: expected a KVCache"),
    ]
    for call, match in cases:
        with torch.no_grad(), pytest.raises(ValueError, match=match) as err:
            call()
        assert "\n" not in str(err.value)


def test_checking_the_config_draws_what_building_its_small_layers_draws():
    """A seeded run's stream includes the config check's draws (experiments rebuild the config
    after seeding), so the check builds small layers on the CPU as it always did: the generator
    ends where building each distinct layer by hand leaves it. A huge layer draws nothing."""
    from structured_attention.attention import build_attention
    from structured_attention.models import TransformerConfig

    config = TransformerConfig(d_model=32, n_heads=2, n_layers=4, attention="mha,mlr:8|4|4")
    torch.manual_seed(0)
    config.check_attention()
    after_check = torch.get_rng_state()
    torch.manual_seed(0)
    for attention in config.attention_configs()[:2]:
        build_attention(attention)
    assert torch.equal(after_check, torch.get_rng_state())
    torch.manual_seed(0)
    TransformerConfig(d_model=8192, n_heads=8, attention="mha").check_attention()  # 2^26 parameters: meta only
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(0).get_state())


@pytest.mark.parametrize("attention", [*KINDS, "mlr:4|4:n_kv_heads=2:level_scale=learned:qk_norm=true"])
def test_every_kind_trains_and_decodes_inside_bfloat16_autocast(attention):
    """Inside ``torch.autocast`` (what training does on CUDA by default) every kind runs: the loss
    and gradients are the float32 ones to bfloat16's precision, and a decoding step with either
    cache gives the logits of the whole sequence run again under autocast."""
    model, idx = tiny(attention).train(), torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    _, loss = model(idx, idx)
    loss.backward()
    exact = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, low = model(idx, idx)
    low.backward()
    assert abs(low.item() - loss.item()) < 0.02 * loss.item()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == exact.keys()
    flat, flat_exact = (torch.cat([g[name].flatten() for name in exact]) for g in (grads, exact))
    assert (flat - flat_exact).norm() <= 0.05 * flat_exact.norm()
    model.eval()
    for static in (False, True):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            whole = model(idx)[0].float()
            caches = model.new_caches(2, static=static)
            steps = [model(idx[:, :8], caches=caches)[0][:, -1]]
            steps += [model(idx[:, t:t + 1], caches=caches)[0][:, -1] for t in range(8, 12)]
        torch.testing.assert_close(torch.stack(steps, 1).float(), whole[:, 7:], atol=0.05, rtol=0.05)


def _synchronisations(model: GPT, idx: torch.Tensor) -> list[str]:
    """Where the synchronising CUDA calls of one forward+backward of ``model`` are made (after a
    first one that makes plans and tables), from torch.cuda.set_sync_debug_mode("warn")'s warnings."""
    import warnings

    model(idx[:, :-1], idx[:, 1:])[1].backward()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(idx[:, :-1], idx[:, 1:])[1].backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a host synchronisation is a CUDA device's")
@pytest.mark.parametrize("attention", ["mlr:8|8|8|8|8|8|8|8", "mlr:16|16|16|16", "mlr:32|16|8|8"])
def test_an_mlr_training_step_waits_for_the_gpu_no_more_than_an_mha_one(attention):
    """A GPT's forward and backward (sattn bench lm's model, smaller) with MLR attention makes no
    more synchronising CUDA calls than the same GPT with MHA (whose embedding's backward may make
    one): the layers' own work, the attention kernels, the per-level scales and the heads, queue
    on the GPU without waiting for it."""
    counts = {}
    for kind in ("mha", attention):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, n_layers=2, d_model=256, n_heads=4, max_seq_len=1024,
                              attention=kind)).to(device="cuda", dtype=torch.bfloat16)
        idx = torch.randint(0, 256, (2, 1025), device="cuda")
        counts[kind] = _synchronisations(model, idx)
    assert len(counts[attention]) <= len(counts["mha"]), counts


@pytest.mark.parametrize("attention", ["mha", "mlr:4|2|2:block_sizes=32|8|2"])
def test_a_compiled_step_inside_autocast_generates_what_the_eager_one_does(attention):
    """A compiled graph runs its custom ops outside autocast: the static caches' reads compute in
    the cache's dtype either way, so compiled and eager steps give the same tokens."""
    model, idx = tiny(attention), torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        eager = model.generate(idx, 10, temperature=0, attention_mask=mask, cache="static")
        compiled = model.generate(idx, 10, temperature=0, attention_mask=mask, cache="static", compile="aot_eager")
    assert torch.equal(compiled, eager)
