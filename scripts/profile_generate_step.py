"""Where one GPT generation step goes, per attention kind and cache mode (growing, static, compiled,
and on CUDA graph: the compiled step and the token's choice captured in one CUDA graph).

    PYTHONPATH=src python3 scripts/profile_generate_step.py [--device cuda] [--batch 16] [--out FILE.txt]

The model and sizes of ``sattn bench generate`` (2 layers, width 512, 8 heads, a 16368-token
prompt). For each kind and mode it prints the step's wall time, the number of device kernels and
CUDA-graph launches one step issues, and writes the profiler's table of the step (top operators by
device time; on the CPU inductor's generated loops each a row) to ``--out``: whether a compiled
step really replays one graph, and which kernels hold the static cache's step back.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from structured_attention.models import GPT, GPTConfig
from structured_attention.models.decoding import CapturedDecoding

KINDS = ("mha", "mlr:8|8|8|8|8|8|8|8")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--cache-len", type=int, default=16368,
                   help="prompt length; plus 16 decoded tokens, the context (a multiple of 128 for MLR)")
    p.add_argument("--compile-mode", default="reduce-overhead")
    p.add_argument("--out", default="generate-profile.txt")
    args = p.parse_args()
    device, dtype = torch.device(args.device), torch.bfloat16 if args.device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # inductor's CPU loops as rows of their own in the table, not inside the compiled graph's call
    torch._inductor.config.cpp.enable_kernel_profile = True
    tables = []
    for kind in KINDS:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, n_layers=2, d_model=512, n_heads=8, max_seq_len=args.cache_len + 16,
                              attention=kind)).to(device, dtype).eval()
        prompt = torch.randint(0, 256, (args.batch, args.cache_len), device=device)
        with torch.no_grad():
            prefilled = model.new_caches(args.batch)
            model(prompt, caches=prefilled)
            compiled = torch.compile(model._decode_step, fullgraph=True, dynamic=False, mode=args.compile_mode)
            modes = [("growing", model._decode_step), ("static", model._decode_step), ("compiled", compiled)]
            if device.type == "cuda":  # a function of its own: compiled in the default mode, then captured
                modes.append(("graph", torch.compile(lambda token, caches: model._decode_step(token, caches),
                                                     fullgraph=True, dynamic=False)))
            for mode, step in modes:
                caches = copy.deepcopy(prefilled)
                if mode != "growing":
                    caches = [block.attn.static_cache(c) for block, c in zip(model.blocks, caches)]
                token = prompt[:, -1:]
                advance = greedy(step, caches)
                if mode == "graph":  # 13 steps: the warm-up's, the timed ones and the profiled one
                    captured = CapturedDecoding(lambda t, step=step, caches=caches: step(t, caches),
                                                lambda logits: logits.argmax(-1), args.batch, 13, device)
                    captured.start(token[:, 0])
                    advance = lambda token, captured=captured: captured()[:, None]  # noqa: E731
                for _ in range(4):  # warm-up (compiles, records the graph)
                    token = advance(token)
                sync()
                t0 = time.perf_counter()
                for _ in range(8):
                    token = advance(token)
                sync()
                ms = (time.perf_counter() - t0) / 8 * 1e3
                with profile(activities=activities) as prof:
                    token = advance(token)
                    sync()
                events = prof.events()
                kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
                graphs = sum(1 for e in events if e.name == "cudaGraphLaunch")
                line = f"{kind:22s} {mode:9s} batch {args.batch}: {ms:7.3f} ms/step, {kernels} kernels, {graphs} graph launches"
                print(line, flush=True)
                sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
                tables.append(f"## {line}\n{prof.key_averages().table(sort_by=sort, row_limit=15)}")
    with open(args.out, "w") as f:
        f.write("\n\n".join(tables))


def greedy(step: Callable[..., torch.Tensor], caches: list) -> Callable[[torch.Tensor], torch.Tensor]:
    """One greedy step from ``token`` ``(B, 1)``: the next token, ``(B, 1)``."""
    return lambda token: step(token, caches)[:, -1].argmax(-1, keepdim=True)


if __name__ == "__main__":
    main()
