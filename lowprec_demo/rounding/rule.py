"""The freeze rule, written once: whether an update leaves a stored weight in place, and how likely SR moves it.

For a stored weight ``w`` (a value of the format's grid) and an update ``d``, the gap on the update's side is
``2**(max(floor(log2|w|), e_min) - m)``, halved moving toward zero from a power of two (inf included; never below the
subnormal spacing). Round to nearest freezes ``w`` when ``|d| < gap / 2``, or ``|d| == gap / 2`` with ``w`` an even
multiple of the gap; a *stuck* weight stays whatever the update (``+-max`` of a saturating format under an outward
update, inf under a finite one or one of its own sign); a NaN weight or update never freezes. Stochastic rounding
moves it with probability ``min(1, |d| / gap)`` (0 when stuck), with k random bits
``round_half_even(p * 2**k) / 2**k``, so an update below ``2**-(k+1)`` gaps never moves.

The functions here, on bit patterns (:data:`LAYOUTS`), are the rule behind ``would_freeze``, ``move_probability``,
``update_ulp_ratio`` and the freeze kernels of :mod:`~lowprec_demo.rounding.bits`
(``tests/test_freeze_rule_callers.py`` runs every caller against an exact ``Fraction`` reference). A format reaches
them and the rounding kernels as named integers (:class:`RuleParams`, :class:`RoundParams`), which a kernel takes as
one integer tensor: one compiled kernel serves every format and seed.

Example:
    >>> import torch
    >>> from lowprec_demo.formats import get_format
    >>> w, d = torch.tensor([1.0, 1.0, 448.0]), torch.tensor([2**-9, -2**-9, 32.0])
    >>> q = rule_params(get_format("e4m3"))
    >>> frozen, ratio, stuck = freeze_elements(w.view(torch.int32) & 0x7FFFFFFF, w.view(torch.int32), d, q)
    >>> frozen.tolist(), stuck.tolist()
    ([True, True, True], [False, False, True])
"""

from __future__ import annotations

import struct
from typing import Dict, NamedTuple, Optional

import torch

from lowprec_demo.formats import FloatFormat

__all__ = ["BitLayout", "LAYOUTS", "FIRST_EDGE", "LAST_EDGE", "PER_OCTAVE", "BINS", "OCTAVES", "RoundParams", "RuleParams",
           "round_params", "rule_params", "seed_words", "freeze_elements", "gap_exponent", "gap_value", "move_share",
           "bin_thresholds", "step_code", "gap_options"]

# the one binning of log2(|d| / gap) (less log2(lr) where the watch divides by the learning rate): eighths of an
# octave from 2**-64 to 2**32, a bin below and one above; a NaN ratio takes one more slot (BINS) of its own. The same
# bins in whole octaves (OCTAVES of them, the predictor's: eight eighths each) are those of ``ceil(log2 ratio)``
FIRST_EDGE, LAST_EDGE, PER_OCTAVE = -64, 32, 8
BINS = (LAST_EDGE - FIRST_EDGE) * PER_OCTAVE + 2
OCTAVES = LAST_EDGE - FIRST_EDGE + 2
FULL_RAND_BITS = 32           # stochastic rounding at full resolution: the 32 bits of one hash


class BitLayout(NamedTuple):
    """The bit layout of a float dtype the kernels and the rule work on (:data:`LAYOUTS`): its
    integer type of the same width, stored mantissa bits P, exponent bias and the bit patterns
    the kernels use. Example: ``hex(LAYOUTS[torch.float32].inf_bits)`` -> ``'0x7f800000'``."""
    dtype: torch.dtype
    itype: torch.dtype
    man_bits: int
    bias: int
    width: int
    abs_mask: int           # all bits but the sign
    sign_bits: int          # the sign bit, as a negative integer of the width
    inf_bits: int
    nan_bits: int           # the quiet NaN
    half_bits: int          # 0.5

    def bits(self, value: float) -> int:
        """The bit pattern of ``value`` in this dtype, as a signed integer of its width."""
        code = "if" if self.width == 32 else "qd"
        return struct.unpack("<" + code[0], struct.pack("<" + code[1], value))[0]

    def pow2_bits(self, k: int) -> int:
        """The bit pattern of ``2.0**k``, subnormal or normal (``k`` within the dtype's range)."""
        biased = k + self.bias
        return biased << self.man_bits if biased >= 1 else 1 << (biased - 1 + self.man_bits)


