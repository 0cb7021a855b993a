"""Which elements the freeze watch follows: :class:`SamplePlan` in one process (every element, or
an evenly strided sample of a large tensor, the same elements every step) and, under FSDP2,
:class:`ShardedSamplePlan` (on each process those of them in its pieces, found with
``lowprec_demo.optim.sharding``); the counts of all processes are added with one ``all_reduce``
per watched step, so that every process holds the single-process report."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from lowprec_demo.optim.sharding import local_part, check_placements, flat_offset, row_range, counts_here

__all__ = ["SamplePlan", "ShardedSamplePlan"]


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
