"""What :class:`~lowprec_demo.freeze.prediction.FreezePredictor` keeps of a step: per format, one kernel pass
(:func:`lowprec_demo.rounding.kernels.freeze_code`) over each pack of tensors (:mod:`lowprec_demo.optim.packing`) writes
a code byte per element (:mod:`lowprec_demo.rounding.rule`) and sums the move probabilities; one :func:`torch.bincount`
per pack, laid out not to stall on runs of equal codes, counts them, and everything reaches Python in one transfer.

Example:
    >>> import torch
    >>> from lowprec_demo.formats import get_format
    >>> from lowprec_demo.optim.packing import packs
    >>> old = torch.ones(4); new = old + torch.tensor([1e-3, 1e-2, 0.0, 1.0])
    >>> pack, = packs([old]); counts, = count_freezes([(pack, old, new)], [get_format("bf16")], range(-24, 9))
    >>> counts.frozen
    [2]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from lowprec_demo.rounding import kernels
from lowprec_demo.formats import FloatFormat
from lowprec_demo.rounding.rule import decode_code

__all__ = ["FreezeCounts", "count_freezes", "PAIRED_BINCOUNT"]

PAIRED_BINCOUNT = sys.byteorder == "little"   # two uint8 codes read as one int16


@dataclass(frozen=True)
class FreezeCounts:
    """What :func:`count_freezes` counts for one format: ``moved``, the sum of the move
    probabilities ``min(1, |d|/gap)`` (resolved to k bits with k random bits); ``frozen``, the
    elements that freeze per tensor, pack after pack; ``fewbit``, those few-bit SR never moves (0
    without it); ``ratio_hist``, the elements per bin of ``log2(|d|/gap)`` (NaN in none)."""

    moved: float
    frozen: List[int]
    fewbit: int
    ratio_hist: List[int]


def _layout_for(pack, rand_bits: Optional[int]) -> str:
    """How a pack's codes are laid out: without few-bit prediction two per bincount entry (one tensor, even length) or
    one (several tensors, frozen counted per block); else with the few-bit flag, tagged by tensor if several."""
    if rand_bits is None and pack.several:
        return "bytes"
    if rand_bits is None and pack.numel % 2 == 0 and PAIRED_BINCOUNT:
        return "paired"
    return "tagged" if pack.several else "codes"


def _count_parts(layout: str, pack, old: torch.Tensor, new: torch.Tensor, fmt: FloatFormat,
                 edges: Sequence[int], rand_bits: Optional[int]) -> List[torch.Tensor]:
    """One pack's counts as flat tensors, read back by :func:`_fold_counts`: the move sum, 256
    counts of code bytes, then 128 of the odd elements (``"paired"``) or one per tensor."""
    if layout in ("bytes", "paired"):
        codes = pack.codes()
        moved = kernels.freeze_code(old, new, fmt, edges, codes, layout)
        if layout == "bytes":   # one byte per bincount entry, the frozen elements per block
            return [moved.reshape(1), torch.bincount(codes, minlength=256), pack.per_tensor(kernels.frozen_blocks(codes))]
        # two codes per entry: 256 counts per byte of the even element, 128 per (bin, frozen) of
        # the odd one (two plain reductions; the rest in Python on the short lists)
        rows = torch.bincount(codes.view(torch.int16), minlength=1 << 15).view(128, 256)
        return [moved.reshape(1), rows.sum(0), rows.sum(1)]
    # one bincount of frozen, few-bit and bin jointly per tensor (the gaps' tag: a row left out)
    code = torch.empty(pack.numel, dtype=torch.int32 if layout == "tagged" else torch.uint8, device=old.device)
    moved = kernels.freeze_code(old, new, fmt, edges, code, layout, rand_bits, pack.tags())
    k = len(pack.sizes)
    joint = torch.bincount(code, minlength=256 * (k + pack.several)).view(-1, 256)[:k]
    return [moved.reshape(1), joint.sum(0), joint.view(-1, 128, 2)[:, :, 1].sum(1)]


def _byte_table() -> tuple:
    """The code bytes with bit 1 set, and every byte's bin (bits 2-7): bit 1 is the few-bit flag
    of the flagged codes and the frozen flag of the ``"bytes"`` layout (``code << 1 | lane``)."""
    byte = torch.arange(256)
    _, flag, bin_ = decode_code(byte)
    frozen, _, shifted_bin = decode_code(byte >> 1, fewbit=False)
    assert torch.equal(flag, frozen) and torch.equal(bin_, shifted_bin)   # one table for both layouts
    return [b for b in range(256) if flag[b]], bin_.tolist()


_FLAGGED_BYTES, _BIN_OF_BYTE = _byte_table()


def _fold_bytes(counts: list) -> tuple:
    """From 256 counts per code byte: those with bit 1 set, and the histogram of bits 2-7."""
    hist = [0] * 64
    for byte, count in enumerate(counts):
        hist[_BIN_OF_BYTE[byte]] += count
    return sum(counts[b] for b in _FLAGGED_BYTES), hist


def _fold_counts(layout: str, pack, values: list, at: int) -> tuple:
    """``(moved, frozen per tensor, few-bit count, 64-bin histogram, values read)`` from
    ``values[at:]``, as :func:`_count_parts` wrote them."""
    k = len(pack.sizes)
    moved, counts = values[at], values[at + 1:at + 257]
    if layout == "bytes":   # the zeros in the gaps: a zero update, frozen, bin 0
        _, hist = _fold_bytes(counts)
        hist[0] -= sum(pack.pads)
        return moved, [f - pad for f, pad in zip(values[at + 257:at + 257 + k], pack.pads)], 0, hist, 257 + k
    if layout == "paired":
        frozen, hist = _fold_bytes(counts)
        odd = values[at + 257:at + 385]
        frozen += sum(odd[1::2])
        return moved, [frozen], 0, [h + a + b for h, a, b in zip(hist, odd[0::2], odd[1::2])], 385
    fewbit, hist = _fold_bytes(counts)   # bit 1: the few-bit flag
    return moved, values[at + 257:at + 257 + k], fewbit, hist, 257 + k


def count_freezes(pairs: Sequence[tuple], formats: Sequence[FloatFormat], edges: Sequence[int],
                  rand_bits: Optional[int] = None) -> List[FreezeCounts]:
    """One :class:`FreezeCounts` per format for the updates ``new - old`` of every ``(pack, old, new)`` (a
    :class:`~lowprec_demo.optim.packing.Pack` and two flat float32 tensors in its layout), the histogram in the bins
    of ``edges`` (consecutive integers, :data:`~lowprec_demo.freeze.records.RATIO_BINS`)."""
    edges = tuple(edges)   # (a key of the parameter cache)
    layouts = [_layout_for(pack, rand_bits) for pack, _, _ in pairs]
    parts = [part for fmt in formats for layout, (pack, old, new) in zip(layouts, pairs)
             for part in _count_parts(layout, pack, old, new, fmt, edges, rand_bits)]
    values = torch.cat(parts).tolist() if parts else []          # one transfer
    out, at = [], 0
    for _ in formats:
        moved, frozen, fewbit, hist = 0.0, [], 0, [0] * 64
        for layout, (pack, _, _) in zip(layouts, pairs):
            m, f, few, h, used = _fold_counts(layout, pack, values, at)
            moved += m
            fewbit += few
            frozen += [int(x) for x in f]
            hist = [a + b for a, b in zip(hist, h)]
            at += used
        out.append(FreezeCounts(moved, frozen, int(fewbit), [int(c) for c in hist[:len(edges) + 1]]))
    return out
