"""One MLR decoding step against the compressed cache, beyond the backends' agreement with the
references on the shared grid (tests/test_mlr_grid.py, ``test_cached_attention``): one-line errors,
the dispatcher taking the reference when gradients are needed, the Triton kernel's default chunking,
its reading of levels at any offset and stride and of a half query against a float32 cache, and a
whole layer decoding token by token through the kernel."""

from __future__ import annotations

import pytest
import torch

from mlr_cases import cache_step
from structured_attention.attention import build_attention
from structured_attention.ops.mlr import mlr_decode_reference


def test_bad_arguments_name_the_parameter():
    s = cache_step(1, 2, 2, 20, (4, 4), (32, 8), 4)
    q_new, keys, starts, v = s.q_new, s.keys, s.starts, s.v
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
    with pytest.raises(ValueError, match="^q.dtype: expected a floating-point dtype"):  # it blamed v
        mlr_decode_reference(q_new.long(), keys, starts, v, (4, 4), 1.0)


def test_dispatch_takes_the_reference_when_gradients_are_needed():
    from structured_attention.ops.mlr import mlr_decode

    s = cache_step(1, 2, 2, 30, (4, 4), (32, 8), 4)
    q_new, keys, starts, v = s.q_new.clone().requires_grad_(), s.keys, s.starts, s.v
    out = mlr_decode(q_new, keys, starts, v, (4, 4), 0.5)
    (grad,) = torch.autograd.grad(out.sum(), q_new)
    assert grad.shape == q_new.shape and grad.abs().sum() > 0


@pytest.mark.parametrize("ranks", [(8, 8, 8), (5, 3)], ids=["r8", "r5"])
def test_cpu_kernel_serves_a_key_heads_query_heads_together_as_each_alone(ranks):
    """With GQA the C++ kernel reads a key head's cache once for its query heads (in chunks): each
    query head's output has the bits of that head decoded alone against its key head."""
    from structured_attention.ops.mlr import cpu

    if not cpu.available():
        pytest.skip("needs the C++ kernel")
    s = cache_step(4, 8, 2, 700, ranks, (1024, 256, 64)[: len(ranks)], 24, torch.float32)
    starts = torch.tensor([[0] * len(ranks), [9] * len(ranks)] * 2)  # rows 1 and 3 left-padded
    together = cpu.mlr_decode_cpu(s.q_new, s.keys, s.starts, s.v, ranks, 0.3, row_starts=starts)
    for h in range(8):
        kv = slice(h // 4, h // 4 + 1)
        alone = cpu.mlr_decode_cpu(s.q_new[:, h:h + 1], [k[:, kv] for k in s.keys], s.starts, s.v[:, kv], ranks, 0.3,
                                   row_starts=starts)
        assert torch.equal(together[:, h:h + 1], alone)


triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'triton>=3.0')")
import triton.language as tl  # noqa: E402

