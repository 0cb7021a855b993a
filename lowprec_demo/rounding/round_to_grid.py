"""Rounding onto a format's grid, bit for bit: round to nearest, ties to even (:func:`nearest_bits`), and stochastic
rounding (:func:`stochastic_bits`), behind :func:`quantize` and :func:`quantize_`.

The kernels work on the bit patterns of float32 or float64 tensors (:data:`LAYOUTS`) with integer operations, so
eager PyTorch and ``torch.compile`` give the same bits. With P stored mantissa bits and bias B, a non-negative float is
``S * 2**(E' - B - P)``, ``E' = max(exponent field, 1)``, with the integer significand ``S = bits - ((E' - 1) << P)``
(subnormals included); the target grid's spacing is ``2**d`` units of ``S``, ``d = P - m + max(e_min + B - E', 0)``.
``S`` rounded to a multiple of ``2**d``, plus ``(E' - 1) << P``, is the result's bit pattern (a carry runs into the
exponent): float64 input is rounded once (torch rounds it twice, through float32). Beyond ``fmt.max`` the overflow
policy applies: ``"inf"`` (by the RNE rule: E5M2 sends 61439 to 57344, 61440 to inf), ``"saturate"`` or ``"nan"``
(None: the format's own). NaN stays NaN, the sign of zero is kept. Where torch's cast is the same rounding it is used:
bfloat16 and float16, and the float8 types on the CPU.

:func:`run` is the one compile step (``torch.compile`` fuses a kernel into one loop): mode (``LOWPREC_FUSED`` or
:func:`set_mode`) ``"off"``, ``"on"``, or ``"auto"``: compiled once a kernel's eager work reaches :data:`EAGER_BUDGET`
elements, so that rounding a few tensors never waits for the compiler while a training loop soon runs compiled.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from typing import Callable, Dict, NamedTuple, Optional, Union

import torch

from lowprec_demo.formats import FloatFormat, check_overflow_policy, get_format

ROUNDING_MODES = ("nearest", "stochastic")
GeneratorLike = Union[torch.Generator, int, None]
FULL_RAND_BITS = 32            # stochastic rounding at full resolution: the 32 bits of one hash
MAX_NUMEL = (1 << 31) - 1      # compiled kernels number elements in int32; larger tensors run eagerly
_M32 = 0xFFFFFFFF


# --- bit layouts, the kernels' parameters and the hash ----------------------------------------------
class BitLayout:
    """A float dtype's bit layout: its integer type, P (``man_bits``), the bias and the bit patterns the kernels use
    (``LAYOUTS[torch.float32].inf_bits`` is ``0x7f800000``; ``sign_bits`` is negative, ``half_bits`` those of 0.5)."""

    def __init__(self, dtype: torch.dtype, itype: torch.dtype, man_bits: int, bias: int) -> None:
        self.dtype, self.itype, self.man_bits, self.bias = dtype, itype, man_bits, bias
        width, self.inf_bits = torch.finfo(dtype).bits, (2 * bias + 1) << man_bits
        self.abs_mask, self.sign_bits = (1 << (width - 1)) - 1, -(1 << (width - 1))
        self.nan_bits, self.half_bits = self.inf_bits | 1 << (man_bits - 1), (bias - 1) << man_bits

    def bits(self, value: float) -> int:
        """The bit pattern of ``value`` (held exactly by the dtype), as a signed integer of its width."""
        return torch.tensor(value, dtype=torch.float64).to(self.dtype).view(self.itype).item()


LAYOUTS = {torch.float32: BitLayout(torch.float32, torch.int32, 23, 127),
           torch.float64: BitLayout(torch.float64, torch.int64, 52, 1023)}
_F32 = LAYOUTS[torch.float32]
_BY_ITYPE = {layout.itype: layout for layout in LAYOUTS.values()}


class RoundParams(NamedTuple):
    """What the rounding kernels need of a format, as integers of a :class:`BitLayout`. A kernel takes them as one
    integer tensor (:meth:`tensor`), so that one compiled kernel serves every format and seed."""
    man_bits: int          # m, the format's stored mantissa bits
    emin_biased: int       # e_min + the layout's bias
    max_bits: int          # the bit pattern of max
    overflow_bits: int     # the bit pattern of what a value beyond max becomes (the overflow policy's)
    rand_bits: int         # k, the random bits of stochastic rounding (32: full resolution)
    tiny_bits: int         # the bit pattern of the smallest subnormal 2**(e_min - m)
    seed_lo: int           # the two seed words of seed_words (stochastic rounding only)
    seed_hi: int
    index_offset: int      # the index of the first element, as a signed 32-bit number

    def tensor(self, device=None, layout: BitLayout = _F32) -> torch.Tensor:
        return torch.tensor(self, dtype=layout.itype, device=device)

    read = classmethod(lambda cls, p: cls(*p.unbind()))     # the named values of a parameter tensor (0-dim tensors)


def _signed32(value: int) -> int:
    return ((value + (1 << 31)) & _M32) - (1 << 31)


def seed_words(seed: int, stream: int = 0) -> tuple:
    """The two 32-bit words (as signed values) the hash mixes in for a 64-bit seed and a stream."""
    return _signed32(seed), _signed32((seed >> 32) ^ (0x9E3779B9 * (stream + 1)))


def grid_bits(fmt: FloatFormat, overflow: Optional[str], layout: BitLayout) -> tuple:
    """``(m, e_min + bias, bits of max, bits of the overflow value)``; overflow None: the format's."""
    top = layout.bits(fmt.max)
    over = {"inf": layout.inf_bits, "saturate": top, "nan": layout.nan_bits}[overflow or fmt.overflow]
    return fmt.man_bits, fmt.e_min + layout.bias, top, over


