"""Forecasters: RevIN, patching, both families with every attention kind, channel independence."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from structured_attention.models.forecasting import (
    ForecasterConfig,
    PatchForecaster,
    PointForecaster,
    RevIN,
    build_forecaster,
    n_patches,
    patchify,
)

KINDS = ["mha", "swa:8", "mlr:4|2|1|1", "bilinear_mlr:2|2", "bilinear_btt:1"]


def tiny(family: str, attention: str = "mha", **kw) -> ForecasterConfig:
    """A small forecaster; ``kw`` sets its own fields and its encoder's, flat."""
    own = {f.name for f in dataclasses.fields(ForecasterConfig)}
    base = dict(family=family, n_channels=3, lookback=32, horizon=8, patch_len=8, stride=4)
    encoder = dict(n_layers=1, d_model=16, n_heads=2, attention=attention, dropout=0.0)
    encoder.update({k: v for k, v in kw.items() if k not in own})
    backbone = dataclasses.replace(ForecasterConfig().backbone, **encoder)
    return ForecasterConfig(**{**base, **{k: v for k, v in kw.items() if k in own}}, backbone=backbone)


@pytest.mark.parametrize("affine", [True, False])
def test_revin_round_trips_and_normalises_each_channel(affine):
    torch.manual_seed(0)
    x = torch.randn(4, 50, 3) * torch.tensor([1.0, 10.0, 0.1]) + torch.tensor([5.0, -20.0, 0.0])
    revin = RevIN(3, affine=affine)
    if affine:
        with torch.no_grad():
            revin.weight.copy_(torch.tensor([0.5, 2.0, -1.5]))
            revin.bias.copy_(torch.tensor([0.1, -0.3, 2.0]))
    z, stats = revin.normalize(x)
    torch.testing.assert_close(revin.denormalize(z, stats), x, rtol=1e-5, atol=1e-5)
    if not affine:
        torch.testing.assert_close(z.mean(1), torch.zeros(4, 3), atol=1e-5, rtol=0)
        torch.testing.assert_close(z.std(1, unbiased=False), torch.ones(4, 3), atol=1e-3, rtol=0)  # eps in the variance


@pytest.mark.parametrize("length,patch,stride", [(512, 16, 8), (32, 8, 4), (30, 7, 3), (16, 16, 8)])
def test_patchify_matches_a_naive_loop(length, patch, stride):
    x = torch.randn(2, 3, length)
    got = patchify(x, patch, stride)
    padded = [list(row) + [row[-1]] * stride for row in x.reshape(-1, length).tolist()]
    starts = range(0, length + stride - patch + 1, stride)
    want = torch.tensor([[row[s:s + patch] for s in starts] for row in padded]).reshape(2, 3, -1, patch)
    assert got.shape == want.shape and got.shape[2] == n_patches(length, patch, stride)
    torch.testing.assert_close(got, want)
    if (length, patch, stride) == (512, 16, 8):
        assert got.shape[2] == 64  # PatchTST/64


