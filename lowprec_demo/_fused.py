"""Fused kernels: rounding and the freeze rule in one pass over memory.

Eager PyTorch makes one pass over memory per operation, so exact rounding written as ten tensor
operations costs ten passes where a native cast costs two. Here each computation is one plain
PyTorch function of integer operations on float32 bit patterns, handed to ``torch.compile``
(inductor: C++ loops on the CPU, Triton on GPUs) so that it runs as one loop. Without the
compiler the same functions run eagerly, so the two paths compute the same bits by
construction (round to nearest may take torch's own cast instead, where that is the same
rounding); the eager code of :mod:`lowprec_demo.rounding` for float32 is these functions too.
``tests/test_rounding.py`` checks them against an exact reference, ``tests/test_bench.py`` the
compiled kernels against them on the exhaustive point sets of the exactness suite.

Integer arithmetic on bit patterns leaves nothing to the compiler's floating-point flags (inductor
compiles C++ with ``-fno-signed-zeros``; Triton divides approximately unless told otherwise):
rounding uses only integer operations, and the freeze statistics only exact floating-point ones
(subtraction, comparisons, multiplication by powers of two).

Bit patterns in and out
    The rounding kernels (:func:`rne_bits`, :func:`sr_bits`) take the int32 view of a float32
    tensor and give the bit patterns of the results; their callers view them as float32 on the
    way in and out (free: no copy). Inductor's CPU code moves a vector between float32 and
    int32 lanes through memory (a store, a loop over the lanes, a load; for AVX2 and AVX-512
    alike), so a kernel that loads floats and views them as integers pays that twice a vector:
    given the bit patterns, compiled round to nearest took 1.19 instead of 1.46 times torch's
    bf16 round trip on 16M elements, stochastic rounding 1.99 instead of 2.21 (a 2-core AMD
    EPYC at 2.0 GHz, one thread: ``benchmarks/cpu-2026-12-02-zen1-*``). Round to nearest is
    left with no such loop, stochastic rounding with one (its scaling factor).
    :func:`rne_fp32` and :func:`sr_fp32` are the same functions on float32 tensors.

Round to nearest (``rne_bits``)
    Write a non-negative float32 ``a`` as ``S * 2**(E' - 150)`` with ``E' = max(exponent field, 1)``
    and the integer significand ``S = bits - ((E' - 1) << 23)`` (the subnormals fit the same
    formula). The target grid's spacing is ``2**d`` units of ``S`` with
    ``d = 23 - m + max(e_min + 127 - E', 0)``. Rounding ``S`` to a multiple of ``2**d`` by integer
    arithmetic and adding back ``(E' - 1) << 23`` gives the bit pattern of the result (a carry runs
    into the exponent, as it should); for ``d >= 25`` the result is 0.

Stochastic rounding (``sr_bits``)
    With the same ``S`` and ``d``, ``frac = S mod 2**d`` is the position inside the gap in units of
    ``2**-d`` gaps. With k random bits (k = 32 is full resolution) and ``j = min(d, k)``, the
    position is resolved to j bits (``round_half_even(frac / 2**(d - j))``) and the value moves
    away from zero when the top j bits of the 32-bit hash of (seed, element index) are below it:
    probability ``round_half_even(frac * 2**k / 2**d) / 2**k``, which is the exact ``frac / 2**d``
    whenever ``d <= k``. The hash is :func:`hash32` (:func:`lowprec_demo.rounding.random_bits`
    gives the same bits). (Tensors of 2**31 elements or more take the eager path of ``rounding``.)

Freeze statistics (``freeze_code_fp32``, counted by :func:`lowprec_demo.prediction.count_freezes`)
    For a reference update ``new - old``: the freeze rule of
    :func:`lowprec_demo.rounding.would_freeze`, the SR move probability ``min(1, |d|/gap)``, the
    few-bit freeze, and the bin of ``log2(|d|/gap)`` (bins given by their edges, those of
    :data:`lowprec_demo.prediction.RATIO_BINS`), packed into one byte per element, and the sum
    of the move probabilities. The stored weight ``q(old)`` is rounded by ``rne_bits``' own
    formula on magnitudes (:func:`_rne_magnitude`). The counts come from
    :func:`torch.bincount` of the bytes, which stalls when long runs of elements share a code
    (each increment waits for the one before): without the few-bit flag the kernel lays the
    bytes out so that two neighbours read as one int16 entry and consecutive entries alternate
    between two counters (:func:`pair_pattern`). Its arguments ``infinite_gap`` and
    ``one_factor`` (:func:`gap_options`, from the format) leave out work a format does not
    need: the division by the gap takes two scaling factors for bf16 (whose smallest gaps are
    below 2**-127) and one for fp16 and the 8-bit formats, and only formats without mantissa
    bits have an infinite gap (at inf); ``torch.compile`` makes one version of the kernel per
    setting. A pack of a model's small tensors (:mod:`lowprec_demo._packing`) takes another
    layout (``"bytes"``: one code per entry, 256 bins, lanes alternating element by element)
    and counts its frozen elements per block of 64 (:func:`frozen_blocks_u8`;
    :func:`changed_blocks_fp32` counts the changed ones for the observer), each tensor of the
    pack starting at a block's start.

When is the compiled version used?
    ``LOWPREC_FUSED`` (environment) or :func:`set_mode`: ``"off"`` never, ``"on"`` for every
    tensor of 2 or more elements, ``"auto"`` (default) once a kernel's eager work, this call
    included, reaches :data:`EAGER_BUDGET` elements (a single call that large compiles at
    once). Compiling every kernel costs 6-13 s once per process on the CPUs of the stored
    benchmarks (the lower figure once inductor's disk cache is warm), and up to 90 s on the
    slowest of them with that cache empty (14 s with it full). The eager functions, run in
    slices of :data:`EAGER_CHUNK` elements, cost about 10 (round to nearest) to 20
    (stochastic rounding) ns an element more than the compiled ones on the faster CPUs, 17
    and 34 on the slowest (the benchmark's cold-path table), so compiling pays
    after about 2**28 to 2**31 elements; the budget leans toward compiling early: a chapter that
    rounds a few tensors never waits for it, a GPT-2 step compiles at once. If compiling
    fails (no C++ compiler, an unsupported platform), the same functions run eagerly from
    then on and :func:`status` says why; it also counts the calls that ran each way.

Example:
    >>> import torch
    >>> from lowprec_demo.formats import get_format
    >>> p = nearest_params(get_format("e4m3"), "saturate")
    >>> rne_fp32(torch.tensor([1.06, 500.0]), torch.tensor(p, dtype=torch.int32)).tolist()
    [1.0, 448.0]
"""

