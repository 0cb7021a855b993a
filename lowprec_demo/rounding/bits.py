"""The kernels: rounding and the freeze rule as integer operations on bit patterns.

Eager PyTorch makes one pass over memory per operation, so exact rounding written as ten tensor operations costs ten
passes where a native cast costs two. Each kernel here is one plain PyTorch function on the int32 or int64 lanes of
float32 or float64 tensors (``rule.LAYOUTS``), which :mod:`~lowprec_demo.rounding.kernels` compiles into one loop or
runs eagerly. The rounding kernels take and give bit patterns, because inductor's CPU code moves a vector between
float and integer lanes through memory (:func:`round_nearest` and :func:`round_stochastic` take float tensors).

Round to nearest (``rne_bits``)
    With P stored mantissa bits and bias B, a non-negative float is ``S * 2**(E' - B - P)`` with
    ``E' = max(exponent field, 1)`` and the integer significand ``S = bits - ((E' - 1) << P)`` (subnormals included).
    The target grid's spacing is ``2**d`` units of ``S``, ``d = P - m + max(e_min + B - E', 0)``. ``S`` rounded to a
    multiple of ``2**d`` by integer arithmetic, plus ``(E' - 1) << P``, is the bit pattern of the result (a carry runs
    into the exponent). One rounding: float64 input is rounded once, exactly.

Stochastic rounding (``sr_bits``)
    ``frac = S mod 2**d`` is the position inside the gap in units of ``2**-d`` gaps. With k random bits (32: full
    resolution) and ``j = min(d, k)``, the position is resolved to j bits (``round_half_even(frac / 2**(d - j))``) and
    the value moves away from zero when the top j bits of the 32-bit hash of (seed, element index) are below it: the
    exact ``frac / 2**d`` whenever ``d <= k``. One convention for every dtype, size and shard: element i of a call with
    ``index_offset`` draws :func:`hash32` of ``index_offset + i`` modulo 2**32 (as
    :func:`lowprec_demo.rounding.random_bits`).

The freeze rule (``freeze_detail_fp32``, ``step_code_fp32``)
    :mod:`~lowprec_demo.rounding.rule` at ``q(old)``: per element whether it freezes, and a code for one
    :func:`torch.bincount` that counts a step for the predictor and the watch alike.

Example:
    >>> from lowprec_demo.formats import get_format
    >>> from lowprec_demo.rounding.rule import round_params
    >>> round_nearest(torch.tensor([1.06, 500.0]), round_params(get_format("e4m3"), "saturate").tensor()).tolist()
    [1.0, 448.0]
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from lowprec_demo.rounding.rule import LAYOUTS, BitLayout, RoundParams, RuleParams, freeze_elements, move_share, step_code

__all__ = ["hash32", "rne_bits", "rne_bits_", "sr_bits", "sr_bits_", "round_nearest", "round_stochastic",
           "rne_magnitude", "freeze_detail_fp32", "step_code_fp32", "equal_count_fp32", "changed_blocks_fp32", "BLOCK",
           "MAX_NUMEL"]

MAX_NUMEL = (1 << 31) - 1      # the compiled kernels number elements in int32; larger tensors run eagerly in slices
BLOCK = 64                     # in a pack of several tensors, each starts at a multiple of this many elements

_F32 = LAYOUTS[torch.float32]
_BY_ITYPE = {layout.itype: layout for layout in LAYOUTS.values()}
_INT32_MIN = -(1 << 31)
_M32 = 0xFFFFFFFF


# --- the two dialects of the kernels' conditions and constants: the one place compiled and eager differ ---
class _Compiled:
    """Conditions as bool tensors, ``torch.where``, constants as Python numbers: inductor's fastest loop."""
    k = staticmethod(lambda value, like: value)
    above = staticmethod(lambda a, b, own=False: a > b)
    cond = staticmethod(lambda c, like: c)
    select = staticmethod(torch.where)
    keep = staticmethod(lambda c, a, own=False: torch.where(c, a, 0))


_CONSTANTS: Dict[tuple, torch.Tensor] = {}


