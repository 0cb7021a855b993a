"""Packing: a model's many small tensors laid out one after another in one flat buffer.

A kernel call costs a few microseconds whatever its size, and a model has many small tensors
(biases, layer-norm gains): one call per tensor would cost more than the work. So the tensors
are split into runs (:func:`group`): every large tensor alone, the small ones together, and each
run becomes a :class:`Pack`, which lays its tensors out in flat buffers so that one kernel call
serves them all. :class:`lowprec_demo.optimizer.LowPrecisionOptimizer` rounds its packs in place
in the pack's buffer: the tensors live there (:meth:`Pack.flat` with ``adopt=True`` makes each
tensor's ``.data`` a view of the buffer), so a step copies nothing;
:class:`lowprec_demo.prediction.StepTracker` keeps a snapshot buffer per pack and compares it with
the tensors' new values, laid out alike.

Example:
    >>> import torch
    >>> a, b = torch.ones(3), torch.full((2, 2), 2.0)
    >>> [p.indices for p in packs([a, b, torch.zeros(1 << 16)])]
    [[0, 1], [2]]
    >>> pack = packs([a, b])[0]
    >>> pack.flat([a, b]).tolist()
    [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]
"""

from __future__ import annotations

import weakref
from typing import List, Optional, Sequence

import torch

__all__ = ["Pack", "packs", "group", "copy_into", "SMALL_NUMEL", "PACK_NUMEL", "PACK_TENSORS"]

SMALL_NUMEL = 1 << 16      # tensors below this size are packed together, one kernel call each pack
PACK_NUMEL = 1 << 20       # the most elements in one pack
PACK_TENSORS = 256         # the most tensors in one pack


def copy_into(targets: list, sources: list) -> None:
    """``t.copy_(s)`` for each pair, in one call where torch has ``_foreach_copy_``."""
    if len(targets) > 1 and hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(targets, sources)
    else:
        for t, s in zip(targets, sources):
            t.copy_(s)


def group(tensors: Sequence[torch.Tensor]) -> List[List[int]]:
    """Split a list of tensors into runs of consecutive indices: every tensor of at least
    :data:`SMALL_NUMEL` elements alone, the small ones packed (one device and dtype per run),
    up to :data:`PACK_NUMEL` elements and :data:`PACK_TENSORS` tensors per run.

    Example:
        >>> group([torch.zeros(3), torch.zeros(4), torch.zeros(1 << 16), torch.zeros(5)])
        [[0, 1], [2], [3]]
    """
    groups, run, run_numel = [], [], 0
    for i, t in enumerate(tensors):
        n = t.numel()
        if n >= SMALL_NUMEL:
            if run:
                groups.append(run)
                run, run_numel = [], 0
            groups.append([i])
            continue
        if run and (run_numel + n > PACK_NUMEL or len(run) >= PACK_TENSORS or t.device != tensors[run[0]].device
                    or t.dtype != tensors[run[0]].dtype):
            groups.append(run)
            run, run_numel = [], 0
        run.append(i)
        run_numel += n
    if run:
        groups.append(run)
    return groups