from __future__ import annotations

import functools
import os
import struct
import sys
import time
from typing import Dict, Optional, Sequence

import torch

from .formats import FloatFormat

__all__ = ["status", "set_mode", "get_mode", "compile_all", "nearest_params", "stochastic_params",
           "freeze_params", "ratio_bin_params", "seed_words", "hash32", "rne_bits", "rne_fp32", "sr_bits", "sr_fp32",
           "freeze_code_fp32",
           "gap_options", "one_factor_gaps", "pair_pattern", "equal_count_fp32", "nearest", "nearest_",
           "stochastic", "stochastic_", "freeze_code", "equal_count",
           "changed_blocks_fp32", "frozen_blocks_u8", "changed_blocks", "frozen_blocks", "fits", "MODES",
           "BLOCK"]

MODES = ("auto", "on", "off")
EAGER_BUDGET = 1 << 27         # "auto": compile once a kernel's eager work would reach this many elements
MIN_NUMEL = 2                  # torch.compile specialises sizes 0 and 1: keep those eager
MAX_NUMEL = (1 << 31) - 1      # int32 element indices: larger tensors take the eager float64-style path

_INT32_MIN = -(1 << 31)
_INF_BITS = 0x7F800000
_NAN_BITS = 0x7FC00000
_HALF_BITS = 0x3F000000
_M32 = 0xFFFFFFFF
_NO_BIN = 63                   # the bin field of a NaN ratio: counted nowhere


def _f32_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


# ------------------------------------------------------------------------------------------------
# parameters: everything about the format, policy and seed as integers (a tensor, so that one
# compiled kernel serves every format and seed without recompiling)
# ------------------------------------------------------------------------------------------------
def _overflow_bits(fmt: FloatFormat, policy: str) -> int:
    return {"inf": _INF_BITS, "saturate": _f32_bits(fmt.max), "nan": _NAN_BITS}[policy]


def nearest_params(fmt: FloatFormat, policy: Optional[str]) -> list:
    """``[m, e_min + 127, bits of max, bits of the overflow value]`` for :func:`rne_fp32`;
    policy None: the grid continued above max (up to float32's own overflow to inf)."""
    if policy is None:
        return [fmt.man_bits, fmt.e_min + 127, _INF_BITS, _INF_BITS]
    return [fmt.man_bits, fmt.e_min + 127, _f32_bits(fmt.max), _overflow_bits(fmt, policy)]


def stochastic_params(fmt: FloatFormat, policy: str, rand_bits: Optional[int], seed: int) -> list:
    """``[m, e_min + 127, k, bits of max, overflow bits, bits of the smallest subnormal, the two
    seed words as int32, index of the first element]`` for :func:`sr_fp32`; k = 32 for full
    resolution."""
    k = 32 if rand_bits is None else rand_bits
    s1, s2 = seed_words(seed)
    return [fmt.man_bits, fmt.e_min + 127, k, _f32_bits(fmt.max), _overflow_bits(fmt, policy),
            _f32_bits(fmt.smallest_subnormal), s1, s2, 0]


def freeze_params(fmt: FloatFormat, rand_bits: Optional[int], edges: Sequence[int]) -> list:
    """``[m, e_min + 127, bits of max, overflow bits, stuck bits, bits of 2**-(k+1), k, stuck
    limit]`` and the two numbers of :func:`ratio_bin_params` for :func:`freeze_code_fp32` (the
    format's own overflow policy; k = 0 when there is no few-bit prediction; ``edges`` the
    histogram's bin edges). The stuck weight is the one every outward update leaves in place:
    the max where the format saturates, inf where it overflows to inf (-1: none, as with NaN);
    the stuck limit is the bits of inf where any finite update leaves it in place (inf), else 0."""
    k = 0 if rand_bits is None else rand_bits
    stuck = {"saturate": _f32_bits(fmt.max), "inf": _INF_BITS, "nan": -1}[fmt.overflow]
    return [fmt.man_bits, fmt.e_min + 127, _f32_bits(fmt.max), _overflow_bits(fmt, fmt.overflow),
            stuck, (127 - k - 1) << 23, k, _INF_BITS if fmt.overflow == "inf" else 0] + ratio_bin_params(edges)


def ratio_bin_params(edges: Sequence[int]) -> list:
    """``[127 + edges[0], len(edges)]``: the bins of ``log2(|d|/gap)`` as the freeze kernel
    computes them, for edges that are consecutive integers (such as
    :data:`lowprec_demo.prediction.RATIO_BINS`). ``bucketize(log2 r, edges)`` is then
    ``ceil(log2 r) - edges[0]``, clamped to ``0..len(edges)``: the biased exponent of ``r``
    rounded up, less the first number. The bins must fit in the code's 6 bits, the last value
    (63) left for NaN.

    Example:
        >>> ratio_bin_params(range(-24, 9))
        [103, 33]
    """
    edges = [int(e) for e in edges]
    if not edges or edges != list(range(edges[0], edges[0] + len(edges))):
        raise ValueError(f"the ratio bins' edges must be consecutive integers; got {edges}")
    if len(edges) >= _NO_BIN or not -126 <= edges[0] <= 127 - len(edges):
        raise ValueError(f"{len(edges) + 1} bins from {edges[0]} do not fit the freeze code")
    return [127 + edges[0], len(edges)]


def seed_words(seed: int, stream: int = 0) -> tuple:
    """The two 32-bit words that :func:`hash32` mixes in for a 64-bit seed and a stream
    number, as int32 values (patterns of 2**31 and more read as negative)."""
    words = seed & _M32, ((seed >> 32) ^ (0x9E3779B9 * (stream + 1))) & _M32
    return tuple(w - (1 << 32) if w >= 1 << 31 else w for w in words)


