"""torch.compile and torch.library: MLR attention's custom ops pass ``opcheck``, and every attention
kind's layer, a GPT training step and a one-token decoding step through the cache compile whole
(``fullgraph=True``, so any graph break fails) and agree with the same code run eagerly.

The eager run is the independent computation: the compiled graph holds the same custom ops, so
agreement checks that tracing (fake implementations, registered autograd, the cache's Python
state) changed nothing. Inductor is tested on the MLR cases; every kind runs under aot_eager,
which traces forward and backward the same way without generating code.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.library import opcheck

import structured_attention.ops.mlr.blocked  # noqa: F401  (registers sattn::mlr_blocked_*)
from structured_attention.attention import build_attention
from structured_attention.models.gpt import GPT, GPTConfig
from structured_attention.ops.mlr import cpu, mlr_attention, mlr_decode

SPECS = ["mha", "mha:n_kv_heads=1", "swa:window=8", "global_swa:window=8", "bilinear_btt", "bilinear_mlr",
         "bilinear_mlr:key_map=true", "mlr:8|4|2|2", "mlr:8|4|2|2:depth_normalize=true", "mlr:8|4|2|2:n_kv_heads=1",
         "mlr:8|4|2|2:causal=false", "mlr:8|4|2|2:rotary=true:qk_norm=true"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graph_ops(fn, *args):
    """Run ``fn`` compiled whole under aot_eager; return its outputs and the call targets of its graph."""
    targets: set[str] = set()

    def backend(gm, example_inputs):
        targets.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    return torch.compile(fn, fullgraph=True, backend=backend)(*args), targets


def _rand(*shape, dtype=torch.float64, grad=False, seed=[0]):  # noqa: B006 - a counter for distinct draws
    seed[0] += 1
    x = torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed[0]))
    return x.requires_grad_(grad)


# --------------------------------------------------------------------------------------------------
# The custom ops themselves
# --------------------------------------------------------------------------------------------------

N, T, R, DV = 2, 24, 8, 4
SIZES, OFFSETS = [32, 8], [0, 4, 8]


def _needs_cpu_kernel():
    if not cpu.available():
        pytest.skip("the C++ kernel cannot be built here (no compiler or ninja)")


def _needs_triton():
    pytest.importorskip("triton", reason="triton is not installed")
    from structured_attention.ops.mlr.triton_common import INTERPRETED

    if not torch.cuda.is_available() and not INTERPRETED:
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")


def _triton_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_opcheck_blocked_forward_and_backward():
    q, k, v = _rand(N, T, R, grad=True), _rand(N, T, R, grad=True), _rand(N, T, DV, grad=True)
    cfg = (SIZES, OFFSETS, True, 0.5, False, 8)
    opcheck(torch.ops.sattn.mlr_blocked_forward.default, (q, k, v, *cfg))
    out = torch.ops.sattn.mlr_blocked_forward(q, k, v, *cfg)
    opcheck(torch.ops.sattn.mlr_blocked_backward.default,
            (_rand(N, T, DV), q.detach(), k.detach(), v.detach(), out.detach(), *cfg))


def test_opcheck_cpu_forward_backward_and_decode():
    _needs_cpu_kernel()
    # two query heads on one key head (GQA), read in place from (B, T, H, D) memory, dims reordered
    q = _rand(1, T, N, R).transpose(1, 2).requires_grad_()
    k, v = _rand(1, 1, T, R, grad=True), _rand(1, T, 1, DV).transpose(1, 2).requires_grad_()
    documents = torch.tensor([[0] * 20 + [1] * (T - 20)])  # two documents, read as segments inside the ops
    for document_ids in (None, documents):
        cfg = (document_ids, SIZES, OFFSETS, [3, 0, 1, 2, 7, 6, 5, 4], 0.5, False, True)
        opcheck(torch.ops.sattn.mlr_cpu_forward.default, (q, k, v, *cfg))
        out, lse = torch.ops.sattn.mlr_cpu_forward(q, k, v, *cfg)
        opcheck(torch.ops.sattn.mlr_cpu_backward.default,
                (_rand(1, N, T, DV), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), *cfg))
    keys = [_rand(1, 2, T, 4), _rand(1, 2, T - 16, 4)]
    for row_starts in (None, torch.tensor([[3, 20]])):
        opcheck(torch.ops.sattn.mlr_cpu_decode.default,
                (_rand(1, 2, R), keys, [0, 16], _rand(1, 2, T, DV), 0.5, True, row_starts))


@pytest.mark.parametrize("kernel", ["general", "prefix"])
def test_opcheck_triton_forward_and_backward(kernel):
    _needs_triton()
    import structured_attention.ops.mlr.triton_general  # noqa: F401  (registers the Triton ops)

    dev, f32 = _triton_device(), torch.float32
    q, k = (_rand(1, 2, 32, 32, dtype=f32).to(dev).requires_grad_() for _ in range(2))
    v = _rand(1, 2, 32, 16, dtype=f32).to(dev).requires_grad_()
    # two documents, read as segments inside the ops (every other test passes None, whole rows)
    document_ids = torch.tensor([[0] * 20 + [1] * 12], device=dev)
    # the ops of packed documents, tagged for inductor's CUDA graphs (they read the ids on the host);
    # the whole-row ops are the same functions, untagged
    name = "mlr_triton_varlen" if kernel == "general" else "mlr_triton_prefix_varlen"
    fwd, bwd = getattr(torch.ops.sattn, f"{name}_forward"), getattr(torch.ops.sattn, f"{name}_backward")
    assert all(torch.Tag.cudagraph_unsafe in op.default.tags for op in (fwd, bwd))
    whole = getattr(torch.ops.sattn, name.removesuffix("_varlen") + "_forward")
    assert torch.Tag.cudagraph_unsafe not in whole.default.tags
    if kernel == "general":
        cfg = (document_ids, [16, 8, 8], [32, 12, 6], True, 0.2, False, 16, 16)
    else:
        cfg = (document_ids, [16, 8, 8], [32, 32, 16], True, 0.2, False, [16] * 6 + [4, 2])
    opcheck(fwd.default, (q, k, v, *cfg))
    out, lse = fwd(q, k, v, *cfg)
    do = _rand(1, 2, 32, 16, dtype=f32).to(dev)
    opcheck(bwd.default, (do, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), *cfg))


def test_opcheck_triton_decode():
    _needs_triton()
    import structured_attention.ops.mlr.triton_decode  # noqa: F401  (registers sattn::mlr_triton_decode)

    dev, f32 = _triton_device(), torch.float32
    keys = [_rand(1, 2, T, 4, dtype=f32).to(dev), _rand(1, 2, T - 16, 4, dtype=f32).to(dev)]
    for row_starts in (None, torch.tensor([[3, 20]], device=dev)):
        args = (_rand(1, 2, 1, R, dtype=f32).to(dev), keys, [0, 16], _rand(1, 2, T, DV, dtype=f32).to(dev), [4, 4],
                0.5, False, row_starts, 16, 16, 4, 2, None)
        opcheck(torch.ops.sattn.mlr_triton_decode.default, args)


# --------------------------------------------------------------------------------------------------
# Whole graphs: the dispatcher, every layer, a training step, a decoding step
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "blocked"])
def test_dispatcher_compiles_to_one_custom_op_forward_and_backward(kernel, monkeypatch):
    if kernel:
        _needs_cpu_kernel()
    else:
        monkeypatch.setattr(cpu, "available", lambda: False)
    q, k, v = _rand(1, 4, 40, 8, grad=True), _rand(1, 2, 40, 8, grad=True), _rand(1, 2, 40, 6, grad=True)

    def f(q, k, v):
        return mlr_attention(q, k, v, (4, 2, 2), (64, 16, 4), causal=True)

    out, targets = _graph_ops(f, q, k, v)
    op = "sattn.mlr_cpu_forward.default" if kernel else "sattn.mlr_blocked_forward.default"
    assert op in targets
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref = f(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", ["general", "prefix"])
def test_triton_calls_compile_to_their_op_and_run_without_it_eagerly(kernel, no_dynamo_warnings):
    # Eagerly, the Triton kernels' functions run in an autograd.Function (the op's dispatch costs
    # the host tens of microseconds a call), or alone without grad; a compiled graph holds the op.
    # Same results every way.
    _needs_triton()
    from structured_attention.ops.mlr import triton_general

    op = f"sattn::mlr_triton{'_prefix' if kernel == 'prefix' else ''}_forward"
    dev, f32 = _triton_device(), torch.float32
    q, k = (_rand(1, 2, 32, 16, dtype=f32).to(dev).requires_grad_() for _ in range(2))
    v = _rand(1, 2, 32, 8, dtype=f32).to(dev).requires_grad_()
    tiles = {"block_m": 16, "block_n": 32} if kernel == "general" else {}

    def f(q, k, v):
        return triton_general.mlr_attention_triton(q, k, v, (8, 4, 4), (32, 16, 8), **tiles)

    with torch.profiler.profile() as prof:
        ref = f(q, k, v)
    assert op not in {e.name for e in prof.events()}
    with torch.no_grad():  # nothing to record: the function alone, no autograd node
        plain = f(q, k, v)
    assert ref.grad_fn is not None and plain.grad_fn is None
    torch.testing.assert_close(plain, ref, rtol=0, atol=0)
    out, targets = _graph_ops(f, q, k, v)
    assert op.replace("::", ".") + ".default" in targets
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for got, want in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_triton_decoding_step_compiles_to_its_op_and_runs_without_it_eagerly():
    _needs_triton()
    from structured_attention.ops.mlr import triton_decode

    dev, f32 = _triton_device(), torch.float32
    keys = [_rand(1, 2, T, 4, dtype=f32).to(dev), _rand(1, 2, T - 16, 4, dtype=f32).to(dev)]
    q, v = _rand(1, 2, 1, R, dtype=f32).to(dev), _rand(1, 2, T, DV, dtype=f32).to(dev)

    def step(q, k0, k1, v):
        return triton_decode.decode(q, [k0, k1], [0, 16], v, [4, 4], 0.5, False, chunk=16, block_n=16)

    with torch.profiler.profile() as prof:
        ref = step(q, *keys, v)
    assert "sattn::mlr_triton_decode" not in {e.name for e in prof.events()}
    out, targets = _graph_ops(step, q, *keys, v)
    assert "sattn.mlr_triton_decode.default" in targets
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_opcheck_static_decoding_ops():
    from structured_attention.functional.decode import masked_decode, prefix_decode
    from structured_attention.ops.mlr.static import mlr_decode_static

    slot, offsets = torch.tensor(21), torch.tensor([0, 3])
    real = torch.ones(2, T, dtype=torch.bool)
    opcheck(masked_decode, (_rand(2, 4, 1, R), _rand(2, 2, T, R), _rand(2, 2, T, DV), real, 0.5))
    real[:, 22:] = False  # a static cache before its end, one row padded: the CPU reads 22 slots, masked
    real[1, :3] = False
    opcheck(masked_decode, (_rand(2, 4, 1, R), _rand(2, 2, T, R), _rand(2, 2, T, DV), real, 0.5))
    for rows in (offsets, torch.zeros(2, dtype=torch.long)):  # one row padded (masked), none (no mask)
        opcheck(prefix_decode, (_rand(2, 4, 1, R), _rand(2, 2, T, R), _rand(2, 2, T, DV), rows, slot, 0.5))
    keys = [_rand(2, 2, T, 4), _rand(2, 2, 8, 4)]
    opcheck(mlr_decode_static, (_rand(2, 4, 1, R), keys, _rand(2, 2, T, DV), slot, offsets, [4, 4], [32, 8], 0.5, True))


def test_decode_dispatch_compiles_to_the_cpu_kernel():
    _needs_cpu_kernel()
    keys = [_rand(1, 2, T, 4), _rand(1, 2, T - 16, 4)]
    args = (_rand(1, 2, 1, R), keys, [0, 16], _rand(1, 2, T, DV), (4, 4), 0.5)
    out, targets = _graph_ops(mlr_decode, *args)
    assert "sattn.mlr_cpu_decode.default" in targets
    torch.testing.assert_close(out, mlr_decode(*args), rtol=1e-12, atol=1e-12)


def _layer_and_input(spec, seed=0):
    torch.manual_seed(seed)
    layer = build_attention(spec, d_model=32, n_heads=2, max_seq_len=64)
    x = torch.randn(2, 48, 32, requires_grad=True)
    return layer, x


def _forward_backward(layer, x):
    out = layer(x)
    grads = torch.autograd.grad(out.square().sum(), (x, *layer.parameters()))
    return out, grads


# One spec per attention kind (MLR with rotary and qk_norm): these take batches of several lengths
ONE_PER_KIND = ["mha", "swa:window=8", "global_swa:window=8", "bilinear_btt", "bilinear_mlr",
                "mlr:8|4|2|2:rotary=true:qk_norm=true"]


@pytest.mark.parametrize("spec", SPECS)
def test_every_layer_compiles_whole_forward_and_backward(spec, no_dynamo_warnings):
    """Every spec at one length. One spec per kind at three: two graphs, the first length's and
    then one with the length symbolic, as torch.compile's automatic dynamic shapes make them, and
    for a sliding window one more once the batch outgrows its 64-row query tile (one tile, then
    several). SDPA refused a symbolic is_causal (an error at the second length), and the window's
    tile, min(64, T), fixed the length below 64 (a graph per length, and a failed view in the
    symbolic one)."""
    torch.manual_seed(0)
    layer = build_attention(spec, d_model=32, n_heads=2, max_seq_len=128)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    lengths = (12, 16, 72) if spec in ONE_PER_KIND else (48,)
    for length in lengths:
        x = torch.randn(2, length, 32, requires_grad=True)
        torch.testing.assert_close(_forward_backward(compiled, x), _forward_backward(layer, x), rtol=1e-5, atol=1e-5)
    assert len(graphs) == (1 if len(lengths) == 1 else 3 if "swa" in spec else 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", ["mlr:8|4|2|2", "mlr:8|4|2|2:n_kv_heads=1"])
def test_mlr_layer_compiles_whole_on_cuda(spec):
    """On CUDA the graph holds the Triton kernels' custom ops; compiled equals eager."""
    pytest.importorskip("triton", reason="triton is not installed")
    layer, x = _layer_and_input(spec)
    layer, x = layer.cuda(), x.detach().cuda().requires_grad_()
    eager = _forward_backward(layer, x)
    out, targets = _graph_ops(layer, x)
    assert any(t.startswith("sattn.mlr_triton") for t in targets), targets
    compiled = _forward_backward(torch.compile(layer, fullgraph=True), x)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def _gpt(spec):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=64, attention=spec))


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "activation-checkpointing"])
def test_gpt_training_step_compiles_whole(checkpointed):
    # Whole (fullgraph) is Dynamo's trace, the same under every backend; inductor's code for a GPT's
    # training step is tested by the training loop (tests/test_training.py, run.compile=true). With
    # activation checkpointing the compiled model's blocks are computed again in its backward.
    model = _gpt("mlr:8|4|2|2")
    twin = copy.deepcopy(model)
    model.backbone.activation_checkpointing = checkpointed
    step_model = torch.compile(model, fullgraph=True, backend="aot_eager")
    opt, twin_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):  # three steps: the compiled graph is reused after the weights change
        idx = torch.randint(0, 64, (2, 40), generator=gen)
        targets = torch.randint(0, 64, (2, 40), generator=gen)
        losses = []
        for m, o, fn in ((model, opt, step_model), (twin, twin_opt, twin)):
            o.zero_grad()
            _, loss = fn(idx, targets)
            loss.backward()
            o.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_gpt_training_steps_replay_from_cuda_graphs_and_equal_eager(packed):
    """torch.compile(mode="reduce-overhead"), the training loop's run.compile_mode: each step's
    kernels (the Triton kernels' custom ops among them) recorded in CUDA graphs and replayed, with
    no graph skipped, training as eager does. Packed documents too: their ops read the ids on the
    host, and inductor records the graph around them (VARLEN_TAGS)."""
    pytest.importorskip("triton", reason="triton is not installed")
    from torch._dynamo.utils import counters

    model = _gpt("mlr:8|4|2|2").cuda()
    twin = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    step_model = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    opt, twin_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin))
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):  # recorded on the first steps, replayed after the weights change
        idx, targets = (torch.randint(0, 64, (2, 40), generator=gen).cuda() for _ in range(2))
        documents = {"document_ids": torch.tensor([[0] * 15 + [1] * 25, [0] * 40]).cuda()} if packed else {}
        losses = []
        for m, o, fn in ((model, opt, step_model), (twin, twin_opt, twin)):
            o.zero_grad()
            torch.compiler.cudagraph_mark_step_begin()
            _, loss = fn(idx, targets, **documents)
            loss.backward()
            o.step()
            losses.append(loss.detach().clone())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    assert counters["inductor"]["cudagraph_skips"] == 0
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)


