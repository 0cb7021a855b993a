"""The public rounding functions: argument checks, the choice between torch's cast and a kernel
(:mod:`~lowprec_demo.rounding.kernels`), and the freeze rule on float tensors.

Round to nearest, ties to even
    Bit-identical to torch's casts to bfloat16, float16, float8_e4m3fn and float8_e5m2 for every fp32 input, and to
    ml_dtypes' casts for the fp6/fp4 types; float64 input is rounded once, exactly (torch rounds it twice, through
    float32). Where torch's cast is the same rounding and faster it is used: always for bfloat16 and float16, and for
    the float8 types on the CPU while the kernels run eagerly. float16 and bfloat16 are widened to float32 first.

Overflow
    Beyond ``fmt.max`` the overflow policy applies: ``"inf"`` (IEEE formats, by the RNE rule:
    E5M2 sends 61439 to 57344 and 61440 to inf), ``"saturate"`` (to +-max, infinities too, as torch's float8_e4m3fn
    cast) or ``"nan"`` (ml_dtypes' E4M3 rule); every ``overflow`` argument reads None as the format's own. NaN stays
    NaN even in formats without NaN, so that a NaN is never hidden; the sign of zero is kept.

Stochastic rounding
    One of the two grid neighbours of ``x``, the one away from zero with probability (distance to the lower neighbour) /
    gap, so ``E[q(x)] = x``; beyond ``max`` on the grid continued above it, then the overflow policy. The random bits
    are a hash of a seed (from the caller's ``torch.Generator``, or an int) and the element's index: one seed, the same
    bits everywhere. Probabilities are resolved to 2^-32 of a gap (exact for float32 input in every format's normal
    range); ``rand_bits=k`` models k-bit hardware SR, so an update below 2^-(k+1) of a gap never moves.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple, Union

import torch

from lowprec_demo.formats import FloatFormat, check_overflow_policy, get_format
from lowprec_demo.rounding import bits as bit_kernels, kernels
from lowprec_demo.rounding.rule import (LAYOUTS, freeze_elements, gap_value, move_share, rule_params,
                                        seed_words)

__all__ = ["quantize", "quantize_", "ulp", "would_freeze", "move_probability", "update_ulp_ratio", "decay_rounds_back",
           "ROUNDING_MODES", "random_bits", "draw_seed"]

ROUNDING_MODES = ("nearest", "stochastic")
GeneratorLike = Union[torch.Generator, int, None]

_M32 = 0xFFFFFFFF
_NARROW = {torch.float16: get_format("fp16"), torch.bfloat16: get_format("bf16")}
# what a tensor of each dtype can hold: a format with E = 8 and no inf reaches the binade 2**128
_HOLDS = {**_NARROW, torch.float32: get_format("fp32")}
_SUPPORTED = "float32, float64, float16 or bfloat16"


# --- argument checks -------------------------------------------------------------------------------
def _check_tensor(x, what: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in LAYOUTS and x.dtype not in _NARROW:
        raise TypeError(f"{what} must be a floating-point tensor ({_SUPPORTED}); got {x.dtype}")


def _contains(outer: FloatFormat, inner: FloatFormat) -> bool:   # every value of inner (overflow's too)
    return (inner.man_bits <= outer.man_bits and inner.e_max <= outer.e_max
            and inner.e_min - inner.man_bits >= outer.e_min - outer.man_bits)


def _check_narrow(dtype: torch.dtype, fmt: FloatFormat) -> None:
    if dtype in _HOLDS and not _contains(_HOLDS[dtype], fmt):
        wider = "a float32 or float64 tensor" if _contains(_HOLDS[torch.float32], fmt) else "a float64 tensor"
        raise ValueError(
            f"format {fmt.name} has values that {dtype} cannot hold, so the result could not lie on "
            f"the {fmt.name} grid; quantize {wider} instead"
        )


def _check_rand_bits(rand_bits: Optional[int]) -> None:
    if rand_bits is not None and (isinstance(rand_bits, bool) or not isinstance(rand_bits, int)
                                  or not 1 <= rand_bits <= 32):
        raise ValueError(f"rand_bits must be None (full resolution) or an integer in 1..32, got {rand_bits!r}")


# --- random bits: a counter-based hash of (seed, element index) ------------------------------------
def draw_seed(generator: GeneratorLike) -> int:
    """The 64-bit seed one rounding call draws: from the generator (advancing it by one draw), the int given, or
    torch's default CPU generator for None. The shards of one tensor share one seed, each with its ``index_offset``.

    Example:
        >>> draw_seed(torch.Generator().manual_seed(0)) == draw_seed(torch.Generator().manual_seed(0))
        True
    """
    if isinstance(generator, bool):
        raise TypeError("generator must be a torch.Generator, an int seed or None")
    if isinstance(generator, int):
        return generator & ((1 << 64) - 1)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, an int seed or None, got {type(generator).__name__}")
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2**62, (), generator=generator, device=device).item())


def _check_index_offset(index_offset) -> int:
    if isinstance(index_offset, bool) or not isinstance(index_offset, int) or index_offset < 0:
        raise ValueError(f"index_offset must be a non-negative integer (the index of the first element), "
                         f"got {index_offset!r}")
    return index_offset


def random_bits(shape, seed: int, stream: int = 0, device=None, index_offset: int = 0) -> torch.Tensor:
    """32 random bits per element (int64 values in [0, 2^32)), a pure function of (seed, stream,
    element index), the hash stochastic rounding draws (stream 0) on every device. The elements
    are numbered from ``index_offset``, so that a piece of a larger tensor draws that tensor's bits.

    Example:
        >>> random_bits((3,), seed=1).tolist() == random_bits((3,), seed=1).tolist()
        True
        >>> random_bits((2,), seed=1, index_offset=1).tolist() == random_bits((3,), seed=1).tolist()[1:]
        True
    """
    index_offset = _check_index_offset(index_offset)
    numel = math.prod(shape)
    if index_offset + numel > 1 << 32:
        raise ValueError(f"random_bits numbers at most 2**32 elements (32-bit indices); got {index_offset + numel}")
    wide = index_offset + numel > 1 << 31
    index = torch.arange(index_offset, index_offset + numel, dtype=torch.int64 if wide else torch.int32, device=device)
    return (bit_kernels.hash32(index.to(torch.int32), *seed_words(seed, stream)).to(torch.int64) & _M32).view(shape)


# --- the public entry points -----------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _cpu_cast_saturates(dtype: torch.dtype) -> bool:
    """Whether torch's CPU cast to ``dtype`` saturates (float8_e4m3fn; some torch versions give NaN)."""
    top = torch.finfo(dtype).max
    probe = torch.tensor([top * 1.04, top * 4, math.inf, -math.inf]).to(dtype).float()
    return probe.tolist() == [top, top, top, -top]


