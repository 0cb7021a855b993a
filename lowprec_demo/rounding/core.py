"""Rounding onto a format's grid: round-to-nearest-even and stochastic rounding, exactly.

Everything here is vectorised tensor code (CPU and CUDA alike) working on the bit patterns of
float32 or float64 tensors; float16 and bfloat16 tensors are widened to float32 first.

Round to nearest, ties to even (RNE)
    ``quantize(x, fmt)`` is bit-identical to torch's casts to bfloat16, float16, float8_e4m3fn and
    float8_e5m2 for every fp32 input, and to ml_dtypes' casts for the fp6/fp4 types. float64 input is
    rounded once, exactly (torch rounds it twice, through float32, as ml_dtypes did
    before 0.7).

Overflow
    A value whose rounding lies beyond ``fmt.max`` follows the format's overflow policy:
    ``"inf"`` (IEEE formats: by the RNE rule, e.g. E5M2 sends 61439 to 57344 and 61440 to inf),
    ``"saturate"`` (formats without inf: to +-max; infinities saturate too, as torch's
    float8_e4m3fn cast does) or ``"nan"`` (ml_dtypes' E4M3 rule). NaN stays NaN, even in formats with
    no NaN encoding, so that a NaN is never hidden. The sign of zero is kept.

Stochastic rounding (SR)
    ``quantize(x, fmt, "stochastic")`` returns one of the two grid neighbours of ``x``, the one away
    from zero with probability (distance to the lower neighbour) / (gap), so ``E[q(x)] = x``.
    Values past ``max`` are rounded on the grid continued above ``max`` and then follow the
    overflow policy. The random bits come from a counter-based hash of a seed and the element's
    index, so they are the same on CPU and GPU and on every data-parallel rank given the same
    seed; the seed is drawn from the caller's ``torch.Generator`` (or given as an int).
    Probabilities are resolved to 2^-32 of a gap for float32 input (exact wherever the gap is
    at most 2^32 float32 spacings of the input: the whole normal range of every format, and all
    but the smallest inputs below it) and to 2^-53 for float64 input. ``rand_bits=k`` models
    hardware SR with k random bits: the position inside the gap is first rounded to nearest at
    k bits, so an update smaller than 2^-(k+1) of a gap never moves the value: few-bit SR
    freezes again.

Speed
    float32 tensors are rounded by the fused kernels of :mod:`lowprec_demo.kernels`: integer
    arithmetic on the bit patterns, compiled by ``torch.compile`` into one pass over memory once
    the work is large enough to be worth compiling, and run eagerly otherwise (the same bits
    either way). Where torch has the format's dtype and its cast is the exact rounding with the
    same overflow rule, round to nearest is that cast.

Example:
    >>> import torch
    >>> quantize(torch.tensor([1.0 + 2**-9]), "bf16")
    tensor([1.])
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from lowprec_demo.rounding import bits as bit_kernels, kernels
from lowprec_demo.formats import FloatFormat, check_overflow_policy, get_format
from lowprec_demo.rounding.rule import LAYOUTS, RATIO_EDGES, freeze_elements, move_share, rule_params

__all__ = ["quantize", "quantize_", "ulp", "would_freeze", "move_probability", "update_ulp_ratio", "decay_rounds_back",
           "ROUNDING_MODES", "random_bits", "draw_seed"]

ROUNDING_MODES = ("nearest", "stochastic")
GeneratorLike = Union[torch.Generator, int, None]

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class _Spec:
    """Layout of a floating-point dtype the bit-level code works on."""
    man_bits: int          # stored mantissa bits P
    bias: int              # exponent bias B
    itype: torch.dtype     # integer type of the same width
    rand_bits: int         # random bits of full-resolution SR (float mantissa + 1)

    @property
    def mant_mask(self) -> int:
        return (1 << self.man_bits) - 1

    @property
    def exp_all_ones(self) -> int:
        return (2 * self.bias + 1) << self.man_bits  # the bit pattern of +inf


_SPECS = {
    torch.float32: _Spec(23, 127, torch.int32, 24),
    torch.float64: _Spec(52, 1023, torch.int64, 53),
}
_NARROW = {torch.float16: FloatFormat(5, 10, "ieee", "fp16"),
           torch.bfloat16: FloatFormat(8, 7, "ieee", "bf16")}
# what a tensor of each dtype can hold: a format with E = 8 and no inf reaches the binade 2**128
_HOLDS = {**_NARROW, torch.float32: FloatFormat(8, 23, "ieee", "fp32")}
_SUPPORTED = "float32, float64, float16 or bfloat16"


# ------------------------------------------------------------------------------------------------
# argument checks
# ------------------------------------------------------------------------------------------------
def _check_tensor(x, what: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SPECS and x.dtype not in _NARROW:
        raise TypeError(f"{what} must be a floating-point tensor ({_SUPPORTED}); got {x.dtype}")


def _contains(outer: FloatFormat, inner: FloatFormat) -> bool:
    """Whether every value of ``inner`` (and its overflow values) is representable in ``outer``."""
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
    if rand_bits is None:
        return
    if isinstance(rand_bits, bool) or not isinstance(rand_bits, int) or not 1 <= rand_bits <= 32:
        raise ValueError(f"rand_bits must be None (full resolution) or an integer in 1..32, got {rand_bits!r}")


# ------------------------------------------------------------------------------------------------
# random bits: a counter-based hash of (seed, element index)
# ------------------------------------------------------------------------------------------------
def draw_seed(generator: GeneratorLike) -> int:
    """The 64-bit seed one rounding call draws: from the generator (advancing it by one draw),
    the int given, or torch's default CPU generator for None. Stochastic rounding of several
    pieces of one tensor (the shards of a parameter) draws it once and gives it to each piece,
    with the piece's ``index_offset``.

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


