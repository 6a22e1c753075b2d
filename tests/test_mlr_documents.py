"""Packed documents (``document_ids``) for MLR attention: each document scored exactly as if it ran
alone as its own sequence, with the call's block sizes (docs/design.md, "MLR attention").

Every check compares against per-document runs of the plain reference (no ``document_ids``).
"""

from __future__ import annotations

import pytest
import torch

from structured_attention.ops.mlr import cpu as mlr_cpu
from structured_attention.ops.mlr.contract import mlr_block_sizes
from structured_attention.ops.mlr.dispatch import mlr_attention
from structured_attention.ops.mlr.reference import mlr_attention_reference

# (ranks, block_sizes, H, Hk, per-row document lengths); T is the sum of a row's lengths.
CASES = {
    # default sizes (16, 8): lengths 1, a non-power-of-two, a document starting at 5 that crosses
    # the global block boundary at 8, a document of exactly one block, a whole-row document.
    "two-levels": ((2, 2), None, 2, 2, [[1, 5, 10], [5, 8, 3], [8, 8], [16]]),
    # uneven ranks, four levels (16, 8, 4, 2), GQA.
    "uneven-gqa": ((4, 2, 1, 1), None, 4, 2, [[3, 13], [1, 1, 1, 6, 7], [16]]),
    # custom sizes with s_1 > T and partial finest blocks.
    "custom-sizes": ((2, 3, 1), (16, 8, 4), 2, 1, [[12], [3, 7, 2], [1, 1, 10], [5, 7]]),
    # every fine block a multiple of 16 (the Triton prefix-rank kernels' tiles), GQA; documents
    # starting off the tile grid, one token long, and a whole row.
    "prefix-tiles": ((4, 2, 2), (64, 32, 16), 2, 1, [[20, 37, 7], [64], [16, 48], [1, 62, 1]]),
    # blocks finer than the default tiles (16 rows in the interpreter, 64 on a GPU): sub-tile levels
    # of the prefix-rank kernels, one of them straddling the interpreter's tiles.
    "sub-tile": ((4, 2, 2), (48, 24, 12), 2, 1, [[20, 21, 7], [48], [24, 24], [1, 46, 1]]),
}
FLAGS = [(True, False), (True, True), (False, False), (False, True)]


def _ids(lengths: list[list[int]]) -> torch.Tensor:
    """Non-decreasing ids (with gaps, different per row) from per-row document lengths."""
    rows = []
    for b, row in enumerate(lengths):
        rows.append(torch.cat([torch.full((n,), 3 * d + b, dtype=torch.long) for d, n in enumerate(row)]))
    return torch.stack(rows)


def _bounds(row: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for n in row:
        out.append((start, start + n))
        start += n
    return out


def _inputs(case: str, dtype: torch.dtype, seed: int = 0, requires_grad: bool = False):
    ranks, block_sizes, H, Hk, lengths = CASES[case]
    T = sum(lengths[0])
    assert all(sum(row) == T for row in lengths)
    B, R = len(lengths), sum(ranks)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, R, generator=g, dtype=dtype)
    k = torch.randn(B, Hk, T, R, generator=g, dtype=dtype)
    v = torch.randn(B, Hk, T, 3, generator=g, dtype=dtype)
    if requires_grad:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
    return q, k, v, ranks, block_sizes, lengths


def _per_document(q, k, v, ranks, block_sizes, lengths, causal, depth_normalize):
    """The expected output: the plain reference on each document alone, with the call's sizes."""
    sizes = mlr_block_sizes(ranks, q.shape[2], block_sizes)
    rows = []
    for b, row in enumerate(lengths):
        rows.append(torch.cat([
            mlr_attention_reference(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e], ranks, sizes,
                                    causal=causal, depth_normalize=depth_normalize)
            for s, e in _bounds(row)
        ], dim=2))
    return torch.cat(rows)


@pytest.mark.parametrize("causal,depth_normalize", FLAGS)
@pytest.mark.parametrize("case", list(CASES))
def test_reference_equals_documents_alone(case, causal, depth_normalize):
    q, k, v, ranks, block_sizes, lengths = _inputs(case, torch.float64)
    out = mlr_attention_reference(q, k, v, ranks, block_sizes, causal=causal, depth_normalize=depth_normalize,
                                  document_ids=_ids(lengths))
    expected = _per_document(q, k, v, ranks, block_sizes, lengths, causal, depth_normalize)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_one_document_per_row_is_the_plain_call(causal):
    q, k, v, ranks, block_sizes, _ = _inputs("uneven-gqa", torch.float64)
    ids = torch.tensor([[7] * 16, [0] * 16, [2] * 16])
    plain = mlr_attention_reference(q, k, v, ranks, causal=causal, depth_normalize=True)
    docs = mlr_attention_reference(q, k, v, ranks, causal=causal, depth_normalize=True, document_ids=ids)
    torch.testing.assert_close(docs, plain, rtol=0, atol=1e-10)
    torch.testing.assert_close(mlr_attention(q, k, v, ranks, causal=causal, depth_normalize=True, document_ids=ids),
                               plain, rtol=0, atol=1e-10)