def _bit_layout(dtype: torch.dtype, itype: torch.dtype, man_bits: int, bias: int) -> BitLayout:
    width, inf = torch.finfo(dtype).bits, (2 * bias + 1) << man_bits
    return BitLayout(dtype, itype, man_bits, bias, width, (1 << (width - 1)) - 1, -(1 << (width - 1)), inf,
                     inf | 1 << (man_bits - 1), (bias - 1) << man_bits)


LAYOUTS: Dict[torch.dtype, BitLayout] = {torch.float32: _bit_layout(torch.float32, torch.int32, 23, 127),
                                         torch.float64: _bit_layout(torch.float64, torch.int64, 52, 1023)}
_F32 = LAYOUTS[torch.float32]


class RoundParams(NamedTuple):
    """What the rounding kernels need of a format, as integers of a :class:`BitLayout`."""
    man_bits: int          # m, the format's stored mantissa bits
    emin_biased: int       # e_min + the layout's bias
    max_bits: int          # the bit pattern of max
    overflow_bits: int     # the bit pattern of what a value beyond max becomes (the overflow policy's)
    rand_bits: int         # k, the random bits of stochastic rounding (FULL_RAND_BITS: full resolution)
    tiny_bits: int         # the bit pattern of the smallest subnormal 2**(e_min - m)
    seed_lo: int           # the two seed words of seed_words (stochastic rounding only)
    seed_hi: int
    index_offset: int      # the index of the first element, as a signed 32-bit number


class RuleParams(NamedTuple):
    """What the freeze rule needs of a format, as integers of a :class:`BitLayout`; the first four
    are those of :class:`RoundParams` (the freeze kernels round the old weight with them)."""
    man_bits: int
    emin_biased: int
    max_bits: int
    overflow_bits: int
    stuck_bits: int        # the weight every outward update leaves in place (-1: none)
    rand_bits: int         # k, SR's random bits for the move probability (0: full resolution)
    stuck_limit: int       # the bits of inf where any finite update leaves inf in place, else 0


# params.tensor(device, layout): the values as one tensor of the layout's integer type;
# Params.read(p): the named values of such a tensor (0-dim tensors, read by position here only)
for _cls in (RoundParams, RuleParams):
    _cls.tensor = lambda self, device=None, layout=_F32: torch.tensor(self, dtype=layout.itype, device=device)
    _cls.read = classmethod(lambda cls, p: cls(*[p[i] for i in range(len(cls._fields))]))


def _signed32(value: int) -> int:
    return ((value + (1 << 31)) & 0xFFFFFFFF) - (1 << 31)


def seed_words(seed: int, stream: int = 0) -> tuple:
    """The two 32-bit words (as signed values) the hash mixes in for a 64-bit seed and a stream."""
    return _signed32(seed), _signed32((seed >> 32) ^ (0x9E3779B9 * (stream + 1)))


def _grid(fmt: FloatFormat, overflow: Optional[str], layout: BitLayout) -> tuple:
    """``(m, e_min + bias, bits of max, bits of the overflow value)``; overflow None: the format's."""
    overflow = fmt.overflow if overflow is None else overflow
    top = layout.bits(fmt.max)
    over = {"inf": layout.inf_bits, "saturate": top, "nan": layout.nan_bits}[overflow]
    return fmt.man_bits, fmt.e_min + layout.bias, top, over


