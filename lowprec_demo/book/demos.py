"""Small demonstrations used by the first chapters: bit fields, repeated addition, SR samples.

* :func:`decode_bits` splits a representable value into its sign, exponent and mantissa fields;
  :func:`value_from_bits` goes back from a bit pattern to the value. Both follow the format
  definition (``formats``), so they work for any format, with or without a native dtype.
* :func:`repeated_add` adds the same increment ``n`` times, rounding onto the grid after every
  addition: the smallest possible "training loop" (``w <- q(w + d)``), nearest or stochastic.
* :func:`sr_samples` draws many stochastic roundings of one value.
* :func:`grid_neighbours` gives the two grid values around ``x``.

Example:
    >>> decode_bits(1.5, "bf16").fields
    '0 01111111 1000000'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from lowprec_demo.formats import FloatFormat, get_format
from lowprec_demo.rounding.core import GeneratorLike, quantize, ulp

__all__ = ["BitFields", "decode_bits", "value_from_bits", "repeated_add", "sr_samples", "grid_neighbours"]

FormatLike = Union[str, FloatFormat]


@dataclass(frozen=True)
class BitFields:
    """The three fields of one encoded value: ``sign`` (0 or 1), the biased ``exponent`` field and
    the stored ``mantissa`` field, for a format with ``exp_bits`` and ``man_bits``.

    A normal number is ``(-1)**sign * (1 + mantissa / 2**m) * 2**(exponent - bias)``; a subnormal
    (exponent field 0) is ``(-1)**sign * (mantissa / 2**m) * 2**e_min``.

    Example:
        >>> decode_bits(448.0, "e4m3").pattern
        126
    """

    format: str
    sign: int
    exponent: int
    mantissa: int
    exp_bits: int
    man_bits: int

    @property
    def pattern(self) -> int:
        """The whole bit pattern as an unsigned integer (sign, then exponent, then mantissa)."""
        return (self.sign << (self.exp_bits + self.man_bits)) | (self.exponent << self.man_bits) | self.mantissa

    @property
    def fields(self) -> str:
        """The pattern as ``"sign exponent mantissa"`` in binary, e.g. ``'0 1111 110'``."""
        mant = format(self.mantissa, f"0{self.man_bits}b") if self.man_bits else ""
        return f"{self.sign} {self.exponent:0{self.exp_bits}b} {mant}".rstrip()

    @property
    def hex(self) -> str:
        """The pattern in hexadecimal, padded to the format's width, e.g. ``'0x3fc0'``."""
        digits = -(-(1 + self.exp_bits + self.man_bits) // 4)
        return f"0x{self.pattern:0{digits}x}"

    def __str__(self) -> str:
        return f"{self.format}: {self.fields} ({self.hex})"


def _check_pattern_format(fmt: FloatFormat) -> None:
    if fmt.bits > 32:
        raise ValueError(f"bit patterns are supported up to 32 bits, {fmt.name} has {fmt.bits}")


def value_from_bits(pattern: int, fmt: FormatLike) -> float:
    """The value a bit pattern encodes in ``fmt`` (sign, exponent field, mantissa field, from the
    most significant bit down): ``(-1)**s (1 + f/2**m) 2**(e - bias)`` for normal numbers,
    ``(-1)**s (f/2**m) 2**e_min`` for subnormals, inf and NaN as the format's kind says.

    Example:
        >>> value_from_bits(0x3FC0, "bf16"), value_from_bits(0x7E, "e4m3"), value_from_bits(0x7F, "e4m3")
        (1.5, 448.0, nan)
    """
    fmt = get_format(fmt)
    _check_pattern_format(fmt)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or not 0 <= pattern < 2**fmt.bits:
        raise ValueError(f"pattern must be an integer in 0..{2**fmt.bits - 1} for {fmt.name}, got {pattern!r}")
    m, top = fmt.man_bits, 2**fmt.exp_bits - 1
    sign = -1.0 if (pattern >> (fmt.exp_bits + m)) & 1 else 1.0
    exponent = (pattern >> m) & top
    mantissa = pattern & (2**m - 1)
    if exponent == top and fmt.kind == "ieee":
        return sign * math.inf if mantissa == 0 else math.nan
    if exponent == top and fmt.kind == "fn" and mantissa == 2**m - 1:
        return math.nan
    if exponent == 0:
        return sign * mantissa * fmt.smallest_subnormal
    return sign * (1 + mantissa / 2**m) * 2.0 ** (exponent - fmt.bias)


def decode_bits(value: Union[float, torch.Tensor], fmt: FormatLike) -> BitFields:
    """Split ``value``, which must lie on ``fmt``'s grid, into its sign, exponent and mantissa
    fields (the inverse of :func:`value_from_bits`). NaN gets the canonical quiet NaN (top mantissa
    bit set) in IEEE formats and the all-ones pattern in E4M3-like formats. Round a value onto the
    grid first (``quantize``) to decode what a format would store.

    Example:
        >>> str(decode_bits(-0.75, "e4m3"))
        'e4m3: 1 0110 100 (0xb4)'
    """
    fmt = get_format(fmt)
    _check_pattern_format(fmt)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"decode_bits takes one value, got a tensor of {value.numel()} elements")
        value = value.item()
    value = float(value)
    m, top = fmt.man_bits, 2**fmt.exp_bits - 1
    sign = 1 if math.copysign(1.0, value) < 0 else 0
    a = abs(value)

    def fields(exponent: int, mantissa: int, s: int = sign) -> BitFields:
        return BitFields(fmt.name, s, exponent, mantissa, fmt.exp_bits, fmt.man_bits)

    if math.isnan(value):
        if not fmt.has_nan:
            raise ValueError(f"{fmt.name} has no NaN encoding")
        return fields(top, 2**m - 1 if fmt.kind == "fn" else 1 << (m - 1) if m else 0, 0)
    if math.isinf(value):
        if not fmt.has_inf:
            raise ValueError(f"{fmt.name} has no infinity (values beyond {fmt.max:g} do not exist in it)")
        return fields(top, 0)
    stored = quantize(torch.tensor([value], dtype=torch.float64), fmt, overflow="saturate").item()
    if stored != value or a > fmt.max:
        raise ValueError(f"{value!r} is not a value of {fmt.name} (the nearest is {stored!r}); quantize it first")
    if a < fmt.smallest_normal:                      # zero and subnormals: exponent field 0
        return fields(0, int(a / fmt.smallest_subnormal))
    e = math.frexp(a)[1] - 1                         # a = 1.f * 2**e exactly
    return fields(e + fmt.bias, int((a / 2.0**e - 1) * 2**m))


