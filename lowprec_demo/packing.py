"""Packing: a model's many small tensors laid out one after another in one flat buffer.

A kernel call costs a few microseconds whatever its size, and a model has many small tensors
(biases, layer-norm gains): one call per tensor would cost more than the work. So the tensors
are split into runs (:func:`group`): every large tensor alone, the small ones together, and each
run becomes a :class:`Pack`, which lays its tensors out in flat buffers so that one kernel call
serves them all. :class:`lowprec_demo.optimizer.LowPrecisionOptimizer` rounds its packs in place
(the tensors copied into the pack's buffer, rounded, copied back);
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

    def zeros(self) -> torch.Tensor:
        """A new buffer of this pack's length, dtype and device, all zeros."""
        return torch.zeros(self.numel, dtype=self.dtype, device=self.device)

    def views(self, buffer: torch.Tensor) -> List[torch.Tensor]:
        """The pieces of a buffer in this pack's layout, shaped like the tensors."""
        return [v[:n].view(shape) for v, n, shape in zip(buffer.split(self.spans), self.sizes, self.shapes)]

    def flat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The tensors' current values, flat, in this pack's layout: one tensor itself, flat (a
        view where it is contiguous), several copied into a buffer the pack keeps from call to
        call (with the same zeros in the gaps)."""
        if not self.several:
            return tensors[0].reshape(-1)
        if self._flat is None:
            self._flat = self.zeros()
            self._flat_views = self.views(self._flat)
        copy_into(self._flat_views, list(tensors))
        return self._flat

    def put_back(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the buffer of :meth:`flat` back into the tensors (after in-place work on it;
        nothing to do for one tensor, whose flat view is the tensor itself)."""
        if self.several:
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

    def held_bytes(self) -> int:
        """The memory this pack keeps from call to call: its buffer, codes and tags."""
        return sum(t.numel() * t.element_size() for t in (self._flat, self._codes, self._tags) if t is not None)


def packs(tensors: Sequence[torch.Tensor], block: int = 1) -> List[Pack]:
    """The :class:`Pack` of every run of :func:`group`, in order."""
    return [Pack(indices, [tensors[i] for i in indices], block) for indices in group(tensors)]