def _check_first(first) -> int:
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"index_offset must be a non-negative integer (the index of the first element), got {first!r}")
    return first


def random_bits(shape, seed: int, stream: int = 0, device=None, first: int = 0) -> torch.Tensor:
    """32 random bits per element (int64 values in [0, 2^32)), a pure function of
    ``(seed, stream, element index)``: identical on every device and process. The hash is
    :func:`lowprec_demo.bit_kernels.hash32`, the one the stochastic-rounding kernel draws.
    ``first`` numbers the first element (the elements are ``first, first + 1, ...``): a
    piece of a larger tensor draws that tensor's bits.

    Example:
        >>> random_bits((3,), seed=1).tolist() == random_bits((3,), seed=1).tolist()
        True
        >>> random_bits((2,), seed=1, first=1).tolist() == random_bits((3,), seed=1).tolist()[1:]
        True
    """
    numel = math.prod(shape)
    _check_first(first)
    if first + numel > 1 << 32:
        raise ValueError(f"random_bits numbers at most 2**32 elements (32-bit indices); got {first + numel}")
    wide = first + numel > 1 << 31
    index = torch.arange(first, first + numel, dtype=torch.int64 if wide else torch.int32, device=device)
    s1, s2 = bit_kernels.seed_words(seed, stream)
    return (bit_kernels.hash32(index.to(torch.int32), s1, s2).to(torch.int64) & _M32).view(shape)


def _uniform_ints(shape, nbits: int, seed: int, device, first: int = 0) -> torch.Tensor:
    """Uniform integers in [0, 2^nbits), 1 <= nbits <= 53, as int64."""
    if nbits <= 32:
        return random_bits(shape, seed, 0, device, first) >> (32 - nbits)
    hi = random_bits(shape, seed, 0, device, first)
    lo = random_bits(shape, seed, 1, device, first)
    return (hi << (nbits - 32)) | (lo >> (64 - nbits))