def round_params(fmt: FloatFormat, overflow: Optional[str] = None, rand_bits: Optional[int] = None, seed: int = 0,
                 index_offset: int = 0, layout: BitLayout = _F32) -> RoundParams:
    """The kernels' parameters: grid, overflow policy (None: the format's), and for SR the random bits (None: full
    resolution), seed and first element's index."""
    return RoundParams(*grid_bits(fmt, overflow, layout), FULL_RAND_BITS if rand_bits is None else rand_bits,
                       layout.bits(2.0 ** (fmt.e_min - fmt.man_bits)), *seed_words(seed), _signed32(index_offset))


@functools.lru_cache(maxsize=256)   # a parameter tensor made once per device (nearest and the rule, not SR's seeds)
def cached_tensor(values: tuple, itype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=itype, device=device)


def _mix32_(h: torch.Tensor) -> torch.Tensor:   # a bijective 32-bit finaliser (xor-shift-multiply), in place
    for step in range(3):
        h ^= (h >> 16) & 0xFFFF
        if step < 2:
            h.mul_(0x45D9F3B)
    return h


def hash32(index: torch.Tensor, seed_lo, seed_hi) -> torch.Tensor:
    """The one hash: 32 random bits (int32, read unsigned) of each int32 ``index`` for the :func:`seed_words`."""
    h = _mix32_(index ^ seed_lo)
    h ^= seed_hi
    return _mix32_(h)


def draw_seed(generator: GeneratorLike) -> int:
    """The 64-bit seed one rounding call draws: from the generator (advancing it by one draw), the int given, or
    torch's default CPU generator for None. The shards of one tensor share one seed, each with its ``index_offset``.

    Example:
        >>> draw_seed(torch.Generator().manual_seed(0)) == draw_seed(torch.Generator().manual_seed(0))
        True
    """
    if isinstance(generator, int) and not isinstance(generator, bool):
        return generator & ((1 << 64) - 1)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, an int seed or None, got {type(generator).__name__}")
    return int(torch.randint(0, 2**62, (), generator=generator, device=getattr(generator, "device", "cpu")))


def _check_index_offset(index_offset) -> int:
    if isinstance(index_offset, bool) or not isinstance(index_offset, int) or index_offset < 0:
        raise ValueError(f"index_offset must be a non-negative integer (the first index), got {index_offset!r}")
    return index_offset


def random_bits(shape, seed: int, stream: int = 0, device=None, index_offset: int = 0) -> torch.Tensor:
    """32 random bits per element (int64 in [0, 2^32)) of (seed, stream, element index), those SR draws (stream 0) on
    every device; the elements numbered from ``index_offset``, so that a piece of a tensor draws that tensor's bits.

    Example:
        >>> random_bits((2,), seed=1, index_offset=1).tolist() == random_bits((3,), seed=1).tolist()[1:]
        True
    """
    index_offset = _check_index_offset(index_offset)
    numel = math.prod(shape)
    if index_offset + numel > 1 << 32:
        raise ValueError(f"random_bits numbers at most 2**32 elements (32-bit indices); got {index_offset + numel}")
    index = torch.arange(index_offset, index_offset + numel, dtype=torch.int64, device=device)
    return (hash32(index.to(torch.int32), *seed_words(seed, stream)).to(torch.int64) & _M32).view(shape)