# torch's casts that beat the kernel, compiled or not (the CPU's float8 casts, only the eager one)
_FAST_CASTS = (torch.bfloat16, torch.float16)


def _native_dtype(x: torch.Tensor, fmt: FloatFormat, overflow: str) -> Optional[torch.dtype]:
    """A torch dtype whose cast from ``x`` is this exact RNE with this overflow policy, or None."""
    dtype = fmt.with_overflow(overflow).torch_dtype if overflow != fmt.overflow else fmt.torch_dtype
    if dtype is None:
        return None
    if x.dtype == torch.float32:
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and x.device.type != "cpu":
            return None
        if dtype == torch.float8_e4m3fn and not _cpu_cast_saturates(dtype):
            return None
        return dtype
    return dtype if x.dtype == torch.float64 and dtype == torch.float32 else None


def _checked(x: torch.Tensor, fmt: Union[str, FloatFormat], rounding: str, rand_bits: Optional[int],
             overflow: Optional[str], index_offset: int = 0) -> Tuple[FloatFormat, str]:
    """The checked arguments of :func:`quantize` and :func:`quantize_`: the format and policy."""
    fmt = get_format(fmt)
    _check_tensor(x)
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {', '.join(ROUNDING_MODES)}; got {rounding!r}")
    _check_rand_bits(rand_bits)
    _check_index_offset(index_offset)
    overflow = fmt.overflow if overflow is None else overflow
    check_overflow_policy(fmt, overflow)
    _check_narrow(x.dtype, fmt)
    return fmt, overflow


