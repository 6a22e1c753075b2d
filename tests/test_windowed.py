"""Sliding-window attention (tiled CPU path and the FlexAttention path) against a dense band mask."""

from __future__ import annotations

import warnings

import pytest
import torch

from structured_attention.functional import sliding_window_attention
from structured_attention.functional.windowed import _flex_window, _tiled_window


def dense_band(q, k, v, window, causal, scale):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    t = q.shape[2]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    keep = ((i - j).abs() <= window) & ((j <= i) if causal else True)
    s = (q @ k.transpose(-1, -2)) * scale
    return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("t, window, tile", [(1, 3, 4), (17, 3, 4), (40, 0, 8), (64, 5, 16), (50, 100, 16), (33, 7, 64)])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_tiled_matches_dense(causal, t, window, tile, kv_heads):
    torch.manual_seed(t)
    q = torch.randn(2, 4, t, 8, dtype=torch.float64)
    k = torch.randn(2, kv_heads, t, 8, dtype=torch.float64)
    v = torch.randn(2, kv_heads, t, 6, dtype=torch.float64)
    out = sliding_window_attention(q, k, v, window, causal=causal, scale=0.3, tile=tile)
    torch.testing.assert_close(out, dense_band(q, k, v, window, causal, 0.3), rtol=1e-10, atol=1e-10)


def test_tiled_gradients_match_dense():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 21, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda a, b, c: _tiled_window(a, b, c, 3, True, 0.5, 0.0, 8), (q, k, v))


def test_tiled_memory_is_banded():
    # The tiles hold T * (tile + window) scores, not T * T: check the shape SDPA receives.
    seen = {}
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen["scores"] = q.shape[:-1].numel() * k.shape[-2]
        return real(q, k, v, **kw)

    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        q = torch.randn(1, 1, 4096, 8)
        sliding_window_attention(q, q, q, 32, tile=64)
    finally:
        torch.nn.functional.scaled_dot_product_attention = real
    assert seen["scores"] == 4096 * (64 + 32)


@pytest.mark.parametrize("causal", [True, False])
def test_flex_path_matches_dense(causal):
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 256, 16), torch.randn(1, 2, 256, 16), torch.randn(1, 2, 256, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _flex_window(q, k, v, 20, causal, 0.25)
    torch.testing.assert_close(out, dense_band(q, k, v, 20, causal, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_flex_path_with_documents_matches_dense(causal):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 256, 16), torch.randn(2, 2, 256, 16), torch.randn(2, 2, 256, 16)
    ids = torch.tensor([[0] * 100 + [1] * 156, [0] * 7 + [2] * 249])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _flex_window(q, k, v, 20, causal, 0.25, ids)
    i = torch.arange(256)
    keep = ((i[:, None] - i[None, :]).abs() <= 20) & (ids[:, :, None] == ids[:, None, :])
    if causal:
        keep &= i[:, None] >= i[None, :]
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.25).masked_fill(~keep[:, None], float("-inf"))
    torch.testing.assert_close(out, scores.softmax(-1) @ v.repeat_interleave(2, dim=1), rtol=1e-5, atol=1e-5)


def test_bad_window_names_the_parameter():
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(ValueError, match="window"):
        sliding_window_attention(q, q, q, -1)


_Q, _K, _V = torch.randn(2, 4, 10, 6), torch.randn(2, 2, 10, 6), torch.randn(2, 2, 10, 3)


@pytest.mark.parametrize("call, message", [
    # accepted before, with a result: one value head for two key heads, a string as causal (run
    # causal), a negative scale, float document ids (truncated)
    (lambda: sliding_window_attention(_Q, _K, _V[:, :1], 3), "^v: expected shape"),
    (lambda: sliding_window_attention(_Q, _K, _V, 3, causal="no"), "^causal: expected a bool"),
    (lambda: sliding_window_attention(_Q, _K, _V, 3, scale=-1.0), "^scale: expected a finite positive number"),
    (lambda: sliding_window_attention(_Q, _K, _V, 3, document_ids=torch.rand(2, 10)),
     "^document_ids: expected an integer tensor"),
    # errors from deep inside: a reshape, a batched product, a division by zero, a bool subtraction
    (lambda: sliding_window_attention(_Q, _K[:1], _V[:1], 3), "^k: expected shape"),
    (lambda: sliding_window_attention(_Q, _K[..., :4], _V, 3), "^k: expected shape"),
    (lambda: sliding_window_attention(_Q[:, :, :0], _K[:, :, :0], _V[:, :, :0], 3), "^q: expected a non-empty"),
    (lambda: sliding_window_attention(_Q, _K, _V, True), "^window: expected a non-negative integer"),
    (lambda: sliding_window_attention(_Q.long(), _K.long(), _V.long(), 3), "^q.dtype: expected a floating-point"),
    (lambda: sliding_window_attention(_Q, _K, _V, 3, dropout_p=1.0), "^dropout_p: expected a probability"),
])
def test_bad_arguments_are_one_line_naming_the_parameter(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("documents", [False, True])
def test_flex_path_compiles_whole_without_a_warning(documents, no_dynamo_warnings):
    # On CUDA the layers take the FlexAttention band, which a compiled model traces; its block mask
    # is made once per length eagerly, and traced under torch.compile (no warning to the user).
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 2, 128, 16), torch.randn(1, 2, 128, 16), torch.randn(1, 2, 128, 16)
    ids = torch.tensor([[0] * 50 + [1] * 78]) if documents else None
    compiled = torch.compile(_flex_window, fullgraph=True, backend="eager")
    with torch.no_grad():
        out = compiled(q, k, v, 20, True, 0.25, ids)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager FlexAttention's own notice that it is not compiled
            torch.testing.assert_close(out, _flex_window(q, k, v, 20, True, 0.25, ids), rtol=1e-5, atol=1e-5)