# --- the kernels, on bit patterns -------------------------------------------------------------------
def _decompose(u: torch.Tensor, q):   # (E' - 1) << P, the significand S and d of non-negative bit patterns u
    man = _BY_ITYPE[u.dtype].man_bits
    e = (u >> man).clamp_(min=1)
    d = (q.emin_biased - e).clamp_(min=0)
    d += man - q.man_bits
    e -= 1
    e <<= man
    return e, u - e, d


def rne_magnitude(u: torch.Tensor, q) -> torch.Tensor:
    """RNE of non-negative bit patterns ``u`` (at most inf's) onto the grid of ``q``, beyond max the overflow value:
    ``S`` rounded by ml_dtypes' bias expression (add ``2**(d-1) - 1`` plus the last kept bit, clear the low ``d``
    bits); from ``d = P + 2`` on every ``S`` rounds to 0."""
    top, s, d = _decompose(u, q)
    d.clamp_(max=_BY_ITYPE[u.dtype].man_bits + 2)
    half = (1 << d) >> 1
    bias = (s >> d) & torch.clamp(half, max=1)     # the last kept bit, for ties (none when d = 0)
    bias += half - 1
    s += bias.clamp_(min=0)
    s >>= d
    s <<= d
    out = torch.where(s > 0, top.add_(s), 0)       # a rounded significand of 0: the magnitude is 0
    return torch.where(out > q.max_bits, q.overflow_bits, out)


