"""Sharded parameters (FSDP2's ``fully_shard``): where each process's piece lies in the whole tensor.

Under ``torch.distributed.fsdp.fully_shard`` every parameter is a ``DTensor`` whose process holds
one block of rows (the placement ``Shard(0)``: ``torch.chunk`` of dim 0 over the processes, the
last blocks shorter or empty). The rows of a block are consecutive in the whole tensor's
row-major order, so the piece is the stretch of the flat tensor that starts at
:func:`flat_offset`. :class:`~lowprec_demo.optimizer.LowPrecisionOptimizer` rounds each piece
where it lies (:func:`store_pieces`), stochastic rounding drawing, for each element, the random
bits of its index in the whole tensor (or in the pack of small tensors a single process would
round it in): one process and N processes store the same bits. The freeze watch follows the
elements of :class:`SamplePlan` (in one process), and on each process of a sharded run those of
them that fall in its pieces (:class:`ShardedSamplePlan`), and adds
the counts of all processes with one ``all_reduce`` per watched step, so that every process
holds the single-process report.

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
from typing import List, Optional, Sequence

import torch

from lowprec_demo.rounding.core import draw_seed, quantize_

__all__ = ["is_sharded", "any_sharded", "local_part", "check_placements", "flat_offset", "row_range", "counts_here", "store_pieces",
           "SamplePlan", "ShardedSamplePlan", "ALLOWED_PLACEMENTS"]

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


def _end_to_end(parts: List[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The flat ``parts`` laid end to end, in their dtype (float64 where they differ), into
    ``out`` when it has that dtype and length (one buffer, step after step)."""
    dtype = parts[0].dtype
    if any(p.dtype != dtype for p in parts):
        dtype = torch.float64
        parts = [p.to(dtype) for p in parts]
    if out is not None and out.dtype == dtype and out.numel() == sum(p.numel() for p in parts):
        return torch.cat(parts, out=out)
    return torch.cat(parts)