def round_params(fmt: FloatFormat, overflow: Optional[str] = None, rand_bits: Optional[int] = None, seed: int = 0,
                 index_offset: int = 0, layout: BitLayout = _F32) -> RoundParams:
    """The rounding kernels' parameters: the grid, the overflow policy (None: the format's own), and for stochastic
    rounding the random bits (None: full resolution), the seed and the index of the first element."""
    return RoundParams(*_grid(fmt, overflow, layout), FULL_RAND_BITS if rand_bits is None else rand_bits,
                       layout.pow2_bits(fmt.e_min - fmt.man_bits), *seed_words(seed), _signed32(index_offset))


def rule_params(fmt: FloatFormat, rand_bits: Optional[int] = None, layout: BitLayout = _F32,
                overflow: Optional[str] = None) -> RuleParams:
    """The freeze rule's parameters (:class:`RuleParams`) for k = ``rand_bits`` random bits (None: full resolution)
    and the policy ``overflow`` (None: the format's own), whose stuck weight is max (saturate), inf (inf) or none
    (nan)."""
    overflow = fmt.overflow if overflow is None else overflow
    grid = _grid(fmt, overflow, layout)
    stuck = {"saturate": grid[2], "inf": layout.inf_bits, "nan": -1}[overflow]
    return RuleParams(*grid, stuck, 0 if rand_bits is None else rand_bits,
                      layout.inf_bits if overflow == "inf" else 0)


def gap_exponent(wu: torch.Tensor, inward: torch.Tensor, q, layout: BitLayout = _F32) -> torch.Tensor:
    """The biased exponent of the gap on the update's side of the stored magnitudes ``wu`` (bit
    patterns): ``max(exponent of w - inward, e_min) - m``, where ``inward`` (bool) says that the
    update points toward zero from a power of two (there the grid below is twice as fine);
    ``q``: the format's :class:`RuleParams` (or :class:`RoundParams`)."""
    ew = wu >> layout.man_bits
    return torch.clamp(ew - inward.to(wu.dtype), min=q.emin_biased) - q.man_bits


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


def freeze_elements(wu: torch.Tensor, signed: torch.Tensor, d: torch.Tensor, q: RuleParams,
                    layout: BitLayout = _F32, infinite_gap: bool = True, one_factor: bool = False,
                    divide: bool = False):
    """The rule for stored magnitudes ``wu`` (bit patterns of ``q(w)``, at most those of inf), the signs of ``signed``
    (bit patterns of anything with w's sign) and the updates ``d`` (floats of ``layout``), with the parameters ``q`` of
    :func:`rule_params` (Python integers or 0-dim tensors). Returns ``(frozen, ratio, stuck)``: whether round to nearest
    keeps ``q(w)``, ``|d| / gap`` on the update's side (exact but below the smallest normal, where two factors of a huge
    gap can round twice, unless ``divide``: one division; 0 or NaN at an infinite gap), and whether the weight is stuck.
    ``infinite_gap=False`` leaves out the gap at inf of a format without mantissa bits; ``one_factor`` scales by the gap
    with one multiplication (:func:`one_factor_gaps`); Python values, on which ``torch.compile`` specialises."""
    inf_bits, half_bits = layout.inf_bits, layout.half_bits
    db = d.view(layout.itype)
    du = db & layout.abs_mask
    opposite = (signed ^ db) < 0            # w and d point different ways
    inward = opposite & ((wu & ((1 << layout.man_bits) - 1)) == 0) & (wu != 0)
    gap_exp = gap_exponent(wu, inward, q, layout)
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
    stuck = (wu == q.stuck_bits) & (~opposite | (du < q.stuck_limit)) & (du <= inf_bits)   # (a NaN update moves nothing)
    frozen = (frozen | stuck) & (torch.maximum(wu, du) <= inf_bits)       # NaN never
    return frozen, ratio, stuck


