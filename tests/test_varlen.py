"""Variable-length batches: padding masks, packed documents and ragged generation, for every
attention kind, against the same sequences run alone."""

from __future__ import annotations

import pytest
import torch

from structured_attention.attention import build_attention
from structured_attention.functional import sliding_window_attention
from structured_attention.models import GPT, GPTConfig, TransformerConfig
from structured_attention.models.regression import RegressionTransformer
from structured_attention.ops.mlr import mlr_decode, mlr_decode_reference, mlr_prefill_reference
from structured_attention.ops.mlr import cpu as mlr_cpu

# (spec, positions) pairs: every kind, with rotary where the kind takes it and a layer whose MLR
# blocks are small enough for sequences to cross several of them.
KINDS = [
    ("mha", "learned"),
    ("mha:n_kv_heads=1", "rotary"),
    ("swa:3", "rotary"),
    ("global_swa:window=2", "learned"),
    ("global_swa:8|8:window=3", "rotary"),
    ("mlr:8|4|4", "learned"),
    ("mlr:8|4|4:block_sizes=32|4|2", "rotary"),
    ("mlr:8|4|4:block_sizes=32|8|2:depth_normalize=true", "rotary"),
    ("bilinear_btt:1", "learned"),
    ("bilinear_mlr:4|2", "learned"),
]
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
# On a GPU machine the models run there: the Triton kernels, FlexAttention's band and SDPA's CUDA
# kernels then meet the same checks as the CPU paths do elsewhere.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gpt(spec: str, positions: str, dtype: torch.dtype, max_seq_len: int = 32) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(n_layers=2, d_model=32, n_heads=2, max_seq_len=max_seq_len, attention=spec,
                       positions=positions, vocab_size=40)
    return GPT(config).to(DEVICE, dtype).eval()


def _padding_mask(lengths: list[int], total: int, side: str) -> torch.Tensor:
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, total - n:] = 1 if side == "left" else 0
        mask[row, :n] = 1 if side == "right" else mask[row, :n]
    return mask.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("spec,positions", KINDS)
