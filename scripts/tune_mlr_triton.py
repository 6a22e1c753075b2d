"""Check and time the Triton MLR kernels' tile settings against SDPA on one CUDA GPU.

    PYTHONPATH=src python3 scripts/tune_mlr_triton.py [--seq-lens 8192,16384] [--no-decode] [--out FILE.json]
                                                      [--v-dim 64] [--batch 1] [--heads 8]

Prints, for each T and rank split (B=1, H=8, Dv=64 unless given, bfloat16, causal): SDPA's default and flash
backends, the general Triton kernel, and the prefix-rank kernels under several tile / warp / stage
settings, each as forward and forward+backward medians (``triton.testing.do_bench``). Every
setting is first checked against the exact reference at the shortest length. Below T = 4096 (8
levels), the default tiles run the prefix-rank kernels with sub-tile levels, so the general kernel
beside them is the alternative they replace. It also times one decoding
step's attention (the kernel alone, no projections) at a 16k cache: SDPA's cuDNN, flash and
memory-efficient kernels, and the MLR decoding kernel under several grid / tile / stage / register
settings, each checked against the float32 reference, timed from a CUDA graph so that the host's
launch cost does not count; then, in the default setting, level 1 and the values alone (also with
the tiles and stages of the default before), and both
reads again from one buffer that holds a token's level-1 key and value in one row; last the same
cache as a static cache holds it (what graph-captured generation reads: level 1 and the values in
buffers as long as the context, each finer level in a ring of its block size), in two buffers and
in one.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from check_prefix_tilings import errors, use_tile_warps  # scripts/ is on the path of a script run from it
from structured_attention.functional import mlr_decode_reference
from structured_attention.ops.mlr.contract import check_mlr_arguments, mlr_block_sizes
from structured_attention.ops.mlr.static import one_allocation
from structured_attention.ops.mlr.triton_decode import decode_static, mlr_decode_triton
from structured_attention.ops.mlr.triton_general import mlr_attention_triton
from structured_attention.ops.mlr.triton_prefix import PrefixTiles, mlr_attention_prefix

SETTINGS = {
    "64/w4/s2": PrefixTiles(num_warps=4, num_stages=2),
    # what the dispatcher takes where a 64-row tile would need sub-tile levels but 32 rows divide every
    # fine block (8 levels at T = 4096: the finest blocks are 32 tokens)
    "32/w4/s2": PrefixTiles(*(32,) * 6, num_warps=4, num_stages=2),
    # three stages, the dispatcher's on CUDA in half precision up to head dim 64: the next tile's
    # copies in flight while one is scored (with two, each is waited for before its own arithmetic)
    "64/w4/s3": PrefixTiles(num_warps=4, num_stages=3),
    "32/w4/s3": PrefixTiles(*(32,) * 6, num_warps=4, num_stages=3),
    # the stages the launch picks for this GPU, kernel by kernel (pipeline_stages: on Hopper at head
    # dim 128 three for the forward, two for the backward)
    "64/w4/auto": PrefixTiles(num_warps=4, num_stages=0),
    "64/w8/s2": PrefixTiles(num_warps=8, num_stages=2),
    "64/w4/s1": PrefixTiles(num_warps=4, num_stages=1),
    "128x64/w8/s2": PrefixTiles(128, 64, 128, 64, 128, 64, num_warps=8, num_stages=2),
    "128x64/w4/s2": PrefixTiles(128, 64, 128, 64, 128, 64, num_warps=4, num_stages=2),
    "bwd32/w4/s2": PrefixTiles(64, 64, 64, 32, 64, 32, num_warps=4, num_stages=2),
    # the same with eight warps: compiled for sm_90 without a GPU, the dK/dV kernel (its dQ added with
    # atomics) spills 56 bytes a thread, against 184 with four and 560 for 64/w4 (triton_resources.py)
    "bwd32/w8/s2": PrefixTiles(64, 64, 64, 32, 64, 32, num_warps=8, num_stages=2),
    # the dK/dV kernel holds k, v and both accumulators for its own keys: 32 of them instead of 64
    "dkdv32/w4/s2": PrefixTiles(64, 64, 32, 32, 64, 64, num_warps=4, num_stages=2),
    "dkdv32/w4/s3": PrefixTiles(64, 64, 32, 32, 64, 64, num_warps=4, num_stages=3),
    "dkdv32x16/w4/s2": PrefixTiles(64, 64, 32, 16, 64, 64, num_warps=4, num_stages=2),
}


DECODE_CACHE, DECODE_RANKS, CONTEXT = 16368, (8,) * 8, 16384


def decode_case(batch: int = 16, heads: int = 8) -> tuple[torch.Tensor, list[torch.Tensor], list[int], torch.Tensor,
                                                          torch.Tensor]:
    """The benchmark's decoding step in bfloat16: a new query, the compressed MLR cache a layer built
    for a 16k context holds after ``DECODE_CACHE`` tokens (level ``l`` keeps its current block),
    the values, and full 64-dim keys for MHA."""
    T, sizes = DECODE_CACHE, mlr_block_sizes(DECODE_RANKS, CONTEXT)
    q = torch.randn(batch, heads, 1, 64, device="cuda", dtype=torch.bfloat16)
    starts = [0] + [(T // s) * s for s in sizes[1:]]
    keys = [torch.randn(batch, heads, T + 1 - start, r, device="cuda", dtype=torch.bfloat16)
            for r, start in zip(DECODE_RANKS, starts)]
    v, k = (torch.randn(batch, heads, T + 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, keys, starts, v, k


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _graph_ms(fn) -> float:
    """The median of ``fn`` replayed from a CUDA graph: a decoding step's kernels take about as long
    as the Python that launches them, so timed call by call the host's speed would decide."""
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def _case(fn, q, k, v):
    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    def fwd_bwd():
        for x in (q, k, v):
            x.grad = None
        fn(q, k, v).sum().backward()

    return fwd, fwd_bwd


