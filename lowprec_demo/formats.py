"""Floating-point formats: what a format's grid looks like.

A binary format with ``E`` exponent bits and ``m`` stored mantissa bits holds the normal numbers
``(1 + f / 2**m) * 2**e`` (``e_min <= e <= e_max``, ``0 <= f < 2**m``) and, evenly spaced below the smallest normal, the
subnormal numbers ``(f / 2**m) * 2**e_min``: the grid's spacing around ``w`` is
``ulp(w) = 2**(max(floor(log2|w|), e_min) - m)``. The top exponent field is encoded in one of three ways (``kind``):
``"ieee"`` reserves it for inf and NaN (fp32, tf32, bf16, fp16, fp8 E5M2); ``"fn"`` ("finite plus NaN", OCP fp8 E4M3,
max 448) has no inf, and there only the all-ones mantissa is NaN; ``"finite"`` (the OCP Microscaling fp6 E3M2, fp6 E2M3,
fp4 E2M1) has neither: every encoding is a number.

Example:
    >>> get_format("e4m3").max
    448.0
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

import torch

__all__ = ["FloatFormat", "get_format", "FORMAT_NAMES", "KINDS", "OVERFLOW_POLICIES", "format_table",
           "DTYPE_FORMATS", "format_of_dtype"]

KINDS = ("ieee", "fn", "finite")
OVERFLOW_POLICIES = ("inf", "saturate", "nan")

# Exponent and mantissa widths the simulation supports: every format that fits inside fp32.
EXP_BITS_RANGE = range(2, 9)
MAN_BITS_RANGE = range(0, 24)


def check_overflow_policy(fmt: "FloatFormat", overflow: str) -> None:
    """Raise ValueError unless ``overflow`` is a policy the format can express."""
    allowed = [p for p in OVERFLOW_POLICIES if (p != "inf" or fmt.has_inf) and (p != "nan" or fmt.has_nan)]
    if overflow not in allowed:
        raise ValueError(
            f"overflow policy {overflow!r} is not available for {fmt.name or 'this format'}; "
            f"allowed: {', '.join(allowed)}"
        )


@dataclass(frozen=True)
class FloatFormat:
    """A format with E = ``exp_bits`` (2..8) exponent bits, m = ``man_bits`` (0..23) stored mantissa bits, a ``kind``, a
    display ``name`` (default ``"e{E}m{m}"``) and an ``overflow`` policy, what a value beyond ``max`` becomes:
    ``"inf"``, ``"saturate"`` (to +-max) or ``"nan"`` (default ``"inf"`` if the format has inf, else ``"saturate"``).

    Example:
        >>> FloatFormat(5, 3).max   # an IEEE-like 9-bit format "e5m3"
        61440.0
    """

    exp_bits: int
    man_bits: int
    kind: str = "ieee"
    name: str = ""
    overflow: str = ""

    def __post_init__(self) -> None:
        for field, allowed in (("exp_bits", EXP_BITS_RANGE), ("man_bits", MAN_BITS_RANGE)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
                raise ValueError(
                    f"{field} must be an integer in {allowed.start}..{allowed.stop - 1}, got {value!r}"
                )
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if self.kind == "fn" and self.man_bits == 0:
            raise ValueError("kind 'fn' needs at least one mantissa bit (the all-ones mantissa is NaN)")
        if not self.name:
            object.__setattr__(self, "name", f"e{self.exp_bits}m{self.man_bits}")
        if not self.overflow:
            object.__setattr__(self, "overflow", "inf" if self.has_inf else "saturate")
        check_overflow_policy(self, self.overflow)

    @property
    def bias(self) -> int:
        """Exponent bias ``2**(E-1) - 1``."""
        return 2 ** (self.exp_bits - 1) - 1

    @property
    def e_min(self) -> int:
        """Exponent of the smallest normal number, ``1 - bias``."""
        return 1 - self.bias

    @property
    def e_max(self) -> int:
        """Exponent of the largest finite number."""
        top = 2**self.exp_bits - 1 - self.bias  # exponent of the all-ones exponent field
        return top - 1 if self.kind == "ieee" else top

    @property
    def has_inf(self) -> bool:
        """Whether the format encodes infinity."""
        return self.kind == "ieee"

    @property
    def has_nan(self) -> bool:
        """Whether the format encodes NaN (an "ieee" format without mantissa bits has only inf)."""
        return self.kind == "fn" or (self.kind == "ieee" and self.man_bits > 0)

    @property
    def max(self) -> float:
        """Largest finite value, ``(2 - 2**-m) * 2**e_max`` (for "fn" ``(2 - 2**(1-m)) * 2**e_max``).
        Every landmark is a dyadic rational, exact as a Python float."""
        top_mantissa = 2**self.man_bits - (2 if self.kind == "fn" else 1)
        return (1 + top_mantissa / 2**self.man_bits) * 2.0**self.e_max

    @property
    def smallest_normal(self) -> float:
        """``2**e_min``."""
        return 2.0**self.e_min

    @property
    def smallest_subnormal(self) -> float:
        """``2**(e_min - m)``, also the grid's spacing below the smallest normal."""
        return 2.0 ** (self.e_min - self.man_bits)

    @property
    def eps(self) -> float:
        """Machine epsilon ``2**-m``, the distance from 1 to the next larger value."""
        return 2.0**-self.man_bits

    @property
    def bits(self) -> int:
        """The total width in bits, ``1 + E + m`` (sign, exponent and mantissa)."""
        return 1 + self.exp_bits + self.man_bits

    @property
    def freeze_threshold_range(self) -> tuple:
        """The smallest and largest relative update ``|d|/|w|`` that round-to-nearest can swallow,
        ``(2**-(m+2), 2**-(m+1)]`` for normal ``w`` (the lower end at a power of two)."""
        return (2.0 ** -(self.man_bits + 2), 2.0 ** -(self.man_bits + 1))

    @property
    def torch_dtype(self) -> Optional[torch.dtype]:
        """The torch dtype with exactly this grid and the same overflow rule, if there is one."""
        dtype = _TORCH_DTYPES.get((self.exp_bits, self.man_bits, self.kind))
        # torch's casts send overflow to inf (ieee) or saturate (float8_e4m3fn on the CPU)
        return dtype if self.overflow == ("inf" if self.kind == "ieee" else "saturate") else None

    @property
    def ml_dtypes_name(self) -> Optional[str]:
        """The name of the ml_dtypes type with this grid, if there is one."""
        return _ML_DTYPES_NAMES.get((self.exp_bits, self.man_bits, self.kind))

    def with_overflow(self, overflow: str) -> "FloatFormat":
        """The same grid with another overflow policy."""
        check_overflow_policy(self, overflow)
        return FloatFormat(self.exp_bits, self.man_bits, self.kind, self.name, overflow)

    def __str__(self) -> str:
        return self.name


