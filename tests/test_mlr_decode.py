"""One MLR decoding step against the compressed cache: the PyTorch reference
(``functional.mlr_decode_reference``) against the last row of the exact dense-mask attention, and
the fused Triton kernel (``kernels.mlr_decode_triton``, in Triton's interpreter without a GPU)
against the reference; then a whole layer decoding token by token through the kernel."""

from __future__ import annotations

import pytest
import torch

from structured_attention.attention import build_attention
from structured_attention.functional import mlr_attention_reference, mlr_block_sizes
from structured_attention.ops.mlr import mlr_decode_reference


def _step(B, H, Hk, T, ranks, block_sizes, Dv, dtype, seed=0, capacity=0):
    """The last token's query, the cache a decoder holds after ``T`` tokens (level ``l`` keeps its
    current block; buffers are views into ``capacity`` spare slots, as in ``TokenBuffer``), and the
    exact full-sequence attention."""
    gen = torch.Generator().manual_seed(seed)
    R = sum(ranks)
    q, k = torch.randn(B, H, T, R, generator=gen, dtype=torch.float64), torch.randn(B, Hk, T, R, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hk, T, Dv, generator=gen, dtype=torch.float64)
    sizes = mlr_block_sizes(ranks, T, block_sizes)
    p = T - 1
    starts = [0] + [p - p % s for s in sizes[1:]]
    keys = []
    for k_l, start in zip(k.split(list(ranks), dim=-1), starts):
        held = k_l[:, :, start:]
        buffer = torch.empty(B, Hk, held.shape[2] + capacity, held.shape[3], dtype=dtype)
        buffer[:, :, : held.shape[2]] = held
        keys.append(buffer[:, :, : held.shape[2]])
    return q[:, :, -1:], keys, starts, v, sizes, (q, k)


CASES = [  # B, H, Hk, T, ranks, block_sizes, Dv
    pytest.param(1, 2, 2, 37, (8, 4, 4), (64, 16, 4), 16, id="T37-8|4|4"),
    pytest.param(2, 6, 2, 104, (4, 2, 1, 1), None, 12, id="gqa3-default-blocks-Dv12"),
    pytest.param(1, 4, 1, 64, (8, 8), (64, 32), 8, id="mqa-block-boundary"),
    pytest.param(1, 2, 1, 65, (8, 8), (128, 32), 8, id="first-token-of-a-block"),
    pytest.param(1, 2, 2, 50, (12,), None, 20, id="single-level"),
    pytest.param(1, 2, 2, 93, (12, 6, 3), (96, 24, 6), 5, id="ranks12|6|3"),
]


@pytest.mark.parametrize("depth_normalize", [False, True], ids=["", "dn"])
@pytest.mark.parametrize("B,H,Hk,T,ranks,block_sizes,Dv", CASES)
def test_reference_is_the_last_row_of_exact_attention(B, H, Hk, T, ranks, block_sizes, Dv, depth_normalize):
    q_new, keys, starts, v, sizes, (q, k) = _step(B, H, Hk, T, ranks, block_sizes, Dv, torch.float64, capacity=3)
    out = mlr_decode_reference(q_new, keys, starts, v, ranks, 0.37, depth_normalize)
    full = mlr_attention_reference(q, k, v, ranks, sizes, causal=True, scale=0.37, depth_normalize=depth_normalize)
    torch.testing.assert_close(out, full[:, :, -1:], atol=1e-10, rtol=1e-10)


def test_bad_arguments_name_the_parameter():
    q_new, keys, starts, v, _, _ = _step(1, 2, 2, 20, (4, 4), (32, 8), 4, torch.float64)
    with pytest.raises(ValueError, match=r"^q: expected shape .*sum\(ranks\)=8"):
        mlr_decode_reference(q_new[..., :7], keys, starts, v, (4, 4), 1.0)
    with pytest.raises(ValueError, match="^keys: expected one tensor per level"):
        mlr_decode_reference(q_new, keys[:1], starts, v, (4, 4), 1.0)
    with pytest.raises(ValueError, match="^key_starts: expected 0 for level 1"):
        mlr_decode_reference(q_new, keys, [1, starts[1]], v, (4, 4), 1.0)
    with pytest.raises(ValueError, match=r"^keys\[1\]: expected shape"):
        mlr_decode_reference(q_new, [keys[0], keys[1][:, :, 1:]], starts, v, (4, 4), 1.0)
    with pytest.raises(ValueError, match="^q: expected"):
        mlr_decode_reference(q_new.expand(1, 2, 2, 8), keys, starts, v, (4, 4), 1.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("depth_normalize", [False, True], ids=["", "dn"])
@pytest.mark.parametrize("B,H,Hk,T,ranks,block_sizes,Dv", CASES)
def test_cpu_kernel_matches_reference(B, H, Hk, T, ranks, block_sizes, Dv, depth_normalize, dtype):
    from structured_attention.ops.mlr import cpu as mlr_cpu

    if not mlr_cpu.available():
        pytest.skip("the C++ kernel cannot be built here (no compiler or ninja)")
    q_new, keys, starts, v, _, _ = _step(B, H, Hk, T, ranks, block_sizes, Dv, dtype, capacity=5)
    q_new, v = q_new.to(dtype), v.to(dtype)
    ref = mlr_decode_reference(q_new.double(), [k.double() for k in keys], starts, v.double(), ranks, 0.37, depth_normalize)
    out = mlr_cpu.mlr_decode_cpu(q_new, keys, starts, v, ranks, 0.37, depth_normalize)
    assert out.dtype == dtype and out.shape == ref.shape
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_dispatch_takes_the_reference_when_gradients_are_needed():
    from structured_attention.ops.mlr import mlr_decode

    q_new, keys, starts, v, _, _ = _step(1, 2, 2, 30, (4, 4), (32, 8), 4, torch.float64)
    q_new = q_new.clone().requires_grad_()
    out = mlr_decode(q_new, keys, starts, v, (4, 4), 0.5)
    (grad,) = torch.autograd.grad(out.sum(), q_new)
    assert grad.shape == q_new.shape and grad.abs().sum() > 0


triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'triton>=3.0')")
from structured_attention.ops.mlr.triton_decode import mlr_decode_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("depth_normalize", [False, True], ids=["", "dn"])
@pytest.mark.parametrize("B,H,Hk,T,ranks,block_sizes,Dv", CASES)
def test_triton_kernel_matches_reference(B, H, Hk, T, ranks, block_sizes, Dv, depth_normalize, dtype):
    q_new, keys, starts, v, _, _ = _step(B, H, Hk, T, ranks, block_sizes, Dv, dtype, capacity=5)
    q_new, v = q_new.to(dtype), v.to(dtype)
    ref = mlr_decode_reference(q_new.double(), [k.double() for k in keys], starts, v.double(), ranks, 0.37, depth_normalize)
    # chunks of 32 keys in tiles of 16: several splits to merge and a ragged last tile
    out = mlr_decode_triton(q_new.to(DEVICE), [k.to(DEVICE) for k in keys], starts, v.to(DEVICE), ranks, 0.37,
                            depth_normalize, chunk=32, block_n=16)
    assert out.dtype == dtype and out.shape == ref.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)


