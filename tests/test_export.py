"""torch.export of a GPT of every attention kind, with the batch and the length dynamic: the exported
program, run at lengths on both sides of the sliding window's 64-row tile and with padded and packed
batches, gives the logits of the model run eagerly, and saved and loaded again it still does. And
of its one-token decoding step on static caches (DecodingStep), which continues the caches as eager
steps do."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim, export

from structured_attention.models.decoding import DecodingStep
from structured_attention.models.gpt import GPT, GPTConfig

# One spec per kind; the window and the MLR blocks smaller than the lengths below, so that a batch
# spans several tiles and blocks
SPECS = ["mha:n_kv_heads=2", "swa:16", "global_swa:4|12", "mlr:8|4|4", "bilinear_mlr:8|4", "bilinear_btt:2"]
SHAPES = [(1, 2), (2, 63), (4, 64), (3, 129), (2, 200)]
# CUDA: the Triton kernels and FlexAttention inside a trace (the GPU check runs this file)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs a CUDA device"))]


class _Logits(torch.nn.Module):
    def __init__(self, model: GPT, batch: str) -> None:
        super().__init__()
        self.model, self.batch = model, batch

    def forward(self, idx: torch.Tensor, aux: torch.Tensor | None = None) -> torch.Tensor:
        if self.batch == "padded":
            return self.model(idx, attention_mask=aux)[0]
        if self.batch == "packed":
            return self.model(idx, document_ids=aux)[0]
        return self.model(idx)[0]


def _inputs(batch: str, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    idx = torch.randint(0, 50, (b, t))
    if batch == "padded":  # the first row left-padded, the last right-padded
        mask = torch.ones(b, t, dtype=torch.bool)
        mask[0, : t // 3] = False
        mask[-1, t - t // 4:] = False
        mask[-1, 0] = True
        return idx, mask
    if batch == "packed":  # three documents a row (one where t is short)
        return idx, ((torch.arange(t) >= t // 3).long() + (torch.arange(t) >= t // 2).long()).expand(b, t).contiguous()
    return idx, None


def _on(device: str, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    return tuple(None if t is None else t.to(device) for t in tensors)


def _tolerance(device: str) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if device == "cpu" else {"rtol": 1e-4, "atol": 1e-4}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", ["plain", "padded", "packed"])
@pytest.mark.parametrize("spec", SPECS)
def test_an_exported_gpt_takes_every_batch_and_length(spec, batch, device):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, d_model=64, n_heads=4, n_layers=2, max_seq_len=256,
                          attention=spec)).to(device).eval()
    wrapped = _Logits(model, batch)
    idx, aux = _on(device, *_inputs(batch, 3, 100))
    dims = {0: Dim("batch", min=1, max=8), 1: Dim("seq_len", min=2, max=256)}
    program = export(wrapped, (idx, aux), dynamic_shapes=(dims, dims if aux is not None else None))
    for b, t in SHAPES:
        idx, aux = _on(device, *_inputs(batch, b, t))
        with torch.no_grad():
            torch.testing.assert_close(program.module()(idx, aux), wrapped(idx, aux), **_tolerance(device))


def test_an_exported_program_saved_and_loaded_runs_the_packages_ops(tmp_path):
    """The program holds the package's custom ops (sattn::), which a loading process has once it
    imports structured_attention."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, d_model=64, n_heads=4, n_layers=2, max_seq_len=256,
                          attention="mlr:8|4|4,swa:16")).eval()
    wrapped = _Logits(model, "packed")
    idx, ids = _inputs("packed", 2, 100)
    dims = {0: Dim("batch", min=1, max=8), 1: Dim("seq_len", min=2, max=256)}
    program = export(wrapped, (idx, ids), dynamic_shapes=(dims, dims))
    assert any(str(node.target).startswith("sattn.") for node in program.graph.nodes)
    torch.export.save(program, tmp_path / "gpt.pt2")
    loaded = torch.export.load(tmp_path / "gpt.pt2")
    idx, ids = _inputs("packed", 3, 150)
    with torch.no_grad():
        torch.testing.assert_close(loaded.module()(idx, ids), wrapped(idx, ids), rtol=1e-5, atol=1e-5)