# ------------------------------------------------------------------------------------------------
# the kernels: plain PyTorch functions, run compiled or eagerly
# ------------------------------------------------------------------------------------------------
_EAGER_CONSTANTS: Dict[tuple, torch.Tensor] = {}


def _k(value, like: torch.Tensor):
    """The int32 constant ``value`` for an operation with ``like``: compiled, the number itself;
    eagerly a 0-dim int32 tensor on like's device, made once (torch converts a Python number to
    a tensor anew on every operation, which costs a third of an integer operation's time on a
    slice of 128K elements on a CPU). A tensor is returned as it is."""
    if torch.compiler.is_compiling() or not isinstance(value, int):
        return value
    key = (value, like.device)
    t = _EAGER_CONSTANTS.get(key)
    if t is None:
        t = _EAGER_CONSTANTS[key] = torch.tensor(value, dtype=torch.int32, device=like.device)
    return t


def _shift_xor_(h: torch.Tensor) -> torch.Tensor:
    """``h ^= h >>> 16`` in place, the logical shift made of an arithmetic one and a mask."""
    t = h >> _k(16, h)
    t &= _k(0xFFFF, h)
    h ^= t
    return h


def _mix32_(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply, multiplier 0x45d9f3b), bijective on
    32-bit patterns held in int32 lanes, applied to ``h`` in place (products wrap modulo 2**32)."""
    _shift_xor_(h).mul_(_k(0x45D9F3B, h))
    _shift_xor_(h).mul_(_k(0x45D9F3B, h))
    return _shift_xor_(h)


def hash32(index: torch.Tensor, s1, s2) -> torch.Tensor:
    """The 32 random bits of element ``index`` (int32 lanes, read as unsigned) for the seed
    words ``s1, s2`` of :func:`seed_words` (as int32): the one hash of the package, behind
    :func:`sr_fp32` and :func:`lowprec_demo.rounding.random_bits`."""
    return _hash32_(index.clone(), s1, s2)


def _hash32_(h: torch.Tensor, s1, s2) -> torch.Tensor:
    """:func:`hash32` of the indices ``h``, written over them."""
    h ^= s1
    _mix32_(h)
    h ^= s2
    return _mix32_(h)


# Eager speed. Run eagerly, each tensor operation is one pass over its slice (see _sliced), so
# the kernels are written to make those passes cheap without changing what they compute (the
# compiler makes one loop of them either way): operations on the kernel's own temporaries are
# in place (``t &= m``: memory already in the cache, where a new tensor's is not), constants
# are 0-dim tensors (:func:`_k`), and conditions are int32 masks of bits (-1 or 0) instead of
# bool tensors, because torch's eager comparisons and ``where`` cost about 3 and 18 times an
# integer ``^``; compiled, comparisons and ``where`` are the faster. The kernels below are
# written once with these four helpers.
def _above(a: torch.Tensor, b, own: bool = False) -> torch.Tensor:
    """The condition ``a > b``, for int32 values in 0 .. 2**31 - 1 (eagerly ``(b - a) >> 31``:
    their difference cannot overflow); ``own``: ``a`` is a temporary not needed after, and
    eagerly the condition is written over it."""
    if torch.compiler.is_compiling():
        return a > b
    b = _k(b, a)
    t = a.neg_().add_(b) if own else b - a
    t >>= _k(31, a)
    return t


def _condition(cond: torch.Tensor) -> torch.Tensor:
    """A bool tensor as a condition (eagerly a mask of bits)."""
    return cond if torch.compiler.is_compiling() else cond.to(torch.int32).neg_()


def _select(cond: torch.Tensor, a, b: torch.Tensor) -> torch.Tensor:
    """``a`` where the condition holds, else ``b`` (int32; ``b`` a tensor as long as ``cond``)."""
    if torch.compiler.is_compiling():
        return torch.where(cond, a, b)
    t = _k(a, b) ^ b
    t &= cond
    t ^= b
    return t


def _keep(cond: torch.Tensor, a, own: bool = False) -> torch.Tensor:
    """``a`` where the condition holds, else 0 (int32); ``own``: the condition is a temporary
    not needed after (eagerly the result is written over it)."""
    if torch.compiler.is_compiling():
        return torch.where(cond, a, 0)
    return cond.__iand__(a) if own else cond & a


def _decompose(u: torch.Tensor, man_bits, emin_b):
    """For non-negative float32 bit patterns ``u``: ``(E' - 1) << 23``, the integer significand
    ``S`` and the number ``d`` of its low bits below the target grid's spacing."""
    e = (u >> _k(23, u)).clamp_(min=1)
    d = (emin_b - e).clamp_(min=0)
    d += 23 - man_bits
    e -= _k(1, u)
    e <<= _k(23, u)
    return e, u - e, d


def _repack(out: torch.Tensor, sign: torch.Tensor, nan: torch.Tensor, max_bits, over_bits) -> torch.Tensor:
    """Magnitude bits ``out`` as the bits of the result: beyond the format's max the overflow
    value, NaN where the condition ``nan`` holds (the input was NaN), the input's sign."""
    out = _select(nan, _NAN_BITS, _select(_above(out, max_bits), over_bits, out))
    out |= sign
    return out


def rne_bits(bits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even of float32 values given as their bit patterns (int32) onto the grid
    that ``p`` (int32, :func:`nearest_params`) describes, with its overflow policy, returning
    the bit patterns of the results; the sign (of zero too) is kept and NaN stays NaN.
    (:func:`rne_fp32` is the same on float32 tensors.)"""
    u = bits & _k(0x7FFFFFFF, bits)
    nan = _above(u, _INF_BITS)
    out = _select(nan, _NAN_BITS, _rne_magnitude(_keep(~nan, u), p[0], p[1], p[2], p[3]))  # (a NaN's magnitude as 0)
    out |= bits & _k(_INT32_MIN, bits)
    return out


def rne_fp32(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """:func:`rne_bits` of a float32 tensor, as float32."""
    return rne_bits(x.view(torch.int32), p).view(torch.float32)


def sr_bits(bits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of a flat tensor of float32 values given as their bit patterns (int32;
    fewer than 2**31 elements) onto the grid that ``p`` (int32, :func:`stochastic_params`)
    describes, returning the bit patterns of the results; element i draws the hash of (seed, i).
    The value moves away from zero when the top ``j = min(d, k)`` bits of the 32-bit hash ``r``
    are below the position in the gap resolved to j bits, ``P``: compared as the unsigned
    32-bit numbers ``r < P * 2**(32 - j)``, with ``P = 2**j`` (a position rounded up to the
    whole gap) always moving. (:func:`sr_fp32` is the same on float32 tensors.)"""
    man_bits, emin_b, k, max_bits, over_bits, tiny_bits, s1, s2, first = (p[i] for i in range(9))
    u = bits & _k(0x7FFFFFFF, bits)         # (a NaN goes through the arithmetic and is replaced)
    top, s, d = _decompose(u, man_bits, emin_b)
    dd = torch.clamp(d, max=25)
    down = (s >> dd) << dd                  # S rounded down to the grid
    frac = s - down                         # S mod 2**d, below 2**24: exact as a float32
    j = torch.clamp(d, max=k)
    # P = round_half_even(frac * 2**(j - d)): frac itself when d <= k; at 2**-30 and below the
    # product is below 1/64 and rounds to 0 either way
    scale = (j - d).clamp_(min=-30)
    scale += _k(127, bits)
    scale <<= _k(23, bits)
    position = frac.to(torch.float32)
    position *= scale.view(torch.float32)
    position = position.round_().to(torch.int32)
    r = torch.arange(bits.numel(), dtype=torch.int32, device=bits.device)
    r += first
    r = _hash32_(r, s1, s2)
    # P * 2**(32 - j) modulo 2**32 (j = 0 only with P = 0); shift counts stay below 32 (Triton
    # leaves larger ones undefined). move: where the value moves away from zero
    threshold = position << (_k(32, bits) - j).clamp_(max=31)
    r ^= _k(_INT32_MIN, bits)
    threshold ^= _k(_INT32_MIN, bits)
    move = _above(position >> j.clamp_(max=31), 0, own=True)
    move |= _condition(r < threshold)      # unsigned r < threshold
    down += _keep(move, _k(1, bits) << dd.clamp_(max=24))
    down += top
    # d >= 24: the value is below the smallest subnormal step: 0 or that step
    out = _select(_above(d, 23, own=True), _keep(move, tiny_bits, own=True), down)
    return _repack(out, bits & _k(_INT32_MIN, bits), _above(u, _INF_BITS, own=True), max_bits, over_bits)


def sr_fp32(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """:func:`sr_bits` of a flat float32 tensor, as float32."""
    return sr_bits(x.view(torch.int32), p).view(torch.float32)


def freeze_code_fp32(old: torch.Tensor, new: torch.Tensor, p: torch.Tensor, out: torch.Tensor,
                     pattern: Optional[torch.Tensor] = None, fewbit: bool = True, infinite_gap: bool = True,
                     one_factor: bool = False) -> torch.Tensor:
    """The codes of :func:`_freeze_code` (its ``fewbit``, ``infinite_gap`` and ``one_factor``
    as given: Python values, on which ``torch.compile`` specialises) written into ``out``, one
    per element, laid out as ``pattern`` says; returns the sum of the move probabilities
    (float64, 0-dim).

    ``pattern`` None
        The code itself (``out`` uint8).
    ``pattern`` int32 (tags)
        The code or-ed with the tag (``out`` int32): the index of the element's tensor in a
        pack, shifted left by 8, so that one bincount counts the codes of every tensor of the
        pack. (int32 throughout: inductor's CPU code handles int16 lane by lane.)
    ``pattern`` uint8 (:func:`pair_pattern`, with ``fewbit=False``)
        Two neighbours read as one int16 (little-endian) make one :func:`torch.bincount`
        entry: half as many entries, and consecutive entries alternate between two counters
        where the codes repeat (a run of equal codes otherwise makes every increment wait for
        the one before). With ``c = frozen | bin << 1`` (below 128), element ``i`` holds
        ``c << 1 | ((i >> 1) & 1)`` when ``i`` is even and ``c`` when it is odd, so that the
        int16 is not negative: the pattern holds ``1 | ((i >> 1) & 1) << 1`` for even ``i``
        and 0 for odd ones (read from memory: inductor's CPU code builds an element index lane
        by lane, which costs more). The ``"bytes"`` pattern lays out one code per entry."""
    code, moved = _freeze_code(old, new, p, fewbit=fewbit, infinite_gap=infinite_gap, one_factor=one_factor)
    if pattern is None:
        out.copy_(code.to(torch.uint8))
    elif pattern.dtype == torch.int32:
        out.copy_(code | pattern)
    else:
        layout = pattern.to(torch.int32)
        out.copy_(((code << (layout & 1)) | (layout >> 1)).to(torch.uint8))
    return moved


def one_factor_gaps(fmt: FloatFormat) -> bool:
    """Whether ``1/gap`` is a normal float32 for every gap of the format, inf's included
    (biased gap exponents 0..253): ``m >= 2`` and ``e_min - m >= -127``."""
    return fmt.man_bits >= 2 and fmt.e_min - fmt.man_bits >= -127


def gap_options(fmt: FloatFormat) -> dict:
    """The ``infinite_gap`` and ``one_factor`` arguments of :func:`freeze_code_fp32` for the
    format: the infinite gap at inf only without mantissa bits, the division by the gap with
    one factor where :func:`one_factor_gaps` allows it.

    Example:
        >>> from lowprec_demo.formats import get_format
        >>> gap_options(get_format("bf16")), gap_options(get_format("e4m3"))
        ({'infinite_gap': False, 'one_factor': False}, {'infinite_gap': False, 'one_factor': True})
    """
    if not fmt.man_bits:
        return {"infinite_gap": True, "one_factor": False}
    return {"infinite_gap": False, "one_factor": one_factor_gaps(fmt)}


_PATTERNS: Dict[tuple, torch.Tensor] = {}


def pair_pattern(n: int, device, layout: str = "paired") -> torch.Tensor:
    """The layout bytes of :func:`freeze_code_fp32` for ``n`` elements: a view of one
    tensor per device and layout, kept and grown to the longest asked for. ``"paired"``: two
    codes per int16 bincount entry (see there); ``"bytes"``: every element holds
    ``c << 1 | (i & 1)`` (the pattern ``1 | (i & 1) << 1``), one uint8 bincount entry each,
    consecutive entries alternating between two counters: for packs of small tensors, whose
    counts then fit in 256 bins instead of 32768."""
    if layout not in ("paired", "bytes"):
        raise ValueError(f"layout must be 'paired' or 'bytes'; got {layout!r}")
    pattern = _PATTERNS.get((device, layout))
    if pattern is None or pattern.numel() < n:
        i = torch.arange(max(n, 1 << 16), dtype=torch.int32, device=device)
        if layout == "paired":
            even = (i & 1) ^ 1
            pattern = (even | (((i >> 1) & 1) & even) << 1).to(torch.uint8)
        else:
            pattern = (1 | (i & 1) << 1).to(torch.uint8)
        _PATTERNS[(device, layout)] = pattern
    return pattern[:n]


def _rne_magnitude(u: torch.Tensor, man_bits, emin_b, max_bits, over_bits) -> torch.Tensor:
    """Round to nearest even of non-negative float32 bit patterns ``u`` (at most those of
    infinity) onto the grid, beyond the format's max the overflow value: the significand ``S``
    of :func:`_decompose` rounded to a multiple of ``2**d`` by ml_dtypes' bias expression
    (add ``2**(d-1) - 1`` plus the last kept bit, clear the low ``d`` bits; nothing when
    ``d = 0``), and ``(E' - 1) << 23`` added back, so that a carry runs into the exponent. For
    ``d >= 25`` every significand (below ``2**24``) rounds to 0."""
    top, s, d = _decompose(u, man_bits, emin_b)
    d.clamp_(max=25)
    half = _k(1, u) << d
    half >>= _k(1, u)
    bias = s >> d
    bias &= torch.clamp(half, max=1)        # the last kept bit, for ties (none when d = 0)
    bias += half
    bias -= _k(1, u)
    s += bias.clamp_(min=0)
    s >>= d
    s <<= d
    out = _keep(_above(s, 0), top.add_(s))  # a rounded significand of 0: the magnitude is 0
    return _select(_above(out, max_bits), over_bits, out)


def _freeze_code(old: torch.Tensor, new: torch.Tensor, p: torch.Tensor, fewbit: bool = True,
                 infinite_gap: bool = True, one_factor: bool = False):
    """The freeze statistics of the update ``new - old`` (float32) for the format ``p``
    (int32, :func:`freeze_params`) describes, as :class:`lowprec_demo.prediction.FreezePredictor`
    defines them: the stored weight is ``w = q(old)`` (round to nearest) and ``d = new - old``.

    Returns ``(code, moved)``: ``code`` (int32, one per element, below 256) holds in bit 0 whether the
    element freezes (:func:`lowprec_demo.rounding.would_freeze`), in bit 1 whether ``|d|/gap``
    is at most ``2**-(k+1)`` (few-bit SR never moves it) and in bits 2-7 the bin of
    ``log2(|d|/gap)`` (as ``bucketize`` with the edges of :func:`ratio_bin_params`: 0..33 for
    edges -24..8; ratio 0 in bin 0; 63 for NaN); with ``fewbit=False`` there is no few-bit
    flag and the bin sits in bits 1-6.
    ``moved`` (float64, 0-dim) is the sum of the move probabilities ``min(1, |d|/gap)``, with k
    random bits resolved to k bits, and 0 for a stuck weight, as
    :func:`lowprec_demo.rounding.move_probability` gives them (``fewbit=False``: full resolution).
    ``infinite_gap=False`` leaves out the gap at inf of a format without mantissa bits (the
    only infinite gap): for formats with m >= 1. ``one_factor=True`` divides by the gap with
    one multiplication: for formats whose every gap lies between 2**-127 and 2**126 (m >= 2 and
    ``e_min - m >= -127``, :func:`one_factor_gaps`), where the second factor is 1.

    Everything is decided on bit patterns: NaN and infinity (``torch.isnan`` and friends
    compile to a loop over lanes on the CPU), signs, and the freeze rule itself, read off the
    exactly computed ratio ``|d|/gap`` (below 1/2, or 1/2 at an even multiple of the gap).
    ``w`` is needed as its magnitude only (its sign is that of ``old``), and not at all when
    ``old`` is NaN (then ``d`` is NaN, and a NaN update never freezes); a weight that
    overflowed to NaN never freezes either."""
    man_bits, emin_b, stuck_bits, fewbit_bits, stuck_limit = p[0], p[1], p[4], p[5], p[7]
    ob = old.view(torch.int32)
    wu = _rne_magnitude(torch.clamp(ob & 0x7FFFFFFF, max=_INF_BITS), man_bits, emin_b, p[2], p[3])
    d = new - old
    db = d.view(torch.int32)
    du = db & 0x7FFFFFFF
    opposite = (ob ^ db) < 0                # w and d point different ways (w has old's sign)
    # the gap on d's side of w (lowprec_demo.rounding._side_gap): toward zero from a power of two
    # (inf included) the grid below is twice as fine. (A zero d needs no gap: its ratio is 0.)
    inward = opposite & ((wu & 0x7FFFFF) == 0) & (wu != 0)
    ew = wu >> 23
    gap_exp = torch.clamp(ew - inward.to(torch.int32), min=emin_b) - man_bits   # biased exponent of the gap
    # |d| / gap by multiplication with 2**-g, split in two normal factors when 2**-g is beyond
    # float32's normal range (both factors >= 1 when it is large, so the product rounds once;
    # only ratios below 2**-126 can round twice, and they stay below every threshold here); an
    # infinite gap (m = 0 at inf) gives 0 or NaN, as the division does
    if one_factor:
        scales = [((254 - gap_exp) << 23).view(torch.float32)]
    else:
        neg_g = 127 - gap_exp               # -128..149
        first = torch.clamp(neg_g, min=-126, max=127)
        scales = [((first + 127) << 23).view(torch.float32), ((neg_g - first + 127) << 23).view(torch.float32)]
    ratio = d.abs()
    for scale in scales:
        ratio = ratio * scale
    if infinite_gap:
        ratio = torch.where(gap_exp >= 255, torch.where(du < _INF_BITS, 0.0, float("nan")), ratio)
    rb = ratio.view(torch.int32)
    # would_freeze: |d| below half a gap, or exactly half with w an even multiple of the gap.
    # |w| / gap, an integer of at most 25 bits, comes exactly from the same two factors (the
    # first product is normal, or 0: |w| >= gap or w = 0); it is even when its half is whole.
    # (At inf the half is inf and counts as even: a finite update leaves inf in place anyway.)
    half_multiple = wu.view(torch.float32)
    for scale in scales:
        half_multiple = half_multiple * scale
    half_multiple = half_multiple * 0.5
    frozen = (rb < _HALF_BITS) | ((rb == _HALF_BITS) & (torch.round(half_multiple) == half_multiple))
    # the stuck weight (saturated max, or inf) stays under an outward update; inf under any finite
    # one: frozen, and stochastic rounding cannot move it either
    stuck = (wu == stuck_bits) & (~opposite | (du < stuck_limit))
    frozen = frozen | stuck
    frozen = frozen & (torch.maximum(wu, du) <= _INF_BITS)                 # NaN never (w: "nan" overflow)
    # log2(ratio) rounded up (a nonzero mantissa carries into the exponent), less the first
    # edge: the bin of bucketize(log2 ratio, edges)
    bin_ = torch.minimum(torch.clamp(((rb + 0x7FFFFF) >> 23) - p[8], min=0), p[9])
    bin_ = torch.where(rb > _INF_BITS, _NO_BIN, bin_)
    probability = torch.where(stuck, 0.0, torch.clamp(ratio, max=1.0))
    if not fewbit:   # no few-bit flag: the bin right above the frozen bit
        return frozen.to(torch.int32) | (bin_ << 1), probability.to(torch.float64).sum()
    code = frozen.to(torch.int32) | ((rb <= fewbit_bits).to(torch.int32) << 1) | (bin_ << 2)
    k = p[6]                                # 2**k and 2**-k as bit patterns (k <= 32)
    resolved = torch.round(probability * ((k + 127) << 23).view(torch.float32)) * ((127 - k) << 23).view(torch.float32)
    probability = torch.where(k > 0, resolved, probability)
    moved = probability.to(torch.float64).sum()
    return code, moved


def equal_count_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many elements of ``a`` equal those of ``b`` (``a == b`` as floats compare: NaN never,
    +0 and -0 always), as an int64 0-dim tensor, in one pass that writes nothing."""
    return torch.where(a == b, 1, 0).sum()


BLOCK = 64                  # in a pack of several tensors, each starts at a multiple of this many elements


def changed_blocks_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many elements differ (``a == b`` false as floats compare: NaN always, +0 and -0
    never) in each block of :data:`BLOCK` consecutive elements of two flat float32 tensors whose
    length is a multiple of it, as float32 (exact: at most 64). One pass that writes one number
    per block (a float sum: inductor's CPU code vectorizes it, an integer one it does not)."""
    return torch.where(a.view(-1, BLOCK) == b.view(-1, BLOCK), 0.0, 1.0).sum(1)


def frozen_blocks_u8(codes: torch.Tensor) -> torch.Tensor:
    """How many elements freeze in each block of :data:`BLOCK` codes written by
    :func:`freeze_code_fp32` in the ``"bytes"`` layout (the frozen flag in bit 1), as
    float32 (exact)."""
    return ((codes.to(torch.int32) >> 1) & 1).to(torch.float32).view(-1, BLOCK).sum(1)


def _rne_bits_(bits: torch.Tensor, p: torch.Tensor) -> None:
    bits.copy_(rne_bits(bits, p))


def _sr_bits_(bits: torch.Tensor, p: torch.Tensor) -> None:
    bits.copy_(sr_bits(bits, p))


# ------------------------------------------------------------------------------------------------
# running a kernel: compiled when asked or when the work pays for it, else the same function eagerly
# ------------------------------------------------------------------------------------------------
EAGER_CHUNK = 1 << 18   # eagerly, tensors go in slices this long (the fastest of 2**16 .. 2**19 here)


@functools.cache
def _keep_freed_memory() -> None:
    """Let the C allocator keep the slices' freed temporaries, once per process. glibc's malloc
    gives memory freed at the top of its heap back to the system once there is more of it than
    a threshold (128 KB at first, then twice the largest block it mapped on its own and has
    freed), so that the next slice takes a page fault for every 4 KB of it that it writes (a
    third of the eager time here). Mapping and freeing one 16 MB block raises the threshold to
    32 MB, as in any process that has freed a tensor of that size; other allocators ignore it."""
    block = torch.empty(1 << 22, dtype=torch.int32)
    del block


def _sliced(fn, args: tuple, first: Optional[int] = None, options: Optional[dict] = None):
    """``fn(*args, **options)`` run eagerly slice by slice: every tensor argument as long as the
    first one sliced alike, the others whole; with ``first``, the parameter tensor (the last
    argument) told at that position where each slice starts. Each returned tensor as long as
    its slice goes straight into one output tensor (while the slice is still in the cache),
    others are concatenated and 0-dim ones (sums) added in slice order: the bits of one call."""
    n = args[0].numel()
    options = options or {}
    if n <= EAGER_CHUNK:
        return fn(*args, **options)
    _keep_freed_memory()
    outs, pieces, single = None, None, False
    for start in range(0, n, EAGER_CHUNK):
        sliced = [a[start:start + EAGER_CHUNK] if torch.is_tensor(a) and a.dim() and a.numel() == n else a
                  for a in args]
        if first is not None:
            sliced[-1] = sliced[-1].clone()
            sliced[-1][first] += start
        part = fn(*sliced, **options)
        if part is None:
            continue
        single = not isinstance(part, tuple)
        part = (part,) if single else part
        length = sliced[0].numel()
        if outs is None:
            outs = [torch.empty(n, dtype=t.dtype, device=t.device) if t.dim() and t.numel() == length
                    else None for t in part]
            pieces = [[] for _ in part]
        for i, t in enumerate(part):
            if outs[i] is not None:
                outs[i][start:start + length].copy_(t)
            else:
                pieces[i].append(t)
    if outs is None:
        return None
    joined = [o if o is not None else (sum(ps) if ps[0].dim() == 0 else torch.cat(ps)) for o, ps in zip(outs, pieces)]
    return joined[0] if single else tuple(joined)


class _Kernel:
    """A kernel function with its compiled versions (``torch.compile``, one per device type,
    which makes one version per setting of the keyword options a call passes and per dtypes of
    its arguments: a variant), the time the first compiled call of each variant took, the calls
    that ran each way and why compiling failed, if it did. In mode ``"auto"`` each variant
    counts its own eager work. ``first``: where its parameters hold the index of the first
    element."""

    def __init__(self, fn, name: str, first: Optional[int] = None) -> None:
        self.fn, self.name, self.first = fn, name, first
        self.compiled: Dict[str, object] = {}
        self.variants: Dict[tuple, float] = {}   # (device type, options, dtypes): seconds of the first compiled call
        self.failed: Dict[str, str] = {}
        self.eager_numel: Dict[tuple, int] = {}
        self.calls = {"compiled": 0, "eager": 0}

    def __call__(self, *args, eager=None, **options):
        """Compiled when the mode says so, else ``eager()`` (by default the function itself)."""
        n, device = args[0].numel(), args[0].device.type
        # what torch.compile makes a version for: the options and the arguments' dtypes
        variant = (device, tuple(options.items()), tuple(getattr(a, "dtype", a) for a in args))
        mode = _state["mode"]
        if (mode != "off" and n >= MIN_NUMEL and device not in self.failed
                and (mode == "on" or variant in self.variants or self.eager_numel.get(variant, 0) + n > EAGER_BUDGET)):
            try:
                start = time.perf_counter()
                with torch.no_grad():   # one grad mode: no recompiling for callers with grad on
                    out = self.compiled_call(device)(*args, **options)
                if variant not in self.variants:
                    self.variants[variant] = time.perf_counter() - start
                self.calls["compiled"] += 1
                return out
            except Exception as error:  # no compiler, unsupported platform...: eagerly from now on
                lines = str(error).strip().splitlines()
                self.failed[device] = f"{type(error).__name__}: {lines[0][:300] if lines else ''}"
                self.compiled.pop(device, None)
        self.eager_numel[variant] = self.eager_numel.get(variant, 0) + n
        self.calls["eager"] += 1
        return _sliced(self.fn, args, self.first, options) if eager is None else eager()

    def compiled_call(self, device_type: str):
        """The compiled function for the device type, made (not yet compiled) on first use."""
        fn = self.compiled.get(device_type)
        if fn is None:
            fn = self.compiled[device_type] = torch.compile(self.fn, dynamic=True, fullgraph=True)
        return fn

    def compile_seconds(self) -> Dict[str, float]:
        """Per device type, the time the first compiled call of every setting took, summed."""
        seconds: Dict[str, float] = {}
        for (device, _, _), t in self.variants.items():
            seconds[device] = seconds.get(device, 0.0) + t
        return seconds


def _env_mode() -> str:
    mode = os.environ.get("LOWPREC_FUSED", "auto").strip().lower()
    return {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}.get(
        mode, mode if mode in MODES else "auto")


_state = {"mode": _env_mode()}
_KERNELS = {
    # the rounding kernels take and give bit patterns (see "Bit patterns in and out" above)
    "nearest": _Kernel(rne_bits, "nearest"),
    "nearest_": _Kernel(_rne_bits_, "nearest_"),
    "stochastic": _Kernel(sr_bits, "stochastic", first=8),
    "stochastic_": _Kernel(_sr_bits_, "stochastic_", first=8),
    # five variants (see freeze_code): torch.compile keeps at most eight versions of a function
    # (torch._dynamo.config.recompile_limit), and the kernels are called without grad, so that
    # a caller's grad mode does not double them
    "freeze": _Kernel(freeze_code_fp32, "freeze"),
    "equal_count": _Kernel(equal_count_fp32, "equal_count"),
    "changed_blocks": _Kernel(changed_blocks_fp32, "changed_blocks"),
    "frozen_blocks": _Kernel(frozen_blocks_u8, "frozen_blocks"),
}


def set_mode(mode: str) -> str:
    """Choose when compiled kernels are used: ``"auto"``, ``"on"`` or ``"off"``; returns the
    previous mode. The results are the same bits in every mode.

    Example:
        >>> previous = set_mode("off"); set_mode(previous)
        'off'
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    previous, _state["mode"] = _state["mode"], mode
    return previous


def get_mode() -> str:
    """The current mode (see :func:`set_mode`)."""
    return _state["mode"]


def status() -> dict:
    """Which kernels are compiled (per device type), how long their first call took, how many
    calls ran compiled and eagerly, and why compilation failed, if it did.

    Example: ``status()["mode"]`` -> ``"auto"``."""
    return {"mode": _state["mode"], "torch": torch.__version__,
            "kernels": {name: {"compiled": sorted(k.compile_seconds()), "compile_seconds": k.compile_seconds(),
                               "variants": len(k.variants), "failed": dict(k.failed), "calls": dict(k.calls)}
                        for name, k in _KERNELS.items()}}


def reset() -> None:
    """Forget compiled kernels, failures and eager work (for tests and benchmarks)."""
    for name, k in list(_KERNELS.items()):
        _KERNELS[name] = _Kernel(k.fn, name, k.first)


# ------------------------------------------------------------------------------------------------
# entry points for rounding.py, optimizer.py and prediction.py
# ------------------------------------------------------------------------------------------------
_PARAM_CACHE: Dict[tuple, torch.Tensor] = {}


def _cached_params(kind: str, fmt: FloatFormat, policy: Optional[str], rand_bits: Optional[int],
                   device: torch.device, edges: Sequence[int] = ()) -> torch.Tensor:
    """The parameter tensor of a format (no seed), made once per device."""
    key = (kind, fmt, policy, rand_bits, device, tuple(edges))
    t = _PARAM_CACHE.get(key)
    if t is None:
        values = nearest_params(fmt, policy) if kind == "nearest" else freeze_params(fmt, rand_bits, edges)
        if len(_PARAM_CACHE) > 256:
            _PARAM_CACHE.clear()
        t = _PARAM_CACHE[key] = torch.tensor(values, dtype=torch.int32, device=device)
    return t


def nearest(x: torch.Tensor, fmt: FloatFormat, policy: str, eager=None) -> torch.Tensor:
    """RNE of a float32 tensor (any shape and layout) as a new tensor: compiled, or ``eager()``
    (a float32 result; by default the kernel function itself)."""
    p = _cached_params("nearest", fmt, policy, None, x.device)
    flat = x.reshape(-1)
    out = _KERNELS["nearest"](flat.view(torch.int32), p,
                              eager=None if eager is None else lambda: eager().view(torch.int32)).view(torch.float32)
    return out if out.shape == x.shape else out.view(x.shape)


def nearest_(x: torch.Tensor, fmt: FloatFormat, policy: str, eager=None) -> torch.Tensor:
    """RNE of a contiguous float32 tensor, in place: compiled, or ``eager()``."""
    p = _cached_params("nearest", fmt, policy, None, x.device)
    _KERNELS["nearest_"](x.view(-1).view(torch.int32), p, eager=eager)
    return x


def stochastic(x: torch.Tensor, fmt: FloatFormat, policy: str, rand_bits: Optional[int], seed: int) -> torch.Tensor:
    """SR of a float32 tensor as a new tensor; element i of ``x`` in row-major order draws the
    hash of (seed, i)."""
    p = torch.tensor(stochastic_params(fmt, policy, rand_bits, seed), dtype=torch.int32, device=x.device)
    flat = x.reshape(-1)
    out = _KERNELS["stochastic"](flat.view(torch.int32), p)
    return out.view(torch.float32).view(x.shape)


def stochastic_(x: torch.Tensor, fmt: FloatFormat, policy: str, rand_bits: Optional[int], seed: int) -> torch.Tensor:
    """SR of a contiguous float32 tensor, in place (the same bits as :func:`stochastic`)."""
    p = torch.tensor(stochastic_params(fmt, policy, rand_bits, seed), dtype=torch.int32, device=x.device)
    _KERNELS["stochastic_"](x.view(-1).view(torch.int32), p)
    return x


def equal_count(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:func:`equal_count_fp32` of two flat float32 tensors, compiled or eagerly."""
    return _KERNELS["equal_count"](a, b)


def changed_blocks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:func:`changed_blocks_fp32`, compiled or eagerly."""
    return _KERNELS["changed_blocks"](a, b)


def frozen_blocks(codes: torch.Tensor) -> torch.Tensor:
    """:func:`frozen_blocks_u8`, compiled or eagerly."""
    return _KERNELS["frozen_blocks"](codes)


LAYOUTS = ("codes", "tagged", "paired", "bytes")


def freeze_code(old: torch.Tensor, new: torch.Tensor, fmt: FloatFormat, edges: Sequence[int], out: torch.Tensor,
                layout: str = "codes", rand_bits: Optional[int] = None,
                tags: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`freeze_code_fp32` of two flat float32 tensors into ``out``, compiled or eagerly,
    with the ratio bins of ``edges`` (:func:`ratio_bin_params`); returns the sum of the move
    probabilities (float64, 0-dim). ``layout``:

    * ``"codes"``: one code per element with the few-bit flag (``out`` uint8; ``rand_bits``
      k, or None: no few-bit prediction, the flag then marks the ratios up to 1/2);
    * ``"tagged"``: the same or-ed with ``tags`` (``out`` int32; the tags of
      :meth:`lowprec_demo._packing.Pack.tags`);
    * ``"paired"`` (an even number of elements) and ``"bytes"``: without the few-bit flag, in
      the layouts of :func:`pair_pattern` (``out`` uint8), with the kernel's options for the
      format (:func:`gap_options`).

    The kernel is compiled in five variants: the codes, the tagged codes, and the three
    settings of :func:`gap_options` for the two layouts without the flag (the codes with the
    flag take the general gap handling, as few-bit prediction is the rarer case).
    """
    if layout in ("paired", "bytes"):
        p = _cached_params("freeze", fmt, None, None, old.device, edges)
        pattern = pair_pattern(old.numel(), old.device, layout)
        return _KERNELS["freeze"](old, new, p, out, pattern, fewbit=False, **gap_options(fmt))
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    p = _cached_params("freeze", fmt, None, rand_bits, old.device, edges)
    return _KERNELS["freeze"](old, new, p, out, tags if layout == "tagged" else None,
                              fewbit=True, infinite_gap=True, one_factor=False)


def compile_all(device="cpu") -> dict:
    """Compile every kernel for ``device`` now (mode "on" for the duration) and return
    :func:`status`: the first call of each is timed there, or its failure recorded."""
    previous = set_mode("on")
    try:
        x = torch.randn(4096, device=device)
        fmt = FloatFormat(5, 3)
        nearest(x, fmt, "inf")
        nearest_(x.clone(), fmt, "inf")
        stochastic(x, fmt, "inf", None, 1)
        stochastic_(x.clone(), fmt, "inf", None, 1)
        edges = range(-8, 8)   # (any edges: they are values of the parameter tensor, not of the code)
        codes = torch.empty(4096, dtype=torch.uint8, device=device)
        freeze_code(x, x + 1e-3, fmt, edges, codes)
        freeze_code(x, x + 1e-3, fmt, edges, torch.empty(4096, dtype=torch.int32, device=device), "tagged",
                    tags=torch.zeros(4096, dtype=torch.int32, device=device))
        for f in (fmt, FloatFormat(3, 0), FloatFormat(8, 7)):   # the three settings of gap_options
            freeze_code(x, x + 1e-3, f, edges, codes, "paired")
        equal_count(x, x + 1e-3)
        changed_blocks(x, x + 1e-3)
        frozen_blocks(torch.zeros(4096, dtype=torch.uint8, device=device))
        if x.device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        set_mode(previous)
    return status()


def fits(x: torch.Tensor, fmt: FloatFormat) -> bool:
    """Whether the fused kernels handle this tensor and format: float32 values, a format that
    float32 holds (which quantize has checked already for float32 input)."""
    return x.dtype == torch.float32 and fmt.e_max + 1 <= 128