def move_share(ratio: torch.Tensor, stuck: torch.Tensor, k) -> torch.Tensor:
    """The move probability of stochastic rounding from :func:`freeze_elements`' ratio and stuck
    flags: ``min(1, ratio)``, 0 where stuck, resolved to ``k`` random bits where ``k > 0`` (an int
    or a 0-dim integer tensor, at most 32); NaN stays NaN."""
    probability = torch.where(stuck, 0.0, torch.clamp(ratio, max=1.0))
    if isinstance(k, int):
        return probability if k == 0 else torch.round(probability * 2.0**k) * 2.0**-k
    f32 = torch.float32   # 2**k and 2**-k as float32 bit patterns (k <= 32)
    resolved = torch.round(probability * ((k + 127) << 23).view(f32)) * ((127 - k) << 23).view(f32)
    return torch.where(k > 0, resolved.to(probability.dtype), probability)


def bin_thresholds(log_lr: Optional[torch.Tensor] = None, device=None) -> torch.Tensor:
    """The shift of :func:`step_code`'s bins by ``log2(lr)``, as it takes it: float32 ``[a, t_0, ..., t_7]`` per
    value of ``log_lr`` (float32, 0-dim or one per tensor; None: no shift), with ``a = floor(8 log_lr)`` and ``t_j`` the largest
    float32 at most ``2 ** ((j + f) / 8)``, ``f = 8 log_lr - a``: a mantissa ``m`` in [1, 2) is above ``t_j`` exactly
    when it is above ``2 ** ((j + f) / 8)``, so ``ceil(8 (log2 m - log_lr)) = #{j: m > t_j} - a``.

    Example:
        >>> bin_thresholds()[:3].tolist(), bin_thresholds(torch.tensor([-0.5, -3.0])).shape
        ([0.0, 1.0, 1.0905076265335083], torch.Size([2, 9]))
    """
    key = str(device) if device is not None else (str(log_lr.device) if log_lr is not None else "cpu")
    if log_lr is None:
        cached = _UNSHIFTED.get(key)
        if cached is None:
            cached = _UNSHIFTED[key] = bin_thresholds(torch.zeros((), device=key))
        return cached
    if log_lr.dim() and log_lr.numel() == 1:    # one tensor's rate: one row for all (a row per tensor of one
        log_lr = log_lr.reshape(())             # would compile a kernel version of its own)
    eighths = log_lr.double() * PER_OCTAVE                  # (a float32 times 8: exact)
    a = torch.floor(eighths)
    f = eighths - a
    exact = torch.exp2((torch.arange(PER_OCTAVE, dtype=torch.float64, device=log_lr.device) + f.unsqueeze(-1))
                       / PER_OCTAVE)
    t = exact.float()
    t = torch.where(t.double() > exact, torch.nextafter(t, torch.zeros_like(t)), t)   # rounded down
    return torch.cat([a.float().unsqueeze(-1), t], -1)


_UNSHIFTED: Dict[str, torch.Tensor] = {}