@pytest.mark.parametrize("family", ["point", "patch"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_attention_kind_forecasts_in_both_families(family, kind):
    torch.manual_seed(0)
    config = tiny(family, kind)
    model = build_forecaster(config)
    assert isinstance(model, PointForecaster if family == "point" else PatchForecaster)
    assert model.backbone.config.causal is False and model.backbone.config.max_seq_len == config.n_tokens
    x = torch.randn(5, 32, 3, requires_grad=True)
    y = model(x)
    assert y.shape == (5, 8, 3) and torch.isfinite(y).all()
    y.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert model.training_flops_per_token() > 0 and model.parameter_fans()


def test_point_model_is_bidirectional():
    # a change in the last lookback step moves the encoder features of the first token
    torch.manual_seed(0)
    model = build_forecaster(tiny("point", "mlr:4|2|1|1", revin=False)).eval()
    x = torch.randn(1, 32, 3)
    x2 = x.clone()
    x2[0, -1] += 1.0
    h1 = model.backbone(model.embed(x))
    h2 = model.backbone(model.embed(x2))
    assert not torch.allclose(h1[0, 0], h2[0, 0])


@pytest.mark.parametrize("kind", ["mha", "mlr:4|2|1|1"])
def test_patch_model_is_channel_independent(kind):
    torch.manual_seed(0)
    model = build_forecaster(tiny("patch", kind, dropout=0.1, head_dropout=0.1)).eval()
    with torch.no_grad():
        model.revin.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 32, 3)
    x2 = x.clone()
    x2[:, :, 1] = torch.randn(2, 32) * 5 + 3  # another history for channel 1 only
    y, y2 = model(x), model(x2)
    torch.testing.assert_close(y[:, :, [0, 2]], y2[:, :, [0, 2]], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(y[:, :, 1], y2[:, :, 1])
    # and a channel forecast on its own equals the same channel inside the batch
    solo = build_forecaster(tiny("patch", kind, n_channels=1, dropout=0.1, head_dropout=0.1)).eval()
    state = {k: (v[2:3] if k.startswith("revin.") else v) for k, v in model.state_dict().items()}
    solo.load_state_dict(state)
    torch.testing.assert_close(solo(x[:, :, 2:3]), y[:, :, 2:3], rtol=1e-5, atol=1e-6)


def test_config_validation_is_one_line():
    with pytest.raises(ValueError, match="model.family: expected 'point' or 'patch'"):
        tiny("hourly")
    with pytest.raises(ValueError, match="model.patch_len: expected at most the lookback 32"):
        tiny("patch", patch_len=64)
    with pytest.raises(ValueError, match="model.head_dropout"):
        tiny("patch", head_dropout=1.0)
    with pytest.raises(ValueError, match="model.skip_trainable: expected true unless model.linear_skip is true"):
        tiny("patch", skip_trainable=False)


@pytest.mark.parametrize("final_norm", [False, True])
def test_without_final_norm_the_residual_stream_reaches_the_head(final_norm):
    # With every residual branch silenced the encoder is the identity (plus positions), so the
    # patch model is the linear forecaster embed -> head; a final LayerNorm would break that.
    torch.manual_seed(0)
    model = build_forecaster(tiny("patch", "mlr:4|2|1|1", final_norm=final_norm)).eval()
    with torch.no_grad():
        for block in model.backbone.blocks:
            block.attn.out_proj.weight.zero_()
            block.mlp.down.weight.zero_()
    h = torch.randn(2, model.config.n_tokens, 16)
    want = h + model.backbone.pos_emb.weight
    if final_norm:
        want = torch.nn.functional.layer_norm(want, (16,), model.backbone.ln_f.weight, model.backbone.ln_f.bias)
    torch.testing.assert_close(model.backbone(h), want)


def test_linear_skip_starts_as_revin_plus_a_linear_map_over_time():
    torch.manual_seed(0)
    config = tiny("patch", "mlr:4|2|1|1", linear_skip=True, revin_affine=False)
    model = build_forecaster(config).eval()
    x = torch.randn(3, 32, 3) * 4 + 1
    mean = x.mean(1, keepdim=True)
    std = torch.sqrt(x.var(1, keepdim=True, unbiased=False) + 1e-5)
    z = ((x - mean) / std).transpose(1, 2)  # (B, C, L)
    want = (z @ model.skip.weight.T + model.skip.bias).transpose(1, 2) * std + mean
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="model.linear_skip: expected false for the point family"):
        tiny("point", linear_skip=True)


def test_linear_skip_keeps_channel_independence():
    torch.manual_seed(0)
    model = build_forecaster(tiny("patch", "mha", linear_skip=True))
    torch.nn.init.normal_(model.head.weight, std=0.02)  # trained, not at its zero start
    model.eval()
    x = torch.randn(2, 32, 3)
    x2 = x.clone()
    x2[:, :, 0] += torch.randn(2, 32)
    torch.testing.assert_close(model(x)[:, :, 1:], model(x2)[:, :, 1:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm", ["layer", "batch"])
def test_post_norm_blocks_normalise_after_each_residual_sum(norm):
    """PatchTST's encoder block: ``x = N(x + attn(x)); x = N(x + mlp(x))``, with BatchNorm over
    batch and positions (batch statistics in training, running ones in evaluation)."""
    torch.manual_seed(0)
    model = build_forecaster(tiny("patch", "mlr:4|2|1|1", norm=norm, prenorm=False, bias=True))
    block = model.backbone.blocks[0]
    x = torch.randn(4, 8, 16)

    def normalise(h, module):
        if norm == "layer":
            return F.layer_norm(h, (16,), module.weight, module.bias)
        if module.training:
            mean, var = h.mean((0, 1)), h.var((0, 1), unbiased=False)
        else:
            mean, var = module.running_mean, module.running_var
        return (h - mean) / torch.sqrt(var + module.eps) * module.weight + module.bias

    for training in (True, False):
        block.train(training)
        with torch.no_grad():
            for m in (block.ln_attn, block.ln_mlp):
                if norm == "batch":  # non-trivial running statistics and affine maps
                    m.running_mean.uniform_(-1, 1), m.running_var.uniform_(0.5, 2)
                m.weight.uniform_(0.5, 2), m.bias.uniform_(-1, 1)
            h = normalise(x + block.attn(x), block.ln_attn)
            want = normalise(h + block.mlp(h), block.ln_mlp)
            torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-5)
    assert block.attn.q_proj.bias is not None and block.mlp.up.bias is not None  # model.bias=true


def test_batch_norm_needs_a_bidirectional_model_and_names_the_parameter():
    from structured_attention.models.transformer import TransformerConfig

    with pytest.raises(ValueError, match="norm"):
        TransformerConfig(norm="batch", causal=True)
    from structured_attention.experiments.forecasting import load_ts_config

    with pytest.raises(ValueError, match="^model.norm: expected 'layer' or 'batch', got 'group'$"):
        load_ts_config(None, ["model.norm=group"])  # a key of the encoder, set flat


@pytest.mark.parametrize("kind", ["mha", "mlr:4|2|1|1"])
def test_attention_dropout_is_set_apart_from_the_residual_dropout(kind):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    for attn_dropout, deterministic in ((0.0, True), (None, False)):  # None: model.dropout
        attn = build_forecaster(tiny("patch", kind, dropout=0.5, attn_dropout=attn_dropout)).backbone.blocks[0].attn
        attn.train()
        assert torch.equal(attn(x), attn(x)) is deterministic
    with pytest.raises(ValueError, match="model.attn_dropout"):
        tiny("patch", attn_dropout=1.5)