class SamplePlan:
    """Which elements of each tracked tensor the freeze watch follows in one process: all of
    them, or for a tensor larger than ``sample`` an evenly strided ``sample`` of them (the same
    elements every step).
    Everything the watch computes runs once over the followed elements of all tensors laid end
    to end, and per-tensor sums come from one ``bincount``."""

    def __init__(self, tensors: List[torch.Tensor], sample: Optional[int]) -> None:
        self.strides, self.counts = [], []
        for t in tensors:
            n = t.numel()
            stride = 1 if sample is None or n <= sample else -(-n // sample)
            self.strides.append(stride)
            self.counts.append(len(range(0, n, stride)))
        device = tensors[0].device if tensors else "cpu"
        self.tensor_id = torch.repeat_interleave(torch.arange(len(tensors), dtype=torch.int32, device=device),
                                                 torch.tensor(self.counts, device=device))
        self.ends = torch.cumsum(torch.tensor(self.counts, device=device), 0) - 1   # every count is >= 1
        self._views: Optional[List[torch.Tensor]] = None
        self._view_key: Optional[List[int]] = None

    def gather(self, tensors: List[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The followed elements, end to end (into ``out`` when it fits: one buffer, step after step)."""
        return _end_to_end([t.reshape(-1)[::s] for t, s in zip(tensors, self.strides)], out)

    def gather_params(self, params: List[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """:meth:`gather` of the tracked parameters, through flat views of them made once (a
        parameter's storage stays where it is while an optimizer steps it in place); made again
        when a parameter has moved, and not used for a parameter that has no flat view."""
        where = [p.data_ptr() for p in params]
        if where != self._view_key:
            try:
                views = [p.detach().view(-1)[::s] for p, s in zip(params, self.strides)]
            except RuntimeError:      # not contiguous: no flat view
                views = None
            if views is not None and any(v.dtype != views[0].dtype for v in views):
                views = None
            self._views, self._view_key = views, where
        return self.gather(params, out) if self._views is None else _end_to_end(self._views, out)

    def per_tensor(self, values: torch.Tensor) -> torch.Tensor:
        """Per tensor, the sum of ``values`` (bool or float) over its followed elements, float64:
        a running sum, read at the end of every tensor's stretch (exact for counts)."""
        exact = torch.int64 if values.dtype == torch.bool else torch.float64
        total = values.cumsum(0, dtype=exact)[self.ends]
        return torch.diff(total, prepend=total.new_zeros(1)).double()

    def grads(self, params: List[torch.Tensor]) -> torch.Tensor:
        """The gradients at the followed elements (zeros for a parameter without one)."""
        return self.gather([p.grad if p.grad is not None else p.new_zeros(()).expand(p.shape) for p in params])

    @staticmethod
    def row_flags(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """For an embedding: whether each row has a gradient."""
        return grad.reshape(grad.shape[0], -1).ne(0).any(1)

    @staticmethod
    def reduce(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """One process holds everything: the tensors as they are (see
        :meth:`ShardedSamplePlan.reduce`)."""
        return tensors


class ShardedSamplePlan:
    """The freeze watch's sample plan for sharded tensors: the elements a single process follows
    (every element of a tensor of up to ``sample``, else every ``stride``-th of the flat whole
    tensor), of which each process takes those in its pieces. ``counts`` are the whole
    tensors' (what fractions are taken of), ``tensor_id`` the local elements'; per-tensor sums
    are local until :meth:`reduce` adds those of every process (one ``all_reduce``)."""

    def __init__(self, tensors: List[torch.Tensor], sample: Optional[int]) -> None:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("sharded (DTensor) parameters need the process group: call "
                               "torch.distributed.init_process_group first")
        self.strides, self.counts, self.firsts, self.local_counts = [], [], [], []
        for t in tensors:
            check_placements(t)
        self.counted_here = [counts_here(t) for t in tensors]
        for t, here in zip(tensors, self.counted_here):
            n = t.numel()
            stride = 1 if sample is None or n <= sample else -(-n // sample)
            self.strides.append(stride)
            self.counts.append(len(range(0, n, stride)))
            m = local_part(t).numel() if here else 0
            first = (-flat_offset(t)) % stride
            self.firsts.append(first)
            self.local_counts.append(len(range(first, m, stride)))
        self.device = local_part(tensors[0]).device if tensors else torch.device("cpu")
        self.tensor_id = torch.repeat_interleave(torch.arange(len(tensors), dtype=torch.int32, device=self.device),
                                                 torch.tensor(self.local_counts, device=self.device))
        self._index = self.tensor_id.long()
        self.group_size = dist.get_world_size()

    def _parts(self, tensors: Sequence) -> List[torch.Tensor]:
        return [local_part(t).reshape(-1)[f::s] if here else local_part(t).reshape(-1)[:0]
                for t, f, s, here in zip(tensors, self.firsts, self.strides, self.counted_here)]

    def gather(self, tensors: Sequence, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The followed elements of this process's pieces, end to end."""
        return _end_to_end(self._parts(tensors), out)

    gather_params = gather     # (a DTensor's local piece is looked up each time)

    def grads(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The gradients at the followed elements (zeros for a parameter without one)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(local_part(p)) for p in params]
        return self.gather(grads)

    def per_tensor(self, values: torch.Tensor) -> torch.Tensor:
        """Per tensor, the sum of ``values`` over this process's followed elements, float64."""
        out = torch.zeros(len(self.counts), dtype=torch.float64, device=values.device)
        return out.index_add_(0, self._index, values.to(torch.float64))

    def row_flags(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """For an embedding: 1.0 for each row of the whole table that has a gradient in this
        process's piece (float64, the table's length: added over processes by :meth:`reduce`)."""
        start, count = row_range(param)
        flags = torch.zeros(param.shape[0], dtype=torch.float64, device=self.device)
        g = local_part(grad)
        if count and counts_here(param):
            flags[start:start + count] = g.reshape(count, -1).ne(0).any(1).to(torch.float64)
        return flags

    def reduce(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """The tensors added over every process (float64), in one ``all_reduce``."""
        import torch.distributed as dist
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
        if self.group_size > 1:
            dist.all_reduce(flat)
        return [piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
