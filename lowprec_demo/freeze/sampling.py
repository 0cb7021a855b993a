"""Which elements a freeze tracker follows: every element of a tensor of up to ``sample`` (all of them for None), else
an evenly strided sample, the same every step (:class:`Sample`), all laid end to end so that each computation runs once
and per-tensor sums come from one pass. Under FSDP2 each process takes those in its pieces (:class:`ShardedSample`),
and one ``all_reduce`` per step adds the counts."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from lowprec_demo.common.sharding import local_part, check_placements, flat_offset, row_range, counts_here

__all__ = ["Sample", "ShardedSample"]


def _stride(n: int, sample: Optional[int]) -> int:
    """1 for a tensor of up to ``sample`` elements, else the stride of an even sample."""
    return 1 if sample is None or n <= sample else -(-n // sample)


def _end_to_end(parts: List[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The flat ``parts`` end to end (float64 where dtypes differ), into ``out`` when it fits."""
    dtype = parts[0].dtype
    if any(p.dtype != dtype for p in parts):
        dtype = torch.float64
        parts = [p.to(dtype) for p in parts]
    if out is not None and out.dtype == dtype and out.numel() == sum(p.numel() for p in parts):
        return torch.cat(parts, out=out)
    return torch.cat(parts)


class Sample:
    """The followed elements of each tensor in one process (see the module docstring); ``counts`` per tensor."""

    def __init__(self, tensors: List[torch.Tensor], sample: Optional[int]) -> None:
        self.strides = [_stride(t.numel(), sample) for t in tensors]
        self.counts = [len(range(0, t.numel(), s)) for t, s in zip(tensors, self.strides)]
        device = tensors[0].device if tensors else "cpu"
        counts = torch.tensor(self.counts, device=device)
        self.tensor_id = torch.repeat_interleave(torch.arange(len(tensors), dtype=torch.int32, device=device), counts)
        self.ends = torch.cumsum(counts, 0) - 1   # every count is >= 1
        self._views = self._view_key = None       # flat views of the parameters, and where they were

    def gather(self, tensors: List[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The followed elements, end to end (into ``out`` when it fits)."""
        return _end_to_end([t.reshape(-1)[::s] for t, s in zip(tensors, self.strides)], out)

    def gather_params(self, params: List[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """:meth:`gather` through flat views of the parameters, made again when one has moved."""
        where = [p.data_ptr() for p in params]
        if where != self._view_key:
            try:      # none where a parameter is not contiguous, or where the dtypes differ
                views = [p.detach().view(-1)[::s] for p, s in zip(params, self.strides)]
                views = None if any(v.dtype != views[0].dtype for v in views) else views
            except RuntimeError:
                views = None
            self._views, self._view_key = views, where
        return self.gather(params, out) if self._views is None else _end_to_end(self._views, out)

    def per_tensor(self, values: torch.Tensor) -> torch.Tensor:
        """Per tensor, the float64 sum of ``values`` (bool or float) over its followed elements."""
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
        """The tensors as they are: one process holds everything."""
        return tensors


class ShardedSample:
    """:class:`Sample`'s elements in this process's pieces: ``counts`` are the whole tensors',
    ``tensor_id`` the local elements', per-tensor sums local until :meth:`reduce`."""

    def __init__(self, tensors: List[torch.Tensor], sample: Optional[int]) -> None:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("sharded (DTensor) parameters need the process group: call "
                               "torch.distributed.init_process_group first")
        for t in tensors:
            check_placements(t)
        self.counted_here = [counts_here(t) for t in tensors]
        self.strides = [_stride(t.numel(), sample) for t in tensors]
        self.counts = [len(range(0, t.numel(), s)) for t, s in zip(tensors, self.strides)]
        self.firsts = [(-flat_offset(t)) % s for t, s in zip(tensors, self.strides)]
        self.local_counts = [len(range(f, local_part(t).numel() if here else 0, s))
                             for t, f, s, here in zip(tensors, self.firsts, self.strides, self.counted_here)]
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
        return self.gather([p.grad if p.grad is not None else torch.zeros_like(local_part(p)) for p in params])

    def per_tensor(self, values: torch.Tensor) -> torch.Tensor:
        """Per tensor, the sum of ``values`` over this process's followed elements, float64."""
        out = torch.zeros(len(self.counts), dtype=torch.float64, device=values.device)
        return out.index_add_(0, self._index, values.to(torch.float64))

    def row_flags(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """For an embedding: 1.0 per row of the whole table with a gradient in this piece."""
        start, count = row_range(param)
        flags = torch.zeros(param.shape[0], dtype=torch.float64, device=self.device)
        if count and counts_here(param):
            flags[start:start + count] = local_part(grad).reshape(count, -1).ne(0).any(1).to(torch.float64)
        return flags

    def reduce(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """The tensors added over every process (float64), in one ``all_reduce``."""
        import torch.distributed as dist
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
        if self.group_size > 1:
            dist.all_reduce(flat)
        return [piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
