"""A model's many small tensors (biases, layer-norm gains) laid end to end in one flat buffer, so that one kernel call
(whose fixed cost exceeds the work of each) serves them all: :func:`group` splits the tensors into runs, every large
tensor alone. :class:`~lowprec_demo.optim.LowPrecisionOptimizer` draws one stochastic-rounding seed per run
(:func:`runs`) and, asked to (``pack=True``), rounds each run in one call in a :class:`Pack`'s buffer, where the
tensors then live (:meth:`Pack.flat` with ``adopt``; a :class:`PackCache` keeps the packs).

Example:
    >>> import torch
    >>> a, b = torch.ones(3), torch.full((2, 2), 2.0)
    >>> group([a, b, torch.zeros(1 << 16)])
    [[0, 1], [2]]
    >>> Pack([a, b]).flat([a, b]).tolist()
    [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]
"""

from __future__ import annotations

from typing import Callable, List, MutableMapping, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Pack", "PackCache", "group", "runs", "copy_into", "SMALL_NUMEL", "PACK_NUMEL", "PACK_TENSORS"]

SMALL_NUMEL = 1 << 16      # tensors below this size are packed together, one kernel call each pack
PACK_NUMEL = 1 << 20       # the most elements in one pack
PACK_TENSORS = 256         # the most tensors in one pack


def copy_into(targets: list, sources: list) -> None:
    """``t.copy_(s)`` for each pair, in one call."""
    if targets:
        torch._foreach_copy_(targets, sources)


def group(tensors: Sequence[torch.Tensor]) -> List[List[int]]:
    """Runs of consecutive indices: a tensor of :data:`SMALL_NUMEL` elements or more alone, small ones
    together (one device and dtype, at most :data:`PACK_NUMEL` elements, :data:`PACK_TENSORS` tensors).

    Example:
        >>> group([torch.zeros(3), torch.zeros(4), torch.zeros(1 << 16), torch.zeros(5)])
        [[0, 1], [2], [3]]
    """
    groups, numel = [], 0     # numel: the elements of the last run
    for i, t in enumerate(tensors):
        n, run = t.numel(), groups[-1] if groups else [i]
        first = tensors[run[0]]
        if (groups and n < SMALL_NUMEL and first.numel() < SMALL_NUMEL and numel + n <= PACK_NUMEL
                and len(run) < PACK_TENSORS and t.device == first.device and t.dtype == first.dtype):
            run.append(i)
            numel += n
        else:
            groups.append([i])
            numel = n
    return groups


def runs(tensors: Sequence[torch.Tensor], packable: Callable[[torch.Tensor], bool]) -> List[list]:
    """The tensors rounded together: each one not ``packable`` alone, then the runs of :func:`group` of the others."""
    fast = [t for t in tensors if packable(t)]
    return [[t] for t in tensors if not packable(t)] + [[fast[i] for i in run] for run in group(fast)]


class Pack:
    """A run of tensors laid end to end in one flat buffer (made when first needed), tensor i in ``sizes[i]``
    elements of it."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.shapes, self.sizes = [t.shape for t in tensors], [t.numel() for t in tensors]
        self.several, self.dtype, self.device = len(tensors) > 1, tensors[0].dtype, tensors[0].device
        self._flat: Optional[torch.Tensor] = None
        self._flat_views: List[torch.Tensor] = []
        self._homes: Optional[tuple] = None   # where adopted tensors live: their views' data pointers

    def flat(self, tensors: Sequence[torch.Tensor], adopt: Optional[MutableMapping] = None) -> torch.Tensor:
        """The tensors' values, flat, in this pack's layout: one tensor itself, flat, several copied
        into the pack's buffer. With ``adopt`` (``PackCache.adopted``) they move into it, each
        one's ``.data`` becoming its view there, so that while they stay (:meth:`at_home`) nothing
        is copied in or back; views of a larger tensor and tensors sharing memory are copied."""
        if not self.several:
            return tensors[0].reshape(-1)
        if self._flat is None:
            self._flat = torch.zeros(sum(self.sizes), dtype=self.dtype, device=self.device)
            self._flat_views = [v.view(shape) for v, shape in zip(self._flat.split(self.sizes), self.shapes)]
        if self.at_home(tensors):
            return self._flat
        copy_into(self._flat_views, list(tensors))
        self._homes = None
        if adopt is not None and _movable(tensors, self._flat_views, adopt):
            with torch.no_grad():
                for t, view in zip(tensors, self._flat_views):
                    t.data = view
                    adopt[t] = view.data_ptr()
            self._homes = tuple(v.data_ptr() for v in self._flat_views)
        return self._flat

    def at_home(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` (several) live in this pack's buffer."""
        return self._homes is not None and tuple(map(torch.Tensor.data_ptr, tensors)) == self._homes

    def put_back(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the buffer of :meth:`flat` back into the tensors, unless it is theirs."""
        if self.several and not self.at_home(tensors):
            copy_into(list(tensors), self._flat_views)

    def held_bytes(self, tensors: Sequence[torch.Tensor]) -> int:
        """The memory this pack keeps: its buffer, unless ``tensors`` live in it."""
        home = self._flat is None or self.several and self.at_home(tensors)
        return 0 if home else self._flat.numel() * self._flat.element_size()


def _movable(tensors: Sequence[torch.Tensor], homes: Sequence[torch.Tensor], adopted: MutableMapping) -> bool:
    """Whether each tensor lives in a pack's buffer (its place ``home`` in this one, or where a
    pack put it by the ``adopted`` record), or is the whole of a storage of its own."""
    pointers = set()
    for t, home in zip(tensors, homes):
        where = t.data_ptr()
        if where == home.data_ptr() or adopted.get(t) == where:
            continue
        storage = t.untyped_storage()
        if t.storage_offset() != 0 or storage.nbytes() != t.numel() * t.element_size() or storage.data_ptr() in pointers:
            return False
        pointers.add(storage.data_ptr())
    return True


class PackCache:
    """The packs an owner keeps: ``kept`` (:meth:`packs_for`, by the ids of the tensors they hold) and
    ``adopted`` (weak: tensor -> the data pointer of its place in a pack), which :meth:`Pack.flat`
    takes. New packs drop the kept ones that share a tensor with them."""

    def __init__(self) -> None:
        self.kept: dict = {}
        self.adopted = WeakIdKeyDictionary()

    def packs_for(self, tensors: Sequence[torch.Tensor], packable: Callable[[torch.Tensor], bool]) -> list:
        """``(members, pack)`` for each of :func:`runs`: a tensor not ``packable`` alone (no pack), then the packs."""
        key = tuple(map(id, tensors))
        if key not in self.kept:
            for old in [k for k in self.kept if not set(key).isdisjoint(k)]:
                del self.kept[old]
            if len(self.kept) >= 8:
                self.kept.clear()
            self.kept[key] = [(members, Pack(members) if packable(members[0]) else None)
                              for members in runs(tensors, packable)]
        return self.kept[key]

    def held_bytes(self) -> int:
        """The memory of the kept packs (none for a pack whose tensors live in it)."""
        return sum(pack.held_bytes(members) for kept in self.kept.values() for members, pack in kept if pack)