def check(tiles: PrefixTiles, ranks: tuple[int, ...], T: int, dv: int) -> float:
    """Largest relative error of output and gradients against the float64 reference (bfloat16
    inputs, ``T`` tokens, value dim ``dv``, the default block sizes); NaN where the tiles do not fit
    those blocks."""
    checked = errors(tiles, ranks, T, dv=dv)
    return float("nan") if checked is None else max(checked[0].values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="8192,16384")
    parser.add_argument("--ranks", default="8|8|8|8|8|8|8|8,16|16|16|16")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--v-dim", type=int, default=64, help="the prefill's value dim (default 64)")
    parser.add_argument("--batch", type=int, default=1, help="the prefill's batch (default 1)")
    parser.add_argument("--heads", type=int, default=8, help="the prefill's heads (default 8)")
    parser.add_argument("--decode-only", action="store_true", help="time only the decoding step")
    parser.add_argument("--no-decode", action="store_true", help="leave out the decoding step")
    parser.add_argument("--tile-warps", action="store_true",
                        help="launch each setting with its own warps, also where sub-tile levels take eight on CUDA")
    parser.add_argument("--no-general", action="store_true",
                        help="leave out the general kernel (tens of ms a call at 8192 and longer, and its compile)")
    parser.add_argument("--decode-settings", choices=("sweep", "default"), default="sweep",
                        help="the decoding kernel's settings: the sweep (a first compile each, about 15 s on an "
                             "H200) or its default arguments alone (an A/B of two versions)")
    args = parser.parse_args()
    if args.tile_warps:
        use_tile_warps()
    seq_lens = sorted(int(t) for t in args.seq_lens.split(","))
    rows = []
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}", flush=True)
    for spec in [] if args.decode_only else args.ranks.split(","):
        ranks = tuple(int(r) for r in spec.split("|"))
        for name in args.settings.split(","):
            error = check(SETTINGS[name], ranks, seq_lens[0], args.v_dim)
            print(f"check {spec} {name} T={seq_lens[0]}: max relative error {error:.2e}", flush=True)
        for T in seq_lens:
            torch.manual_seed(0)
            shape = (args.batch, args.heads, T)
            q, k = (torch.randn(*shape, sum(ranks), device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(2))
            v = torch.randn(*shape, args.v_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            sizes = check_mlr_arguments(q, k, v, ranks, None, True, None, False)[1]
            scale = 1 / math.sqrt(sum(ranks))
            pad = max(args.v_dim - sum(ranks), 0)

            def sdpa(q, k, v):
                return F.scaled_dot_product_attention(F.pad(q, (0, pad)), F.pad(k, (0, pad)), v, is_causal=True)

            def sdpa_flash(q, k, v):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return sdpa(q, k, v)

            cases = {"sdpa": sdpa, "sdpa_flash": sdpa_flash}
            if not args.no_general:
                cases["triton_general"] = lambda q, k, v: mlr_attention_triton(q, k, v, ranks, block_m=64, block_n=32)
            for name in args.settings.split(","):
                tiles = SETTINGS[name]
                if tiles.fits(sizes[1:]):
                    cases[f"prefix {name}"] = (lambda t: lambda q, k, v: mlr_attention_prefix(
                        q, k, v, ranks, sizes, True, scale, False, t))(tiles)
            base = None
            for name, fn in cases.items():
                fwd, fwd_bwd = _case(fn, q, k, v)
                try:
                    a, b = _ms(fwd), _ms(fwd_bwd)
                except Exception as e:  # a setting the compiler rejects (e.g. out of shared memory)
                    print(f"  {spec:18s} T={T:6d} {name:22s} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                base = base or (a, b)
                rows.append(dict(ranks=spec, T=T, case=name, fwd_ms=a, fwd_bwd_ms=b))
                print(f"  {spec:18s} T={T:6d} {name:22s} fwd {a:7.3f} ms ({base[0] / a:4.2f}x)  "
                      f"fwd+bwd {b:7.3f} ms ({base[1] / b:4.2f}x)", flush=True)

    if args.no_decode:
        _write(rows, args.out)
        return
    # One decoding step's attention at a 16k cache, batch 16, 8 heads: the kernel against SDPA.
    q1, keys, starts, vals, kfull = decode_case()
    B, H, T, ranks = *vals.shape[:2], DECODE_CACHE, DECODE_RANKS
    ref = mlr_decode_reference(q1.float(), [k.float() for k in keys], starts, vals.float(), ranks, 0.125)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"decode B={B} H={H} cache={T}")
    # MHA's step by SDPA backend. With a fixed key length cuDNN reuses its plan; a decoder's length
    # grows every step, so the layers decode with flash or memory-efficient attention instead.
    mha = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def sdpa_step(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q1, kfull, vals)
        try:
            mha[name] = _graph_ms(sdpa_step)
        except RuntimeError as e:  # a backend this GPU or build lacks
            print(f"  sdpa {name}: failed: {str(e)[:120]}")
            continue
        rows.append(dict(case=f"decode sdpa {name}", cache=T, batch=B, ms=mha[name]))
        print(f"  sdpa {name}: {mha[name] * 1e3:.1f} us", flush=True)
    base = mha.get("flash") or min(mha.values())
    mlr_bytes = sum(k.numel() * k.element_size() for k in keys) + vals.numel() * vals.element_size()
    # (programs per multiprocessor, keys per tile, warps, stages, register cap): the default (4, 64,
    # 4, 3, 128: every region's loop with the next tile in flight, in the shared memory of one
    # 128-key tile) and the ones around it, the default before it (4, 128, 4, 2, 128), the register
    # caps that let more programs share a multiprocessor, and the best of the earlier sweeps
    # (docs/results/bench/gpu-h200/decode-maxnreg.log).
    settings = [(per_sm, 64, 4, 3, maxnreg) for per_sm in (4, 6, 8) for maxnreg in (None, 128, 96)]
    settings += [(4, 64, 4, 2, 128), (4, 128, 4, 2, 128), (4, 128, 4, 3, 128), (8, 64, 4, 2, 96),
                 (2, 256, 4, 2, 168)]
    if args.decode_settings == "default":
        settings = [None]  # mlr_decode_triton's own defaults, whatever the version's are
    for setting in settings:
        named, tuning = {"setting": "default"}, {}
        if setting is not None:
            per_sm, block_n, warps, stages, maxnreg = setting
            named = dict(per_sm=per_sm, block_n=block_n, warps=warps, stages=stages, maxnreg=maxnreg)
            splits = max(1, per_sm * sms // (B * H))
            tuning = dict(chunk=triton.cdiv(triton.cdiv(T + 1, splits), block_n) * block_n, block_n=block_n,
                          num_warps=warps, num_stages=stages, maxnreg=maxnreg)

        def step(tuning=tuning):
            return mlr_decode_triton(q1, keys, starts, vals, ranks, 0.125, **tuning)

        err = float((step().float() - ref).abs().max())
        mlr = _graph_ms(step)
        rows.append(dict(case="decode", cache=T, batch=B, **named, mlr_ms=mlr, max_error=err,
                         **{f"sdpa_{n}_ms": t for n, t in mha.items()}))
        print(f"  {' '.join(f'{k} {v}' for k, v in named.items())}: "
              f"mlr kernel {mlr * 1e3:.1f} us ({base / mlr:.2f}x flash, {mlr_bytes / mlr / 1e9:.2f} TB/s, "
              f"error {err:.1e})", flush=True)
    # The floor without finer levels: level 1 and the values alone, in the default setting.
    floor = _graph_ms(lambda: mlr_decode_triton(q1[..., :8], keys[:1], starts[:1], vals, ranks[:1], 0.125))
    rows.append(dict(case="decode level 1 only", cache=T, batch=B, mlr_ms=floor))
    print(f"  level 1 and values only (default setting): {floor * 1e3:.1f} us", flush=True)
    # and with 128-key tiles and two stages, the default before (each tile's loads waited for
    # before its own arithmetic): what the overlap gives
    floor2 = _graph_ms(lambda: mlr_decode_triton(q1[..., :8], keys[:1], starts[:1], vals, ranks[:1], 0.125,
                                                 block_n=128, num_stages=2))
    rows.append(dict(case="decode level 1 only, 128 keys, 2 stages", cache=T, batch=B, mlr_ms=floor2))
    print(f"  level 1 and values only, 128-key tiles, two stages: {floor2 * 1e3:.1f} us", flush=True)
    # The same reads from one buffer that holds a token's level-1 key and value in one row (144
    # bytes, one run per tile instead of two): does that layout move the bytes faster?
    kv = torch.cat([keys[0], vals], dim=-1)
    k0_in, v_in = kv[..., :ranks[0]], kv[..., ranks[0]:]

    def interleaved():
        return mlr_decode_triton(q1, [k0_in, *keys[1:]], starts, v_in, ranks, 0.125)

    err = float((interleaved().float() - ref).abs().max())
    both = _graph_ms(interleaved)
    alone = _graph_ms(lambda: mlr_decode_triton(q1[..., :ranks[0]], [k0_in], starts[:1], v_in, ranks[:1], 0.125))
    rows.append(dict(case="decode interleaved level 1 and values", cache=T, batch=B, mlr_ms=both, max_error=err))
    rows.append(dict(case="decode interleaved level 1 and values, level 1 only", cache=T, batch=B, mlr_ms=alone))
    print(f"  level-1 keys and values interleaved (default setting): {both * 1e3:.1f} us "
          f"({mlr_bytes / both / 1e9:.2f} TB/s, error {err:.1e}); level 1 and values only {alone * 1e3:.1f} us",
          flush=True)
    # The same step against the cache laid out as a static cache holds it (decode_static: what a
    # captured generation step reads), the slot and the rows' starts read on the device.
    slot = torch.tensor(T, device="cuda")
    offsets = torch.zeros(B, dtype=torch.long, device="cuda")
    sizes = mlr_block_sizes(ranks, CONTEXT)
    rings = one_allocation([torch.zeros(B, H, s, r, device="cuda", dtype=torch.bfloat16)
                            for r, s in zip(ranks[1:], sizes[1:])])
    for ring, held, start, s in zip(rings, keys[1:], starts[1:], sizes[1:]):
        ring[:, :, torch.arange(start, T + 1, device="cuda") % s] = held
    for name, width in (("static", None), ("static interleaved level 1 and values", ranks[0] + vals.shape[-1])):
        level_1, values = (torch.zeros(B, H, CONTEXT, d, device="cuda", dtype=torch.bfloat16)
                           for d in (ranks[0], vals.shape[-1]))
        if width is not None:
            both = torch.zeros(B, H, CONTEXT, width, device="cuda", dtype=torch.bfloat16)
            level_1, values = both[..., :ranks[0]], both[..., ranks[0]:]
        level_1[:, :, :T + 1], values[:, :, :T + 1] = keys[0], vals

        def static_step(level_1=level_1, values=values):
            return decode_static(q1, [level_1, *rings], values, slot, offsets, ranks, sizes, 0.125, False)

        err = float((static_step().float() - ref).abs().max())
        ms = _graph_ms(static_step)
        rows.append(dict(case=f"decode {name}", cache=T, batch=B, mlr_ms=ms, max_error=err))
        print(f"  {name} cache (default setting): {ms * 1e3:.1f} us ({mlr_bytes / ms / 1e9:.2f} TB/s, "
              f"error {err:.1e})", flush=True)
    _write(rows, args.out)


def _write(rows: list[dict], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
