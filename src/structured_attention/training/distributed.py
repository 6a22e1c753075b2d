"""torch.distributed set-up: DDP (or FSDP) when launched by ``torchrun`` (``RANK``/``WORLD_SIZE`` set).

Backend: ``nccl`` on CUDA, ``gloo`` on CPU. Without those variables (or with ``WORLD_SIZE=1``) the
run is a single process and nothing is initialised.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DistInfo", "all_reduce_mean", "barrier", "cleanup_distributed", "setup_distributed", "wrap_model"]


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    initialized_here: bool = False  # whether setup_distributed created the process group

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _pick_device(pref: str, local_rank: int) -> torch.device:
    if pref == "cuda" or (pref == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("run.device: 'cuda' was asked for but no CUDA device is available")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"run.device: expected a CUDA device for each process of this machine, got process "
                             f"LOCAL_RANK={local_rank} and {torch.cuda.device_count()} device(s) (start fewer "
                             f"processes per machine, or set run.device=cpu)")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup_distributed(device: str = "auto") -> DistInfo:
    """Initialise the process group from the ``torchrun`` environment, if any."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    dev = _pick_device(device, local_rank if world_size > 1 else 0)
    if world_size <= 1:
        return DistInfo(device=dev)
    created = False
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world_size)
        created = True
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=dev, initialized_here=created)


def cleanup_distributed(info: DistInfo) -> None:
    if info.initialized_here and dist.is_initialized():
        # A reference cycle inside torch (the frames of DDP's construction, held by a lazy import) can
        # keep the DDP wrapper, and the gloo work it holds, alive past training. Freed during
        # interpreter exit, that work aborts the process ("terminate called without an active
        # exception", seen in CI), so free it now, while the group still exists.
        gc.collect()
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def all_reduce_mean(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= info.world_size
    return t


def wrap_model(model: nn.Module, info: DistInfo, fsdp: bool) -> nn.Module:
    """DDP, or FSDP (``fully_shard`` per block, then the whole model), when distributed; else the
    model itself. FSDP shards in place (the returned module is ``model``)."""
    if fsdp:
        if not info.enabled:
            return model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # The run's device, not fully_shard's default (the machine's accelerator): on a machine with
        # a GPU, run.device=cpu would otherwise shard onto a CUDA mesh over a gloo group.
        mesh = init_device_mesh(info.device.type, (info.world_size,))
        for block in getattr(model, "blocks", []):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if not info.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[info.local_rank] if info.device.type == "cuda" else None)