def _check_dispatch(case, dtype, causal, depth_normalize, tol):
    q, k, v, ranks, block_sizes, lengths = _inputs(case, dtype, seed=1, requires_grad=True)
    out = mlr_attention(q, k, v, ranks, block_sizes, causal=causal, depth_normalize=depth_normalize,
                        document_ids=_ids(lengths))
    expected = _per_document(q, k, v, ranks, block_sizes, lengths, causal, depth_normalize)
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * w).sum(), (q, k, v))
    for name, got, want in zip("qkv", grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("causal,depth_normalize", FLAGS)
@pytest.mark.parametrize("case", list(CASES))
def test_dispatch_on_cpu(case, causal, depth_normalize, dtype, tol):
    _check_dispatch(case, dtype, causal, depth_normalize, tol)


@pytest.mark.parametrize("causal,depth_normalize", FLAGS)
@pytest.mark.parametrize("case", list(CASES))
def test_blocked_path(monkeypatch, case, causal, depth_normalize):
    import structured_attention.ops.mlr.blocked as blocked

    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    original = blocked.mlr_attention_blocked
    monkeypatch.setattr(blocked, "mlr_attention_blocked", spy)
    monkeypatch.setattr(mlr_cpu, "available", lambda: False)
    _check_dispatch(case, torch.float64, causal, depth_normalize, 1e-10)
    assert calls  # the blocked path ran


@pytest.mark.parametrize("fn", [mlr_attention_reference, mlr_attention], ids=["reference", "dispatch"])
@pytest.mark.parametrize("causal", [True, False])
def test_other_documents_never_leak(fn, causal):
    """Changing another document's q/k/v (padding included) leaves a document's output bit for bit."""
    q, k, v, ranks, block_sizes, _ = _inputs("uneven-gqa", torch.float64)
    # Row 0: documents [0, 3), [3, 10) and padding [10, 16) under the largest id.
    ids = torch.tensor([[1] * 3 + [2] * 7 + [9] * 6, [0] * 4 + [5] * 12, [4] * 16])
    out = fn(q, k, v, ranks, causal=causal, depth_normalize=True, document_ids=ids)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[0, :, :3] = 1e4 * torch.randn_like(x[0, :, :3])
        x[0, :, 10:] = -1e4
        x[1, :, 4:] = 1e3 * torch.randn_like(x[1, :, 4:])
    out2 = fn(q2, k2, v2, ranks, causal=causal, depth_normalize=True, document_ids=ids)
    assert torch.equal(out[0, :, 3:10], out2[0, :, 3:10])
    assert torch.equal(out[1, :, :4], out2[1, :, :4])
    assert torch.equal(out[2], out2[2])


BAD_IDS = {
    "not-a-tensor": [[0] * 8, [0] * 8],
    "one-dimensional": torch.zeros(8, dtype=torch.long),
    "wrong-batch": torch.zeros(3, 8, dtype=torch.long),
    "wrong-length": torch.zeros(2, 9, dtype=torch.long),
    "float": torch.zeros(2, 8),
    "bool": torch.zeros(2, 8, dtype=torch.bool),
    "decreasing": torch.tensor([[0] * 8, [0, 0, 1, 1, 0, 0, 2, 2]]),
    "other-device": torch.zeros(2, 8, dtype=torch.long, device="meta"),
}


@pytest.mark.parametrize("fn", [mlr_attention_reference, mlr_attention], ids=["reference", "dispatch"])
@pytest.mark.parametrize("bad", list(BAD_IDS))
def test_bad_document_ids(fn, bad):
    q = torch.randn(2, 2, 8, 4)
    with pytest.raises(ValueError, match=r"^document_ids: expected") as info:
        fn(q, q, q, (2, 2), document_ids=BAD_IDS[bad])
    assert "\n" not in str(info.value)


def test_int32_ids_and_none():
    q, k, v, ranks, block_sizes, lengths = _inputs("two-levels", torch.float64)
    ids = _ids(lengths)
    torch.testing.assert_close(
        mlr_attention(q, k, v, ranks, document_ids=ids.to(torch.int32)),
        mlr_attention_reference(q, k, v, ranks, document_ids=ids), rtol=0, atol=1e-10)
    assert torch.equal(mlr_attention_reference(q, k, v, ranks, document_ids=None),
                       mlr_attention_reference(q, k, v, ranks))


def test_cpu_kernel_takes_documents_in_one_call(monkeypatch):
    """Varlen: the C++ kernel runs every document of the batch in one forward call, as segments."""
    if not mlr_cpu.available():
        pytest.skip("the C++ kernel is not available here")
    calls = []
    kernel = mlr_cpu.load()
    original = kernel.forward

    def spy(q, k, v, segments, *rest):
        calls.append(segments.clone())
        return original(q, k, v, segments, *rest)

    monkeypatch.setattr(kernel, "forward", spy)
    q, k, v, ranks, block_sizes, lengths = _inputs("uneven-gqa", torch.float32)
    mlr_attention(q, k, v, ranks, block_sizes, document_ids=_ids(lengths))
    assert len(calls) == 1
    H = q.shape[1]
    expected = [(b * H + h, s, e - s) for b, row in enumerate(lengths) for s, e in _bounds(row) for h in range(H)]
    assert sorted(map(tuple, calls[0].tolist())) == sorted(expected)


@pytest.mark.parametrize("causal,depth_normalize", [(True, False), (False, True)])
@pytest.mark.parametrize("case,tile,kernels", [("two-levels", 16, "general"), ("custom-sizes", 16, "general"),
                                               ("prefix-tiles", 16, "prefix"), ("sub-tile", None, "prefix")])
def test_triton_kernels_take_documents(case, tile, kernels, causal, depth_normalize, monkeypatch):
    """The Triton kernels (in the interpreter without a GPU) read each document as a segment: the
    general ones (explicit 16-row tiles that the fine blocks are not multiples of), and the
    prefix-rank ones, with or without sub-tile levels (``tile=None``: the default tiles)."""
    triton_general = pytest.importorskip("structured_attention.ops.mlr.triton_general")
    triton_prefix = pytest.importorskip("structured_attention.ops.mlr.triton_prefix")
    prefix_calls = []
    monkeypatch.setattr(triton_general, "mlr_attention_prefix",
                        lambda *a: prefix_calls.append(a) or triton_prefix.mlr_attention_prefix(*a))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, ranks, block_sizes, lengths = _inputs(case, torch.float32, seed=3, requires_grad=True)
    expected = _per_document(q, k, v, ranks, block_sizes, lengths, causal, depth_normalize)
    args = [x.detach().to(device).requires_grad_() for x in (q, k, v)]
    out = triton_general.mlr_attention_triton(*args, ranks, block_sizes, causal=causal,
                                              depth_normalize=depth_normalize,
                                              document_ids=_ids(lengths).to(device), block_m=tile, block_n=tile)
    assert len(prefix_calls) == (kernels == "prefix")
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    grads = torch.autograd.grad((out * w.to(device)).sum(), args)
    expected_grads = torch.autograd.grad((expected * w).sum(), (q, k, v))
    for name, got, want in zip("qkv", grads, expected_grads):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("case,tile,kernels", [("custom-sizes", 16, "general"), ("prefix-tiles", 16, "prefix")])
def test_triton_kernels_compile_whole_with_documents(case, tile, kernels, no_dynamo_warnings):
    """A packed batch through the Triton kernels compiles to one graph (``fullgraph``: the ops read
    their segment table from the ids themselves) and equals the documents run alone, forward and
    backward."""
    triton_general = pytest.importorskip("structured_attention.ops.mlr.triton_general")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, ranks, block_sizes, lengths = _inputs(case, torch.float32, seed=5, requires_grad=True)
    q, k, v, lengths = q[:2], k[:2], v[:2], lengths[:2]  # two rows: the interpreter is slow
    expected = _per_document(q, k, v, ranks, block_sizes, lengths, True, False)
    args = [x.detach().to(device).requires_grad_() for x in (q, k, v)]

    def f(q, k, v, ids):
        return triton_general.mlr_attention_triton(q, k, v, ranks, block_sizes, document_ids=ids, block_m=tile,
                                                   block_n=tile)

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(*args, _ids(lengths).to(device))
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    grads = torch.autograd.grad((out * w.to(device)).sum(), args)
    for name, got, want in zip("qkv", grads, torch.autograd.grad((expected * w).sum(), (q, k, v))):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"d{name}: {m}")