def nearest_bits(bits: torch.Tensor, p: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """RNE of bit patterns onto the grid of ``p`` (:class:`RoundParams` as a tensor of their integer type), with its
    overflow policy, as bit patterns (with ``inplace`` written over ``bits``).

    Example:
        >>> p = round_params(get_format("e4m3"), "saturate").tensor()
        >>> nearest_bits(torch.tensor([1.06, 500.0]).view(torch.int32), p).view(torch.float32).tolist()
        [1.0, 448.0]
    """
    layout, q = _BY_ITYPE[bits.dtype], RoundParams.read(p)
    u = bits & layout.abs_mask
    nan = u > layout.inf_bits
    out = torch.where(nan, layout.nan_bits, rne_magnitude(torch.where(~nan, u, 0), q))   # (a NaN's magnitude as 0)
    out |= bits & layout.sign_bits
    return bits.copy_(out) if inplace else out


def stochastic_bits(bits: torch.Tensor, p: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """Stochastic rounding of flat bit patterns (as :func:`nearest_bits`): away from zero with probability ``frac /
    2**d``, ``frac = S mod 2**d``, resolved to ``j = min(d, k)`` bits for k random bits (32: full resolution): when the
    top j bits of :func:`hash32` of (seed, index_offset + i) are below ``round_half_even(frac / 2**(d - j))``."""
    layout, q = _BY_ITYPE[bits.dtype], RoundParams.read(p)
    man = layout.man_bits
    u = bits & layout.abs_mask               # (a NaN goes through the arithmetic and is replaced)
    top, s, d = _decompose(u, q)
    dd = torch.clamp(d, max=man + 2)
    down = (s >> dd) << dd                   # S rounded down to the grid
    frac = s - down                          # S mod 2**d, below 2**(P+1): exact as a float of the layout
    j = torch.clamp(d, max=q.rand_bits)
    # position = round_half_even(frac * 2**(j - d)): frac itself when d <= k; at 2**-(P+7) and below the product is
    # below 1/64 and rounds to 0 either way
    scale = (j - d).clamp_(min=-(man + 7))
    scale += layout.bias
    scale <<= man
    position = frac.to(layout.dtype)
    position *= scale.view(layout.dtype)
    position = position.round_().to(layout.itype)
    n = bits.numel()     # (int32 indices, modulo 2**32 from index_offset; int64 first beyond MAX_NUMEL, eagerly)
    index = torch.arange(n, dtype=torch.int64 if n > MAX_NUMEL else torch.int32, device=bits.device).to(torch.int32)
    index += q.index_offset
    r = hash32(index, q.seed_lo, q.seed_hi)    # move when r (unsigned) is below position * 2**(32 - j); 32-bit lanes
    # compare modulo 2**32 (shifts below 32: Triton leaves larger ones undefined) and test the whole gap 2**j apart
    if layout.itype == torch.int64:
        move = (r.to(torch.int64) & _M32) < (position << (32 - j))
    else:
        threshold = (position << (32 - j).clamp_(max=31)) ^ -(1 << 31)
        move = ((position >> j.clamp_(max=31)) > 0) | ((r ^ -(1 << 31)) < threshold)
    down += torch.where(move, 1 << dd.clamp_(max=man + 1), 0)
    down += top
    # d >= P + 1: the value is below the smallest subnormal step: 0 or that step
    out = torch.where(d > man, torch.where(move, q.tiny_bits, 0), down)
    out = torch.where(u > layout.inf_bits, layout.nan_bits, torch.where(out > q.max_bits, q.overflow_bits, out))
    out |= bits & layout.sign_bits
    return bits.copy_(out) if inplace else out


# --- the one compile step -----------------------------------------------------------------------------
MODES = ("auto", "on", "off")
EAGER_BUDGET = 1 << 27         # "auto": compile a kernel once its eager work would reach this many elements
_ENV = os.environ.get("LOWPREC_FUSED", "auto").strip().lower()
_state = {"mode": {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}.get(
    _ENV, _ENV if _ENV in MODES else "auto")}
_eager_work: Dict[Callable, int] = {}
_compiled: Dict[tuple, Optional[Callable]] = {}   # (kernel, device type) -> compiled function, None where it failed


def set_mode(mode: str) -> str:
    """Choose when kernels are compiled: ``"auto"``, ``"on"`` or ``"off"``; returns the previous mode."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    previous, _state["mode"] = _state["mode"], mode
    return previous


def get_mode() -> str:
    return _state["mode"]        # (see set_mode)


def run(kernel: Callable, *args, **options):
    """``kernel(*args, **options)``, compiled when the mode says so (once per kernel and device type, without grad),
    else eagerly (also where compiling failed): the same bits either way. The first argument's size, device decide."""
    n, device = args[0].numel(), args[0].device.type
    mode, key = _state["mode"], (kernel, device)
    wanted = mode == "on" or (mode == "auto" and (key in _compiled or _eager_work.get(kernel, 0) + n > EAGER_BUDGET))
    if wanted and 2 <= n <= MAX_NUMEL and _compiled.get(key, True) is not None:   # (sizes 0 and 1 are specialised)
        try:
            if key not in _compiled:
                _compiled[key] = torch.compile(kernel, dynamic=True, fullgraph=True)
            with torch.no_grad():
                return _compiled[key](*args, **options)
        except Exception as error:  # no compiler, unsupported platform...: eagerly from now on
            _compiled[key], first = None, (str(error).strip().splitlines() or [""])[0][:300]
            warnings.warn(f"compiling the {kernel.__name__} kernel for {device} failed ({type(error).__name__}: "
                          f"{first}); it runs eagerly from now on, same bits", RuntimeWarning)
    _eager_work[kernel] = _eager_work.get(kernel, 0) + n
    return kernel(*args, **options)


# --- the public functions ---------------------------------------------------------------------------
_NARROW = {torch.float16: get_format("fp16"), torch.bfloat16: get_format("bf16")}
# what a tensor of each dtype can hold: a format with E = 8 and no inf reaches the binade 2**128
_HOLDS = {**_NARROW, torch.float32: get_format("fp32")}


def check_tensor(x, what: str = "x") -> None:   # a float32, float64, float16 or bfloat16 tensor
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in LAYOUTS and x.dtype not in _NARROW:
        raise TypeError(f"{what} must be a float32, float64, float16 or bfloat16 tensor; got {x.dtype}")


def _check_narrow(dtype: torch.dtype, fmt: FloatFormat) -> None:
    def holds(outer):   # every value of fmt (overflow's too)
        return (fmt.man_bits <= outer.man_bits and fmt.e_max <= outer.e_max
                and fmt.e_min - fmt.man_bits >= outer.e_min - outer.man_bits)
    if dtype in _HOLDS and not holds(_HOLDS[dtype]):
        wider = "a float32 or float64 tensor" if holds(_HOLDS[torch.float32]) else "a float64 tensor"
        raise ValueError(f"format {fmt.name} has values that {dtype} cannot hold, so the result could not lie on "
                         f"the {fmt.name} grid; quantize {wider} instead")


def check_rand_bits(rand_bits: Optional[int]) -> None:   # None or an integer in 1..32
    if rand_bits is not None and (type(rand_bits) is not int or not 1 <= rand_bits <= 32):
        raise ValueError(f"rand_bits must be None (full resolution) or an integer in 1..32, got {rand_bits!r}")


@functools.lru_cache(maxsize=None)
def _cpu_cast_saturates(dtype: torch.dtype) -> bool:   # torch's CPU float8_e4m3fn cast (some versions give NaN)
    top = torch.finfo(dtype).max
    probe = torch.tensor([top * 1.04, top * 4, math.inf, -math.inf]).to(dtype).float()
    return probe.tolist() == [top, top, top, -top]


def _native_dtype(x: torch.Tensor, fmt: FloatFormat, overflow: str) -> Optional[torch.dtype]:
    """A torch dtype whose cast from ``x`` is this exact RNE with this overflow policy, or None: bfloat16 and float16
    everywhere, the float8 types on the CPU (where torch's cast is the same rounding), float32 from float64."""
    dtype = fmt.with_overflow(overflow).torch_dtype if overflow != fmt.overflow else fmt.torch_dtype
    if x.dtype == torch.float64 or dtype is None:
        return dtype if dtype == torch.float32 else None
    float8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if float8 and (x.device.type != "cpu" or (dtype == torch.float8_e4m3fn and not _cpu_cast_saturates(dtype))):
        return None
    return dtype


def _round(x: torch.Tensor, fmt: FloatFormat, rounding: str, generator: GeneratorLike, rand_bits: Optional[int],
           overflow: str, index_offset: int, inplace: bool) -> torch.Tensor:
    # the one dispatch of quantize and quantize_ (a float32 or float64 x)
    layout = LAYOUTS[x.dtype]
    if rounding == "stochastic":
        kernel = stochastic_bits
        p = round_params(fmt, overflow, rand_bits, draw_seed(generator), index_offset, layout).tensor(x.device, layout)
    else:
        native = _native_dtype(x, fmt, overflow)
        if native == x.dtype:  # the grid holds every value of x
            return x if inplace else x.clone()
        if native is not None:
            return x.copy_(x.to(native)) if inplace else x.to(native).to(x.dtype)
        kernel, p = nearest_bits, cached_tensor(round_params(fmt, overflow, layout=layout), layout.itype, x.device)
    if inplace:
        run(kernel, x.view(-1).view(layout.itype), p, inplace=True)
        return x
    return run(kernel, x.reshape(-1).view(layout.itype), p).view(x.dtype).view(x.shape)


def _checked(x: torch.Tensor, fmt, rounding: str, rand_bits: Optional[int], overflow: Optional[str],
             index_offset: int) -> tuple:   # the format and overflow policy of quantize and quantize_, checked
    fmt = get_format(fmt)
    check_tensor(x)
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {', '.join(ROUNDING_MODES)}; got {rounding!r}")
    check_rand_bits(rand_bits)
    _check_index_offset(index_offset)
    overflow = fmt.overflow if overflow is None else overflow
    check_overflow_policy(fmt, overflow)
    _check_narrow(x.dtype, fmt)
    return fmt, overflow


def quantize(x: torch.Tensor, fmt: Union[str, FloatFormat], rounding: str = "nearest",
             generator: GeneratorLike = None, rand_bits: Optional[int] = None,
             overflow: Optional[str] = None, index_offset: int = 0) -> torch.Tensor:
    """Round a float32, float64, float16 or bfloat16 tensor ``x`` (not modified, no gradient) onto the grid of ``fmt``
    (a name or a FloatFormat), ``rounding`` ``"nearest"`` or ``"stochastic"``: a new tensor of x's dtype and device.
    SR takes ``generator`` (:func:`draw_seed`), ``rand_bits`` k in 1..32 (None: full resolution) and ``index_offset``:
    element i (row-major) draws the bits of element ``index_offset + i`` (modulo 2**32), so that a shard rounded with
    its tensor's seed gets that tensor's bits. ``overflow`` overrides the format's policy.

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
    """:func:`quantize` in place, returning ``x``: the bits of ``x.copy_(quantize(x, ...))`` (a contiguous float32 or
    float64 tensor is rounded where it lies).

    Example:
        >>> quantize_(torch.tensor([1.0 + 2**-9, 3.0]), "e2m1").tolist()
        [1.0, 3.0]
    """
    fmt, overflow = _checked(x, fmt, rounding, rand_bits, overflow, index_offset)
    with torch.no_grad():
        if x.dtype in _NARROW or not x.is_contiguous():
            return x.copy_(quantize(x, fmt, rounding, generator, rand_bits, overflow, index_offset))
        return _round(x, fmt, rounding, generator, rand_bits, overflow, index_offset, True)