def test_triton_kernel_default_chunking_and_bad_input():
    q_new, keys, starts, v, _, _ = _step(1, 4, 2, 300, (8, 4, 4), None, 16, torch.float32)
    q_new, keys, v = q_new.float().to(DEVICE), [k.to(DEVICE) for k in keys], v.float().to(DEVICE)
    ref = mlr_decode_reference(q_new, keys, starts, v, (8, 4, 4), 0.5)
    torch.testing.assert_close(mlr_decode_triton(q_new, keys, starts, v, (8, 4, 4), 0.5), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="^chunk: expected a positive multiple of block_n=128"):
        mlr_decode_triton(q_new, keys, starts, v, (8, 4, 4), 0.5, chunk=100)
    with pytest.raises(ValueError, match=r"^v.dtype: expected float32, float16 or bfloat16"):
        mlr_decode_triton(q_new, [k.double() for k in keys], starts, v.double(), (8, 4, 4), 0.5)
    # a bfloat16 query (autocast) against a float32 cache is computed in the cache's dtype
    torch.testing.assert_close(mlr_decode_triton(q_new.bfloat16(), keys, starts, v, (8, 4, 4), 0.5),
                               mlr_decode_reference(q_new.bfloat16().float(), keys, starts, v, (8, 4, 4), 0.5),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_kernel_reads_levels_at_any_offset_and_stride(dtype):
    # The kernel addresses the finer levels by their offset from level 1's buffer and tells the
    # compiler the largest alignment all offsets and strides share: here levels sit at odd offsets
    # of one flat buffer, one with padded rows, and level 1 has padded rows too (so it is copied).
    q_new, keys, starts, v, _, _ = _step(2, 4, 2, 90, (8, 4, 4, 2), (128, 32, 8, 4), 16, torch.float64)
    flat = torch.zeros(20_000, dtype=dtype, device=DEVICE)
    packed, at = [], 3
    for level, k in enumerate(keys):
        b, h, t, r = k.shape
        row = r + (1 if level in (0, 2) else 0)
        view = flat[at : at + b * h * t * row].view(b, h, t, row)[..., :r]
        view.copy_(k)
        packed.append(view)
        at += b * h * t * row + 5
    q, vv = q_new.to(DEVICE, dtype), v.to(DEVICE, dtype)
    ref = mlr_decode_reference(q.double().cpu(), [k.double().cpu() for k in packed], starts, vv.double().cpu(),
                               (8, 4, 4, 2), 0.37)
    out = mlr_decode_triton(q, packed, starts, vv, (8, 4, 4, 2), 0.37, chunk=32, block_n=16)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("spec", ["mlr:8|4|2|2", "mlr:8|4|2|2:depth_normalize=true"])
def test_layer_decodes_through_the_kernel_like_its_full_forward(spec, monkeypatch):
    import structured_attention.ops.mlr.dispatch as dispatch

    calls = []

    def kernel(*args):
        calls.append(1)
        return mlr_decode_triton(*args, block_n=16)

    monkeypatch.setattr(dispatch, "mlr_decode", kernel)
    torch.manual_seed(0)
    layer = build_attention(spec, d_model=32, n_heads=2, max_seq_len=64).to(DEVICE).eval()
    x = torch.randn(1, 40, 32, device=DEVICE)
    with torch.no_grad():
        full = layer(x)
        cache = layer.new_cache(1)
        layer(x[:, :20], cache)  # prefill, then one token at a time across block boundaries
        steps = [layer(x[:, t : t + 1], cache) for t in range(20, 40)]
    assert len(calls) == 20
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 20:], atol=1e-5, rtol=1e-5)