_TORCH_DTYPES = {(8, 23, "ieee"): torch.float32, (8, 7, "ieee"): torch.bfloat16, (5, 10, "ieee"): torch.float16,
                 (4, 3, "fn"): torch.float8_e4m3fn, (5, 2, "ieee"): torch.float8_e5m2}
_ML_DTYPES_NAMES = {(8, 7, "ieee"): "bfloat16", (4, 3, "fn"): "float8_e4m3fn", (5, 2, "ieee"): "float8_e5m2",
                    (4, 3, "ieee"): "float8_e4m3", (3, 4, "ieee"): "float8_e3m4", (3, 2, "finite"): "float6_e3m2fn",
                    (2, 3, "finite"): "float6_e2m3fn", (2, 1, "finite"): "float4_e2m1fn"}
_NAMED = {f.name: f for f in (
    FloatFormat(8, 23, "ieee", "fp32"), FloatFormat(8, 10, "ieee", "tf32"), FloatFormat(8, 7, "ieee", "bf16"),
    FloatFormat(5, 10, "ieee", "fp16"), FloatFormat(4, 3, "fn", "e4m3"), FloatFormat(5, 2, "ieee", "e5m2"),
    FloatFormat(3, 2, "finite", "e3m2"), FloatFormat(2, 3, "finite", "e2m3"), FloatFormat(2, 1, "finite", "e2m1"))}