def repeated_add(start: float, increment: float, n: int, fmt: FormatLike, rounding: str = "nearest",
                 generator: GeneratorLike = None, paths: int = 1, rand_bits: Optional[int] = None) -> torch.Tensor:
    """Add ``increment`` to ``start`` ``n`` times, storing the sum in ``fmt`` after every addition:
    ``w_0 = q(start)``, ``w_{k+1} = q(w_k + increment)``. Returns the trajectory, a float64 tensor
    of shape ``(n + 1, paths)``; with stochastic rounding each column is an independent sequence.

    The sum is formed in float64 (relative error 2^-53, far below any simulated format's ulp), then
    rounded once by :func:`lowprec_demo.rounding.quantize`. An int ``generator`` seeds one
    ``torch.Generator`` for the whole sequence, so every step draws fresh random bits.

    Example:
        >>> repeated_add(1.0, 1e-3, 1000, "bf16")[-1].item()
        1.0
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    if isinstance(paths, bool) or not isinstance(paths, int) or paths < 1:
        raise ValueError(f"paths must be a positive integer, got {paths!r}")
    if isinstance(generator, int) and not isinstance(generator, bool):
        generator = torch.Generator().manual_seed(generator)
    out = torch.empty(n + 1, paths, dtype=torch.float64)
    w = quantize(torch.full((paths,), float(start), dtype=torch.float64), fmt)
    out[0] = w
    for k in range(n):
        w = quantize(w + increment, fmt, rounding, generator=generator, rand_bits=rand_bits)
        out[k + 1] = w
    return out


def sr_samples(x: float, fmt: FormatLike, n: int, generator: GeneratorLike = None,
               rand_bits: Optional[int] = None) -> torch.Tensor:
    """``n`` independent stochastic roundings of the one value ``x`` (float64 tensor of shape
    ``(n,)``). Each sample is one of the two grid neighbours of ``x``.

    Example:
        >>> sorted(set(sr_samples(1.0 + 2**-9, "bf16", 1000, generator=0).tolist()))
        [1.0, 1.0078125]
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    return quantize(torch.full((n,), float(x), dtype=torch.float64), fmt, "stochastic",
                    generator=generator, rand_bits=rand_bits)


def grid_neighbours(x: torch.Tensor, fmt: FormatLike) -> Tuple[torch.Tensor, torch.Tensor]:
    """The grid values ``lo <= x <= hi`` around ``x`` (element-wise, by magnitude: ``|lo| <= |x|
    <= |hi|``, signs as ``x``); ``lo == hi == x`` where ``x`` is on the grid. Between two grid values
    the gap is ``ulp(x)``, since every power of two is a grid value. For ``|x|`` within the
    format's range.

    Example:
        >>> [t.tolist() for t in grid_neighbours(torch.tensor([1.3], dtype=torch.float64), "e2m1")]
        [[1.0], [1.5]]
    """
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x, dtype=torch.float64)
    a = x.abs()
    nearest = quantize(a, fmt)
    gap = ulp(a, fmt)
    lo = torch.where(nearest <= a, nearest, nearest - gap)
    hi = torch.where(lo == a, lo, lo + gap)
    return lo.copysign(x), hi.copysign(x)
