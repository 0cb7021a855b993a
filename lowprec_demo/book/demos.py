"""Small demonstrations for the first chapters: bit fields (:func:`decode_bits`,
:func:`value_from_bits`), the smallest training loop ``w <- q(w + d)`` (:func:`repeated_add`),
stochastic rounding's samples (:func:`sr_samples`) and grid neighbours (:func:`grid_neighbours`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from lowprec_demo.formats import FloatFormat, get_format
from lowprec_demo.rounding import GeneratorLike, quantize, ulp

__all__ = ["BitFields", "decode_bits", "value_from_bits", "repeated_add", "sr_samples", "grid_neighbours"]

FormatLike = Union[str, FloatFormat]


@dataclass(frozen=True)
class BitFields:
    """A value's ``sign``, biased ``exponent`` and stored ``mantissa`` fields: a normal number is
    ``(-1)**sign (1 + mantissa / 2**m) 2**(exponent - bias)``, a subnormal ``(-1)**sign (mantissa / 2**m) 2**e_min``."""

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
        """The pattern as ``"sign exponent mantissa"`` in binary."""
        mant = format(self.mantissa, f"0{self.man_bits}b") if self.man_bits else ""
        return f"{self.sign} {self.exponent:0{self.exp_bits}b} {mant}".rstrip()

    @property
    def hex(self) -> str:
        """The pattern in hexadecimal, padded to the format's width."""
        digits = -(-(1 + self.exp_bits + self.man_bits) // 4)
        return f"0x{self.pattern:0{digits}x}"

    def __str__(self) -> str:
        return f"{self.format}: {self.fields} ({self.hex})"


def _check_pattern_format(fmt: FloatFormat) -> None:
    if fmt.bits > 32:
        raise ValueError(f"bit patterns are supported up to 32 bits, {fmt.name} has {fmt.bits}")


def value_from_bits(pattern: int, fmt: FormatLike) -> float:
    """The value a bit pattern encodes in ``fmt`` (inf and NaN as the format's kind says).

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
    """The fields of ``value``, which must lie on ``fmt``'s grid (``quantize`` it first); NaN gets the
    canonical quiet NaN in IEEE formats, the all-ones pattern in E4M3-like ones.

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
    """``w_0 = q(start)``, ``w_{k+1} = q(w_k + increment)`` for ``n`` steps (sums in float64, rounded
    once): float64 ``(n + 1, paths)``, the columns independent under stochastic rounding.

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
    """``n`` independent stochastic roundings of ``x``, each one of its two grid neighbours.

    Example:
        >>> sorted(set(sr_samples(1.0 + 2**-9, "bf16", 1000, generator=0).tolist()))
        [1.0, 1.0078125]
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    return quantize(torch.full((n,), float(x), dtype=torch.float64), fmt, "stochastic",
                    generator=generator, rand_bits=rand_bits)


def grid_neighbours(x: torch.Tensor, fmt: FormatLike) -> Tuple[torch.Tensor, torch.Tensor]:
    """The grid values around ``x`` by magnitude, ``|lo| <= |x| <= |hi|``, signs as ``x``, ``ulp(x)`` apart.

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