def _round(x: torch.Tensor, fmt: FloatFormat, rounding: str, generator: GeneratorLike, rand_bits: Optional[int],
           overflow: str, index_offset: int, inplace: bool) -> torch.Tensor:
    """The one dispatch of :func:`quantize` and :func:`quantize_` (a float32 or float64 ``x``)."""
    if rounding == "stochastic":
        return kernels.stochastic(x, fmt, overflow, rand_bits, draw_seed(generator), index_offset, inplace)
    native = _native_dtype(x, fmt, overflow)
    if native == x.dtype:  # the grid holds every value of x
        return x if inplace else x.clone()
    def cast():
        return x.copy_(x.to(native)) if inplace else x.to(native).to(x.dtype)
    if native is not None and (native in _FAST_CASTS or x.dtype == torch.float64):
        return cast()
    # the kernel compiled; eagerly torch's cast where there is one (the CPU's float8 casts)
    return kernels.nearest(x, fmt, overflow, eager=None if native is None else cast, inplace=inplace)


def quantize(x: torch.Tensor, fmt: Union[str, FloatFormat], rounding: str = "nearest",
             generator: GeneratorLike = None, rand_bits: Optional[int] = None,
             overflow: Optional[str] = None, index_offset: int = 0) -> torch.Tensor:
    """Round every element of a float32, float64, float16 or bfloat16 tensor ``x`` (not modified, no gradient flows)
    onto the grid of ``fmt`` (a name for :func:`~lowprec_demo.formats.get_format` or a FloatFormat), ``rounding``
    ``"nearest"`` or ``"stochastic"``; return a new tensor of x's dtype and device. For SR: ``generator``
    (:func:`draw_seed`), ``rand_bits`` k in 1..32 (None: full resolution) and ``index_offset``: element i (row-major)
    draws the random bits of element ``index_offset + i`` (modulo 2**32), so that a shard rounded with its whole
    tensor's seed gets that tensor's bits. ``overflow`` overrides the format's policy.

    Example:
        >>> quantize(torch.tensor([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8]), "bf16").tolist()
        [1.0, 1.0, 1.015625]
    """
    fmt, overflow = _checked(x, fmt, rounding, rand_bits, overflow, index_offset)
    x = x.detach()
    if x.dtype in _NARROW:  # widen exactly, round, narrow exactly (the format fits in the dtype)
        return _round(x.float(), fmt, rounding, generator, rand_bits, overflow, index_offset, False).to(x.dtype)
    return _round(x, fmt, rounding, generator, rand_bits, overflow, index_offset, False)


def quantize_(x: torch.Tensor, fmt: Union[str, FloatFormat], rounding: str = "nearest",
              generator: GeneratorLike = None, rand_bits: Optional[int] = None,
              overflow: Optional[str] = None, index_offset: int = 0) -> torch.Tensor:
    """:func:`quantize` in place, returning ``x``: the bits of ``x.copy_(quantize(x, ...))``, no
    gradient recorded (a contiguous float32 or float64 tensor is rounded where it lies).

    Example:
        >>> quantize_(torch.tensor([1.0 + 2**-9, 3.0]), "e2m1").tolist()
        [1.0, 3.0]
    """
    fmt, overflow = _checked(x, fmt, rounding, rand_bits, overflow, index_offset)
    with torch.no_grad():
        if x.dtype in _NARROW or not x.is_contiguous():
            return x.copy_(quantize(x, fmt, rounding, generator, rand_bits, overflow, index_offset))
        return _round(x, fmt, rounding, generator, rand_bits, overflow, index_offset, True)


