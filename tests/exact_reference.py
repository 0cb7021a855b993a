"""An exact reference for binary floating-point formats, written with ``fractions.Fraction``.

This module is the oracle of the rounding tests. It shares no code with ``lowprec_demo``: a format
is given only by its exponent width E, its stored mantissa width m and the encoding ``kind`` of
the top exponent field, and everything else follows from decoding bit patterns:

* exponent field 0 (subnormal): ``(f / 2**m) * 2**(1 - bias)``;
* exponent field ``1 .. 2**E - 1``: ``(1 + f / 2**m) * 2**(field - bias)``, ``bias = 2**(E-1) - 1``;
* the top field ``2**E - 1`` is inf (f = 0) and NaN (f != 0) for ``"ieee"``; holds numbers except
  the all-ones mantissa, which is NaN, for ``"fn"``; holds numbers only for ``"finite"``.

Rounding works on exact rationals; nothing here rounds through a float or a tensor. The grid used
for rounding is the format's grid *continued above its largest value* (the exponent is unbounded
above; below the smallest normal the spacing stays constant). Its agreement with the decoded
values is checked by the tests for every small format.

Round to nearest, ties to even
    The nearest grid point; at a tie, the one of the two neighbours that is an even multiple of
    the gap between them. For m >= 1 that is IEEE 754's "even last mantissa bit". For m = 0 every
    normal number has the same (implicit) significand, and the rule is the one of Higham and
    Pranesh's ``chop`` and of CPFloat: a tie between 2**e and 2**(e+1) goes to 2**(e+1), a tie
    between 0 and the smallest normal goes to 0.

Overflow
    A rounded magnitude above the largest finite value becomes inf (``"inf"``, the RNE rule on the
    continued grid: E5M2 sends 61439 to 57344 and 61440 to inf), +-max (``"saturate"``) or NaN
    (``"nan"``). Infinite inputs follow the same policy. NaN stays NaN. The sign of zero is kept.

Stochastic rounding
    From the neighbours ``lo <= |x| <= hi`` on the continued grid, ``hi`` is taken with probability
    ``(|x| - lo) / (hi - lo)``; with k random bits that position is first rounded half-to-even to a
    multiple of 2**-k. Each neighbour then follows the overflow policy.

Values are passed in as Python floats (exact binary64 values; -0.0, inf and NaN allowed) or as
Fractions; rounded results come back as Python floats, which hold every value of every format
here exactly (E <= 8 and m <= 23 fit in binary64).
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache
from typing import Iterable, List, Optional, Tuple, Union

import numpy as np

KINDS = ("ieee", "fn", "finite")
POLICIES = ("inf", "saturate", "nan")
Number = Union[float, int, Fraction]

HALF = Fraction(1, 2)


def pow2(k: int) -> Fraction:
    """Exactly 2**k as a Fraction (k may be negative)."""
    return Fraction(2**k) if k >= 0 else Fraction(1, 2 ** (-k))


def dyadic(k: int, t: int) -> Fraction:
    """Exactly k * 2**t as a Fraction."""
    return Fraction(k << t) if t >= 0 else Fraction(k, 1 << -t)


def _ge_pow2(n: int, d: int, e: int) -> bool:
    """Whether n / d >= 2**e (n, d > 0 integers), in integer arithmetic."""
    return (n << -e if e < 0 else n) >= (d << e if e > 0 else d)


def floor_log2_nd(n: int, d: int) -> int:
    """The integer e with 2**e <= n / d < 2**(e+1), for positive integers n, d."""
    e = n.bit_length() - d.bit_length()  # then 2**(e-1) < n/d < 2**(e+1)
    return e if _ge_pow2(n, d, e) else e - 1


def floor_log2(a: Fraction) -> int:
    """The integer e with 2**e <= a < 2**(e+1), for a > 0."""
    if a <= 0:
        raise ValueError("floor_log2 needs a positive number")
    return floor_log2_nd(a.numerator, a.denominator)


def round_half_even(q: Fraction) -> int:
    """The integer nearest to q; at a tie, the even one."""
    k = math.floor(q)
    r = q - k
    if r > HALF or (r == HALF and k % 2 == 1):
        k += 1
    return k


class RefFormat:
    """A format given by (E, m, kind) alone; every landmark is derived by decoding encodings."""

    def __init__(self, exp_bits: int, man_bits: int, kind: str = "ieee"):
        if kind not in KINDS:
            raise ValueError(kind)
        if not (1 <= exp_bits and 0 <= man_bits):
            raise ValueError((exp_bits, man_bits))
        self.E = exp_bits
        self.m = man_bits
        self.kind = kind
        self.bias = 2 ** (exp_bits - 1) - 1
        self.top_field = 2**exp_bits - 1
        self.e_min = 1 - self.bias  # exponent of the smallest normal (field 1)
        self._values = None

        # special values, read off the top exponent field
        tops = [self.decode(self.top_field, f) for f in range(2**man_bits)] if man_bits <= 12 else \
            [self.decode(self.top_field, 0), self.decode(self.top_field, 2**man_bits - 1)]
        self.has_inf = any(isinstance(v, float) and math.isinf(v) for v in tops)
        self.has_nan = any(isinstance(v, float) and math.isnan(v) for v in tops)
        self.policies = tuple(p for p in POLICIES
                              if (p != "inf" or self.has_inf) and (p != "nan" or self.has_nan))

        # the largest finite value: the largest encoding that decodes to a number
        self.max = None
        for field in range(self.top_field, -1, -1):
            for f in (2**man_bits - 1, 2**man_bits - 2):
                if f < 0:
                    continue
                v = self.decode(field, f)
                if isinstance(v, Fraction):
                    self.max = v
                    break
            if self.max is not None:
                break
        self.max_float = float(self.max)
        assert Fraction(self.max_float) == self.max
        self.smallest_normal = self.decode(1, 0)
        self.smallest_positive = self.decode(0, 1) if man_bits > 0 else self.smallest_normal
        one_up = self.decode(self.bias, 1) if man_bits > 0 else self.decode(self.bias + 1, 0)
        self.eps = one_up - 1  # distance from 1 to the next larger value
        assert self.decode(self.bias, 0) == 1

    @property
    def default_overflow(self) -> str:
        return "inf" if self.has_inf else "saturate"

    def __repr__(self) -> str:
        return f"RefFormat(E={self.E}, m={self.m}, kind={self.kind!r})"

    # --- the definition --------------------------------------------------------------------
    def decode(self, exp_field: int, man_field: int):
        """The non-negative value of an encoding: a Fraction, or float inf / NaN."""
        m = self.m
        if exp_field == self.top_field:
            if self.kind == "ieee":
                return math.inf if man_field == 0 else math.nan
            if self.kind == "fn" and man_field == 2**m - 1:
                return math.nan
        if exp_field == 0:  # (f / 2**m) * 2**(1 - bias)
            return dyadic(man_field, 1 - self.bias - m)
        return dyadic(2**m + man_field, exp_field - self.bias - m)  # (1 + f / 2**m) * 2**(field - bias)

    def finite_values(self) -> List[Fraction]:
        """Every non-negative finite value, sorted, from decoding every encoding (small formats)."""
        if self.E + self.m > 20:
            raise ValueError("too many encodings to enumerate")
        if self._values is not None:
            return list(self._values)
        values = set()
        for field in range(self.top_field + 1):
            for f in range(2**self.m):
                v = self.decode(field, f)
                if isinstance(v, Fraction):
                    values.add(v)
        self._values = tuple(sorted(values))
        return list(self._values)

    # --- the grid continued above max --------------------------------------------------------
    def spacing_exponent(self, a: Fraction) -> int:
        """t with 2**t the distance between consecutive grid points in the binade holding a >= 0
        (constant below the smallest normal; the exponent is unbounded above)."""
        return self.spacing_exponent_nd(a.numerator, a.denominator)

    def spacing_exponent_nd(self, n: int, d: int) -> int:
        """spacing_exponent of n / d >= 0 (n >= 0, d > 0 integers)."""
        if n == 0 or not _ge_pow2(n, d, self.e_min):  # below the smallest normal
            return self.e_min - self.m
        return floor_log2_nd(n, d) - self.m

    def spacing(self, a: Fraction) -> Fraction:
        return pow2(self.spacing_exponent(a))

    def neighbours(self, a: Fraction) -> Tuple[Fraction, Fraction]:
        """Grid points lo <= a <= hi with nothing in between (lo == hi when a is on the grid)."""
        s = self.spacing(a)
        k = math.floor(a / s)
        lo = k * s
        return (lo, lo) if lo == a else (lo, lo + s)

    def on_grid(self, a: Fraction) -> bool:
        lo, hi = self.neighbours(a)
        return lo == hi

    def next_up(self, a: Fraction) -> Fraction:
        """The grid point after a >= 0 on the grid."""
        assert self.on_grid(a)
        return a + self.spacing(a)

    def next_down(self, a: Fraction) -> Fraction:
        """The grid point before a > 0 on the grid."""
        assert a > 0 and self.on_grid(a)
        lo, hi = self.neighbours(a - self.spacing(a) / 4)
        assert lo < a - self.spacing(a) / 4 < hi == a
        return lo

    def rne_magnitude(self, a: Fraction) -> Fraction:
        """Round a >= 0 to the nearest point of the continued grid; a tie goes to the neighbour
        that is an even multiple of the gap."""
        return dyadic(*self.rne_magnitude_nd(a.numerator, a.denominator))

    def rne_magnitude_nd(self, n: int, d: int) -> Tuple[int, int]:
        """rne_magnitude of n / d >= 0, as (k, t) with the result k * 2**t.

        With the spacing 2**t of the binade, (n / d) / 2**t = num / den = k + r / den; the
        neighbours are k * 2**t and (k + 1) * 2**t, and r / den against 1/2 decides."""
        t = self.spacing_exponent_nd(n, d)
        num, den = (n, d << t) if t >= 0 else (n << -t, d)
        k, r = divmod(num, den)
        if 2 * r > den or (2 * r == den and k % 2 == 1):
            k += 1
        return k, t

    def rne_magnitude_by_neighbours(self, a: Fraction) -> Fraction:
        """The same rounding spelled out with the two neighbours (slower; used to check the
        integer version above)."""
        lo, hi = self.neighbours(a)
        if lo == hi:
            return lo
        gap = hi - lo
        if a - lo != hi - a:
            return lo if a - lo < hi - a else hi
        k_lo = lo / gap
        assert k_lo.denominator == 1
        return lo if k_lo.numerator % 2 == 0 else hi


@lru_cache(maxsize=None)
def _ref_format_cached(exp_bits: int, man_bits: int, kind: str) -> RefFormat:
    return RefFormat(exp_bits, man_bits, kind)


def ref_format(fmt) -> RefFormat:
    """A RefFormat from a RefFormat, a (E, m[, kind]) tuple or any object with ``exp_bits``,
    ``man_bits`` and ``kind`` attributes (only those three are read)."""
    if isinstance(fmt, RefFormat):
        return fmt
    if isinstance(fmt, tuple):
        return _ref_format_cached(*fmt)
    return _ref_format_cached(fmt.exp_bits, fmt.man_bits, fmt.kind)


# ------------------------------------------------------------------------------------------------
# signed values
# ------------------------------------------------------------------------------------------------
def _split(x: Number):
    """(negative?, magnitude as a Fraction) or (negative?, 'inf' / 'nan')."""
    if isinstance(x, Fraction):
        return x < 0, abs(x)
    x = float(x)
    if math.isnan(x):
        return False, "nan"
    negative = math.copysign(1.0, x) < 0
    if math.isinf(x):
        return negative, "inf"
    return negative, abs(Fraction(x))


def _finish(negative: bool, magnitude, fmt: RefFormat, policy: str) -> float:
    """Apply the overflow policy to a rounded magnitude (a grid Fraction or 'inf'), attach the sign."""
    if isinstance(magnitude, Fraction) and magnitude <= fmt.max:
        value = float(magnitude)
        assert Fraction(value) == magnitude  # every grid value is a binary64 number
    elif policy == "inf":
        value = math.inf
    elif policy == "saturate":
        value = float(fmt.max)
    else:
        return math.nan
    return -value if negative else value


def _policy(fmt: RefFormat, overflow: Optional[str]) -> str:
    policy = fmt.default_overflow if overflow is None else overflow
    if policy not in fmt.policies:
        raise ValueError(f"{policy!r} is not a policy of {fmt}")
    return policy


def round_nearest(x: Number, fmt, overflow: Optional[str] = None) -> float:
    """Exact round-to-nearest-even of x onto the format, with the overflow policy."""
    fmt = ref_format(fmt)
    policy = _policy(fmt, overflow)
    if isinstance(x, Fraction):
        negative, n, d = x < 0, abs(x.numerator), x.denominator
    else:
        x = float(x)
        if math.isnan(x):
            return math.nan
        negative = math.copysign(1.0, x) < 0
        if math.isinf(x):
            return _finish(negative, "inf", fmt, policy)
        n, d = abs(x).as_integer_ratio()
    k, t = fmt.rne_magnitude_nd(n, d)
    # k <= 2**(m + 1) and t >= e_min - m > -1000, so k * 2**t is a float exactly; a t this
    # large is far beyond every format's max (all below 2**129)
    assert k <= 2 ** (fmt.m + 1)
    value = math.ldexp(k, t) if t < 990 else math.inf
    if value <= fmt.max_float:
        return -value if negative else value
    return _finish(negative, "inf", fmt, policy)


def round_nearest_many(xs: Iterable[Number], fmt, overflow: Optional[str] = None) -> np.ndarray:
    """round_nearest of every element, as a float64 array."""
    fmt = ref_format(fmt)
    return np.array([round_nearest(x, fmt, overflow) for x in xs], dtype=np.float64)


def neighbours(x: Number, fmt) -> Tuple[float, float]:
    """The two grid neighbours of finite x on the continued grid, signed, before any overflow
    policy: (toward zero, away from zero); equal when x is on the grid."""
    fmt = ref_format(fmt)
    negative, a = _split(x)
    if not isinstance(a, Fraction):
        raise ValueError("neighbours of a finite number only")
    lo, hi = fmt.neighbours(a)
    sign = -1 if negative else 1
    return sign * float(lo), sign * float(hi)


def sr_outcomes(x: Number, fmt, overflow: Optional[str] = None,
                rand_bits: Optional[int] = None) -> List[Tuple[float, Fraction]]:
    """The exact distribution of stochastic rounding of x: a list of (value, probability) with
    distinct values (compared as floats, NaN once) and probabilities summing to 1."""
    fmt = ref_format(fmt)
    policy = _policy(fmt, overflow)
    negative, a = _split(x)
    if a == "nan":
        return [(math.nan, Fraction(1))]
    if a == "inf":
        return [(_finish(negative, "inf", fmt, policy), Fraction(1))]
    lo, hi = fmt.neighbours(a)
    if lo == hi:
        return [(_finish(negative, lo, fmt, policy), Fraction(1))]
    p_hi = (a - lo) / (hi - lo)
    if rand_bits is not None:
        p_hi = Fraction(round_half_even(p_hi * 2**rand_bits), 2**rand_bits)
    outcomes = {}
    for magnitude, p in ((lo, 1 - p_hi), (hi, p_hi)):
        value = _finish(negative, magnitude, fmt, policy)
        key = "nan" if math.isnan(value) else value
        old = outcomes.get(key, (value, Fraction(0)))
        outcomes[key] = (value, old[1] + p)
    return [vp for vp in outcomes.values() if vp[1] != 0]


def sr_probability_away(x: Number, fmt, rand_bits: Optional[int] = None) -> Fraction:
    """Probability that SR of finite x picks the neighbour away from zero (before overflow)."""
    fmt = ref_format(fmt)
    _, a = _split(x)
    lo, hi = fmt.neighbours(a)
    if lo == hi:
        return Fraction(0)
    p = (a - lo) / (hi - lo)
    if rand_bits is not None:
        p = Fraction(round_half_even(p * 2**rand_bits), 2**rand_bits)
    return p


def ulp(x: Number, fmt) -> float:
    """2**(max(floor(log2|x|), e_min) - m); the subnormal spacing at 0; NaN for inf and NaN."""
    fmt = ref_format(fmt)
    if isinstance(x, Fraction):
        n, d = abs(x.numerator), x.denominator
    else:
        x = float(x)
        if not math.isfinite(x):
            return math.nan
        n, d = abs(x).as_integer_ratio()
    return math.ldexp(1.0, fmt.spacing_exponent_nd(n, d))


# ------------------------------------------------------------------------------------------------
# the freeze rule, from its definition: round(w + d) == w with the exact sum
# ------------------------------------------------------------------------------------------------
def _check_on_grid(w: float, fmt: RefFormat) -> None:
    if math.isnan(w):
        return
    if math.isinf(w):
        assert fmt.has_inf, "an infinite weight in a format without inf"
        return
    a = abs(Fraction(w))
    assert fmt.on_grid(a) and a <= fmt.max, f"{w!r} is not a value of {fmt}"


def _exact_sum(w: float, d: Number):
    """w + d: a Fraction when both are finite, else the float result (inf or NaN)."""
    d_float = d if not isinstance(d, Fraction) else None
    if math.isfinite(w) and (d_float is None or math.isfinite(d_float)):
        return Fraction(w) + Fraction(d)
    return w + float(d)


def _same(a: float, b: float) -> bool:
    return a == b  # 0.0 == -0.0; NaN equals nothing


def would_freeze(w: float, d: Number, fmt, overflow: Optional[str] = None) -> bool:
    """Whether round-to-nearest of the exact w + d gives back w (w a value of the format)."""
    fmt = ref_format(fmt)
    w = float(w)
    _check_on_grid(w, fmt)
    if math.isnan(w) or (not isinstance(d, Fraction) and math.isnan(d)):
        return False
    return _same(round_nearest(_exact_sum(w, d), fmt, overflow), w)


def move_probability(w: float, d: Number, fmt, overflow: Optional[str] = None,
                     rand_bits: Optional[int] = None):
    """Probability (a Fraction) that stochastic rounding of the exact w + d differs from w; NaN
    (undefined) when w or d is NaN."""
    fmt = ref_format(fmt)
    w = float(w)
    _check_on_grid(w, fmt)
    if math.isnan(w) or (not isinstance(d, Fraction) and math.isnan(d)):
        return math.nan
    outcomes = sr_outcomes(_exact_sum(w, d), fmt, overflow, rand_bits)
    return sum((p for v, p in outcomes if not _same(v, w)), Fraction(0))


def side_gap(w: float, d: Number, fmt) -> Fraction:
    """Distance from the finite grid value w to its grid neighbour on the side d points to
    (on the continued grid; at 0 the smallest subnormal spacing)."""
    fmt = ref_format(fmt)
    w = float(w)
    _check_on_grid(w, fmt)
    a = abs(Fraction(w))
    d = Fraction(d)
    inward = w != 0 and d != 0 and ((d > 0) != (w > 0))
    return a - fmt.next_down(a) if inward else fmt.next_up(a) - a


def update_ulp_ratio(w: float, d: Number, fmt) -> Fraction:
    """|d| / side_gap(w, d)."""
    return abs(Fraction(d)) / side_gap(w, d, fmt)