from structured_attention.ops.mlr.triton_decode import _split_by_bytes, mlr_decode_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _split_probe(OUT, FINE_STARTS, FINE_RANK, n_splits, held_end, R0: tl.constexpr, DV: tl.constexpr,
                 RF: tl.constexpr, N_FINE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Each split's ``[lo, hi)`` as the decoding kernel computes it (a row without padding, a
    growing cache: the row-start and ring tables are never read)."""
    split = tl.program_id(0)
    lo, hi = _split_by_bytes(split, n_splits, 0, 0, held_end, FINE_STARTS, FINE_STARTS, FINE_STARTS, FINE_RANK, R0, DV,
                             RF, N_FINE, False, False, BLOCK_N)
    tl.store(OUT + 2 * split, lo)
    tl.store(OUT + 2 * split + 1, hi)


@pytest.mark.parametrize("ranks,equal", [((8,) * 8, True), ((8, 16, 4, 4, 2), False)], ids=["8x8", "unequal"])
def test_triton_splits_read_equal_bytes(ranks, equal):
    """The decoding kernel's splits of a 16k cache: contiguous, every held key once, and each within
    one tile's bytes of an equal share, where a key of depth d reads r_1 + Dv + r_2 + ... + r_d
    numbers (counted here key by key)."""
    held, dv, block_n, n_splits = 16368, 64, 128, 7
    sizes = [16384 >> level for level in range(len(ranks))]
    fine_starts = [held // s * s for s in sizes[1:]]  # each finer level holds its current block
    out = torch.zeros(2 * n_splits, dtype=torch.int32, device=DEVICE)
    _split_probe[(n_splits,)](out, torch.tensor(fine_starts, dtype=torch.int32, device=DEVICE),
                              torch.tensor(ranks[1:], dtype=torch.int32, device=DEVICE), n_splits, held,
                              R0=ranks[0], DV=dv, RF=ranks[1] if equal else 0, N_FINE=len(ranks) - 1, BLOCK_N=block_n)
    bounds = out.view(n_splits, 2).tolist()
    assert bounds[0][0] == 0 and bounds[-1][1] == held
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, none skipped or read twice
    per_key = [ranks[0] + dv + sum(r for r, start in zip(ranks[1:], fine_starts) if n >= start) for n in range(held)]
    share = sum(per_key) / n_splits
    for lo, hi in bounds:
        assert lo % block_n == 0 and abs(sum(per_key[lo:hi]) - share) <= block_n * max(per_key), (lo, hi)


def test_triton_kernel_default_chunking_and_bad_input():
    s = cache_step(1, 4, 2, 300, (8, 4, 4), None, 16, torch.float32, device=DEVICE)
    q_new, keys, starts, v = s.q_new, s.keys, s.starts, s.v
    ref = mlr_decode_reference(q_new, keys, starts, v, (8, 4, 4), 0.5)
    torch.testing.assert_close(mlr_decode_triton(q_new, keys, starts, v, (8, 4, 4), 0.5), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="^chunk: expected a positive multiple of block_n=64"):
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
    # of one flat buffer, one with padded rows, and level 1 has padded rows too (read in place).
    s = cache_step(2, 4, 2, 90, (8, 4, 4, 2), (128, 32, 8, 4), 16)
    q_new, keys, starts, v = s.q_new, s.keys, s.starts, s.v
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_kernel_reads_level_1_keys_and_values_interleaved_in_one_buffer(dtype):
    # One row per token, [level-1 key | value]: the kernel reads both through their row stride, in
    # place (no copy of level 1), with the rows' shared alignment, and gives the reference's result.
    from structured_attention.ops.mlr.triton_decode import _tables

    ranks = (8, 4, 4)
    s = cache_step(2, 4, 2, 100, ranks, (128, 32, 8), 16)
    b, h, t, _ = s.v.shape
    rows = torch.empty(b, h, t, ranks[0] + 16, dtype=dtype, device=DEVICE)
    k0, v = rows[..., :ranks[0]], rows[..., ranks[0]:]
    k0.copy_(s.keys[0])
    v.copy_(s.v)
    keys = [k0] + [k.to(DEVICE, dtype) for k in s.keys[1:]]
    q = s.q_new.to(DEVICE, dtype)
    assert _tables(keys, s.starts, ranks, None).k0.data_ptr() == k0.data_ptr()
    ref = mlr_decode_reference(q.double().cpu(), [k.double().cpu() for k in keys], s.starts, v.double().cpu(), ranks,
                               0.29)
    out = mlr_decode_triton(q, keys, s.starts, v, ranks, 0.29, chunk=32, block_n=16)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_kernel_at_the_benchmarks_shape_with_its_shallow_regions_a_stage_deeper(dtype):
    # 8 levels of rank 8 and 64 value dims (sattn bench's decoding case): the first two regions
    # (level 1 and the values; then level 2) loop with one pipeline stage more than the others,
    # each over several tiles, as do the deeper ones; against the reference in float64.
    from structured_attention.ops.mlr.triton_decode import _shallow_regions

    ranks = (8,) * 8
    assert _shallow_regions(2, 16, 64, 7, 8) == 2
    assert _shallow_regions(3, 16, 64, 7, 8) == 4  # the default
    s = cache_step(1, 2, 1, 1000, ranks, (1024, 512, 256, 128, 64, 32, 16, 8), 64)
    assert s.starts[1:3] == [512, 768]  # regions 1 and 2 span 512 and 256 keys: tiles of 16
    q, keys, v = s.q_new.to(DEVICE, dtype), [k.to(DEVICE, dtype) for k in s.keys], s.v.to(DEVICE, dtype)
    ref = mlr_decode_reference(q.double().cpu(), [k.double().cpu() for k in keys], s.starts, v.double().cpu(),
                               ranks, 0.125)
    out = mlr_decode_triton(q, keys, s.starts, v, ranks, 0.125, chunk=256, block_n=16)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("slot", [0, 37, 95])
@pytest.mark.parametrize("dn", [False, True], ids=["no_dn", "dn"])
@pytest.mark.parametrize("sizes", [(96, 32, 8, 4), (96, 24, 12, 6)], ids=["pow2_rings", "other_rings"])
def test_static_kernel_matches_the_static_step_in_aten_ops(slot, dn, sizes, monkeypatch):
    """decode_static against the static step's ATen form (itself checked against each row run
    alone in test_static_cache.py), with six splits of the keys held up to the slot (several of them
    empty at the early slots); rings of powers of two (a key's slot by a mask) and of other sizes (a
    division), a padded row's blocks wrapping around them."""
    from structured_attention.ops.mlr import cpu, static
    from structured_attention.ops.mlr.triton_decode import decode_static

    g = torch.Generator().manual_seed(slot)
    ranks, C = (8, 4, 2, 2), 96
    keys = [torch.randn(2, 2, C if level == 0 else sizes[level], r, generator=g) for level, r in enumerate(ranks)]
    q, v = torch.randn(2, 4, 1, 16, generator=g), torch.randn(2, 2, C, 24, generator=g)
    slot_t, offsets = torch.tensor(slot), torch.tensor([0, min(slot, 11)])
    monkeypatch.setattr(cpu, "available", lambda: False)
    want = static.mlr_decode_static(q, keys, v, slot_t, offsets, list(ranks), list(sizes), 0.3, dn)
    got = decode_static(q.to(DEVICE), [k.to(DEVICE) for k in keys], v.to(DEVICE), slot_t.to(DEVICE),
                        offsets.to(DEVICE), ranks, sizes, 0.3, dn, chunk=16, block_n=16)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpu_kernel", "aten", "triton"])