def test_ids_changed_in_place_are_read_again():
    """The segments read from an ids tensor are kept for the calls that follow with the same tensor
    (a model's layers): ids written in place between two calls are read again."""
    q, k, v, ranks, block_sizes, lengths = _inputs("two-levels", torch.float64)
    ids = _ids(lengths)
    first = mlr_attention(q, k, v, ranks, block_sizes, document_ids=ids)
    torch.testing.assert_close(first, _per_document(q, k, v, ranks, block_sizes, lengths, True, False),
                               rtol=0, atol=1e-10)
    other = [[4, 4, 8], [16], [1, 15], [10, 6]]
    ids.copy_(_ids(other))
    torch.testing.assert_close(mlr_attention(q, k, v, ranks, block_sizes, document_ids=ids),
                               _per_document(q, k, v, ranks, block_sizes, other, True, False), rtol=0, atol=1e-10)


def test_compiled_calls_refuse_decreasing_ids():
    """Under torch.compile the order of the ids is not checked before the call (it would read them
    on the host in the graph); the kernels' ops, which read them, raise the same line."""
    if not mlr_cpu.available():
        pytest.skip("the C++ kernel is not available here")
    q = torch.randn(2, 2, 8, 4)
    compiled = torch.compile(lambda q, ids: mlr_attention(q, q, q, (2, 2), document_ids=ids), fullgraph=True,
                             backend="aot_eager")
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"^document_ids: expected ids non-decreasing") as info:
        compiled(q, BAD_IDS["decreasing"])
    assert "\n" not in str(info.value)
