"""The kernels: rounding and the freeze rule as integer operations on float32 bit patterns.

Eager PyTorch makes one pass over memory per operation, so exact rounding written as ten tensor
operations costs ten passes where a native cast costs two. Here each computation is one plain
PyTorch function of integer operations on float32 bit patterns, which :mod:`lowprec_demo.kernels`
hands to ``torch.compile`` (inductor: C++ loops on the CPU, Triton on GPUs) so that it runs as one
loop, or runs eagerly: the same functions either way, so the two paths compute the same bits by
construction. ``tests/test_rounding.py`` checks them against an exact reference,
``tests/test_bench.py`` the compiled kernels against them on the exhaustive point sets of the
exactness suite. Integer arithmetic on bit patterns leaves nothing to the compiler's
floating-point flags.

Bit patterns in and out
    The rounding kernels (:func:`rne_bits`, :func:`sr_bits`) take the int32 view of a float32
    tensor and give the bit patterns of the results; their callers view them as float32 on the
    way in and out (free: no copy). Inductor's CPU code moves a vector between float32 and
    int32 lanes through memory, so a kernel that loads floats and views them as integers pays
    that twice a vector: given the bit patterns, compiled round to nearest took 1.19 instead of
    1.46 times torch's bf16 round trip on 16M elements, stochastic rounding 1.99 instead of 2.21
    (a 2-core AMD EPYC at 2.0 GHz, one thread: ``benchmarks/cpu-2026-12-02-zen1-*``).
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
    gives the same bits).

The freeze rule (``freeze_code_fp32``, ``watch_code_fp32``)
    :mod:`lowprec_demo.freeze_rule` at the stored weight ``q(old)``, rounded by ``rne_bits``' own
    formula on magnitudes (:func:`rne_magnitude`): one code byte per element and the sum of the
    move probabilities (for the predictor's counts, :func:`lowprec_demo.prediction.count_freezes`),
    or per element the watch's code (tensor, bin of the step per unit of learning rate, frozen,
    gradient) and move probability. The counts come
    from :func:`torch.bincount` of the bytes, which stalls when long runs of elements share a
    code (each increment waits for the one before): without the few-bit flag the kernel lays
    the bytes out so that two neighbours read as one int16 entry and consecutive entries
    alternate between two counters (:func:`pair_pattern`). A pack of a model's small tensors
    (:mod:`lowprec_demo.packing`) takes another layout (``"bytes"``: one code per entry, 256
    bins, lanes alternating element by element) and counts its frozen elements per block of 64
    (:func:`frozen_blocks_u8`; :func:`changed_blocks_fp32` counts the changed ones for the
    observer), each tensor of the pack starting at a block's start.

Example:
    >>> from lowprec_demo.formats import get_format
    >>> p = nearest_params(get_format("e4m3"), "saturate")
    >>> rne_fp32(torch.tensor([1.06, 500.0]), torch.tensor(p, dtype=torch.int32)).tolist()
    [1.0, 448.0]
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from lowprec_demo.formats import FloatFormat
from lowprec_demo.rounding.rule import LAYOUTS, code_of, freeze_elements, move_share, watch_code

__all__ = ["nearest_params", "stochastic_params", "seed_words", "hash32", "rne_bits", "rne_bits_", "rne_fp32",
           "sr_bits", "sr_bits_", "sr_fp32", "rne_magnitude", "freeze_detail_fp32", "watch_code_fp32",
           "freeze_code_fp32", "pair_pattern", "equal_count_fp32", "changed_blocks_fp32", "frozen_blocks_u8",
           "BLOCK", "MAX_NUMEL"]

MAX_NUMEL = (1 << 31) - 1      # int32 element indices: larger tensors take the eager float64-style path

_INT32_MIN = -(1 << 31)
_F32 = LAYOUTS[torch.float32]
_INF_BITS = _F32.inf_bits
_NAN_BITS = _INF_BITS | 1 << 22          # the quiet NaN
_M32 = 0xFFFFFFFF



# ------------------------------------------------------------------------------------------------
# parameters: everything about the format, policy and seed as integers (a tensor, so that one
# compiled kernel serves every format and seed without recompiling)
# ------------------------------------------------------------------------------------------------
def _overflow_bits(fmt: FloatFormat, policy: str) -> int:
    return {"inf": _INF_BITS, "saturate": _F32.bits(fmt.max), "nan": _NAN_BITS}[policy]


def nearest_params(fmt: FloatFormat, policy: Optional[str]) -> list:
    """``[m, e_min + 127, bits of max, bits of the overflow value]`` for :func:`rne_fp32`;
    policy None: the grid continued above max (up to float32's own overflow to inf)."""
    if policy is None:
        return [fmt.man_bits, fmt.e_min + 127, _INF_BITS, _INF_BITS]
    return [fmt.man_bits, fmt.e_min + 127, _F32.bits(fmt.max), _overflow_bits(fmt, policy)]


def stochastic_params(fmt: FloatFormat, policy: str, rand_bits: Optional[int], seed: int, first: int = 0) -> list:
    """``[m, e_min + 127, k, bits of max, overflow bits, bits of the smallest subnormal, the two
    seed words as int32, index of the first element]`` for :func:`sr_fp32`; k = 32 for full
    resolution. ``first`` (0 unless the tensor is a piece of a larger one, such as a shard of
    a parameter) numbers the first element, so that element i draws the hash of (seed,
    first + i)."""
    k = 32 if rand_bits is None else rand_bits
    s1, s2 = seed_words(seed)
    return [fmt.man_bits, fmt.e_min + 127, k, _F32.bits(fmt.max), _overflow_bits(fmt, policy),
            _F32.bits(fmt.smallest_subnormal), s1, s2, first]


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
    out = _select(nan, _NAN_BITS, rne_magnitude(_keep(~nan, u), p[0], p[1], p[2], p[3]))  # (a NaN's magnitude as 0)
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


def freeze_detail_fp32(old: torch.Tensor, new: torch.Tensor, p: torch.Tensor, infinite_gap: bool = True,
                       one_factor: bool = False):
    """The freeze rule (:func:`lowprec_demo.freeze_rule.freeze_elements`) for the update
    ``d = new - old`` of float32 tensors at the stored weight ``w = q(old)`` (round to nearest by
    :func:`rne_magnitude`, the format's own overflow), with the parameters ``p`` of
    :func:`lowprec_demo.freeze_rule.rule_params`: ``(frozen, ratio, stuck)``. ``w`` is needed
    as its magnitude only (its sign is that of ``old``), and not at all when ``old`` is NaN
    (then ``d`` is NaN, and a NaN update never freezes)."""
    ob = old.view(torch.int32)
    wu = rne_magnitude(torch.clamp(ob & 0x7FFFFFFF, max=_INF_BITS), p[0], p[1], p[2], p[3])
    return freeze_elements(wu, ob, new - old, p, LAYOUTS[torch.float32], infinite_gap=infinite_gap,
                           one_factor=one_factor)


def watch_code_fp32(old: torch.Tensor, new: torch.Tensor, grad: torch.Tensor, tensor_id: torch.Tensor,
                    log_lr: torch.Tensor, p: torch.Tensor, first_edge: float = -64.0, bins: int = 769,
                    infinite_gap: bool = True, one_factor: bool = False):
    """For the freeze watch, in one pass: the codes of :func:`lowprec_demo.freeze_rule.watch_code`
    (int32) of the update ``new - old`` at ``q(old)`` (:func:`freeze_detail_fp32`), and the move
    probability of every element (float32, with k random bits resolved to k bits, 0 where stuck)."""
    frozen, ratio, stuck = freeze_detail_fp32(old, new, p, infinite_gap, one_factor)
    return watch_code(frozen, ratio, grad, tensor_id, log_lr, first_edge, bins), move_share(ratio, stuck, p[6])


def freeze_code_fp32(old: torch.Tensor, new: torch.Tensor, p: torch.Tensor, out: torch.Tensor,
                     pattern: Optional[torch.Tensor] = None, fewbit: bool = True, infinite_gap: bool = True,
                     one_factor: bool = False) -> torch.Tensor:
    """The freeze codes (:func:`lowprec_demo.freeze_rule.code_of`) of the update ``new - old``
    of float32 tensors (the rule of :func:`freeze_detail_fp32`, its ``infinite_gap`` and
    ``one_factor`` as given; with ``fewbit`` the codes carry the few-bit flag: Python values, on
    which ``torch.compile`` specialises) written into ``out``, one per element, laid out as
    ``pattern`` says; returns the sum of the move probabilities (float64, 0-dim; with k random
    bits resolved to k bits where ``fewbit``, else at full resolution).

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
    frozen, ratio, stuck = freeze_detail_fp32(old, new, p, infinite_gap, one_factor)
    code = code_of(frozen, ratio, p, fewbit)
    moved = move_share(ratio, stuck, p[6] if fewbit else 0).to(torch.float64).sum()
    if pattern is None:
        out.copy_(code.to(torch.uint8))
    elif pattern.dtype == torch.int32:
        out.copy_(code | pattern)
    else:
        layout = pattern.to(torch.int32)
        out.copy_(((code << (layout & 1)) | (layout >> 1)).to(torch.uint8))
    return moved


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


def rne_magnitude(u: torch.Tensor, man_bits, emin_b, max_bits, over_bits) -> torch.Tensor:
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


def rne_bits_(bits: torch.Tensor, p: torch.Tensor) -> None:
    """:func:`rne_bits` written over ``bits``."""
    bits.copy_(rne_bits(bits, p))


def sr_bits_(bits: torch.Tensor, p: torch.Tensor) -> None:
    """:func:`sr_bits` written over ``bits``."""
    bits.copy_(sr_bits(bits, p))