class Pack:
    """A run of tensors (one of :func:`group`'s) laid out one after another in flat buffers.

    With ``block`` > 1 and several tensors, each tensor starts at a multiple of ``block``
    elements and zeros fill the gaps (``pads[i]`` after tensor i; the same zeros in every buffer
    of the pack), so that kernels counting per block count per tensor (:meth:`per_tensor`).
    One tensor alone has no gaps.

    Args:
        indices: the positions of the tensors in the list they were grouped from.
        tensors: the tensors (their shapes, dtype and device give the layout).
        block: the alignment of each tensor's start in a pack of several.

    Attributes:
        indices, shapes, sizes: per tensor: its position, shape and element count.
        several: whether the pack holds more than one tensor.
        spans, pads: the elements each tensor takes in a buffer, and the zeros after it.
        numel: the length of the pack's buffers.
    """

    def __init__(self, indices: Sequence[int], tensors: Sequence[torch.Tensor], block: int = 1) -> None:
        self.indices = list(indices)
        self.shapes = [t.shape for t in tensors]
        self.sizes = [t.numel() for t in tensors]
        self.several = len(self.sizes) > 1
        self.block = block
        self.spans = [-(-n // block) * block for n in self.sizes] if self.several else list(self.sizes)
        self.pads = [s - n for s, n in zip(self.spans, self.sizes)]
        self.numel = sum(self.spans)
        self.dtype, self.device = tensors[0].dtype, tensors[0].device
        self._flat: Optional[torch.Tensor] = None
        self._flat_views: List[torch.Tensor] = []
        self._codes: Optional[torch.Tensor] = None
        self._tags: Optional[torch.Tensor] = None
        self._block_tensor: Optional[torch.Tensor] = None
        self._homes: Optional[tuple] = None   # where adopted tensors live: their views' data pointers

    def zeros(self) -> torch.Tensor:
        """A new buffer of this pack's length, dtype and device, all zeros."""
        return torch.zeros(self.numel, dtype=self.dtype, device=self.device)

    def views(self, buffer: torch.Tensor) -> List[torch.Tensor]:
        """The pieces of a buffer in this pack's layout, shaped like the tensors."""
        return [v[:n].view(shape) for v, n, shape in zip(buffer.split(self.spans), self.sizes, self.shapes)]

    def flat(self, tensors: Sequence[torch.Tensor], adopt: bool = False) -> torch.Tensor:
        """The tensors' current values, flat, in this pack's layout: one tensor itself, flat (a
        view where it is contiguous), several copied into a buffer the pack keeps from call to
        call (with the same zeros in the gaps).

        With ``adopt=True`` the tensors move into the buffer: each one's ``.data`` becomes its
        view there (values unchanged), and while they stay (:meth:`at_home`) the buffer is
        returned with nothing copied, and :meth:`put_back` has nothing to do. A tensor given new
        storage since (``model.to``, ``p.data = ...``) is copied in and adopted again. Only
        tensors that own their whole storage, one storage each (or live in a pack's buffer
        already), are adopted: a view of a larger tensor, or two tensors sharing memory, would be
        parted from what they share. Those are copied in and back as without ``adopt``."""
        if not self.several:
            return tensors[0].reshape(-1)
        if self._flat is None:
            self._flat = self.zeros()
            self._flat_views = self.views(self._flat)
        if self.at_home(tensors):
            return self._flat
        copy_into(self._flat_views, list(tensors))
        self._homes = None
        if adopt and _movable(tensors, self._flat_views):
            with torch.no_grad():
                for t, view in zip(tensors, self._flat_views):
                    t.data = view
                    _ADOPTED[id(t)] = (weakref.ref(t, lambda _, key=id(t): _ADOPTED.pop(key, None)), view.data_ptr())
            self._homes = tuple(v.data_ptr() for v in self._flat_views)
        return self._flat

    def at_home(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` (several) live in this pack's buffer, adopted by :meth:`flat`."""
        return self._homes is not None and tuple(map(torch.Tensor.data_ptr, tensors)) == self._homes

    def put_back(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the buffer of :meth:`flat` back into the tensors (after in-place work on it;
        nothing to do for one tensor, whose flat view is the tensor itself, or for tensors
        that live in the buffer)."""
        if self.several and not self.at_home(tensors):
            copy_into(list(tensors), self._flat_views)

    def codes(self) -> torch.Tensor:
        """A uint8 buffer of one code per element, kept for the next calls (allocated when first
        asked for: a fresh allocation of this size costs more than filling it)."""
        if self._codes is None:
            self._codes = torch.empty(self.numel, dtype=torch.uint8, device=self.device)
        return self._codes

    def tags(self) -> Optional[torch.Tensor]:
        """For several tensors (else None): the tensor of each element, shifted into the high
        byte (int32), for one bincount of every code of the pack; the gaps get the index one
        past the last tensor (a row of counts left out). Made when first asked for."""
        if self.several and self._tags is None:
            self._tags = torch.full((self.numel,), len(self.sizes) << 8, dtype=torch.int32, device=self.device)
            for i, tag in enumerate(self._tags.split(self.spans)):
                tag[:self.sizes[i]] = i << 8
        return self._tags

    def per_tensor(self, blocks: torch.Tensor) -> torch.Tensor:
        """Per-tensor sums of per-block counts (one count per ``block`` elements of a pack of
        several tensors), as float64 (exact: a pack holds fewer than 2**53 elements), in one
        operation."""
        if self._block_tensor is None:
            self._block_tensor = torch.repeat_interleave(
                torch.arange(len(self.sizes), device=self.device),
                torch.tensor(self.spans, device=self.device) // self.block)
        return torch.bincount(self._block_tensor, weights=blocks, minlength=len(self.sizes))

    def held_bytes(self, tensors: Optional[Sequence[torch.Tensor]] = None) -> int:
        """The memory this pack keeps from call to call: its buffer (unless ``tensors`` live in
        it: then it is theirs), codes and tags."""
        home = tensors is not None and self.several and self.at_home(tensors)
        own = (self._codes, self._tags) if home else (self._flat, self._codes, self._tags)
        return sum(t.numel() * t.element_size() for t in own if t is not None)


_ADOPTED: dict = {}   # id of a tensor a pack adopted: (a weak reference to it, where the pack put it)


def _movable(tensors: Sequence[torch.Tensor], homes: Sequence[torch.Tensor]) -> bool:
    """Whether each tensor lives in a pack's buffer (this one's or another's: memory that only
    adopted tensors use), or is the whole of its own storage, shared with none of the others."""
    pointers = set()
    for t, home in zip(tensors, homes):
        where = t.data_ptr()
        adopted = _ADOPTED.get(id(t))
        if where == home.data_ptr() or (adopted is not None and adopted[0]() is t and adopted[1] == where):
            continue
        storage = t.untyped_storage()
        if t.storage_offset() != 0 or storage.nbytes() != t.numel() * t.element_size() or storage.data_ptr() in pointers:
            return False
        pointers.add(storage.data_ptr())
    return True


def packs(tensors: Sequence[torch.Tensor], block: int = 1) -> List[Pack]:
    """The :class:`Pack` of every run of :func:`group`, in order."""
    return [Pack(indices, [tensors[i] for i in indices], block) for indices in group(tensors)]