class _Eager:
    """The eager dialect: every operation is a pass over its slice and eager comparisons and ``where`` cost several
    integer operations each, so conditions are masks in the values' integer type (-1 or 0) and constants 0-dim tensors
    made once; with ``own`` the result is written over the first operand, a temporary already in the cache. Same bits as
    :class:`_Compiled`, about twice as fast eagerly (``benchmarks/README.md``)."""

    @staticmethod
    def k(value, like):
        if not isinstance(value, int):
            return value
        key = (value, like.dtype, like.device)
        t = _CONSTANTS.get(key)
        if t is None:
            t = _CONSTANTS[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
        return t

    @staticmethod
    def above(a, b, own=False):
        b = _Eager.k(b, a)
        t = a.neg_().add_(b) if own else b - a
        t >>= _Eager.k(8 * a.element_size() - 1, a)
        return t

    @staticmethod
    def cond(c, like):
        return c.to(like.dtype).neg_()

    @staticmethod
    def select(c, a, b):
        t = _Eager.k(a, b) ^ b
        t &= c
        t ^= b
        return t

    @staticmethod
    def keep(c, a, own=False):
        return c.__iand__(a) if own else c & a


def _ops():
    return _Compiled if torch.compiler.is_compiling() else _Eager


def _layout(bits: torch.Tensor) -> BitLayout:
    return _BY_ITYPE[bits.dtype]


# --- the hash: 32 random bits of (seed, element index) ---------------------------------------------
def _mix32_(h: torch.Tensor, o) -> torch.Tensor:
    """A bijective 32-bit finaliser (xor-shift-multiply by 0x45d9f3b) in place on int32 lanes."""
    for step in range(3):
        t = h >> o.k(16, h)
        t &= o.k(0xFFFF, h)
        h ^= t
        if step < 2:
            h.mul_(o.k(0x45D9F3B, h))
    return h


def _hash32_(h: torch.Tensor, seed_lo, seed_hi) -> torch.Tensor:
    """:func:`hash32` of the int32 indices ``h``, written over them."""
    o = _ops()
    h ^= seed_lo
    _mix32_(h, o)
    h ^= seed_hi
    return _mix32_(h, o)


def hash32(index: torch.Tensor, seed_lo, seed_hi) -> torch.Tensor:
    """The 32 random bits (int32 lanes, read unsigned) of each ``index`` for the seed words of
    :func:`lowprec_demo.rounding.rule.seed_words`: the one hash of the package."""
    return _hash32_(index.clone(), seed_lo, seed_hi)


# --- rounding --------------------------------------------------------------------------------------
def _decompose(u: torch.Tensor, q):
    """``(E' - 1) << P``, the significand ``S`` and ``d`` of non-negative bit patterns ``u``."""
    layout, o = _layout(u), _ops()
    e = (u >> o.k(layout.man_bits, u)).clamp_(min=1)
    d = (q.emin_biased - e).clamp_(min=0)
    d += layout.man_bits - q.man_bits
    e -= o.k(1, u)
    e <<= o.k(layout.man_bits, u)
    return e, u - e, d


def rne_magnitude(u: torch.Tensor, q) -> torch.Tensor:
    """RNE of non-negative bit patterns ``u`` (at most inf's) onto the grid of ``q``, beyond max
    the overflow value: ``S`` rounded by ml_dtypes' bias expression (add ``2**(d-1) - 1`` plus the
    last kept bit, clear the low ``d`` bits); from ``d = P + 2`` on every ``S`` rounds to 0."""
    o = _ops()
    top, s, d = _decompose(u, q)
    d.clamp_(max=_layout(u).man_bits + 2)
    half = o.k(1, u) << d
    half >>= o.k(1, u)
    bias = s >> d
    bias &= torch.clamp(half, max=1)        # the last kept bit, for ties (none when d = 0)
    bias += half
    bias -= o.k(1, u)
    s += bias.clamp_(min=0)
    s >>= d
    s <<= d
    out = o.keep(o.above(s, 0), top.add_(s))  # a rounded significand of 0: the magnitude is 0
    return o.select(o.above(out, q.max_bits), q.overflow_bits, out)


def _finish(out: torch.Tensor, bits: torch.Tensor, nan: torch.Tensor, q) -> torch.Tensor:
    """Magnitudes ``out`` as results: the overflow value beyond max, NaN where ``nan``, the sign of ``bits``."""
    layout, o = _layout(bits), _ops()
    out = o.select(nan, layout.nan_bits, o.select(o.above(out, q.max_bits), q.overflow_bits, out))
    out |= bits & o.k(layout.sign_bits, bits)
    return out


def rne_bits(bits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """RNE of bit patterns onto the grid of ``p`` (``RoundParams`` as a tensor of the same integer
    type) with its overflow policy, as bit patterns; the sign (of zero too) is kept, NaN stays NaN."""
    layout, o, q = _layout(bits), _ops(), RoundParams.read(p)
    u = bits & o.k(layout.abs_mask, bits)
    nan = o.above(u, layout.inf_bits)
    out = o.select(nan, layout.nan_bits, rne_magnitude(o.keep(~nan, u), q))   # (a NaN's magnitude as 0)
    out |= bits & o.k(layout.sign_bits, bits)
    return out


def _moves(r: torch.Tensor, position: torch.Tensor, j: torch.Tensor, layout: BitLayout, o) -> torch.Tensor:
    """Whether the value moves away from zero: the hash ``r`` (read unsigned) below ``position *
    2**(32 - j)``, held as it is in 64-bit lanes; 32-bit lanes compare modulo 2**32 (shifts below
    32: Triton leaves larger ones undefined) and test the whole gap, ``2**j``, apart."""
    if layout.width == 64:
        unsigned = r.to(torch.int64) & o.k(_M32, position)
        return o.cond(unsigned < (position << (o.k(32, j) - j)), position)
    threshold = position << (o.k(32, r) - j).clamp_(max=31)
    r ^= o.k(_INT32_MIN, r)
    threshold ^= o.k(_INT32_MIN, r)
    move = o.above(position >> j.clamp_(max=31), 0, own=True)
    move |= o.cond(r < threshold, move)
    return move


def sr_bits(bits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of a flat tensor of bit patterns (as :func:`rne_bits`, fewer than 2**31
    elements) onto the grid of ``p``; element i draws the hash of (seed, index_offset + i)."""
    layout, o, q = _layout(bits), _ops(), RoundParams.read(p)
    man = layout.man_bits
    u = bits & o.k(layout.abs_mask, bits)   # (a NaN goes through the arithmetic and is replaced)
    top, s, d = _decompose(u, q)
    dd = torch.clamp(d, max=man + 2)
    down = (s >> dd) << dd                  # S rounded down to the grid
    frac = s - down                         # S mod 2**d, below 2**(P+1): exact as a float of the layout
    j = torch.clamp(d, max=q.rand_bits)
    # P = round_half_even(frac * 2**(j - d)): frac itself when d <= k; at 2**-(P+7) and below
    # the product is below 1/64 and rounds to 0 either way
    scale = (j - d).clamp_(min=-(man + 7))
    scale += o.k(layout.bias, bits)
    scale <<= o.k(man, bits)
    position = frac.to(layout.dtype)
    position *= scale.view(layout.dtype)
    position = position.round_().to(layout.itype)
    r = torch.arange(bits.numel(), dtype=torch.int32, device=bits.device)
    r += q.index_offset
    r = _hash32_(r, q.seed_lo, q.seed_hi)
    move = _moves(r, position, j, layout, o)
    down += o.keep(move, o.k(1, bits) << dd.clamp_(max=man + 1))
    down += top
    # d >= P + 1: the value is below the smallest subnormal step: 0 or that step
    out = o.select(o.above(d, man, own=True), o.keep(move, q.tiny_bits, own=True), down)
    return _finish(out, bits, o.above(u, layout.inf_bits, own=True), q)


def rne_bits_(bits: torch.Tensor, p: torch.Tensor) -> None:
    bits.copy_(rne_bits(bits, p))       # written over bits


def sr_bits_(bits: torch.Tensor, p: torch.Tensor) -> None:
    bits.copy_(sr_bits(bits, p))


def round_nearest(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return rne_bits(x.view(LAYOUTS[x.dtype].itype), p).view(x.dtype)    # on float tensors


def round_stochastic(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return sr_bits(x.view(LAYOUTS[x.dtype].itype), p).view(x.dtype)


# --- the freeze rule on float32 tensors ------------------------------------------------------------
def freeze_detail_fp32(old: torch.Tensor, new: torch.Tensor, p: torch.Tensor, infinite_gap: bool = True,
                       one_factor: bool = False):
    """``(frozen, ratio, stuck)`` of ``rule.freeze_elements`` for the update ``new - old`` of
    float32 tensors at ``q(old)`` (with old's sign), the rule's parameters ``p`` as a tensor."""
    q = RuleParams.read(p)
    ob = old.view(torch.int32)
    wu = rne_magnitude(torch.clamp(ob & 0x7FFFFFFF, max=_F32.inf_bits), q)
    return freeze_elements(wu, ob, new - old, q, _F32, infinite_gap=infinite_gap, one_factor=one_factor)


def step_code_fp32(old: torch.Tensor, new: torch.Tensor, grad: Optional[torch.Tensor], tensor_id,
                   bins: Optional[torch.Tensor], p: torch.Tensor, moves_sum: bool = False, infinite_gap: bool = True,
                   one_factor: bool = False):
    """One pass of the rule over the update ``new - old`` at ``q(old)`` of flat float32 tensors: the codes of
    ``rule.step_code`` (the flag ``grad != 0``, or 0 without ``grad``; the bins shifted by ``bins``, from
    ``rule.bin_thresholds``, or whole octaves for None) and every element's move probability (float32,
    ``rule.move_share`` with the random bits of ``p``), or with ``moves_sum`` their float64 sum (0-dim)."""
    frozen, ratio, stuck = freeze_detail_fp32(old, new, p, infinite_gap, one_factor)
    flag = 0 if grad is None else (grad != 0).to(torch.int32)
    moves = move_share(ratio, stuck, RuleParams.read(p).rand_bits)
    return step_code(frozen, ratio, flag, tensor_id, bins), moves.to(torch.float64).sum() if moves_sum else moves


def equal_count_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many elements of ``a`` equal those of ``b`` (``a == b`` as floats compare: NaN never,
    +0 and -0 always), as an int64 0-dim tensor, in one pass that writes nothing."""
    return torch.where(a == b, 1, 0).sum()


def changed_blocks_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many elements differ (``a == b`` false) in each block of :data:`BLOCK` elements of two
    flat float32 tensors, as float32 (exact; a float sum, which inductor's CPU code vectorizes)."""
    return torch.where(a.view(-1, BLOCK) == b.view(-1, BLOCK), 0.0, 1.0).sum(1)