def step_code(frozen: torch.Tensor, ratio: torch.Tensor, flag, tensor_id, bins: Optional[torch.Tensor]) -> torch.Tensor:
    """The code of every element for one ``bincount`` of a step: ``((tensor_id * (BINS + 1) + at) << 2) | frozen << 1
    | flag`` (int32), with ``at`` the bin of ``y = log2(ratio) - log_lr[tensor_id]`` among :data:`BINS` bins an
    eighth of an octave wide from :data:`FIRST_EDGE` (bin 0 up to it, ratio 0 included; the last above
    :data:`LAST_EDGE`, inf included; NaN in slot ``BINS``), the shift by ``log_lr`` given as :func:`bin_thresholds` (one
    row for all, or a row per tensor). ``flag`` (0/1 int32, or 0) is the watch's gradient flag.

    ``ceil(8 y)`` is ``8 * floor(log2 ratio)``, exact from the exponent bits, plus ``ceil(8 * (log2(m) - log_lr))`` for
    the mantissa ``m`` in [1, 2): the count of thresholds below ``m`` less the shift's whole eighths, found in three
    comparisons. Every bin is exact; a subnormal ratio (below ``2**-126``) counts in bin 0, its bin wherever
    ``log_lr >= -62``.

    ``bins=None`` gives the same bins in whole octaves, unshifted, with no flag: ``((tensor_id * (OCTAVES + 1) + at)
    << 1) | frozen``, ``at`` the slot of ``ceil(log2 ratio)`` (``OCTAVES`` for NaN), the eight eighth-octave bins of
    each octave in one; one byte (uint8) for a 0-dim ``tensor_id``, else int32.

    Example:
        >>> one = torch.ones(1)
        >>> code = step_code(one.bool(), one * 0.25, 1, torch.zeros(1, dtype=torch.int32), bin_thresholds())
        >>> ((code >> 2) % (BINS + 1)).item() == 8 * (-2 - FIRST_EDGE), (code & 3).item()
        (True, 3)
        >>> code = step_code(one.bool(), one * 0.25, 0, torch.zeros((), dtype=torch.int32), None)
        >>> (code >> 1).item() == -2 - FIRST_EDGE, (code & 1).item(), code.dtype
        (True, 1, torch.uint8)
    """
    rb = ratio.view(torch.int32) & 0x7FFFFFFF
    if bins is None:   # ceil(log2 ratio): the exponent, one more for a mantissa above 1
        at = (rb >> 23) - (127 + FIRST_EDGE) + ((rb & 0x7FFFFF) != 0).to(torch.int32)
        slots, low = OCTAVES, frozen.to(torch.int32)
    else:
        m = ((rb & 0x7FFFFF) | (127 << 23)).view(torch.float32)
        t = bins if bins.dim() == 1 else bins[tensor_id]
        # #{j: m > t_j} by a binary search over the sorted t_1..t_7, plus m > t_0
        upper = m > t[..., 5]
        half = m > torch.where(upper, t[..., 7], t[..., 3])
        last = m > torch.where(upper, torch.where(half, t[..., 8], t[..., 6]), torch.where(half, t[..., 4], t[..., 2]))
        above = (upper.to(torch.int32) * 4 + half.to(torch.int32) * 2 + last.to(torch.int32)
                 + (m > t[..., 1]).to(torch.int32))
        at = ((rb >> 23) - (127 + FIRST_EDGE)) * PER_OCTAVE + above - t[..., 0].to(torch.int32)
        slots, low = BINS, (frozen.to(torch.int32) << 1) | flag
    at = torch.where(rb < (1 << 23), 0, torch.clamp(at, 0, slots - 1))     # 0 and the subnormals in bin 0
    at = torch.where(rb > _F32.inf_bits, slots, at)
    code = ((tensor_id * (slots + 1) + at) << (1 if bins is None else 2)) | low
    return code.to(torch.uint8) if bins is None and tensor_id.dim() == 0 else code


def gap_options(fmt: FloatFormat) -> dict:
    """The ``infinite_gap`` and ``one_factor`` arguments of :func:`freeze_elements` for float32
    input: the infinite gap only without mantissa bits, one factor where ``1/gap`` is a normal
    float32 for every gap of the format, inf's included (``m >= 2`` and ``e_min - m >= -127``).

    Example:
        >>> from lowprec_demo.formats import get_format
        >>> gap_options(get_format("bf16")), gap_options(get_format("e4m3"))
        ({'infinite_gap': False, 'one_factor': False}, {'infinite_gap': False, 'one_factor': True})
    """
    if not fmt.man_bits:
        return {"infinite_gap": True, "one_factor": False}
    return {"infinite_gap": False, "one_factor": fmt.man_bits >= 2 and fmt.e_min - fmt.man_bits >= -127}
