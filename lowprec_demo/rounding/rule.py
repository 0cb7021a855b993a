"""The freeze rule, written once: does an update leave a stored weight in place, and how likely
does stochastic rounding move it.

For a stored weight ``w`` (a value of the format's grid) and an update ``d``:

The gap on the update's side
    ``gap = 2**(max(floor(log2|w|), e_min) - m)``, except moving toward zero from a power of two
    (inf included), where the grid below is twice as fine: ``gap / 2`` (never below the
    subnormal spacing ``2**(e_min - m)``).
Would it freeze (round to nearest)
    ``|d| < gap / 2``, or ``|d| == gap / 2`` with ``w`` an even multiple of the gap (the tie goes
    to the even neighbour). A *stuck* weight stays whatever the update's size: ``+-max`` of a
    saturating format under an outward update, an infinite weight under any finite update (or
    an infinite one of its own sign). A NaN weight or update never freezes, and its move
    probability is NaN.
Move probability (stochastic rounding)
    ``min(1, |d| / gap)``, 0 for a stuck weight; with k random bits the position in the gap is
    resolved to k bits, ``round_half_even(p * 2**k) / 2**k``, so that an update below
    ``2**-(k+1)`` gaps never moves (few-bit SR freezes again).
The freeze code
    One byte per element for counting: bit 0 frozen, bit 1 the few-bit flag (``|d|/gap <=
    2**-(k+1)``), bits 2-7 the bin of ``log2(|d|/gap)`` (:func:`ratio_bin`); without few-bit
    prediction the bin sits in bits 1-6. :func:`decode_code` reads it back.

Everything is decided on bit patterns of float32 or float64 tensors (:data:`LAYOUTS`) with
integer operations and exact floating-point ones (comparisons, multiplication by powers of two),
so the functions give the same bits eagerly and under ``torch.compile`` (inductor compiles C++
with ``-fno-signed-zeros``; Triton divides approximately unless told otherwise). They are the
rule behind :func:`lowprec_demo.rounding.would_freeze`, :func:`~lowprec_demo.rounding.move_probability`
and :func:`~lowprec_demo.rounding.update_ulp_ratio`, the freeze kernel of
:mod:`lowprec_demo.kernels` (and through it the predictor and the watch), and
:class:`~lowprec_demo.optimizer.LowPrecisionOptimizer`'s freeze statistics; ``tests/test_freeze_rule_callers.py``
runs every caller on the format's edges against an exact
``fractions.Fraction`` reference.

Example:
    >>> import torch
    >>> from lowprec_demo.formats import get_format
    >>> w, d = torch.tensor([1.0, 1.0, 448.0]), torch.tensor([2**-9, -2**-9, 32.0])
    >>> p = torch.tensor(rule_params(get_format("e4m3"), None, RATIO_EDGES), dtype=torch.int32)
    >>> frozen, ratio, stuck = freeze_elements(w.view(torch.int32) & 0x7FFFFFFF, w.view(torch.int32), d, p)
    >>> frozen.tolist(), stuck.tolist()
    ([True, True, True], [False, False, True])
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

from lowprec_demo.formats import FloatFormat

__all__ = ["BitLayout", "LAYOUTS", "RATIO_EDGES", "NO_BIN", "rule_params", "ratio_bin_params", "freeze_elements",
           "gap_exponent", "gap_value", "move_share", "ratio_bin", "code_of", "decode_code", "watch_code", "gap_options", "one_factor_gaps"]

# the histogram of log2(|d|/gap): bins between consecutive integers from 2**-24 to 2**8
RATIO_EDGES = tuple(range(-24, 9))
NO_BIN = 63                   # the bin of a NaN ratio: counted nowhere


@dataclass(frozen=True)
class BitLayout:
    """The bit layout of a float dtype the rule works on: its integer type, stored mantissa bits
    and exponent bias. Example: ``LAYOUTS[torch.float32].inf_bits`` -> ``0x7F800000``."""

    dtype: torch.dtype
    itype: torch.dtype
    man_bits: int
    bias: int

    @property
    def abs_mask(self) -> int:
        return (1 << (self.man_bits + self.exponent_bits)) - 1

    @property
    def exponent_bits(self) -> int:
        return (2 * self.bias + 1).bit_length()

    @property
    def inf_bits(self) -> int:
        return (2 * self.bias + 1) << self.man_bits

    @property
    def half_bits(self) -> int:
        return (self.bias - 1) << self.man_bits

    def bits(self, value: float) -> int:
        """The bit pattern of ``value`` in this dtype, as a signed integer of its width."""
        if self.dtype == torch.float32:
            return struct.unpack("<i", struct.pack("<f", value))[0]
        return struct.unpack("<q", struct.pack("<d", value))[0]


LAYOUTS: Dict[torch.dtype, BitLayout] = {
    torch.float32: BitLayout(torch.float32, torch.int32, 23, 127),
    torch.float64: BitLayout(torch.float64, torch.int64, 52, 1023),
}
_F32 = LAYOUTS[torch.float32]


def rule_params(fmt: FloatFormat, rand_bits: Optional[int], edges: Sequence[int],
                layout: BitLayout = _F32, overflow: Optional[str] = None) -> list:
    """The rule's parameters as integers (a tensor of ``layout.itype``, so that one compiled
    kernel serves every format): ``[m, e_min + bias, bits of max, bits of the overflow value,
    stuck bits, bits of 2**-(k+1), k, stuck limit]`` and the two numbers of
    :func:`ratio_bin_params`. The stuck weight is the one every outward update leaves in place:
    the max where the format saturates, inf where it overflows to inf (-1: none, as with NaN);
    the stuck limit is the bits of inf where any finite update leaves it in place, else 0.
    ``overflow``: the policy (default the format's own); k = 0: no few-bit prediction.

    Example:
        >>> from lowprec_demo.formats import get_format
        >>> rule_params(get_format("bf16"), None, RATIO_EDGES)[:2]
        [7, 1]
    """
    policy = fmt.overflow if overflow is None else overflow
    k = 0 if rand_bits is None else rand_bits
    inf, top = layout.inf_bits, layout.bits(fmt.max)
    over = {"inf": inf, "saturate": top, "nan": inf | (1 << (layout.man_bits - 1))}[policy]
    stuck = {"saturate": top, "inf": inf, "nan": -1}[policy]
    return [fmt.man_bits, fmt.e_min + layout.bias, top, over, stuck, (layout.bias - k - 1) << layout.man_bits, k,
            inf if policy == "inf" else 0] + ratio_bin_params(edges, layout)


def ratio_bin_params(edges: Sequence[int], layout: BitLayout = _F32) -> list:
    """``[bias + edges[0], len(edges)]``: the bins of ``log2(|d|/gap)`` as :func:`ratio_bin`
    computes them, for edges that are consecutive integers (such as :data:`RATIO_EDGES`):
    ``bucketize(log2 r, edges)`` is then ``ceil(log2 r) - edges[0]``, clamped to
    ``0..len(edges)``. The bins must fit in the code's 6 bits, the last value (63) left for NaN.

    Example:
        >>> ratio_bin_params(range(-24, 9))
        [103, 33]
    """
    edges = [int(e) for e in edges]
    if not edges or edges != list(range(edges[0], edges[0] + len(edges))):
        raise ValueError(f"the ratio bins' edges must be consecutive integers; got {edges}")
    if len(edges) >= NO_BIN or not 1 - layout.bias <= edges[0] <= layout.bias - len(edges):
        raise ValueError(f"{len(edges) + 1} bins from {edges[0]} do not fit the freeze code")
    return [layout.bias + edges[0], len(edges)]


def gap_exponent(wu: torch.Tensor, inward: torch.Tensor, p: torch.Tensor, layout: BitLayout = _F32) -> torch.Tensor:
    """The biased exponent of the gap on the update's side of the stored magnitudes ``wu`` (bit
    patterns): ``max(exponent of w - inward, e_min) - m``, where ``inward`` (bool) says that the
    update points toward zero from a power of two (there the grid below is twice as fine)."""
    ew = wu >> layout.man_bits
    return torch.clamp(ew - inward.to(wu.dtype), min=p[1]) - p[0]


def _scales(gap_exp: torch.Tensor, layout: BitLayout, one_factor: bool) -> list:
    """``2**-gap`` as normal powers of two whose product it is: one factor where every gap of
    the format has a normal reciprocal, else two, each as large as the layout allows."""
    shift, bias = layout.man_bits, layout.bias
    if one_factor:
        return [((2 * bias - gap_exp) << shift).view(layout.dtype)]
    neg_g = bias - gap_exp
    first = torch.clamp(neg_g, min=1 - bias, max=bias)
    return [((first + bias) << shift).view(layout.dtype), ((neg_g - first + bias) << shift).view(layout.dtype)]


def gap_value(gap_exp: torch.Tensor, layout: BitLayout = _F32) -> torch.Tensor:
    """The gap ``2**(gap_exp - bias)`` for biased gap exponents, exactly (subnormal gaps too:
    a biased exponent of 0 or less), as floats of ``layout``; inf from ``2 * bias + 1`` on."""
    man = layout.man_bits
    normal = torch.clamp(gap_exp, min=1, max=2 * layout.bias + 1) << man
    subnormal = torch.ones_like(gap_exp) << torch.clamp(gap_exp - 1 + man, min=0)
    return torch.where(gap_exp >= 1, normal, subnormal).view(layout.dtype)


def freeze_elements(wu: torch.Tensor, signed: torch.Tensor, d: torch.Tensor, p: torch.Tensor,
                    layout: BitLayout = _F32, infinite_gap: bool = True, one_factor: bool = False,
                    divide: bool = False):
    """The rule for stored magnitudes ``wu`` (bit patterns of ``q(w)``, at most those of inf),
    the signs of ``signed`` (bit patterns of ``w`` or of anything with its sign) and the updates
    ``d`` (floats of ``layout``), with the parameters ``p`` of :func:`rule_params`.

    Returns ``(frozen, ratio, stuck)``: whether round to nearest keeps ``q(w)`` (bool), ``|d| /
    gap`` on the update's side (exact but where the ratio is below the smallest normal, where
    the two factors of a huge gap can round twice, unless ``divide``: then ``|d|`` is divided by
    the gap, rounded once; 0 or NaN at an infinite gap), and whether the weight is stuck (bool).
    ``infinite_gap=False`` leaves out the gap at inf of a format without
    mantissa bits (the only infinite gap); ``one_factor=True`` divides by the gap with one
    multiplication (:func:`one_factor_gaps`). Python values both, on which ``torch.compile``
    specialises."""
    inf_bits, half_bits = layout.inf_bits, layout.half_bits
    db = d.view(layout.itype)
    du = db & layout.abs_mask
    opposite = (signed ^ db) < 0            # w and d point different ways
    inward = opposite & ((wu & ((1 << layout.man_bits) - 1)) == 0) & (wu != 0)
    gap_exp = gap_exponent(wu, inward, p, layout)
    scales = _scales(gap_exp, layout, one_factor)
    if divide:
        ratio = d.abs() / gap_value(gap_exp, layout)
    else:
        ratio = d.abs()
        for scale in scales:
            ratio = ratio * scale
    if infinite_gap:
        ratio = torch.where(gap_exp >= 2 * layout.bias + 1, torch.where(du < inf_bits, 0.0, float("nan")), ratio)
    rb = ratio.view(layout.itype)
    # |w| / gap, an integer below 2**(m + 2), comes exactly from the same factors (the first
    # product is normal, or 0: |w| >= gap or w = 0); it is even when its half is whole. (At inf
    # the half is inf and counts as even: a finite update leaves inf in place anyway.)
    half_multiple = wu.view(layout.dtype)
    for scale in scales:
        half_multiple = half_multiple * scale
    half_multiple = half_multiple * 0.5
    frozen = (rb < half_bits) | ((rb == half_bits) & (torch.round(half_multiple) == half_multiple))
    stuck = (wu == p[4]) & (~opposite | (du < p[7])) & (du <= inf_bits)   # (a NaN update moves nothing)
    frozen = (frozen | stuck) & (torch.maximum(wu, du) <= inf_bits)       # NaN never
    return frozen, ratio, stuck


def move_share(ratio: torch.Tensor, stuck: torch.Tensor, k) -> torch.Tensor:
    """The move probability of stochastic rounding from :func:`freeze_elements`' ratio and stuck
    flags: ``min(1, ratio)``, 0 where stuck, resolved to ``k`` random bits where ``k > 0`` (``k``
    a Python int or a 0-dim integer tensor; at most 32). NaN stays NaN."""
    probability = torch.where(stuck, 0.0, torch.clamp(ratio, max=1.0))
    if isinstance(k, int):
        return probability if k == 0 else torch.round(probability * 2.0**k) * 2.0**-k
    f32 = torch.float32   # 2**k and 2**-k as float32 bit patterns (k <= 32)
    resolved = torch.round(probability * ((k + 127) << 23).view(f32)) * ((127 - k) << 23).view(f32)
    return torch.where(k > 0, resolved.to(probability.dtype), probability)


def ratio_bin(ratio: torch.Tensor, p: torch.Tensor, layout: BitLayout = _F32) -> torch.Tensor:
    """The bin of ``log2(ratio)`` as ``bucketize`` with the edges of :func:`ratio_bin_params`:
    the ratio's exponent rounded up (a nonzero mantissa carries into the exponent), less the
    first edge, clamped to the bins; ratio 0 in bin 0, NaN in :data:`NO_BIN`."""
    rb = ratio.view(layout.itype)
    bin_ = torch.minimum(torch.clamp(((rb + ((1 << layout.man_bits) - 1)) >> layout.man_bits) - p[8], min=0), p[9])
    return torch.where(rb > layout.inf_bits, NO_BIN, bin_).to(torch.int32)


def code_of(frozen: torch.Tensor, ratio: torch.Tensor, p: torch.Tensor, fewbit: bool = True,
            layout: BitLayout = _F32) -> torch.Tensor:
    """The freeze code (int32, below 256): bit 0 frozen, then with ``fewbit`` the few-bit flag
    (``ratio <= 2**-(k+1)``) in bit 1 and the bin in bits 2-7, else the bin in bits 1-6."""
    bin_ = ratio_bin(ratio, p, layout)
    if not fewbit:
        return frozen.to(torch.int32) | (bin_ << 1)
    flag = (ratio.view(layout.itype) <= p[5]).to(torch.int32)
    return frozen.to(torch.int32) | (flag << 1) | (bin_ << 2)


def decode_code(code: torch.Tensor, fewbit: bool = True) -> tuple:
    """``(frozen, few-bit flag, bin)`` of freeze codes written by :func:`code_of` (the flag is
    None without ``fewbit``).

    Example:
        >>> [t.tolist() for t in decode_code(torch.tensor([1 | 1 << 1 | 5 << 2]))]
        [[True], [True], [5]]
    """
    code = code.to(torch.int32)
    if not fewbit:
        return (code & 1).bool(), None, code >> 1
    return (code & 1).bool(), ((code >> 1) & 1).bool(), code >> 2


def watch_code(frozen: torch.Tensor, ratio: torch.Tensor, grad: torch.Tensor, tensor_id: torch.Tensor,
               log_lr: torch.Tensor, first_edge: float, bins: int) -> torch.Tensor:
    """The freeze watch's code of every element (int32): ``((tensor * bins + at) << 2) | frozen << 1
    | (grad != 0)``, where ``at`` is the bin of ``y = log2(ratio) - log_lr[tensor]`` (the step per
    unit of learning rate, in gaps) among ``bins`` bins an eighth of an octave wide from
    ``first_edge``: ``ceil((y - first_edge) * 8)`` clamped to ``0 .. bins - 1``, NaN in the last.
    ``log_lr`` holds one value per tensor, or is 0-dim when every tensor has the same learning rate.
    One ``bincount`` of the codes then gives, per tensor, the histogram and the frozen, idle and
    frozen-with-gradient counts.

    Example:
        >>> one = torch.ones(1)
        >>> watch_code(one.bool(), one * 0.25, one, torch.zeros(1, dtype=torch.int32), torch.zeros(1), -4.0, 64).tolist()
        [67]
    """
    y = torch.log2(ratio) - (log_lr if log_lr.dim() == 0 else log_lr[tensor_id])
    at = torch.ceil((y - first_edge) * 8)     # (where, not nan_to_num: the compiled loop stays vectorized)
    at = torch.where(torch.isnan(at), bins - 1, at.clamp(0, bins - 1)).to(torch.int32)
    return ((tensor_id * bins + at) << 2) | (frozen.to(torch.int32) << 1) | (grad != 0).to(torch.int32)


def one_factor_gaps(fmt: FloatFormat) -> bool:
    """Whether ``1/gap`` is a normal float32 for every gap of the format, inf's included
    (biased gap exponents 0..253): ``m >= 2`` and ``e_min - m >= -127``."""
    return fmt.man_bits >= 2 and fmt.e_min - fmt.man_bits >= -127


def gap_options(fmt: FloatFormat) -> dict:
    """The ``infinite_gap`` and ``one_factor`` arguments of :func:`freeze_elements` for float32
    input: the infinite gap at inf only without mantissa bits, the division by the gap with one
    factor where :func:`one_factor_gaps` allows it.

    Example:
        >>> from lowprec_demo.formats import get_format
        >>> gap_options(get_format("bf16")), gap_options(get_format("e4m3"))
        ({'infinite_gap': False, 'one_factor': False}, {'infinite_gap': False, 'one_factor': True})
    """
    if not fmt.man_bits:
        return {"infinite_gap": True, "one_factor": False}
    return {"infinite_gap": False, "one_factor": one_factor_gaps(fmt)}