def test_padded_batch_equals_each_sequence_alone(spec: str, positions: str, side: str, dtype: torch.dtype) -> None:
    model = _gpt(spec, positions, dtype)
    lengths, total = [5, 13, 20], 20
    idx = torch.randint(0, 40, (3, total), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = _padding_mask(lengths, total, side)
    tokens = model.tok_emb(idx).detach().requires_grad_(True)
    features = model.backbone(tokens, attention_mask=mask)
    assert torch.isfinite(features).all()
    real = mask.bool()
    assert features[~real].abs().max() == 0  # padding: zero features
    for row in range(3):
        alone = model.backbone(tokens[row : row + 1, real[row]].detach())
        torch.testing.assert_close(features[row, real[row]], alone[0], atol=TOL[dtype], rtol=0)
    # Padding sends no gradient: a loss over every output, padding included, leaves the padding
    # inputs without gradient, and the weights' gradient equals that of the real tokens alone.
    weights = torch.randn_like(features)
    (features * weights).sum().backward()
    assert torch.isfinite(tokens.grad).all() and tokens.grad[~real].abs().max() == 0


@pytest.mark.parametrize("spec,positions", KINDS)
def test_packed_documents_equal_each_document_alone(spec: str, positions: str) -> None:
    model = _gpt(spec, positions, torch.float64)
    ids = torch.tensor([[0] * 7 + [1] * 3 + [2] * 14, [5] * 24], device=DEVICE)
    idx = torch.randint(0, 40, (2, 24), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    logits, _ = model(idx, document_ids=ids)
    for row in range(2):
        for doc in ids[row].unique():
            sel = ids[row] == doc
            alone, _ = model(idx[row : row + 1, sel])
            torch.testing.assert_close(logits[row, sel], alone[0], atol=1e-10, rtol=0)


@pytest.mark.parametrize("spec,positions", KINDS)
def test_attention_layer_takes_masks_and_documents(spec: str, positions: str) -> None:
    """The layer alone (no model around it): a right-padded row and a row of two documents."""
    kind_spec = spec.split(":")
    torch.manual_seed(0)
    layer = build_attention(spec, d_model=32, n_heads=2, max_seq_len=32, rotary=positions == "rotary")
    layer = layer.to(DEVICE, torch.float64)
    x = torch.randn(2, 12, 32, dtype=torch.float64, device=DEVICE)
    mask = torch.tensor([[1] * 9 + [0] * 3, [1] * 12], device=DEVICE)
    ids = torch.tensor([[0] * 12, [0] * 4 + [1] * 8], device=DEVICE)
    out = layer(x, attention_mask=mask, document_ids=ids)
    assert out[0, 9:].abs().max() == 0, kind_spec
    torch.testing.assert_close(out[0, :9], layer(x[:1, :9])[0], atol=1e-10, rtol=0)
    torch.testing.assert_close(out[1, :4], layer(x[1:, :4])[0], atol=1e-10, rtol=0)
    torch.testing.assert_close(out[1, 4:], layer(x[1:, 4:])[0], atol=1e-10, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("spec,positions", KINDS)
def test_ragged_generation_equals_each_row_alone(spec: str, positions: str, dtype: torch.dtype) -> None:
    model = _gpt(spec, positions, dtype)
    lengths, total, new = [3, 9, 16], 16, 8
    prompts = torch.randint(0, 40, (3, total), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    mask = _padding_mask(lengths, total, "left")
    out = model.generate(prompts, new, temperature=0, attention_mask=mask)
    assert torch.equal(out[:, :total], prompts)
    for row, n in enumerate(lengths):
        alone = model.generate(prompts[row : row + 1, total - n:], new, temperature=0)
        assert torch.equal(out[row, total:], alone[0, n:]), (row, out[row, total:], alone[0, n:])


@pytest.mark.parametrize("spec,positions", KINDS)
def test_left_padded_prompt_prefilled_in_chunks(spec: str, positions: str) -> None:
    """Chunks that are all padding in some rows, a one-token chunk, then decoding: the logits of
    every real token equal those of the whole padded batch at once."""
    model = _gpt(spec, positions, torch.float64, max_seq_len=24)
    idx = torch.randint(0, 40, (3, 22), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    mask = torch.cat([_padding_mask([3, 11, 20], 20, "left"), torch.ones(3, 2, dtype=torch.long, device=DEVICE)], dim=1)
    caches = model.new_caches(3)
    pieces = []
    for lo, hi in [(0, 5), (5, 12), (12, 13), (13, 20), (20, 21), (21, 22)]:
        logits, _ = model(idx[:, lo:hi], caches=caches, attention_mask=mask[:, :hi] if hi <= 20 else None)
        pieces.append(logits)
    whole, _ = model(idx, attention_mask=mask)
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-10, rtol=0)
    assert caches[0].lengths == [5, 13, 22]


def test_loss_ignores_padding_targets() -> None:
    model = _gpt("mlr:8|4|4", "rotary", torch.float64)
    idx = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    targets = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    mask = _padding_mask([4, 10], 10, "left")
    _, loss = model(idx, targets, attention_mask=mask)
    _, short = model(idx[:1, 6:], targets[:1, 6:])
    _, full = model(idx[1:], targets[1:])
    torch.testing.assert_close(loss, (4 * short + 10 * full) / 14, atol=1e-6, rtol=0)  # the loss is float32


def test_regression_model_with_padded_prompts() -> None:
    torch.manual_seed(0)
    model = RegressionTransformer(TransformerConfig(n_layers=2, d_model=32, n_heads=2, max_seq_len=32,
                                                    attention="mlr:8|4|4"), n_dims=3).double()
    xs, ys = torch.randn(2, 8, 3, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
    pred = model(xs, ys, attention_mask=mask)
    torch.testing.assert_close(pred[0, 3:], model(xs[:1, 3:], ys[:1, 3:])[0], atol=1e-10, rtol=0)
    assert pred[0, :3].abs().max() == 0


def test_sliding_window_with_documents_matches_dense() -> None:
    """The tiled band on the CPU, FlexAttention's block mask on a GPU."""
    torch.manual_seed(0)
    dtype, tol = (torch.float64, 1e-12) if DEVICE == "cpu" else (torch.float32, 1e-5)
    q, k, v = (torch.randn(2, 2, 70, 8, dtype=dtype, device=DEVICE) for _ in range(3))
    ids = torch.tensor([[0] * 30 + [1] * 40, [3] * 5 + [4] * 65], device=DEVICE)
    for causal in (True, False):
        out = sliding_window_attention(q, k, v, 6, causal=causal, tile=16, document_ids=ids)
        i = torch.arange(70, device=DEVICE)
        keep = ((i[:, None] - i[None, :]).abs() <= 6) & (ids[:, :, None] == ids[:, None, :])
        if causal:
            keep &= i[:, None] >= i[None, :]
        scores = (q @ k.transpose(-1, -2) / 8**0.5).masked_fill(~keep[:, None], float("-inf"))
        torch.testing.assert_close(out, scores.softmax(-1) @ v, atol=tol, rtol=0)


def _compressed_cache(k: torch.Tensor, offsets: list[int], ranks: tuple[int, ...], sizes: tuple[int, ...]):
    """Level buffers of a left-padded cache after ``end`` slots, as the MLR layer keeps them."""
    end = k.shape[2]
    starts = [0] + [min(o + (end - 1 - o) // s * s for o in offsets) for s in sizes[1:]]
    levels = k.split(ranks, dim=-1)
    keys = [level[:, :, start:] for level, start in zip(levels, starts)]
    rows = torch.tensor([[o + (end - 1 - o) // s * s for s in sizes] for o in offsets])
    return keys, starts, rows


@pytest.mark.parametrize("depth_normalize", [False, True])
def test_decoding_with_row_starts_equals_each_row_alone(depth_normalize: bool) -> None:
    """One decoding step of left-padded rows on every backend here (reference, C++ kernel,
    Triton in its interpreter where it imports) against the rows' own unpadded caches."""
    torch.manual_seed(0)
    ranks, sizes, offsets, end = (4, 2, 2), (64, 8, 4), [0, 5, 13], 30
    q = torch.randn(3, 4, 1, 8, dtype=torch.float64)
    k = torch.randn(3, 2, end, 8, dtype=torch.float64)
    v = torch.randn(3, 2, end, 6, dtype=torch.float64)
    keys, starts, rows = _compressed_cache(k, offsets, ranks, sizes)
    expected = []
    for row, o in enumerate(offsets):
        own_keys, own_starts, _ = _compressed_cache(k[row : row + 1, :, o:], [0], ranks, sizes)
        expected.append(mlr_decode_reference(q[row : row + 1], own_keys, own_starts, v[row : row + 1, :, o:],
                                             ranks, 0.3, depth_normalize))
    expected = torch.cat(expected)
    got = mlr_decode_reference(q, keys, starts, v, ranks, 0.3, depth_normalize, rows)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(mlr_decode(q, keys, starts, v, ranks, 0.3, depth_normalize, rows), expected,
                               atol=1e-12, rtol=0)
    if mlr_cpu.available():
        torch.testing.assert_close(mlr_cpu.mlr_decode_cpu(q.float(), [x.float() for x in keys], starts, v.float(),
                                                          ranks, 0.3, depth_normalize, rows),
                                   expected.float(), atol=1e-5, rtol=0)
    triton_decode = pytest.importorskip("structured_attention.ops.mlr.triton_decode")
    got = triton_decode.mlr_decode_triton(q.float().to(DEVICE), [x.float().to(DEVICE) for x in keys], starts,
                                          v.float().to(DEVICE), ranks, 0.3, depth_normalize, rows.to(DEVICE),
                                          block_n=16)
    torch.testing.assert_close(got.cpu(), expected.float(), atol=1e-5, rtol=0)


def test_prefill_with_row_starts_equals_each_row_alone() -> None:
    torch.manual_seed(0)
    ranks, sizes, offsets, end, t = (4, 2, 2), (64, 8, 4), [0, 5, 13], 30, 7
    q = torch.randn(3, 2, t, 8, dtype=torch.float64)
    k = torch.randn(3, 2, end, 8, dtype=torch.float64)
    v = torch.randn(3, 2, end, 6, dtype=torch.float64)
    first = end - t
    starts = [0] + [min(o + (first - o) // s * s for o in offsets) for s in sizes[1:]]
    keys = [level[:, :, start:] for level, start in zip(k.split(ranks, dim=-1), starts)]
    rows = torch.tensor([[o + (first - o) // s * s for s in sizes] for o in offsets])
    got = mlr_prefill_reference(q, keys, starts, v, ranks, 0.3, False, sizes, rows)
    for row, o in enumerate(offsets):
        own_first = first - o
        own_starts = [0] + [own_first // s * s for s in sizes[1:]]
        own_keys = [level[row : row + 1, :, o + start:] for level, start in zip(k.split(ranks, dim=-1), own_starts)]
        alone = mlr_prefill_reference(q[row : row + 1], own_keys, own_starts, v[row : row + 1, :, o:], ranks, 0.3,
                                      False, sizes)
        torch.testing.assert_close(got[row : row + 1], alone, atol=1e-12, rtol=0)


# -- bad input: one line naming the argument ------------------------------------------------------
def _bad(call, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_bad_masks_and_document_ids() -> None:
    model = _gpt("mlr:8|4|4", "rotary", torch.float32).cpu()
    idx = torch.randint(0, 40, (2, 6))
    ones = torch.ones(2, 6, dtype=torch.long)
    _bad(lambda: model(idx, attention_mask=ones[:, :5]), r"^attention_mask: expected shape \(batch=2, seq_len=6\)")
    _bad(lambda: model(idx, attention_mask=ones.float()), r"^attention_mask: expected a bool or integer tensor")
    _bad(lambda: model(idx, attention_mask=ones * 2), r"^attention_mask: expected 0 or 1")
    _bad(lambda: model(idx, attention_mask=torch.tensor([[0] * 6, [1] * 6])), r"^attention_mask: .*all-padding row 0")
    _bad(lambda: model(idx, attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1], [1] * 6])),
         r"^attention_mask: expected left or right padding .* gap in row 0")
    _bad(lambda: model(idx, document_ids=torch.tensor([[0, 0, 1, 0, 1, 1], [0] * 6])),
         r"^document_ids: expected ids non-decreasing .* row 0 at position 3")
    _bad(lambda: model(idx, document_ids=ones.bool()), r"^document_ids: expected an integer tensor")
    _bad(lambda: model(idx, document_ids=ones[:1]), r"^document_ids: expected shape")
    right = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
    _bad(lambda: model.generate(idx, 2, temperature=0, attention_mask=right),
         r"^attention_mask: expected left padding with a cache")
    _bad(lambda: model.generate(idx, 27, attention_mask=ones), r"^max_new_tokens: expected 0\.\.26")
    _bad(lambda: model(torch.randint(0, 40, (2, 33)), attention_mask=torch.ones(2, 33, dtype=torch.long)),
         r"^seq_len: expected")
    caches = model.new_caches(2)
    model(idx, caches=caches, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6]))
    _bad(lambda: model(idx[:, :1], caches=caches, attention_mask=torch.ones(2, 7, dtype=torch.long)),
         r"^attention_mask: expected the left padding the cache was filled with")
    _bad(lambda: model(idx[:, :1], caches=caches, document_ids=ones[:, :1]), r"^document_ids: expected None with")


def test_bad_row_starts() -> None:
    q, v = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 10, 4)
    keys = [torch.randn(2, 2, 10, 4)]
    _bad(lambda: mlr_decode(q, keys, [0], v, (4,), 0.5, row_starts=torch.tensor([[0], [10]])),
         r"^row_starts: expected slots \[0, 9\]")
    _bad(lambda: mlr_decode(q, keys, [0], v, (4,), 0.5, row_starts=torch.zeros(2, 2, dtype=torch.long)),
         r"^row_starts: expected shape")
    _bad(lambda: mlr_decode(q, keys, [0], v, (4,), 0.5, row_starts=torch.zeros(2, 1)),
         r"^row_starts: expected an int32 or int64 tensor")


def test_a_models_layers_read_the_document_ids_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A training step of a packed batch reads the segments from the ids on the host once, not once
    per layer and pass (each read waits for the device's queued work on a GPU): every MLR call of
    the step, forward and backward, takes the same ids tensor."""
    from structured_attention.ops.mlr import contract

    reads = []
    read = contract._segment_tables
    monkeypatch.setattr(contract, "_segment_tables", lambda ids: reads.append(ids) or read(ids))
    model = _gpt("mlr:8|4|4", "rotary", torch.float32)
    idx = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 3 + [1] * 9], device=DEVICE)
    for step in range(2):
        _, loss = model(idx, idx, document_ids=ids)
        loss.backward()
        assert len(reads) == step + 1  # one read a step (the model's ids are a new tensor each step)


def test_compiled_model_takes_a_padded_batch(no_dynamo_warnings) -> None:
    """torch.compile of a GPT fed a padded or packed batch equals eager, forward and backward. The
    kernels' ops (C++ and Triton) read their segments from the document ids inside, so the graph is
    whole (fullgraph); only the blocked path, where the C++ kernel cannot be built, reads them
    before its calls: a graph break, not an error. Inductor's code on the GPU (the Triton kernels'
    ops in its graph); aot_eager's trace on the CPU, where inductor compiling this GPT's C++ from a
    cold cache (as in CI) took 78 s, and tests/test_compile.py and test_training.py test the C++
    kernel's ops under inductor."""
    model = _gpt("mlr:8|4|4", "rotary", torch.float32)
    idx = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    mask = torch.tensor([[0] * 7 + [1] * 5, [1] * 10 + [0] * 2], device=DEVICE)
    ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 12], device=DEVICE)
    whole = DEVICE == "cuda" or mlr_cpu.available()
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    for batch in (dict(attention_mask=mask), dict(document_ids=ids)):
        torch._dynamo.reset()
        grads = []
        for forward in (torch.compile(model, fullgraph=whole, backend=backend), model):
            model.zero_grad(set_to_none=True)
            logits, loss = forward(idx, idx, **batch)
            loss.backward()
            grads.append((logits.detach(), [p.grad for p in model.parameters()]))
        (compiled, compiled_grads), (eager, eager_grads) = grads
        torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=0)
        for a, b in zip(compiled_grads, eager_grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