def test_the_static_step_reads_level_1_and_the_values_interleaved_in_one_buffer(backend, monkeypatch):
    """Level-1 keys and values as two views of one buffer (a token's key and value in one row: the
    layout gpu-check.sh layout times against two buffers) give the step of two buffers on every
    backend of the static step."""
    from structured_attention.ops.mlr import cpu, static

    if backend == "cpu_kernel" and not cpu.available():
        pytest.skip("the C++ kernel is not built here")
    if backend == "aten":
        monkeypatch.setattr(cpu, "available", lambda: False)
    device = DEVICE if backend == "triton" else "cpu"
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
        monkeypatch.setattr(static, "on_triton", lambda v: True)
    g = torch.Generator().manual_seed(2)
    ranks, sizes, C = (8, 4, 2, 2), (96, 32, 8, 4), 96
    keys = [torch.randn(2, 2, C if level == 0 else sizes[level], r, generator=g).to(device)
            for level, r in enumerate(ranks)]
    q, v = torch.randn(2, 4, 1, 16, generator=g).to(device), torch.randn(2, 2, C, 24, generator=g).to(device)
    slot, offsets = torch.tensor(60).to(device), torch.tensor([0, 11]).to(device)
    both = torch.cat([keys[0], v], dim=-1)
    args = (slot, offsets, list(ranks), list(sizes), 0.3, True)
    want = static.mlr_decode_static(q, keys, v, *args)
    got = static.mlr_decode_static(q, [both[..., :8], *keys[1:]], both[..., 8:], *args)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


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
