"""FSDP2's sharded parameters: where each process's piece lies in the whole tensor.

Under ``fully_shard`` a parameter is a ``DTensor`` whose process holds a block of rows (``Shard(0)``: ``torch.chunk`` of
dim 0), a stretch of the flat tensor from :func:`flat_offset`. :class:`~lowprec_demo.optim.LowPrecisionOptimizer` rounds
each piece where it lies, stochastic rounding drawing each element's bits by its index in the whole tensor (or run of
tensors): one process and N processes store the same bits. The freeze watch's sample finds its elements alike.
Allowed placements: ``Shard(0)`` (once) and ``Replicate()`` (HSDP).

Example:
    >>> import torch
    >>> is_sharded(torch.ones(3)), flat_offset(torch.ones(3))   # a plain tensor is its own whole
    (False, 0)
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

__all__ = ["is_sharded", "any_sharded", "local_part", "check_placements", "flat_offset", "row_range", "counts_here",
           "ALLOWED_PLACEMENTS"]

ALLOWED_PLACEMENTS = ("Shard(0)", "Replicate()")


@functools.lru_cache(maxsize=None)
def _dtensor_types():
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:      # a torch built without distributed support: nothing is sharded
        return None
    return DTensor, Replicate, Shard


def is_sharded(t) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP2 parameter, its gradient or optimizer state)."""
    return _dtensor_types() is not None and isinstance(t, _dtensor_types()[0])


def any_sharded(tensors: Sequence) -> bool:
    """Whether any of the tensors is a ``DTensor``."""
    return any(is_sharded(t) for t in tensors)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This process's piece of ``t`` (a view: writing it writes the parameter), or ``t`` itself."""
    return t.to_local() if is_sharded(t) else t


def _layout(t) -> tuple:
    """``(mesh dims of Shard(0), mesh dims of Replicate)``, refusing other placements."""
    _, replicate, shard = _dtensor_types()
    sharded, replicated = [], []
    for i, placement in enumerate(t.placements):
        if not (type(placement) is replicate or (type(placement) is shard and placement.dim == 0)):
            described = f"{type(placement).__name__}({getattr(placement, 'dim', '')})"
            raise ValueError(f"a parameter of shape {tuple(t.shape)} has the placement {described} on mesh dimension "
                             f"{i}; sharded parameters may have {' or '.join(ALLOWED_PLACEMENTS)} (FSDP2's fully_shard, "
                             f"HSDP), with at most one Shard(0)")
        (replicated if type(placement) is replicate else sharded).append(i)
    if len(sharded) > 1:
        raise ValueError(f"a parameter of shape {tuple(t.shape)} is sharded on dim 0 over {len(sharded)} mesh "
                         f"dimensions ({t.placements}); at most one Shard(0) is supported")
    if sharded and t.dim() == 0:
        raise ValueError("a 0-dimensional parameter cannot be sharded on dim 0")
    return sharded, replicated


def check_placements(t) -> None:
    """Refuse, naming the placements allowed, a sharded tensor laid out in another way."""
    if is_sharded(t):
        row_range(t)


def row_range(t: torch.Tensor) -> tuple:
    """``(first row, rows)`` of this process's block of ``t``, checked against the local piece."""
    sharded = _layout(t)[0] if is_sharded(t) else []
    if not sharded:
        return 0, (t.shape[0] if t.dim() else 1)
    local, rows = t.to_local(), t.shape[0]
    parts, coordinate = t.device_mesh.size(sharded[0]), t.device_mesh.get_coordinate()[sharded[0]]
    chunk = -(-rows // parts)
    start = min(coordinate * chunk, rows)
    count = max(0, min(chunk, rows - start))
    if tuple(local.shape) != (count, *t.shape[1:]):
        raise ValueError(f"the local piece of a parameter of shape {tuple(t.shape)} has shape {tuple(local.shape)}, "
                         f"not the block of {count} rows from row {start} that Shard(0) over {parts} processes gives")
    return start, count


def flat_offset(t: torch.Tensor) -> int:
    """The index in the whole tensor (row-major) of the first element of this process's piece."""
    if not is_sharded(t) or t.dim() == 0:
        return 0
    return row_range(t)[0] * (t.numel() // t.shape[0] if t.shape[0] else 0)


def counts_here(t: torch.Tensor) -> bool:
    """Whether this process's piece of ``t`` is counted when the processes add their counts: on
    the first process of every mesh dimension it is replicated over (of the job, for a plain tensor)."""
    if not is_sharded(t):
        import torch.distributed as dist
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    replicated, coordinate = _layout(t)[1], t.device_mesh.get_coordinate()
    return all(coordinate[i] == 0 for i in replicated)