# --- the freeze rule -------------------------------------------------------------------------------
def _as_computable(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _NARROW else t


def decay_rounds_back(beta: Optional[float], fmt: Union[str, FloatFormat]) -> bool:
    """Whether a moving average ``v <- beta * v + (1 - beta) * x`` kept on ``fmt``'s grid with round to nearest can stop
    decaying: ``1 - beta`` below ``2**-(m+1)``, the largest half gap relative to the value (then values just above a
    power of two round back once the input is small; below ``2**-(m+2)`` every value). False for None or 0.

    Example:
        >>> decay_rounds_back(0.999, "bf16"), decay_rounds_back(0.9, "bf16")   # Adam's beta2, beta1
        (True, False)
    """
    return bool(beta) and 1 - beta < 2.0 ** -(get_format(fmt).man_bits + 1)


def ulp(x: torch.Tensor, fmt: Union[str, FloatFormat]) -> torch.Tensor:
    """The spacing of ``fmt``'s grid at ``x``, ``2**(max(floor(log2|x|), e_min) - m)``, exactly; NaN for inf and NaN.

    Example:
        >>> ulp(torch.tensor([1.0, 1.5, 0.0]), "bf16").tolist()
        [0.0078125, 0.0078125, 9.183549615799121e-41]
    """
    fmt = get_format(fmt)
    _check_tensor(x)
    _check_narrow(x.dtype, fmt)
    a = _as_computable(x.detach())
    layout = LAYOUTS[a.dtype]
    exponent = (a.view(layout.itype) & layout.abs_mask) >> layout.man_bits
    out = gap_value(exponent.clamp_(min=fmt.e_min + layout.bias) - fmt.man_bits, layout)
    return out.masked_fill_(~torch.isfinite(a), math.nan).to(x.dtype)


def _rule(w: torch.Tensor, d: torch.Tensor, fmt: FloatFormat, overflow: Optional[str] = None) -> tuple:
    """``(frozen, ratio, stuck)`` of the rule at ``q(w)`` for ``d`` (broadcast, promoted)."""
    _check_tensor(w, "w")
    _check_tensor(d, "d")
    dtype = torch.promote_types(_as_computable(w).dtype, _as_computable(d).dtype)
    w, d = torch.broadcast_tensors(w.detach().to(dtype), d.detach().to(dtype))
    w = quantize(w, fmt)
    layout = LAYOUTS[w.dtype]
    q = rule_params(fmt, None, layout, overflow)
    signed = w.contiguous().view(layout.itype)
    return freeze_elements(signed & layout.abs_mask, signed, d.contiguous(), q, layout, divide=True)


def update_ulp_ratio(w: torch.Tensor, d: torch.Tensor, fmt: Union[str, FloatFormat]) -> torch.Tensor:
    """``|d| / gap``: the update in grid spacings on its own side of ``q(w)``
    (:mod:`lowprec_demo.rounding.rule`); round to nearest freezes below 1/2.

    Example:
        >>> update_ulp_ratio(torch.tensor([1.0, 1.0]), torch.tensor([2**-9, -2**-9]), "bf16").tolist()
        [0.25, 0.5]
    """
    return _rule(w, d, get_format(fmt))[1]


def would_freeze(w: torch.Tensor, d: torch.Tensor, fmt: Union[str, FloatFormat],
                 overflow: Optional[str] = None) -> torch.Tensor:
    """Whether round-to-nearest of the exact sum ``q(w) + d`` gives back ``q(w)``: ``|d|`` below half the gap on d's
    side, ties to even; stuck weights stay, NaN never freezes (:mod:`~lowprec_demo.rounding.rule`).

    Example:
        >>> would_freeze(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([2**-8, -2**-9, -2**-9 - 2**-12]), "bf16").tolist()
        [True, True, False]
    """
    fmt = get_format(fmt)
    overflow = fmt.overflow if overflow is None else overflow
    check_overflow_policy(fmt, overflow)
    return _rule(w, d, fmt, overflow)[0]


def move_probability(w: torch.Tensor, d: torch.Tensor, fmt: Union[str, FloatFormat],
                     rand_bits: Optional[int] = None) -> torch.Tensor:
    """Probability that stochastic rounding of ``q(w) + d`` differs from ``q(w)``: ``min(1,
    |d|/gap)`` resolved to k = ``rand_bits`` bits, 0 for a stuck weight (:mod:`~lowprec_demo.rounding.rule`).

    Example:
        >>> move_probability(torch.tensor([1.0]), torch.tensor([2**-10]), "bf16").tolist()
        [0.125]
    """
    _check_rand_bits(rand_bits)
    fmt = get_format(fmt)
    _, ratio, stuck = _rule(w, d, fmt)
    return move_share(ratio, stuck, rand_bits or 0)
