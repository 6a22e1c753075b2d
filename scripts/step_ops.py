"""What one training step of a GPT asks of the device, per attention kind: the ATen operations that
do work (each one or more GPU kernels and a host dispatch; views and allocations left out) and the
activation memory saved for the backward.

    PYTHONPATH=src python3 scripts/step_ops.py [--kinds mha,mlr:8|8|8|8|8|8|8|8] [--seq-len 1024]

One forward+backward of ``sattn bench lm``'s model (d_model 256, 4 layers, 4 heads, batch 1) is run
under a dispatch mode that counts every ATen operation, and under saved-tensor hooks that add up the
storage the backward keeps (parameters left out). On a GPU the step is the real one; without one
(``TRITON_INTERPRET=1``, float32 CPU tensors) MLR takes the Triton route with its kernels as no-ops
(``profile_host.no_op_kernels``), so the counts are those of a GPU step. A GPU-bound step pays the
kernels, a host-bound one the dispatches, and the saved storage is what the step holds at its peak
beyond the weights.
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from profile_host import no_op_kernels  # scripts/ is on the path of a script run from it
from structured_attention.models.gpt import GPT, GPTConfig

# operations that only view or allocate memory: no kernel
_NO_WORK = {"aten.t", "aten.view", "aten.detach", "aten.transpose", "aten._unsafe_view", "aten.slice",
            "aten.expand", "aten.as_strided", "aten.split_with_sizes", "aten.unsqueeze", "aten.squeeze",
            "aten.permute", "aten.alias", "aten.split", "aten.unflatten", "aten.empty", "aten.empty_like",
            "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided", "aten.select", "aten.unbind"}


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def step(kind: str, seq_len: int, device: str, dtype: torch.dtype) -> tuple[collections.Counter[str], float]:
    """The working ATen operations of one training step (forward and backward) and the MiB saved for the backward."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_layers=4, d_model=256, n_heads=4, max_seq_len=seq_len,
                          attention=kind)).to(device=device, dtype=dtype)
    idx = torch.randint(0, 256, (1, seq_len + 1), device=device)
    model(idx[:, :-1], idx[:, 1:])[1].float().sum().backward()  # first calls: plans, tables, compiles
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    for p in model.parameters():
        p.grad = None
    with _Count() as count:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(idx[:, :-1], idx[:, 1:])[1].float().sum()
        loss.backward()
    work = collections.Counter({op: n for op, n in count.ops.items() if op not in _NO_WORK})
    return work, sum(saved.values()) / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", default="mha,mlr:8|8|8|8|8|8|8|8")
    p.add_argument("--seq-len", type=int, default=1024)
    args = p.parse_args()
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        no_op_kernels()
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    print(f"{torch.cuda.get_device_name() if on_gpu else 'CPU (MLR kernels are no-ops)'} | torch {torch.__version__}"
          f" | GPT d 256, 4 layers, 4 heads, batch 1, T {args.seq_len}, {str(dtype).removeprefix('torch.')}")
    for kind in args.kinds.split(","):
        work, mib = step(kind, args.seq_len, device, dtype)
        ops = ", ".join(f"{op.removeprefix('aten.')} {n}" for op, n in work.most_common())
        print(f"{kind}: {sum(work.values())} working ATen operations, {mib:.1f} MiB saved for the backward\n  {ops}")


if __name__ == "__main__":
    main()