# ------------------------------------------------------------------------------------------------
# exact powers of two and exponents
# ------------------------------------------------------------------------------------------------
def _pow2(k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exactly ``2.0**k`` for an integer tensor k, built from bits (subnormal results included)."""
    spec = _SPECS[dtype]
    k = k.to(spec.itype)
    biased = k + spec.bias
    normal = biased.clamp(min=1) << spec.man_bits
    sub_shift = (biased - 1 + spec.man_bits).clamp(min=0, max=spec.man_bits - 1)
    subnormal = torch.ones_like(k) << sub_shift
    return torch.where(biased >= 1, normal, subnormal).view(dtype)


def _biased_exponent(a: torch.Tensor) -> torch.Tensor:
    """The exponent field of non-negative floats (0 for zero and subnormals)."""
    spec = _SPECS[a.dtype]
    return a.view(spec.itype) >> spec.man_bits


# ------------------------------------------------------------------------------------------------
# round to nearest, ties to even, on magnitudes (exponent unbounded above)
# ------------------------------------------------------------------------------------------------
def _nearest_magic(a: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """RNE of non-negative ``a`` onto ``fmt``'s grid, in place, by one floating-point addition.

    For ``a`` in the binade of exponent ``e`` (``e`` clamped to ``[e_min, e_max + 1]``) the number
    ``M = 2**(e + P - m)`` has a unit in the last place equal to the target ulp ``2**(e - m)``.
    ``a + M`` is therefore rounded by the hardware (RNE) exactly at the target's grid, and
    ``(a + M) - M`` is exact. One rounding, so float64 input is rounded once."""
    spec = _SPECS[a.dtype]
    shift = spec.man_bits - fmt.man_bits
    e = _biased_exponent(a)
    e.clamp_(fmt.e_min + spec.bias, fmt.e_max + 1 + spec.bias)
    e += shift
    e <<= spec.man_bits
    magic = e.view(a.dtype)
    a += magic
    a -= magic
    return a


def _nearest_magnitude(a: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """RNE of non-negative ``a`` onto the grid of ``fmt`` continued above ``max``; in place.
    float32: the kernel :func:`lowprec_demo.bit_kernels.rne_fp32` (run as the caller's mode says);
    float64: one exact floating-point addition (:func:`_nearest_magic`)."""
    if a.dtype == torch.float32:
        return a.copy_(kernels.nearest(a, fmt, None))
    spec = _SPECS[a.dtype]
    drop = spec.man_bits - fmt.man_bits
    if drop == 0:
        # float32 input and m = 23: only the format's subnormals can be coarser than the input's
        # grid (when E < 8); there the magic number 2**e_min has their spacing as its ulp.
        if fmt.e_min > 1 - spec.bias:
            small = a < fmt.smallest_normal
            a.copy_(torch.where(small, _nearest_magic(a.clone(), fmt), a))
        return a
    return _nearest_magic(a, fmt)


# ------------------------------------------------------------------------------------------------
# stochastic rounding on magnitudes
# ------------------------------------------------------------------------------------------------
def _stochastic_general(a: torch.Tensor, fmt: FloatFormat, seed: int, rand_bits: Optional[int],
                        first: int = 0) -> torch.Tensor:
    """SR of float64 input (float32 input goes through :func:`lowprec_demo.bit_kernels.sr_fp32`) by
    an error-free transformation: n = RNE(a) is the nearest neighbour and err = a - n is
    exact (Sterbenz); the other neighbour is one gap away on err's side, taken with probability
    |err| / gap."""
    spec = _SPECS[a.dtype]
    k = spec.rand_bits if rand_bits is None else rand_bits
    n = _nearest_magnitude(a.clone(), fmt)
    err = a.sub_(n)
    up = err > 0
    # spacing on err's side of n: below a power of two (above the smallest normal) it halves
    nbits = n.view(spec.itype)
    gap_exp = nbits >> spec.man_bits
    gap_exp -= (((nbits & spec.mant_mask) == 0) & ~up).to(spec.itype)
    gap_exp.clamp_(min=fmt.e_min + spec.bias)
    gap_exp -= spec.bias + fmt.man_bits
    gap = _pow2(gap_exp, a.dtype)
    prob_scaled = err.abs_().div_(gap).mul_(2.0**k).round_()  # position in the gap, k bits, RNE
    move = _uniform_ints(a.shape, k, seed, a.device, first) < prob_scaled.to(torch.int64)
    step = torch.where(up, gap, -gap)
    return n.add_(step.masked_fill_(~move, 0.0))


# ------------------------------------------------------------------------------------------------
# the public entry point
# ------------------------------------------------------------------------------------------------
def _apply_overflow(r: torch.Tensor, fmt: FloatFormat, policy: str) -> torch.Tensor:
    value = {"inf": math.inf, "saturate": fmt.max, "nan": math.nan}[policy]
    return r.masked_fill_(r > fmt.max, value)


@functools.lru_cache(maxsize=None)
def _cpu_cast_saturates(dtype: torch.dtype) -> bool:
    """Whether torch's CPU cast from float32 to ``dtype`` sends values beyond max, and infinities,
    to +-max. Recent torch does for float8_e4m3fn; older versions (2.11, for one) give NaN."""
    top = torch.finfo(dtype).max
    probe = torch.tensor([top * 1.04, top * 4, math.inf, -math.inf]).to(dtype).float()
    return probe.tolist() == [top, top, top, -top]


# torch's casts that beat the rounding kernel, compiled or not (the CPU's float8 casts are slow)
_FAST_CASTS = (torch.bfloat16, torch.float16)


def _native_dtype(x: torch.Tensor, fmt: FloatFormat, policy: str) -> Optional[torch.dtype]:
    """A torch dtype whose cast from ``x`` is already the exact RNE (single rounding) with this
    overflow policy, or None."""
    dtype = fmt.with_overflow(policy).torch_dtype if policy != fmt.overflow else fmt.torch_dtype
    if dtype is None:
        return None
    if x.dtype == torch.float32:
        # torch's float8 casts are checked bit for bit on the CPU; elsewhere use the exact path.
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and x.device.type != "cpu":
            return None
        if dtype == torch.float8_e4m3fn and not _cpu_cast_saturates(dtype):
            return None
        return dtype
    if x.dtype == torch.float64 and dtype == torch.float32:
        return dtype
    return None


def _checked(x: torch.Tensor, fmt: Union[str, FloatFormat], rounding: str, rand_bits: Optional[int],
             overflow: Optional[str], index_offset: int = 0) -> Tuple[FloatFormat, str]:
    """The arguments of :func:`quantize` and :func:`quantize_` checked (each bad one refused
    with the values it may take): the format and the overflow policy that applies."""
    fmt = get_format(fmt)
    _check_tensor(x)
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {', '.join(ROUNDING_MODES)}; got {rounding!r}")
    _check_rand_bits(rand_bits)
    _check_first(index_offset)
    policy = fmt.overflow if overflow is None else overflow
    check_overflow_policy(fmt, policy)
    _check_narrow(x.dtype, fmt)
    return fmt, policy


def quantize(x: torch.Tensor, fmt: Union[str, FloatFormat], rounding: str = "nearest",
             generator: GeneratorLike = None, rand_bits: Optional[int] = None,
             overflow: Optional[str] = None, index_offset: int = 0) -> torch.Tensor:
    """Round every element of ``x`` onto the grid of ``fmt``; return a new tensor of x's dtype
    and device.

    Args:
        x: a float32, float64, float16 or bfloat16 tensor (not modified; no gradient flows).
        fmt: a format name (see :func:`lowprec_demo.formats.get_format`) or a FloatFormat.
        rounding: ``"nearest"`` (RNE, ties to even) or ``"stochastic"``.
        generator: for SR, a ``torch.Generator`` (one seed is drawn from it per call) or an int
            seed; None draws from torch's default CPU generator.
        rand_bits: for SR, the number of random bits k (1..32); None is full resolution.
        overflow: override the format's overflow policy: ``"inf"``, ``"saturate"`` or ``"nan"``.
        index_offset: for SR, the index of ``x``'s first element: element i (row-major) draws
            the random bits of element ``index_offset + i``, so that a piece of a larger tensor
            (a shard: a block of rows) rounded with the whole tensor's seed gets the whole
            tensor's bits. Round to nearest ignores it.

    RNE returns ``w`` from ``w + d`` exactly when ``|d| < ulp(w)/2`` (a tie goes to the even
    neighbour); SR moves to the neighbour away from zero with probability (distance to the lower
    neighbour)/gap.

    Example:
        >>> quantize(torch.tensor([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8]), "bf16").tolist()
        [1.0, 1.0, 1.015625]
    """
    fmt, policy = _checked(x, fmt, rounding, rand_bits, overflow, index_offset)
    x = x.detach()

    if x.dtype in _NARROW:  # widen exactly, round, narrow exactly (the format fits in the dtype)
        return quantize(x.float(), fmt, rounding, generator, rand_bits, policy, index_offset).to(x.dtype)

    if rounding == "nearest":
        native = _native_dtype(x, fmt, policy)
        if native == x.dtype:  # the grid holds every value of x (a new tensor all the same)
            return x.clone()
        if native is not None and (native in _FAST_CASTS or x.dtype != torch.float32):
            return x.to(native).to(x.dtype)
        if x.dtype == torch.float32:
            # the kernel, compiled when worth it (the CPU's float8 casts are slow); else torch's
            # cast where there is one, or the kernel function run eagerly
            return kernels.nearest(x, fmt, policy, eager=(lambda: x.to(native).float()) if native is not None else None)
        return _generic_nearest(x, fmt, policy)
    seed = draw_seed(generator)
    if x.dtype == torch.float32 and index_offset + x.numel() <= kernels.MAX_NUMEL:
        return kernels.stochastic(x, fmt, policy, rand_bits, seed, index_offset)
    r = _stochastic_general(x.abs(), fmt, seed, rand_bits, index_offset)
    return _apply_overflow(r, fmt, policy).copysign_(x)


def quantize_(x: torch.Tensor, fmt: Union[str, FloatFormat], rounding: str = "nearest",
              generator: GeneratorLike = None, rand_bits: Optional[int] = None,
              overflow: Optional[str] = None, index_offset: int = 0) -> torch.Tensor:
    """Round every element of ``x`` onto the grid of ``fmt`` in place and return ``x``: the
    same bits as ``x.copy_(quantize(x, fmt, rounding, generator, rand_bits, overflow,
    index_offset))``, with the same arguments, and no gradient recorded.

    RNE: ``q(x)`` is the grid value nearest to ``x`` (a tie to the even neighbour); SR: the
    neighbour away from zero with probability ``(|x| - lo) / gap``, so ``E[q(x)] = x``.

    A contiguous float32 tensor is rounded where it lies: by torch's own cast where that is the
    same rounding, else by the kernels of :mod:`lowprec_demo.kernels`, compiled when the mode
    says so (:func:`lowprec_demo.kernels.set_mode`) and run eagerly otherwise; any other tensor
    through :func:`quantize`.

    Example:
        >>> quantize_(torch.tensor([1.0 + 2**-9, 3.0]), "e2m1").tolist()
        [1.0, 3.0]
    """
    fmt, policy = _checked(x, fmt, rounding, rand_bits, overflow, index_offset)
    with torch.no_grad():
        if x.dtype != torch.float32 or not x.is_contiguous() or index_offset + x.numel() > kernels.MAX_NUMEL:
            return x.copy_(quantize(x, fmt, rounding, generator, rand_bits, policy, index_offset))
        if rounding == "stochastic":
            return kernels.stochastic_(x, fmt, policy, rand_bits, draw_seed(generator), index_offset)
        native = _native_dtype(x, fmt, policy)
        if native == x.dtype:  # the grid holds every float32 value: nothing to do
            return x
        if native in _FAST_CASTS:
            return x.copy_(x.to(native))
        return kernels.nearest_(x, fmt, policy, eager=(lambda: x.copy_(x.to(native))) if native is not None else None)


def _generic_nearest(x: torch.Tensor, fmt: FloatFormat, policy: str) -> torch.Tensor:
    """The package's own round to nearest in eager PyTorch, for any float32 or float64 tensor."""
    return _apply_overflow(_nearest_magnitude(x.abs(), fmt), fmt, policy).copysign_(x)


# ------------------------------------------------------------------------------------------------
# the freeze rule
# ------------------------------------------------------------------------------------------------
def _as_computable(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _NARROW else t


def decay_rounds_back(beta: Optional[float], fmt: Union[str, FloatFormat]) -> bool:
    """Whether a moving average ``v <- beta * v + (1 - beta) * x`` kept on ``fmt``'s grid with
    round to nearest can stop decaying: ``1 - beta`` below ``2**-(m+1)``, the bound of the half
    gap relative to the value. At and above it ``beta * v`` moves every grid value; below it
    the values just above a power of two, whose relative half gap comes closest to the bound,
    are the first that ``beta * v`` rounds back to (once the new input is small), and below
    ``2**-(m+2)`` every value. False for no factor (None or 0).

    Example:
        >>> decay_rounds_back(0.999, "bf16"), decay_rounds_back(0.9, "bf16")   # Adam's beta2, beta1
        (True, False)
    """
    return bool(beta) and 1 - beta < 2.0 ** -(get_format(fmt).man_bits + 1)


def ulp(x: torch.Tensor, fmt: Union[str, FloatFormat]) -> torch.Tensor:
    """The spacing of ``fmt``'s grid at ``x``: ``2**(max(floor(log2|x|), e_min) - m)``; constant
    (the smallest subnormal) below the smallest normal; NaN for inf and NaN. Exact.

    Example:
        >>> ulp(torch.tensor([1.0, 1.5, 0.0]), "bf16").tolist()
        [0.0078125, 0.0078125, 9.183549615799121e-41]
    """
    fmt = get_format(fmt)
    _check_tensor(x)
    _check_narrow(x.dtype, fmt)
    a = _as_computable(x.detach()).abs()
    spec = _SPECS[a.dtype]
    e = _biased_exponent(a).clamp_(min=fmt.e_min + spec.bias) - (spec.bias + fmt.man_bits)
    out = _pow2(e, a.dtype).masked_fill_(~torch.isfinite(a), math.nan)
    return out.to(x.dtype)


def _rule(w: torch.Tensor, d: torch.Tensor, fmt: FloatFormat, overflow: Optional[str] = None,
          rand_bits: Optional[int] = None) -> tuple:
    """``(frozen, ratio, stuck)`` of :func:`lowprec_demo.freeze_rule.freeze_elements` at ``q(w)``
    for the update ``d`` (broadcast, promoted to float32 or float64), the ratio divided exactly."""
    w, d = _prepare_pair(w, d, fmt)
    layout = LAYOUTS[w.dtype]
    p = torch.tensor(rule_params(fmt, rand_bits, RATIO_EDGES, layout, overflow), dtype=layout.itype, device=w.device)
    signed = w.contiguous().view(layout.itype)
    return freeze_elements(signed & layout.abs_mask, signed, d.contiguous(), p, layout, divide=True)


def update_ulp_ratio(w: torch.Tensor, d: torch.Tensor, fmt: Union[str, FloatFormat]) -> torch.Tensor:
    """``|d| / gap``: the update measured in grid spacings on its own side of ``q(w)``
    (:mod:`lowprec_demo.freeze_rule`). Round to nearest freezes below 1/2; SR moves with
    probability min(1, ratio).

    Example:
        >>> update_ulp_ratio(torch.tensor([1.0, 1.0]), torch.tensor([2**-9, -2**-9]), "bf16").tolist()
        [0.25, 0.5]
    """
    return _rule(w, d, get_format(fmt))[1]


def _prepare_pair(w: torch.Tensor, d: torch.Tensor, fmt: FloatFormat):
    _check_tensor(w, "w")
    _check_tensor(d, "d")
    dtype = torch.promote_types(_as_computable(w).dtype, _as_computable(d).dtype)
    w, d = torch.broadcast_tensors(w.detach().to(dtype), d.detach().to(dtype))
    return quantize(w, fmt), d


def would_freeze(w: torch.Tensor, d: torch.Tensor, fmt: Union[str, FloatFormat],
                 overflow: Optional[str] = None) -> torch.Tensor:
    """Whether round-to-nearest of the exact sum ``q(w) + d`` gives back ``q(w)``, element-wise
    (:mod:`lowprec_demo.freeze_rule`, the one implementation of the rule).

    The rule: frozen exactly when ``|d| < gap/2``, or ``|d| == gap/2`` and ``q(w)`` is an even
    multiple of gap (the tie goes to the even neighbour; for m >= 1 that is an even last mantissa
    bit), where gap is the spacing on d's side:
    ``ulp(w)``, except moving toward zero from a power of two above the smallest normal, where the
    grid below is twice as fine and the threshold is ``ulp(w)/4``. A saturating format (or
    ``overflow="saturate"``) also keeps ``+-max`` under any outward update; where it overflows to
    inf, an infinite weight stays under any finite update. NaN never counts as frozen.

    Example:
        >>> would_freeze(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([2**-8, -2**-9, -2**-9 - 2**-12]), "bf16").tolist()
        [True, True, False]
    """
    fmt = get_format(fmt)
    policy = fmt.overflow if overflow is None else overflow
    check_overflow_policy(fmt, policy)
    return _rule(w, d, fmt, policy)[0]


def move_probability(w: torch.Tensor, d: torch.Tensor, fmt: Union[str, FloatFormat],
                     rand_bits: Optional[int] = None) -> torch.Tensor:
    """Probability that stochastic rounding of ``q(w) + d`` differs from ``q(w)``:
    ``min(1, |d|/gap)``; with k random bits the position in the gap is resolved to k bits,
    ``round(|d|/gap * 2**k) / 2**k``, so updates below ``2**-(k+1)`` gaps never move. An
    infinite ``q(w)`` never moves under a finite update (or one of its own sign), nor does
    ``+-max`` of a saturating format under an outward one (:mod:`lowprec_demo.freeze_rule`).

    Example:
        >>> move_probability(torch.tensor([1.0]), torch.tensor([2**-10]), "bf16").tolist()
        [0.125]
    """
    _check_rand_bits(rand_bits)
    fmt = get_format(fmt)
    _, ratio, stuck = _rule(w, d, fmt)
    return move_share(ratio, stuck, rand_bits or 0)
