"""Training under ``torchrun``: this process's place (:class:`Distributed`), the process group, DDP
replicas and FSDP2 shards, the loss averaged over processes, and whether the replicas agree."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lowprec_demo.book.runtime import pick_device

__all__ = ["Distributed", "init_distributed", "finish_distributed", "DataParallel", "mean_over_ranks",
           "replicas_identical", "shard_model", "whole_tensors"]


@dataclass
class Distributed:
    """This process's place in a job of ``world_size`` processes (1: the ordinary case)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = ""

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Only the main process (rank 0) writes files and shows progress."""
        return self.rank == 0


def init_distributed(device: str = "auto") -> Distributed:
    """Join the group ``torchrun`` describes (``WORLD_SIZE > 1``; NCCL on GPUs, gloo on CPUs), or
    return ``Distributed()`` for one process. Safe to repeat.

    Example:
        >>> init_distributed("cpu")   # without torchrun: one process, nothing to join
        Distributed(rank=0, world_size=1, local_rank=0, backend='')
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Distributed()
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    on_gpu = pick_device(device).startswith("cuda")
    if on_gpu:
        torch.cuda.set_device(local_rank)   # so that "cuda" means this process's GPU
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if on_gpu else "gloo")
    return Distributed(rank=rank, world_size=world_size, local_rank=local_rank, backend=dist.get_backend())


def finish_distributed() -> None:
    """Leave the process group, if this process joined one (the end of a torchrun job)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class DataParallel(torch.nn.parallel.DistributedDataParallel):
    """DistributedDataParallel that also answers the wrapped model's attributes, so a task's
    ``loss(model, batch)`` works unchanged with or without torchrun."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """Shard every parameter of ``model`` over the processes with FSDP2's ``fully_shard`` (each
    keeps a block of rows; the passes gather them) and return it; build the optimizer after."""
    from torch.distributed.fsdp import fully_shard
    fully_shard(model)
    return model


def whole_tensors(named: dict):
    """A tensor source for the freeze trackers on sharded parameters: a callable returning
    ``{name: whole tensor}``, gathered from every process (so all call it at the same points)."""
    def gather() -> dict:
        return {n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p) for n, p in named.items()}
    return gather


def mean_over_ranks(value: torch.Tensor, dist_info: Distributed) -> torch.Tensor:
    """The mean of a scalar over all processes: the whole batch's loss, as one process computes it."""
    if not dist_info.enabled:
        return value
    import torch.distributed as dist
    total = value.clone()
    dist.all_reduce(total)
    return total / dist_info.world_size


def replicas_identical(model: torch.nn.Module, dist_info: Distributed) -> bool:
    """Whether every process holds bit-identical parameters (compares a sha256 of their bytes)."""
    import hashlib
    import torch.distributed as dist
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    digests = [None] * dist_info.world_size
    dist.all_gather_object(digests, digest.hexdigest())
    return len(set(digests)) == 1