_ALIASES = {
    "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "fp8_e4m3": "e4m3", "e4m3fn": "e4m3", "float8_e4m3fn": "e4m3",
    "fp8_e5m2": "e5m2", "float8_e5m2": "e5m2",
    "fp6_e3m2": "e3m2", "fp6_e2m3": "e2m3", "fp4_e2m1": "e2m1", "fp4": "e2m1",
}
FORMAT_NAMES = tuple(_NAMED)
_GENERIC = re.compile(r"^e(\d+)m(\d+)$")


def get_format(name: Union[str, FloatFormat]) -> FloatFormat:
    """Look up a format by name.

    Named formats: fp32, tf32, bf16, fp16, e4m3 (OCP E4M3 "fn": no inf, max 448), e5m2, e3m2, e2m3, e2m1 (OCP MX: no
    inf, no NaN). Any other ``"e{E}m{m}"`` (E in 2..8, m in 0..23) is IEEE-like: inf and NaN at the top exponent.

    Example:
        >>> get_format("e5m3").max
        61440.0
    """
    if isinstance(name, FloatFormat):
        return name
    if not isinstance(name, str):
        raise TypeError(f"a format is a name (str) or a FloatFormat, got {type(name).__name__}")
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key in _NAMED:
        return _NAMED[key]
    match = _GENERIC.match(key)
    if match:
        exp_bits, man_bits = int(match.group(1)), int(match.group(2))
        key = f"e{exp_bits}m{man_bits}"  # "e04m3" is "e4m3", the named OCP format
        if key in _NAMED:
            return _NAMED[key]
        if exp_bits in EXP_BITS_RANGE and man_bits in MAN_BITS_RANGE:
            return FloatFormat(exp_bits, man_bits, "ieee", key)
    raise ValueError(
        f"unknown format {name!r}; valid names: {', '.join(FORMAT_NAMES)}, "
        f"or 'e<E>m<m>' with E in 2..8 and m in 0..23 (for example 'e5m3')"
    )


# torch dtypes that store a low-precision format, and the package's name of that format
DTYPE_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def format_of_dtype(dtype: torch.dtype) -> Optional[str]:
    """The package's name of the format a torch dtype stores, or None for float32, float64 and
    non-float dtypes. Example: ``format_of_dtype(torch.bfloat16)`` -> ``"bf16"``."""
    return DTYPE_FORMATS.get(dtype)


def format_table(names=("fp32", "tf32", "bf16", "fp16", "e4m3", "e5m2", "e3m2", "e2m3", "e2m1")) -> list:
    """One dict per format with its landmarks, computed from the format definition.

    Example:
        >>> format_table(["bf16"])[0]["max"]
        3.3895313892515355e+38
    """
    rows = []
    for name in names:
        fmt = get_format(name)
        lo, hi = fmt.freeze_threshold_range
        rows.append({"name": fmt.name, "bits": fmt.bits, "E": fmt.exp_bits, "m": fmt.man_bits, "bias": fmt.bias,
                     "max": fmt.max, "smallest_normal": fmt.smallest_normal,
                     "smallest_subnormal": fmt.smallest_subnormal, "eps": fmt.eps, "inf": fmt.has_inf,
                     "nan": fmt.has_nan, "overflow": fmt.overflow, "freeze_rel_min": lo, "freeze_rel_max": hi})
    return rows