# The cache's position is a Python int, so each step is traced anew for its position (static caches
# that hold it on the device are the way to one graph for every step): the compiled steps are the
# last position of a block of 4 and 8 and the first of the next (24 and 28), the others run eagerly.
DECODE_STEPS = (23, 24, 27, 28)


@pytest.mark.parametrize("spec", ["mha", "swa:window=8", "bilinear_btt", "mlr:8|4|2|2",
                                  "mlr:8|4|2|2:depth_normalize=true"])
def test_one_token_decoding_step_compiles_whole(spec):
    layer = build_attention(spec, d_model=32, n_heads=2, max_seq_len=64).eval()
    x = torch.randn(1, 40, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=len(DECODE_STEPS)):
        full = layer(x)
        cache = layer.new_cache(1)
        layer(x[:, :20], cache)
        step = torch.compile(lambda token: layer(token, cache), fullgraph=True, backend="aot_eager")
        steps = [(step if t in DECODE_STEPS else lambda token: layer(token, cache))(x[:, t : t + 1])
                 for t in range(20, DECODE_STEPS[-1] + 1)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 20 : DECODE_STEPS[-1] + 1], rtol=1e-5, atol=1e-5)


def test_gpt_decoding_step_compiles_whole():
    # A GPT's growing caches, whole (fullgraph). Inductor's code for a GPT's decoding step is tested
    # where users compile it, the static-cache step of generate(compile=True) (test_static_cache.py),
    # and the C++ decoding op's registration by opcheck above.
    model = _gpt("mlr:8|4|2|2").eval()
    idx = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(4))
    # one step, starting new blocks of 4 and 8 (each position is a graph of its own: the layers'
    # steps at other positions are in test_one_token_decoding_step_compiles_whole)
    first, last = 24, 25
    with torch.no_grad():
        full, _ = model(idx)
        caches = model.new_caches(1)
        model(idx[:, :first], caches=caches)
        step = torch.compile(lambda token: model(token, caches=caches)[0], fullgraph=True, backend="aot_eager")
        logits = [step(idx[:, t : t + 1]) for t in range(first, last)]
    torch.testing.assert_close(torch.cat(logits, dim=1), full[:, first:last], rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------
# Errors: the same one line inside torch.compile as outside
# --------------------------------------------------------------------------------------------------

BAD_CALLS = [
    (dict(ranks=(8, 4)), "ranks: expected values summing to R=8"),
    (dict(ranks=(4, 4), block_sizes=(16, 6)), "block_sizes: expected strictly decreasing sizes"),
    (dict(ranks=(4, 4), scale=-1.0), "scale: expected a finite positive number or None, got -1.0"),
]


@pytest.mark.parametrize("kwargs,message", BAD_CALLS, ids=["ranks", "block_sizes", "scale"])
def test_bad_arguments_raise_the_same_line_compiled(kwargs, message):
    q = torch.randn(1, 2, 16, 8)
    with pytest.raises(ValueError, match=message) as eager:
        mlr_attention(q, q, q, **kwargs)
    with pytest.raises(ValueError) as compiled:
        torch.compile(mlr_attention, backend="aot_eager")(q, q, q, **kwargs)
    assert str(compiled.value) == str(eager.value)
    torch._dynamo.reset()
    # fullgraph=True forbids the fallback to eager, so Dynamo reports the error as its own exception,
    # whose text carries the same line.
    with pytest.raises(torch._dynamo.exc.Unsupported, match=message.replace("(", r"\(")):
        torch.compile(mlr_attention, fullgraph=True, backend="aot_eager")(q, q, q, **kwargs)


def test_the_package_marks_constants_as_pytorchs_decorator_does():
    """``_compiler.assume_constant_result`` sets on a function what ``torch.compiler``'s decorator
    sets (so compiled calls still take ``cpu.available()`` and ``has_triton()`` as constants), and
    importing the package and its command line leaves ``torch._dynamo`` unimported (3 s a process)."""
    import subprocess
    import sys

    from structured_attention._compiler import assume_constant_result
    from structured_attention.ops.mlr import cpu_build, dispatch

    def ours():
        return 1

    def theirs():
        return 1

    assume_constant_result(ours)
    torch.compiler.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) != {}
    assert all(vars(theirs).items() <= vars(fn).items() for fn in (cpu_build.available, dispatch.has_triton))
    code = ("import sys, structured_attention.cli.main, structured_attention.experiments, structured_attention.ops.mlr; "
            "print('torch._dynamo' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
