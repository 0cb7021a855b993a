"""Counting the freeze kernel's codes: what the predictor keeps of a step.

One kernel pass (:func:`lowprec_demo.kernels.freeze_code`) over each pack of tensors
(:mod:`lowprec_demo.packing`) per format writes one code byte per element
(:mod:`lowprec_demo.freeze_rule`) and returns the sum of the move probabilities; the counts come
from one :func:`torch.bincount` per pack, laid out so that it does not stall on runs of equal
codes, and everything reaches Python in one transfer. :class:`~lowprec_demo.prediction.FreezePredictor`
adds them to its records.

Example:
    >>> import torch
    >>> from lowprec_demo.formats import get_format
    >>> from lowprec_demo.packing import packs
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
    """What :func:`count_freezes` counts for one format.

    Attributes:
        moved: the sum of the move probabilities ``min(1, |d|/gap)`` (with k random bits
            resolved to k bits).
        frozen: the elements that freeze, per tensor, pack after pack.
        fewbit: the elements whose ratio few-bit SR never moves (0 without few-bit prediction).
        ratio_hist: the elements per bin of ``log2(|d|/gap)``, ``len(edges) + 1`` bins (NaN
            ratios in none).
    """

    moved: float
    frozen: List[int]
    fewbit: int
    ratio_hist: List[int]


def _layout_for(pack, rand_bits: Optional[int]) -> str:
    """How :func:`count_freezes` lays out and counts the codes of a pack: without few-bit
    prediction two codes per bincount entry (one tensor of an even number of elements) or one
    (several tensors: 256 bins, the frozen elements per block); else the codes with the few-bit
    flag, tagged by tensor where there are several."""
    if rand_bits is None and pack.several:
        return "bytes"
    if rand_bits is None and pack.numel % 2 == 0 and PAIRED_BINCOUNT:
        return "paired"
    return "tagged" if pack.several else "codes"


def _count_parts(layout: str, pack, old: torch.Tensor, new: torch.Tensor, fmt: FloatFormat,
                 edges: Sequence[int], rand_bits: Optional[int]) -> List[torch.Tensor]:
    """The counts of one pack and format as flat tensors, read back by :func:`_fold_counts`:
    the move sum first, then 256 counts of code bytes, then per layout 128 more (``"paired"``:
    those of the odd elements) or one number per tensor (its frozen elements)."""
    if layout in ("bytes", "paired"):
        codes = pack.codes()
        moved = kernels.freeze_code(old, new, fmt, edges, codes, layout)
        if layout == "bytes":   # one byte per bincount entry, the frozen elements per block
            return [moved.reshape(1), torch.bincount(codes, minlength=256), pack.per_tensor(kernels.frozen_blocks(codes))]
        # two codes per entry: ``even`` (256) per (bin, frozen, lane) of the even element of a
        # pair, ``odd`` (128) per (bin, frozen) of the odd one (two plain reductions of the
        # 32768 counts; the rest in Python on the short lists, where it costs less)
        rows = torch.bincount(codes.view(torch.int16), minlength=1 << 15).view(128, 256)
        return [moved.reshape(1), rows.sum(0), rows.sum(1)]
    # one bincount: frozen, few-bit and bin jointly, per tensor of the pack (the gaps between
    # tensors have a tag of their own, a row left out)
    code = torch.empty(pack.numel, dtype=torch.int32 if layout == "tagged" else torch.uint8, device=old.device)
    moved = kernels.freeze_code(old, new, fmt, edges, code, layout, rand_bits, pack.tags())
    k = len(pack.sizes)
    joint = torch.bincount(code, minlength=256 * (k + pack.several)).view(-1, 256)[:k]
    return [moved.reshape(1), joint.sum(0), joint.view(-1, 128, 2)[:, :, 1].sum(1)]


def _byte_table() -> tuple:
    """Which code bytes have bit 1 set, and the bin of every byte, read by
    :func:`lowprec_demo.freeze_rule.decode_code`: the codes with the few-bit flag keep it in
    bit 1, the ``"bytes"`` layout (``code << 1 | lane``, the code without the flag) its frozen
    flag; both keep the bin in bits 2-7."""
    byte = torch.arange(256)
    _, flag, bin_ = decode_code(byte)
    frozen, _, shifted_bin = decode_code(byte >> 1, fewbit=False)
    assert torch.equal(flag, frozen) and torch.equal(bin_, shifted_bin)   # one table for both layouts
    return [b for b in range(256) if flag[b]], bin_.tolist()


_FLAGGED_BYTES, _BIN_OF_BYTE = _byte_table()


def _fold_bytes(counts: list) -> tuple:
    """From 256 counts per code byte with the frozen flag in bit 1 and the bin in bits 2-7
    (the ``"bytes"`` layout, the even elements of the ``"paired"`` one) or the few-bit flag in
    bit 1 (the codes with the flag): the count of the bytes with bit 1 set and the histogram of
    the 64 values of bits 2-7."""
    hist = [0] * 64
    for byte, count in enumerate(counts):
        hist[_BIN_OF_BYTE[byte]] += count
    return sum(counts[b] for b in _FLAGGED_BYTES), hist


def _fold_counts(layout: str, pack, values: list, at: int) -> tuple:
    """``(moved, frozen per tensor, few-bit count, histogram of the 64 bin values, how many
    values were read)`` from ``values[at:]``, as :func:`_count_parts` wrote them."""
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
    """The freeze statistics of the update ``new - old`` of every ``(pack, old, new)`` in
    ``pairs`` (a :class:`lowprec_demo.packing.Pack` and two flat float32 tensors in its
    layout), for every format: one :class:`FreezeCounts` per format, over all the packs, with
    the histogram of ``log2(|d|/gap)`` in the bins of ``edges`` (consecutive integers:
    :data:`lowprec_demo.prediction.RATIO_BINS`) and with ``rand_bits`` the few-bit count.

    One kernel pass over each pack per format writes one code per element and returns the sum
    of the move probabilities; the counts come from one bincount per pack, laid out as
    :func:`_layout_for` says, and everything reaches Python in one transfer."""
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