def _prefilled_twice(model: GPT, prompt: torch.Tensor, padding: list[int]) -> tuple[torch.Tensor, list, list]:
    """Two sets of static caches filled by the same left-padded prompts (``padding[b]`` tokens of
    row ``b``): one for the step under test, one for the eager steps it is compared with; and the
    prompts' logits."""
    mask = torch.ones(prompt.shape, dtype=torch.bool, device=prompt.device)
    for row, pad in enumerate(padding):
        mask[row, :pad] = False
    caches, eager = model.new_caches(prompt.shape[0], static=True), model.new_caches(prompt.shape[0], static=True)
    with torch.no_grad():
        logits = model(prompt, caches=caches, attention_mask=mask)[0]
        model(prompt, caches=eager, attention_mask=mask)
    return logits, caches, eager


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS)
def test_an_exported_decoding_step_continues_a_padded_prompt_as_eager_steps_do(spec, device):
    """60 greedy steps after left-padded prompts (past the window and across MLR blocks): the
    program's logits are those of eager steps on caches the same prompts filled, and it wrote into
    the caches themselves."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, d_model=64, n_heads=4, n_layers=2, max_seq_len=96,
                          attention=spec)).to(device).eval()
    prompt = torch.randint(0, 50, (3, 20), device=device)
    logits, caches, eager = _prefilled_twice(model, prompt, [5, 12, 0])
    with torch.no_grad():
        program = export(DecodingStep(model, caches), (prompt[:, -1:],))
        step = program.module()
        token = logits[:, -1:].argmax(-1)
        for _ in range(60):
            got = step(token)
            torch.testing.assert_close(got, model(token, caches=eager)[0], **_tolerance(device))
            token = got[:, -1:].argmax(-1)
    for cache, reference in zip(caches, eager):
        torch.testing.assert_close(cache.tensors(), reference.tensors(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_a_saved_decoding_step_reads_its_prompt_token_by_token_and_starts_again(tmp_path, device):
    """From empty caches, saved and loaded again: fed a sequence token by token, the program gives
    the model's logits of the whole sequence; with its slots set to 0, those of another one."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, d_model=64, n_heads=4, n_layers=3, max_seq_len=64,
                          attention="mlr:8|4|4,swa:16,mha")).to(device).eval()
    token = torch.zeros(2, 1, dtype=torch.long, device=device)
    with torch.no_grad():
        program = export(DecodingStep(model, model.new_caches(2, static=True)), (token,))
    torch.export.save(program, tmp_path / "step.pt2")
    step = torch.export.load(tmp_path / "step.pt2").module()
    assert any(str(node.target).startswith("sattn.") for node in program.graph.nodes)
    for length in (40, 64):
        sequence = torch.randint(0, 50, (2, length), device=device)
        with torch.no_grad():
            got = torch.cat([step(sequence[:, i:i + 1]) for i in range(length)], dim=1)
            torch.testing.assert_close(got, model(sequence)[0], **_tolerance(device))
        for name, buffer in step.named_buffers():
            if name.endswith(".slot"):
                buffer.zero_()


@pytest.mark.parametrize("device", DEVICES)
def test_an_aotinductor_package_of_the_step_continues_caches_it_takes_as_inputs(tmp_path, device):
    """AOTInductor's package of a step that takes the caches' tensors as inputs (inputs=True), after
    left-padded prompts: the logits of eager steps on caches the same prompts filled."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, d_model=64, n_heads=4, n_layers=2, max_seq_len=64,
                          attention="mlr:8|4|4,swa:16")).to(device).eval()
    prompt = torch.randint(0, 50, (2, 12), device=device)
    logits, caches, eager = _prefilled_twice(model, prompt, [0, 7])
    with torch.no_grad():
        step = DecodingStep(model, caches, inputs=True)
        # contiguous, as the tokens below: a package reads its inputs with the example's strides
        program = export(step, (prompt[:, -1:].contiguous(), step.tensors()))
        package = torch._inductor.aoti_load_package(
            torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "step.pt2")))
        token = logits[:, -1:].argmax(-1)
        for _ in range(30):  # past the window and an MLR block
            got = package(token, step.tensors())
            torch.testing.assert_close(got, model(token, caches=eager)[0], **_tolerance(device))
            token = got[:, -1:].argmax(-1)


def test_a_compiled_decoding_step_reads_its_prompt_token_by_token():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, d_model=64, n_heads=4, n_layers=2, max_seq_len=64,
                          attention="mlr:8|4|4,swa:16")).eval()
    step = torch.compile(DecodingStep(model, model.new_caches(2, static=True)), backend="aot_eager", fullgraph=True)
    sequence = torch.randint(0, 50, (2, 40))
    with torch.no_grad():
        got = torch.cat([step(sequence[:, i:i + 1]) for i in range(40)], dim=1)
        torch.testing.assert_close(got, model(sequence)[0], rtol=1e-5, atol=1e-5)


def test_a_decoding_step_takes_static_caches_of_the_model():
    model = GPT(GPTConfig(vocab_size=50, d_model=32, n_heads=2, n_layers=2, max_seq_len=32, attention="mlr:8|8"))
    with pytest.raises(ValueError, match=r"^caches: expected a list of 2 static caches"):
        DecodingStep(model, model.new_caches(1))
    with pytest.raises(ValueError, match=r"^caches: expected a list of 2 static caches"):
        DecodingStep(model, model.new_caches(1, static=True)[:1])
    caches = model.new_caches(1, static=True)
    model.blocks[0].attn.fill_static(caches[0])
    with pytest.raises(ValueError, match=r"^caches: expected all prefilled by one prompt or none"):
        DecodingStep(model, caches)
    token = torch.zeros(1, 1, dtype=torch.long)
    step = DecodingStep(model, model.new_caches(1, static=True))
    with pytest.raises(ValueError, match=r"^tensors: expected the caches' tensors .* with inputs=True, else None"):
        step(token, step.tensors())
    step = DecodingStep(model, model.new_caches(1, static=True), inputs=True)
    with pytest.raises(ValueError, match=r"^tensors: expected the caches' tensors"):
        step(token)
    with pytest.raises(ValueError, match=r"^tensors: expected 2 dicts, one per layer, got 1"):
        step(token, step.tensors()[:1])
