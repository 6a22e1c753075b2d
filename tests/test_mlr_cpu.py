"""Tests for the fused C++ CPU kernel (structured_attention.ops.mlr.cpu) beyond its agreement with
the reference on the shared grid (tests/test_mlr_grid.py, backends ``cpu`` and ``dispatch``, in
float64, float32, bfloat16 and float16): extreme scores, causality, argument validation, memory
linear in T, and results that do not depend on the thread count.
"""

from __future__ import annotations

import pytest
import torch

from mlr_cases import cache_step, intra_op_threads, make_qkv
from structured_attention.functional import mlr_attention_reference
from structured_attention.ops.mlr import cpu as mlr_cpu
from structured_attention.ops.mlr.cpu import mlr_attention_cpu

pytestmark = pytest.mark.skipif(not mlr_cpu.available(), reason="the C++ kernel cannot be built here (no compiler or ninja)")


def test_extreme_scores_stay_finite():
    """Scores of about +-1e4: the online softmax never overflows."""
    q, k, v = make_qkv(1, 2, 2, 96, 8, 4, torch.float32, seed=2, requires_grad=True)
    with torch.no_grad():
        q.mul_(300.0)
        k.mul_(300.0)
    out = mlr_attention_cpu(q, k, v, (4, 4), (128, 32), scale=1.0)
    ref = mlr_attention_reference(q.double(), k.double(), v.double(), (4, 4), (128, 32), scale=1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=0)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


def test_causal_rows_ignore_future_keys():
    q, k, v = make_qkv(1, 2, 2, 130, 8, 4, torch.float64, seed=3, requires_grad=True)
    out = mlr_attention_cpu(q, k, v, (4, 4), (256, 32))
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 70:] = 5.0
    v2[:, :, 70:] = -7.0
    out2 = mlr_attention_cpu(q, k2, v2, (4, 4), (256, 32))
    torch.testing.assert_close(out[:, :, :70], out2[:, :, :70], atol=1e-12, rtol=0)


def test_validation_names_the_parameter():
    q, k, v = make_qkv(1, 2, 2, 16, 8, 4, torch.float32, seed=4, requires_grad=True)
    with pytest.raises(ValueError, match="ranks"):
        mlr_attention_cpu(q, k, v, (4, 3))
    with pytest.raises(ValueError, match="block_sizes"):
        mlr_attention_cpu(q, k, v, (4, 4), (16, 6))


def test_the_thread_count_changes_no_bit():
    """Forward, backward and a decoding step give the same bits on 1, 2 and 3 threads: each
    worker's share of the tiles (and, decoding with GQA, a task per key head or, where that would
    leave a thread idle, per query head) keeps every sum's order."""
    from structured_attention.ops.mlr.cpu import mlr_decode_cpu

    # one row of 2 key heads: fewer tasks than 3 threads, so on 3 the step takes a task per query head
    step = cache_step(1, 4, 2, 700, (8, 4, 4), (1024, 256, 64), 16, torch.float32)
    results = []
    for n in (1, 2, 3):
        with intra_op_threads(n):
            q, k, v = make_qkv(2, 4, 2, 300, 16, 16, torch.float32, seed=7, requires_grad=True)
            out = mlr_attention_cpu(q, k, v, (8, 4, 4), (512, 64, 16))
            grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            decoded = mlr_decode_cpu(step.q_new, step.keys, step.starts, step.v, (8, 4, 4), 0.3)
            results.append((out, *grads, decoded))
    for name, one, two, three in zip(("out", "dq", "dk", "dv", "decoded"), *results):
        assert torch.equal(one, two) and torch.equal(one, three), name


def test_memory_is_linear_in_T():
    """No allocation of T x T size, forward or backward: the kernel's own work buffers are a few
    tiles per thread (and, in the backward, each segment's packed rows), and every tensor it
    allocates is O(T)."""
    from torch.profiler import profile

    T, R = 2048, 16
    q, k, v = make_qkv(1, 2, 2, T, R, 16, torch.float32, seed=6, requires_grad=True)
    with profile(profile_memory=True) as prof:
        mlr_attention_cpu(q, k, v, (4, 4, 4, 4)).sum().backward()
    biggest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < biggest <= 4 * (2 * T * R * 4)  # a few (heads, T, R) tensors
    assert biggest < T * T * 4 / 16


@pytest.mark.parametrize("documents", [False, True], ids=["whole", "documents"])
def test_strided_inputs_and_dim_order_equal_the_gathered_call(documents):
    """The kernel reads q, k and v where they lie ((B, T, H, D) memory, as a projection leaves them;
    two query heads per key head) and takes the head dims in ``dim_order``: equal, with its
    gradients, to the reference on contiguous copies with the dims gathered."""
    from structured_attention.ops.mlr import mlr_attention

    B, H, Hk, T, R, Dv = 2, 4, 2, 70, 8, 6
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, T, H, R, dtype=torch.float64, generator=g).transpose(1, 2).requires_grad_()
    k = torch.randn(B, T, Hk, R, dtype=torch.float64, generator=g).transpose(1, 2).requires_grad_()
    v = torch.randn(B, T, Hk, Dv, dtype=torch.float64, generator=g).transpose(1, 2).requires_grad_()
    order = [4, 0, 5, 1, 6, 2, 7, 3]
    ids = torch.tensor([[0] * 30 + [1] * 40, [0] * 70]) if documents else None
    out = mlr_attention(q, k, v, (2, 2, 4), (128, 32, 8), document_ids=ids, dim_order=order)
    gout = torch.randn(out.shape, dtype=torch.float64, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), gout)
    qc, kc, vc = (x.detach().contiguous().requires_grad_() for x in (q, k, v))
    ref = mlr_attention_reference(qc[..., order], kc[..., order], vc, (2, 2, 4), (128, 32, 8), document_ids=ids)
    ref_grads = torch.autograd.grad(ref, (qc, kc, vc), gout)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_dim_order_off_the_kernel_and_its_validation(monkeypatch):
    """Where the kernel does not run, dim_order gathers the dims first: the same result. A
    dim_order that is not a permutation of the head dims is one line naming it."""
    from structured_attention.ops.mlr import dispatch, mlr_attention

    q, k, v = make_qkv(1, 2, 2, 40, 8, 4, torch.float64, seed=12)
    order = [7, 6, 5, 4, 3, 2, 1, 0]
    kernel = mlr_attention(q, k, v, (4, 4), (64, 16), dim_order=order)
    monkeypatch.setattr(dispatch.cpu, "available", lambda: False)
    torch.testing.assert_close(mlr_attention(q, k, v, (4, 4), (64, 16), dim_order=order), kernel, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="dim_order"):
        mlr_attention(q, k, v, (4, 4), dim_order=[0, 1, 2, 3, 4, 5, 6, 6])
