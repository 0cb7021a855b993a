"""Sharded parameters (FSDP2's ``fully_shard``): where each process's piece lies in the whole tensor.

Under ``torch.distributed.fsdp.fully_shard`` every parameter is a ``DTensor`` whose process holds
one block of rows (the placement ``Shard(0)``: ``torch.chunk`` of dim 0 over the processes, the
last blocks shorter or empty). The rows of a block are consecutive in the whole tensor's
row-major order, so the piece is the stretch of the flat tensor that starts at
:func:`flat_offset`. :class:`~lowprec_demo.optim.LowPrecisionOptimizer` rounds each piece
where it lies (:func:`store_pieces`), stochastic rounding drawing, for each element, the random
bits of its index in the whole tensor (or in the pack of small tensors a single process would
round it in): one process and N processes store the same bits. The freeze watch's sample
of a sharded run (``lowprec_demo.monitor.sampling``) finds its elements with the same functions.

Placements: ``Shard(0)`` and ``Replicate()`` on the mesh dimensions (FSDP2, and HSDP's
replicate-then-shard meshes, with at most one ``Shard(0)``); any other (``Shard(1)``,
``Partial``, a strided shard) is refused with the placements allowed.

Example:
    >>> import torch
    >>> is_sharded(torch.ones(3)), flat_offset(torch.ones(3))   # a plain tensor is its own whole
    (False, 0)
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from lowprec_demo.rounding.core import draw_seed, quantize_

__all__ = ["is_sharded", "any_sharded", "local_part", "check_placements", "flat_offset", "row_range", "counts_here", "store_pieces",
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
    types = _dtensor_types()
    return types is not None and isinstance(t, types[0])


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
        if type(placement) is shard and placement.dim == 0:
            sharded.append(i)
        elif type(placement) is replicate:
            replicated.append(i)
        else:
            described = f"{type(placement).__name__}({getattr(placement, 'dim', '')})"
            raise ValueError(f"a parameter of shape {tuple(t.shape)} has the placement {described} on mesh dimension "
                             f"{i}; sharded parameters may have {' or '.join(ALLOWED_PLACEMENTS)} (FSDP2's fully_shard, "
                             f"HSDP), with at most one Shard(0)")
    if len(sharded) > 1:
        raise ValueError(f"a parameter of shape {tuple(t.shape)} is sharded on dim 0 over {len(sharded)} mesh "
                         f"dimensions ({t.placements}); at most one Shard(0) is supported")
    if sharded and t.dim() == 0:
        raise ValueError("a 0-dimensional parameter cannot be sharded on dim 0")
    return sharded, replicated


def check_placements(t) -> None:
    """Refuse, naming the placements allowed, a sharded tensor laid out in a way this module
    does not handle; nothing for a plain tensor."""
    if is_sharded(t):
        row_range(t)


def row_range(t: torch.Tensor) -> tuple:
    """``(first row, rows)`` of this process's block of ``t``'s dim 0 (the whole of a plain or
    replicated tensor), checked against the local piece's shape."""
    if not is_sharded(t):
        return 0, (t.shape[0] if t.dim() else 1)
    sharded, _ = _layout(t)
    local = t.to_local()
    if not sharded:
        return 0, (t.shape[0] if t.dim() else 1)
    mesh_dim = sharded[0]
    parts, coordinate = t.device_mesh.size(mesh_dim), t.device_mesh.get_coordinate()[mesh_dim]
    rows = t.shape[0]
    chunk = -(-rows // parts)
    start = min(coordinate * chunk, rows)
    count = max(0, min(chunk, rows - start))
    if tuple(local.shape) != (count, *t.shape[1:]):
        raise ValueError(f"the local piece of a parameter of shape {tuple(t.shape)} has shape {tuple(local.shape)}, "
                         f"not the block of {count} rows from row {start} that Shard(0) over {parts} processes gives")
    return start, count


def flat_offset(t: torch.Tensor) -> int:
    """The index, in the whole tensor's row-major order, of the first element of this process's
    piece (0 for a plain or replicated tensor)."""
    if not is_sharded(t) or t.dim() == 0:
        return 0
    start, _ = row_range(t)
    return start * (t.numel() // t.shape[0] if t.shape[0] else 0)


def counts_here(t: torch.Tensor) -> bool:
    """Whether this process's piece of ``t`` is counted when the processes add their counts: on
    the first process of every mesh dimension the tensor is replicated over (a plain tensor
    is held whole by every process: the first process of the job counts it)."""
    if not is_sharded(t):
        import torch.distributed as dist
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    _, replicated = _layout(t)
    coordinate = t.device_mesh.get_coordinate()
    return all(coordinate[i] == 0 for i in replicated)


@torch.no_grad()
def store_pieces(plan: list, fmt, rounding: str, generator, rand_bits: Optional[int], policy: str) -> None:
    """Round the pieces of the tensors of ``plan`` (the ``(members, pack)`` pairs of
    :meth:`~lowprec_demo.optimizer.LowPrecisionOptimizer._pack_plan`, made from the whole
    tensors) where they lie, drawing the seeds one process would: one per tensor outside a
    pack, one per pack. Stochastic rounding gives every element the bits of its index in the
    whole tensor (in a pack: the tensor's place in the pack plus that index)."""
    stochastic = rounding == "stochastic"
    for members, pack in plan:
        if pack is None:
            for t in members:
                _round_piece(t, fmt, rounding, draw_seed(generator) if stochastic else None, 0, rand_bits, policy)
            continue
        seed = draw_seed(generator) if stochastic else None
        start = 0
        for t, size in zip(members, pack.sizes):     # a pack of several lays them end to end, no gaps
            _round_piece(t, fmt, rounding, seed, start, rand_bits, policy)
            start += size


def _round_piece(t, fmt, rounding: str, seed: Optional[int], start: int, rand_bits, policy: str) -> None:
    piece = local_part(t)
    if piece.numel() == 0:
        return
    quantize_(piece, fmt, rounding, generator=seed, rand_bits=rand_bits, overflow=policy,
              index_offset=start + flat_offset(t))
