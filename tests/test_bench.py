"""The fused kernels against the eager code, bit for bit, and the benchmark at tiny sizes.

``lowprec_demo.rounding.round_to_grid.run`` runs each kernel either compiled (``torch.compile``) or eagerly. Here the
compiled kernels are compared with the eager path on the exhaustive point sets of
``test_rounding.py`` (round to nearest: against the package's own eager code, which that file
checks against the exact reference), on random bit patterns and numbers around every format's
range (stochastic rounding: compiled against the same function run eagerly, every few-bit
setting and overflow policy), and on the freeze rule (against ``would_freeze``,
``update_ulp_ratio`` and an exact histogram). No timing is asserted.
"""

import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_rounding as TR  # the exhaustive point sets and helpers

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)
import bench, bench_report, machine, timing  # noqa: E402  (the benchmark's modules, in benchmarks/)
from lowprec_demo.rounding import freeze_rule, round_to_grid
from lowprec_demo.rounding.freeze_rule import BINS, FIRST_EDGE
from lowprec_demo.rounding.round_to_grid import (LAYOUTS, RoundParams, hash32, nearest_bits, round_params, seed_words,
                                                 stochastic_bits)
from lowprec_demo.common import packing
from lowprec_demo.formats import get_format
from lowprec_demo.optim.optimizer import LowPrecisionOptimizer
from lowprec_demo.freeze import RATIO_BINS, FreezeObserver, FreezePredictor
from lowprec_demo.freeze.counts import fewbit_count, fold_octaves, histograms, step_counts
from lowprec_demo.rounding import move_probability, quantize, random_bits, update_ulp_ratio, would_freeze

pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def compiled():
    """``call(kernel, *args, **options)``: the kernel as the package runs it compiled (``round_to_grid.run`` in mode
    "on", without grad); skipped where torch.compile cannot build it (no C++ compiler): the eager path is then all
    there is, and test_rounding.py checks it."""
    # torch.compile keeps at most 8 versions of a function per process: start from none, so that the versions other
    # test files compiled before (in a random order) do not count here
    torch._dynamo.reset()
    round_to_grid._compiled.clear()

    def call(kernel, *args, **options):
        previous = round_to_grid.set_mode("on")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                out = round_to_grid.run(kernel, *args, **options)
        finally:
            round_to_grid.set_mode(previous)
        if round_to_grid._compiled.get((kernel, args[0].device.type)) is None:
            pytest.skip(f"torch.compile is not available here for {kernel.__name__}")
        return out
    return call


def on_floats(kernel, x: torch.Tensor, p: torch.Tensor, **options) -> torch.Tensor:
    """A bit-pattern kernel run eagerly on a float tensor."""
    return kernel(x.view(LAYOUTS[x.dtype].itype), p, **options).view(x.dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns, any NaN matching any NaN."""
    a, b = a.reshape(-1), b.reshape(-1)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def sample_fp32(fmt, seed, n=20_000):
    """Random bit patterns, numbers around the format's range (subnormals and overflow included)
    and the special values: 2n + 5 float32 numbers, a length that is no multiple of a vector."""
    xs = np.concatenate([TR.random_fp32(n, seed), TR.focused(fmt, n, seed + 1, np.float32)])
    return torch.from_numpy(xs.astype(np.float32))


ROUND_FORMATS = {**TR.EXHAUSTIVE, **TR.WIDE}


# ------------------------------------------------------------------------------------------------
# round to nearest
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,policy", TR.EXHAUSTIVE_CASES)
def test_compiled_nearest_is_the_eager_code_on_the_exhaustive_points(compiled, key, policy):
    fmt = TR.EXHAUSTIVE[key]
    x = torch.from_numpy(TR.exhaustive_points(key).astype(np.float32))
    p = round_params(fmt, policy).tensor()
    eager = TR.generic_nearest(x, fmt, policy)
    assert same_bits(compiled(nearest_bits, x.view(torch.int32), p).view(torch.float32), eager)
    assert same_bits(on_floats(nearest_bits, x, p), eager)   # the kernel function run eagerly
    y = x.clone()
    compiled(nearest_bits, y.view(torch.int32), p, inplace=True)
    assert same_bits(y, eager)


@pytest.mark.parametrize("key", list(ROUND_FORMATS))
def test_compiled_nearest_on_random_inputs(compiled, key):
    fmt = ROUND_FORMATS[key]
    x = sample_fp32(fmt, sum(map(ord, key)))
    for policy in TR.policies(fmt):
        p = round_params(fmt, policy).tensor()
        got = compiled(nearest_bits, x.view(torch.int32), p).view(torch.float32)
        assert same_bits(got, TR.generic_nearest(x, fmt, policy)), policy


@pytest.mark.parametrize("key", list(ROUND_FORMATS))
def test_the_freeze_kernels_rounding_is_the_nearest_kernels(key):
    """The freeze kernel rounds ``old`` with its own shorter formula: its magnitudes are those of
    round_nearest on the exhaustive points (where there are some) and random inputs, every policy."""
    fmt = ROUND_FORMATS[key]
    xs = [sample_fp32(fmt, sum(map(ord, key)) + 1)]
    if key in TR.EXHAUSTIVE:
        xs.append(torch.from_numpy(TR.exhaustive_points(key).astype(np.float32)))
    for x in xs:
        x = x[~x.isnan()]
        u = torch.clamp(x.view(torch.int32) & 0x7FFFFFFF, max=0x7F800000)
        for policy in TR.policies(fmt):
            p = round_params(fmt, policy).tensor()
            want = on_floats(nearest_bits, x, p).view(torch.int32) & 0x7FFFFFFF
            assert torch.equal(round_to_grid.rne_magnitude(u, RoundParams.read(p)), want), policy


def test_quantize_takes_the_compiled_path_in_every_mode_alike():
    """Whatever the mode, quantize returns the same bits (nearest and SR, float8 included)."""
    x = sample_fp32(get_format("e4m3"), 3)
    out = {}
    for mode in ("off", "on"):
        previous = round_to_grid.set_mode(mode)
        try:
            out[mode] = [quantize(x, f, r, generator=7, rand_bits=k)
                         for f in ("bf16", "e4m3", "e5m2", "e5m3", "e3m2")
                         for r, k in (("nearest", None), ("stochastic", None), ("stochastic", 3))]
        finally:
            round_to_grid.set_mode(previous)
    assert all(same_bits(a, b) for a, b in zip(out["off"], out["on"]))


# ------------------------------------------------------------------------------------------------
# stochastic rounding
# ------------------------------------------------------------------------------------------------
SR_KEYS = list(TR.SR_FORMATS) + ["fp32", "e5m23", "e7m20", "e8m0", "e2m0"]


def sr_by_integer_position(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The same stochastic rounding as round_stochastic by another route: the position in the gap
    rounded to k bits by integer arithmetic and compared with the top bits of the hash as
    non-negative int32 numbers (where the kernel compares unsigned 32-bit numbers)."""
    q = RoundParams.read(p)
    k, max_bits, over_bits, tiny_bits = q.rand_bits, q.max_bits, q.overflow_bits, q.tiny_bits
    bits = x.view(torch.int32)
    sign, u = bits & -(1 << 31), bits & 0x7FFFFFFF
    nan = u > 0x7F800000
    u = torch.where(nan, 0, u)
    top, s, d = round_to_grid._decompose(u, q)
    frac = s & ((1 << torch.clamp(d, max=25)) - 1)
    sh = torch.clamp(d - k, min=0, max=26)
    half = (1 << sh) >> 1
    odd = (frac >> sh) & torch.clamp(half, max=1)
    position = torch.where(d > k, (frac + (half - 1 + odd).clamp(min=0)) >> sh, frac)
    j = torch.clamp(d, max=k)
    index = torch.arange(x.numel(), dtype=torch.int32) + q.index_offset
    r = hash32(index, q.seed_lo, q.seed_hi)
    top_j = (r >> torch.clamp(32 - j, min=0, max=31)) & (0x7FFFFFFF >> torch.clamp(31 - j, min=0, max=31))
    move = (top_j < position) & ((j < 32) | (r >= 0))
    q = (s - frac) + (move.to(torch.int32) << torch.clamp(d, max=24))
    out = torch.where(d >= 24, torch.where(move, tiny_bits, 0), top + q)
    out = torch.where(nan, 0x7FC00000, torch.where(out > max_bits, over_bits, out))
    return (out | sign).view(torch.float32)


@pytest.mark.parametrize("key", SR_KEYS)
def test_compiled_sr_is_the_eager_function(compiled, key):
    fmt = {**ROUND_FORMATS, **TR.SR_FORMATS}[key]
    x = sample_fp32(fmt, sum(map(ord, key)), n=10_000)
    for policy in TR.policies(fmt):
        for k in (None, 1, 3, 8, 23, 24, 31, 32):
            p = round_params(fmt, policy, k, 1234567891234).tensor()
            eager = on_floats(stochastic_bits, x, p)
            assert same_bits(eager, sr_by_integer_position(x, p)), (policy, k)
            assert same_bits(compiled(stochastic_bits, x.view(torch.int32), p).view(torch.float32), eager), (policy, k)
            y = x.clone()
            compiled(stochastic_bits, y.view(torch.int32), p, inplace=True)
            assert same_bits(y, eager), (policy, k)
        # every result is on the grid (continued above max, then the policy)
        y = on_floats(stochastic_bits, x, p)
        assert same_bits(quantize(y, fmt, overflow=policy), y)


@pytest.mark.parametrize("key", ["bf16", "e4m3", "e5m2", "e3m2", "e8m0", "e8m7-finite"])
def test_compiled_float64_kernels_are_the_eager_functions(compiled, key):
    """The same kernels on float64 bit patterns (int64 lanes): compiled as run eagerly."""
    fmt = {**ROUND_FORMATS, **TR.FP64_ONLY}[key]
    seed = sum(map(ord, key))
    x = torch.from_numpy(np.concatenate([TR.random_fp64(5000, seed), TR.focused(fmt, 5000, seed + 1, np.float64)]))
    layout = LAYOUTS[torch.float64]
    bits = x.view(torch.int64)
    for policy in TR.policies(fmt):
        p = round_params(fmt, policy, layout=layout).tensor(layout=layout)
        eager = on_floats(nearest_bits, x, p)
        assert same_bits64(compiled(nearest_bits, bits, p).view(torch.float64), eager), policy
        for k in (None, 1, 3, 8, 32):
            p = round_params(fmt, policy, k, 1234567891234, 5, layout).tensor(layout=layout)
            eager = on_floats(stochastic_bits, x, p)
            assert same_bits64(compiled(stochastic_bits, bits, p).view(torch.float64), eager), (policy, k)
            y = x.clone()
            compiled(stochastic_bits, y.view(torch.int64), p, inplace=True)
            assert same_bits64(y, eager), (policy, k)


def same_bits64(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int64), b[~nan].view(torch.int64))


def test_sr_random_bits_are_the_public_hash():
    """The kernel's int32 hash is random_bits(), and SR moves exactly when the top bits of the
    hash are below the position in the gap (checked at 32 bits, where d <= k)."""
    n = 50_000
    seed = (0xDEADBEEF << 32) | 0x12345678
    h = hash32(torch.arange(n, dtype=torch.int32), *seed_words(seed))
    assert torch.equal(h.to(torch.int64) & 0xFFFFFFFF, random_bits((n,), seed))
    # 1 + f * 2**-7 for f = i/2**16: moves up exactly when the top 16 bits of the hash < f * 2**16 / ...
    frac = torch.randint(0, 1 << 16, (n,))
    x = 1.0 + frac.double() * 2.0**-23
    y = quantize(x.float(), "bf16", "stochastic", generator=seed)
    r = random_bits((n,), seed)
    assert torch.equal(y > 1.0, (r >> 16) < frac)


# ------------------------------------------------------------------------------------------------
# the freeze rule
# ------------------------------------------------------------------------------------------------
def exact_bins(ratio: torch.Tensor, edges=RATIO_BINS) -> torch.Tensor:
    """bucketize(log2(ratio), edges) computed exactly: ceil(log2 r) - edges[0], clamped; ratio 0
    in bin 0; NaN -> -1 (left out)."""
    r = ratio.double()
    mantissa, exponent = torch.frexp(r)          # r = mantissa * 2**exponent, mantissa in [0.5, 1)
    ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent).double()
    bins = torch.where(r > 0, (ceil_log2 - edges[0]).clamp(0, len(edges)), torch.zeros_like(r))
    bins = torch.where(torch.isinf(r), float(len(edges)), bins)
    return torch.where(r.isnan(), -1.0, bins).to(torch.int64)


def exact_eighths(ratio: torch.Tensor, log_lr: torch.Tensor) -> torch.Tensor:
    """The bin of y = log2(ratio) - log_lr in eighths of an octave from FIRST_EDGE, in float64 (exact where it
    matters here: log2 of a float32 is off by 1e-16 of it, and y falls on an edge only at powers of two)."""
    r = ratio.double()
    at = torch.ceil((torch.log2(r) - log_lr.double() - FIRST_EDGE) * 8).clamp(0, BINS - 1)
    at = torch.where(r == 0, 0.0, at)
    return torch.where(r.isnan(), float(BINS), at).to(torch.int64)


def octave_of(at: torch.Tensor, edges=RATIO_BINS) -> torch.Tensor:
    """The whole-octave bin of eighth-octave bins, as fold_octaves folds them (NaN's slot -> -1)."""
    coarse = (FIRST_EDGE - torch.div(-at, 8, rounding_mode="floor") - edges[0]).clamp(0, len(edges))
    coarse = torch.where(at == 0, 0, torch.where(at >= BINS - 1, len(edges), coarse))
    return torch.where(at == BINS, -1, coarse)


def split_pack(old, new, cut, block=64):
    """Two tensors, ``old[:cut]`` and ``old[cut:]``, laid end to end with each starting at a multiple of ``block``:
    each element's tensor index (the gaps one past the last) and the flat buffers of ``old`` and ``new`` in that
    layout."""
    second = -(-cut // block) * block
    end = second + len(old) - cut
    ids = torch.full((-(-end // block) * block,), 2, dtype=torch.int32)
    ids[:cut], ids[second:end] = 0, 1
    buffers = []
    for t in (old, new):
        buffer = torch.zeros(len(ids), dtype=t.dtype)
        buffer[:cut], buffer[second:end] = t[:cut], t[cut:]
        buffers.append(buffer)
    return ids, buffers[0], buffers[1]


def freeze_cases(key):
    """(old, new): the edge pairs of test_rounding.py (grid weights, updates at fixed fractions
    of the gap, ties, powers of two, infinities, NaN) and random pairs off the grid."""
    fmt = TR.FREEZE_FORMATS[key]
    pairs = TR.freeze_edge_cases(key, "float32")
    w = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    d = torch.tensor([p[1] for p in pairs], dtype=torch.float32)
    new = w + d
    keep = (new - w) == d              # the update the predictor sees is new - old
    old, new = w[keep], new[keep]
    rng = np.random.default_rng(5)
    o = torch.from_numpy(TR.focused(fmt, 5000, 6, np.float32))
    step = torch.from_numpy((rng.standard_normal(5000) * 2.0 ** rng.uniform(-30, 2, 5000)).astype(np.float32))
    specials = torch.tensor([math.nan, math.inf, -math.inf, 0.0, 1.0, 1.0, math.inf, 2.0])
    specials_new = torch.tensor([1.0, math.inf, 3.0, math.nan, math.inf, -math.inf, -math.inf, 2.0 - 2.0**-20])
    return torch.cat([old, o, specials]), torch.cat([new, o + o * step, specials_new])


@pytest.mark.parametrize("key", list(TR.FREEZE_FORMATS))
def test_step_code_is_the_freeze_rule(compiled, key):
    """The one kernel of the predictor and the watch, compiled and eagerly: frozen is would_freeze, the move
    probability move_probability with k random bits, the flag grad != 0 (0 without a gradient, the predictor's), the
    tensor its id; the bin of log2(ratio) - log_lr that of float64 (exact here: the shift is given as thresholds,
    freeze_rule.bin_thresholds; the predictor's unshifted)."""
    fmt = TR.FREEZE_FORMATS[key]
    old, new = freeze_cases(key)
    stored, update = quantize(old, fmt), new - old
    frozen = would_freeze(stored, update, fmt).to(torch.int32)
    ratio = update_ulp_ratio(stored, update, fmt)
    n_tensors = 5
    tensor_id = (torch.arange(len(old), dtype=torch.int32) * n_tensors) // len(old)
    grad = torch.where(torch.arange(len(old)) % 7 == 0, 0.0, 1.0)
    for k in (None, 1, 3, 8):
        p = freeze_rule.rule_params(fmt, k).tensor()
        for log_lr, g in ((None, None), (torch.tensor([-3.0, -7.5, -10.25, 0.0, -60.0]), grad),
                          (torch.tensor(-13.29), grad)):
            args = (old, new, g, tensor_id, freeze_rule.bin_thresholds(log_lr), p)
            eager_code, moves = freeze_rule._step_kernel(*args)
            code, compiled_moves = compiled(freeze_rule._step_kernel, *args)
            assert torch.equal(code, eager_code) and same_bits(compiled_moves, moves)
            assert same_bits(moves, move_probability(stored, update, fmt, rand_bits=k))
            assert torch.equal((code >> 1) & 1, frozen)
            assert torch.equal(code & 1, torch.zeros_like(frozen) if g is None else (grad != 0).to(torch.int32))
            assert torch.equal((code >> 2) // (BINS + 1), tensor_id)
            at = (code >> 2) % (BINS + 1)
            shift = torch.tensor(0.0) if log_lr is None else log_lr if log_lr.dim() == 0 else log_lr[tensor_id]
            want = exact_eighths(ratio, shift)
            assert torch.equal(at, want), (k, log_lr, (at != want).sum().item())


def test_the_eighth_bins_are_exact_next_to_every_threshold():
    """Unshifted (the predictor's bins), ``ceil(8 log2 r)`` in exact rational arithmetic (``r**8`` against powers of
    two) for ratios at, just below and just above every threshold ``2**(j/8)``, in many octaves, and random ones."""
    from fractions import Fraction
    t = freeze_rule.bin_thresholds()[1:]
    near = torch.cat([t, torch.nextafter(t, torch.full_like(t, 2.0)), torch.nextafter(t, torch.zeros_like(t))])
    scale = torch.exp2(torch.arange(-60, 30, 7, dtype=torch.float32))
    g = torch.Generator().manual_seed(3)
    ratio = torch.cat([(near[:, None] * scale[None, :]).reshape(-1), torch.rand(3000, generator=g) * 2.0 ** 10])
    code = freeze_rule.element_codes(torch.zeros(len(ratio), dtype=torch.bool), ratio, 0,
                                     torch.zeros((), dtype=torch.int32), freeze_rule.bin_thresholds())
    for r, at in zip(ratio.tolist(), ((code >> 2) % (BINS + 1)).tolist()):
        power = Fraction(r) ** 8
        k = math.ceil(math.log2(r) * 8)
        while power > Fraction(2) ** k:        # the least k with r**8 <= 2**k: ceil(8 log2 r)
            k += 1
        while power <= Fraction(2) ** (k - 1):
            k -= 1
        want = 0 if r == 0 else min(max(k - 8 * FIRST_EDGE, 0), BINS - 1)
        assert at == want, (r, at, want)


@pytest.mark.parametrize("key", ["e4m3", "e5m2", "fp16", "e3m2", "e2m0"])
def test_step_code_under_every_overflow_policy(compiled, key):
    """Weights stored as the max, inf or NaN after an overflow: the frozen flags, move probabilities and octaves
    follow would_freeze, move_probability and update_ulp_ratio under each policy the format allows (a NaN weight
    never freezes)."""
    old, new = freeze_cases(key)
    big = torch.tensor([1e30, -1e30, 7e4, -7e4, 500.0, 480.0, 464.0, 65520.0, 3.0e38], dtype=torch.float32)
    old = torch.cat([old, big, big])
    new = torch.cat([new, big * 1.5, big * 0.5])
    for policy in TR.policies(TR.FREEZE_FORMATS[key]):
        fmt = TR.FREEZE_FORMATS[key].with_overflow(policy)
        stored, update = quantize(old, fmt), new - old
        frozen, ratio = would_freeze(stored, update, fmt), update_ulp_ratio(stored, update, fmt)
        p = freeze_rule.rule_params(fmt).tensor()
        # (the watch's variant of the kernel, gradients all nonzero: the package's variants are all that compile here)
        args = (old, new, torch.ones_like(old), torch.zeros(len(old), dtype=torch.int32), freeze_rule.bin_thresholds(), p)
        code, moves = compiled(freeze_rule._step_kernel, *args)
        eager_code, eager_moves = freeze_rule._step_kernel(*args)
        assert torch.equal(code, eager_code) and same_bits(moves, eager_moves), policy
        assert torch.equal(code & 1, torch.ones_like(code)), policy
        assert torch.equal(((code >> 1) & 1).bool(), frozen), policy
        assert torch.equal(octave_of(code >> 2), exact_bins(ratio)), policy
        assert same_bits(moves, move_probability(stored, update, fmt)), policy


def test_the_step_kernel_compiles_three_versions_whatever_the_sizes():
    """torch.compile keeps at most 8 versions of a function per process (then it raises, and the package goes eager):
    the calls of the trackers (the predictor's: no gradient, no shift; the watch's: one learning rate, or one per
    tensor), at any size and number of tensors, compile three."""
    entries = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if entries is None:
        pytest.skip("this torch has no torch._dynamo.eval_frame._debug_get_cache_entry_list to count versions with")
    torch._dynamo.reset()
    round_to_grid._compiled.clear()
    previous = round_to_grid.set_mode("on")
    try:
        fmt = get_format("bf16")
        for n, tensors in ((2, 1), (3, 2), (1000, 3), (4097, 7), (50_000, 40)):
            old = torch.randn(n)
            new, grad = old + 1e-3 * torch.randn(n), torch.randn(n)
            ids = (torch.arange(n, dtype=torch.int32) * tensors) // n
            step_counts(old, new, fmt, ids, tensors, None)
            step_counts(old, new, fmt, ids, tensors, None, rand_bits=3)
            step_counts(old, new, fmt, ids, tensors, torch.tensor(-9.5), grad)
            step_counts(old, new, fmt, ids, tensors, torch.linspace(-20, 0, tensors), grad)
        if round_to_grid._compiled.get((freeze_rule._step_kernel, "cpu")) is None:
            pytest.skip("torch.compile is not available here")
        assert len(entries(freeze_rule._step_kernel.__code__)) == 3
    finally:
        round_to_grid.set_mode(previous)


@pytest.mark.parametrize("mode", ["off", "on"])
@pytest.mark.parametrize("edges", [RATIO_BINS, list(range(-10, 3)), list(range(-60, 2)), list(range(-64, 33))])
def test_the_ratio_bins_are_those_of_their_edges(edges, mode):
    """The count of a step (step_counts: one tensor, or a pack of two with gaps between them), its eighths folded into
    whole octaves, is bucketize(log2 ratio, edges) for any consecutive integer edges within the bins' range; the frozen
    elements per tensor and the few-bit count (ratios up to 2**-(k+1)) are those of the rule; other edges are
    refused."""
    old, new = freeze_cases("e4m3")
    fmt = TR.FREEZE_FORMATS["e4m3"]
    stored, update = quantize(old, fmt), new - old
    r = update_ulp_ratio(stored, update, fmt)
    frozen = would_freeze(stored, update, fmt)
    bins = exact_bins(r, edges)
    want = torch.bincount(bins[bins >= 0], minlength=len(edges) + 1).tolist()
    cut = len(old) // 3
    two, old2, new2 = split_pack(old, new, cut)
    zero, ones, every = torch.zeros(()), torch.ones_like(old), torch.zeros(len(old), dtype=torch.int32)
    previous = round_to_grid.set_mode(mode)
    try:
        for k in (None, 3):
            # the predictor's (one tensor, a pack; no flag, no shift) and the watch's (a zero shift, the flag set)
            one = step_counts(old, new, fmt, every, 1, None, rand_bits=k)[0]
            several = step_counts(old2, new2, fmt, two, 3, None, rand_bits=k)[0][:2]
            eighths = step_counts(old, new, fmt, every, 1, zero, ones, rand_bits=k)[0]
            eighths2 = step_counts(old2, new2, fmt, two, 3, zero, torch.ones_like(old2), rand_bits=k)[0][:2]
            assert one.shape == eighths.shape == (1, BINS + 1, 2, 2)
            for counts, frozen_want in ((one, [frozen.sum().item()]), (eighths, [frozen.sum().item()]),
                                        (several, [frozen[:cut].sum().item(), frozen[cut:].sum().item()]),
                                        (eighths2, [frozen[:cut].sum().item(), frozen[cut:].sum().item()])):
                hist = histograms(counts.sum((2, 3)), nan="drop").sum(0).tolist()
                assert fold_octaves(hist, edges) == want, (edges[0], k)
                assert fold_octaves(torch.tensor(hist), edges).tolist() == want
                assert counts[:, :, 1].sum((1, 2)).tolist() == frozen_want
                if k is not None:
                    assert fewbit_count(hist, k) == (r <= 2.0 ** -(k + 1)).sum().item()
                    assert fewbit_count(torch.tensor(hist), k).item() == (r <= 2.0 ** -(k + 1)).sum().item()
    finally:
        round_to_grid.set_mode(previous)
    for bad in ([0, 2, 3], [], list(range(-70, 1)), [125, 126, 127]):
        with pytest.raises(ValueError):
            fold_octaves([0] * BINS, bad)
    with pytest.raises(ValueError, match="770 eighth-octave bins"):
        fold_octaves([0] * 99, edges)


def _tracked_tensors():
    torch.manual_seed(0)
    return {"a": torch.randn(300) * 3, "b": torch.rand(7, 11) + 0.5, "big": torch.randn(1 << 16) * 0.02,
            "c": torch.randn(5, 4), "d": torch.zeros(64)}


def _run_trackers(trackers, tensors, steps=4):
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for t in trackers:
            t.before_step()
        for t in tensors.values():
            t += (10.0 ** -(step + 1)) * torch.randn(t.shape, generator=g) * (t.abs() + 1e-3)
        for t in trackers:
            t.after_step()


class Reference:
    """A tracker written from the public functions, tensor by tensor: per format, the frozen fraction of each tensor
    (the rule, or an unchanged stored value), NaN before a tensor appears, and the exact ratio histogram."""

    def __init__(self, source, formats=None):
        self.source, self.formats = source, formats
        self.by_tensor = {f: {} for f in formats or [""]}
        self.hist = {f: np.zeros(len(RATIO_BINS) + 1, dtype=np.int64) for f in formats or []}
        self.steps = 0

    def before_step(self):
        self.old = {k: v.detach().clone() for k, v in self.source().items()}

    def after_step(self):
        now = self.source()
        for f in self.formats or [""]:
            for k, old in self.old.items():
                new = now[k].detach()
                if f:
                    stored = quantize(old, f)
                    frozen = would_freeze(stored, new - old, f)
                    bins = exact_bins(update_ulp_ratio(stored, new - old, f).reshape(-1))
                    self.hist[f] += np.bincount(bins[bins >= 0].numpy(), minlength=len(RATIO_BINS) + 1)
                else:
                    frozen = new == old
                curve = self.by_tensor[f].setdefault(k, [math.nan] * self.steps)
                curve.append(frozen.sum().item() / frozen.numel() if frozen.numel() else math.nan)
        self.steps += 1


@pytest.mark.parametrize("mode", ["off", "on"])
@pytest.mark.parametrize("rand_bits", [3, None])
def test_the_predictor_is_the_rule_tensor_by_tensor(mode, rand_bits):
    tensors = _tracked_tensors()
    tensors["z"] = torch.zeros(0)   # no elements: a NaN fraction
    formats = ["bf16", "e4m3", "e5m3", "e2m1"]
    predictor, reference = FreezePredictor(tensors, formats, rand_bits=rand_bits), Reference(lambda: tensors, formats)
    previous = round_to_grid.set_mode(mode)
    try:
        _run_trackers([predictor, reference], tensors)
    finally:
        round_to_grid.set_mode(previous)
    for f in formats:
        rec = predictor.record(f)
        assert repr(rec.by_tensor) == repr(reference.by_tensor[f]) and all(map(math.isnan, rec.by_tensor["z"]))
        assert rec.ratio_histogram == reference.hist[f].tolist()
        assert len(rec.move_fraction) == 4 and len(rec.fewbit_frozen) == (4 if rand_bits else 0)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_the_observer_counts_unchanged_stored_values(mode):
    tensors = _tracked_tensors()
    # special values (NaN never equals itself, inf does, -0 equals 0) and a tensor of no elements
    tensors["s"] = torch.tensor([math.nan, math.inf, -0.0, 0.0, 1.0, -math.inf, math.nan])
    tensors["z"] = torch.zeros(0)
    observer, reference = FreezeObserver(tensors), Reference(lambda: tensors)
    with torch.no_grad():
        tensors["a"][:100] = quantize(tensors["a"][:100], "e2m1")   # some elements do not move
    previous = round_to_grid.set_mode(mode)
    try:
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            observer.before_step(), reference.before_step()
            for t in tensors.values():
                t.copy_(quantize(t + 1e-3 * torch.randn(t.shape, generator=g), "e4m3"))
            observer.after_step(), reference.after_step()
    finally:
        round_to_grid.set_mode(previous)
    assert repr(observer.record().by_tensor) == repr(reference.by_tensor[""])   # (NaN included)
    assert len(observer.record().by_tensor["s"]) == 3 and all(map(math.isnan, observer.record().by_tensor["z"]))


def test_trackers_follow_tensors_that_appear_later():
    """State tensors appear after the first step: that step counts the tensors there before it, the next ones all."""
    w = torch.nn.Parameter(torch.zeros(70_000))
    opt = torch.optim.Adam([w], lr=0.1)

    def source():
        return {"w": w, **({"m": opt.state[w]["exp_avg"]} if opt.state[w] else {})}
    observer, reference = FreezeObserver(source), Reference(source)
    for _ in range(3):
        w.grad = torch.zeros_like(w)
        w.grad[:10] = 1.0
        observer.before_step(), reference.before_step()
        opt.step()
        observer.after_step(), reference.after_step()
    assert math.isnan(observer.record().by_tensor["m"][0])
    assert repr(observer.record().by_tensor) == repr(reference.by_tensor[""])   # (NaN included)


# ------------------------------------------------------------------------------------------------
# the optimizer's packed, in-place rounding
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["bf16", "fp16", "e4m3", "e5m2", "e5m3", "e2m1"])
@pytest.mark.parametrize("mode", ["off", "on"])
def test_optimizer_store_is_quantize(fmt, mode):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 2) for s in [(3, 5), (7,), (1 << 16,), (4, 4, 2), ()]]
    params.append(torch.nn.Parameter(torch.randn(6, 4).t()))   # not contiguous: rounded on its own
    raw = [p.detach().clone() for p in params]
    previous = round_to_grid.set_mode(mode)
    try:
        opt = LowPrecisionOptimizer(torch.optim.SGD(params, lr=0.05), fmt, round_initial=False)
        opt.round_params()
    finally:
        round_to_grid.set_mode(previous)
    for p, b in zip(params, raw):
        assert same_bits(p.detach(), quantize(b, fmt))


def test_optimizer_sr_is_the_same_in_every_mode():
    runs = {}
    for mode in ("off", "on"):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in [(300,), (1 << 16,), (5, 5)]]
        previous = round_to_grid.set_mode(mode)
        try:
            opt = LowPrecisionOptimizer(torch.optim.Adam(params, lr=1e-3), "e4m3", rounding="stochastic",
                                        generator=torch.Generator().manual_seed(3), state_format="bf16",
                                        state_rounding="stochastic")
            for _ in range(3):
                for p in params:
                    p.grad = torch.ones_like(p)
                opt.step()
        finally:
            round_to_grid.set_mode(previous)
        runs[mode] = [p.detach().clone() for p in params]
        assert all(torch.equal(quantize(p, "e4m3"), p) for p in runs[mode])
    assert all(torch.equal(a, b) for a, b in zip(runs["off"], runs["on"]))


# ------------------------------------------------------------------------------------------------
# fallback and switches
# ------------------------------------------------------------------------------------------------
def test_a_failing_compiler_falls_back_to_the_eager_path(monkeypatch):
    """A compile failure (no compiler, or torch.compile's limit reached by the user's own calls) says so once, in a
    warning that names the kernel; the kernel goes on eagerly with the same bits."""
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")
    monkeypatch.setattr(round_to_grid, "_compiled", {})
    monkeypatch.setattr(torch, "compile", broken)
    previous = round_to_grid.set_mode("on")
    try:
        x = torch.randn(1000)
        with pytest.warns(RuntimeWarning, match=r"compiling the stochastic_bits kernel for cpu failed \(RuntimeError: "
                                                r"no C\+\+ compiler here\)"):
            a = quantize(x, "e5m3", "stochastic", generator=5)
        assert round_to_grid._compiled == {(stochastic_bits, "cpu"): None}
        with warnings.catch_warnings():
            warnings.simplefilter("error")     # once: later calls go eagerly without a word
            assert torch.equal(a, quantize(x, "e5m3", "stochastic", generator=5))
    finally:
        round_to_grid.set_mode(previous)
    assert torch.equal(a, quantize(x, "e5m3", "stochastic", generator=5))


def test_auto_mode_compiles_once_the_eager_work_reaches_the_budget(monkeypatch):
    """"auto" runs a kernel eagerly until its eager work would reach EAGER_BUDGET elements, then compiled; the bits
    are the same."""
    monkeypatch.setattr(round_to_grid, "_compiled", {})
    monkeypatch.setattr(round_to_grid, "_eager_work", {})
    monkeypatch.setattr(round_to_grid, "EAGER_BUDGET", 3000)
    previous = round_to_grid.set_mode("auto")
    kernels = (stochastic_bits, nearest_bits, freeze_rule._step_kernel)
    step = (lambda x: freeze_rule.step_codes(x, x.flip(0), None, torch.zeros((), dtype=torch.int32), None,
                                             get_format("e5m3")))
    try:
        x = sample_fp32(get_format("e5m3"), 9, n=1000)[:1984]
        first = [quantize(x, "e5m3", "stochastic", generator=5), quantize(x, "e5m3"), *step(x)]
        assert round_to_grid._compiled == {} and all(round_to_grid._eager_work[k] == 1984 for k in kernels)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)     # (where torch.compile fails here: eager again)
            second = [quantize(x, "e5m3", "stochastic", generator=5), quantize(x, "e5m3"), *step(x)]
        assert all((k, "cpu") in round_to_grid._compiled for k in kernels)
        assert all(same_bits(a, b) for a, b in zip(first, second))
    finally:
        round_to_grid.set_mode(previous)


def test_modes():
    previous = round_to_grid.set_mode("off")
    assert round_to_grid.get_mode() == "off"
    round_to_grid.set_mode(previous)
    with pytest.raises(ValueError, match="auto, on, off"):
        round_to_grid.set_mode("always")
    assert packing.group([torch.zeros(3), torch.zeros(1 << 16), torch.zeros(2), torch.zeros(2)]) == [[0], [1], [2, 3]]


# ------------------------------------------------------------------------------------------------
# the benchmark
# ------------------------------------------------------------------------------------------------
def test_cpu_identity_reads_the_first_processor(tmp_path, monkeypatch):
    """Family, model, stepping, clock, cache and vector extensions of the first processor in
    /proc/cpuinfo, its model name in the provenance, and the few words the tables show; nothing
    (and no error) where there is no such file."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 1\n"
                    "model name\t: AMD EPYC\nstepping\t: 2\ncpu MHz\t\t: 1996.248\ncache size\t: 512 KB\n"
                    "flags\t\t: fpu sse4_2 avx avx2 fma\n\n"
                    "processor\t: 1\ncpu MHz\t\t: 3000.000\nflags\t\t: avx512f\n")
    real_open = open

    def open_here(path, *args, **kwargs):
        return real_open(info if path == "/proc/cpuinfo" else path, *args, **kwargs)
    monkeypatch.setattr("builtins.open", open_here)
    identity = machine.cpu_identity()
    assert identity == {"vendor": "AuthenticAMD", "family": 23, "model": 1, "stepping": 2, "mhz": 1996.248,
                        "cache": "512 KB"}
    assert machine.cpu_label(identity) == "family 23 model 1 stepping 2, 1996 MHz, cache 512 KB"
    assert machine.cpu_vector_extensions()["flags"] == ["sse4_2", "avx", "avx2", "fma"]
    from lowprec_demo.book.results import provenance
    assert provenance("cpu")["device_name"] == "AMD EPYC"
    info.write_text("processor\t: 0\ncpu family\t: unknown\nstepping\t: 2\nFeatures\t: fp asimd sve\n")
    assert machine.cpu_identity() == {"family": "unknown", "stepping": 2}          # kept as written
    assert machine.cpu_vector_extensions()["flags"] == ["asimd", "sve"]           # Arm's name for the flags
    info.unlink()
    assert machine.cpu_identity() == {} and machine.cpu_label({}) == ""
    assert machine.cpu_vector_extensions()["flags"] == []


def test_the_split_times_the_kernels_own_hash():
    """The benchmark's "hash alone" is the stochastic-rounding kernel's random bits."""
    seed = 0x1234_5678_9ABC
    p = round_params(get_format("bf16"), "inf", None, seed).tensor()
    bits = bench._hash_only(torch.zeros(3000, dtype=torch.int32), p).to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(bits, random_bits((3000,), seed))


def test_benchmark_runs_at_tiny_sizes(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "STEP_SECONDS", 0.0)   # one step per timing: seconds, not minutes
    result = bench.run("cpu", quick=True, size=5000, repeats=1, models=["nanogpt-quick"], libraries=True,
                       eager=True, scale_sizes=[4096, 8192], progress=False)
    assert {r["format"] for r in result["quantize"]} == {"bf16", "fp16", "e4m3", "e5m2", "e5m3"}
    assert all(r["ratio"] > 0 and r["quantize_GBps"] > 0 for r in result["quantize"])
    training = result["training"][0]
    assert set(training["ratio"]) == set(bench.VARIANTS) and training["ratio"]["plain"] == 1.0
    text = bench_report.report(result)
    for heading in ("## quantize", "## Training step: nanogpt-quick", "## Scale"):
        assert heading in text
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--size", "4096", "--repeats", "1", "--models", "", "--no-libraries",
                       "--no-eager", "--no-scale", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed and "## Against the targets" in printed and out.exists()
    # the summary judges every ratio against its target, read back from the JSON
    assert bench.main(["--summary-of", str(out)]) == 0
    assert "| bf16 " in capsys.readouterr().out
    text = bench_report.summary(result)
    assert text.count("| nanogpt-quick |") == len(bench.VARIANTS) - 1
    # the cold path: compiling off in the same rounds as the native round trip, and a fresh
    # process's first call, which says which way it ran
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| cold path: compiling off"))
    cold = lines[start + 2:start + 2 + len(result["quantize"])]
    assert [line.split("|")[6].strip() for line in cold] == [      # stochastic rounding: no target
        "<= 3" if r["rounding"] == "nearest" else "-" for r in result["quantize"]]
    for r in result["quantize"]:
        assert r["eager_ratio"] == pytest.approx(r["eager_ms"] / r["eager_native_ms"])
    first = result["first_call"]
    assert first["mode"] == "auto" and first["n"] == 5000
    for key in ("bf16 stochastic", "e5m3 nearest"):
        assert first[key]["seconds"] > 0 and sum(first[key]["calls"].values()) == 1
    assert "| first call of a fresh process" in text and "| bf16 stochastic " in text
    assert set(result["machine"]["cpu_vector_extensions"]) == {"flags", "torch_capability"}
    assert result["machine"]["cpu"] == machine.cpu_identity()
    if result["machine"]["cpu"]:   # where /proc/cpuinfo says which processor this is, the tables do too
        assert machine.cpu_label(result["machine"]["cpu"]) in bench_report.report(result).splitlines()[1]
    # where the warm stochastic rounding's time goes: five parts, each against the round trip
    split = result["split"]
    assert set(split["ms"]) == {"copy", "native", "nearest", "hash", "stochastic"}
    assert split["to_native"]["native"] == 1.0 and all(v > 0 for v in split["ms"].values())
    assert "## Where the warm stochastic rounding's time goes" in bench_report.report(result)
    result["quantize"][0]["ratio"] = 9.0     # bf16 nearest, target 1.5
    result["training"][0]["ratio"]["stochastic"] = 1.5
    result["training"][0]["ratio_from_parts"]["stochastic"] = 1.01
    # a quick run: the note says its sizes are not the targets', a missed target says so too
    assert result["quick"] is True
    quick = bench_report.summary(result)
    assert quick.startswith("Quick run (--quick): quantize on 0.00476837M elements, not 16M; "
                            "no training step of gpt2; fewer timed rounds.")
    rows = {}   # the first table a (format, rounding) row appears in: the warm path's
    for line in quick.splitlines():
        rows.setdefault(tuple(c.strip() for c in line.split("|")[1:3]), line)
    assert rows[("bf16", "nearest")].rstrip(" |").split("|")[-3].strip() == "no (quick: not comparable)"
    assert "| no / yes (quick: not comparable) " in rows[("nanogpt-quick", "stochastic")]
    # the full run's judgement is unchanged: a bare "no", no note
    result["quick"] = False
    full = bench_report.summary(result)
    assert full.startswith("Measured ") and "not comparable" not in full and "Quick run" not in full
    rows = {}
    for line in full.splitlines():
        rows.setdefault(tuple(c.strip() for c in line.split("|")[1:3]), line)
    assert rows[("bf16", "nearest")].rstrip(" |").split("|")[-3].strip() == "no"
    assert "| no / yes " in rows[("nanogpt-quick", "stochastic")]
    # a file written before the flag was kept: read from its command line
    del result["quick"]
    result["command"] = "python benchmarks/bench.py --quick"
    assert bench_report.summary(result).startswith("Quick run")
    with pytest.raises(SystemExit):
        bench.main(["--summary-of", str(tmp_path / "missing.json")])


def test_memory_profile_prints_nothing():
    """torch's profiler (kineto) logs two lines to stderr per profile unless told not to when it
    first starts in a process (a fresh process here: another test may have started it)."""
    code = (f"import os, sys, torch; sys.path.insert(0, {BENCHMARKS!r}); import timing; "
            "print(timing.peak_extra_bytes(lambda: torch.ones(1000) * 2, 'cpu')); "
            "print(os.environ.get('KINETO_LOG_LEVEL'))")
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    peak, level = proc.stdout.split()
    assert int(peak) >= 4000 and level == "None"   # measured, and the variable put back
    assert "profiler_start" not in proc.stderr and "USDT" not in proc.stderr, proc.stderr


def test_spread_is_the_quartiles_of_the_per_round_ratios():
    t = {"ratio_rounds": {"nearest": [1.30, 1.00, 1.10, 1.20, 1.05], "stochastic": [1.2]}}
    assert bench_report._spread(t, "nearest") == "1.050-1.200"
    assert bench_report._spread(t, "stochastic") == "-"          # one round: no spread
    assert bench_report._spread({}, "nearest") == "-"            # a run stored before the rounds were kept
    assert bench_report._spread(t, "plain+predictor") == "-"


def test_training_targets_per_model():
    """The watch (every step) has a target per model, 1.10 on the quick nanoGPT and 1.05 on
    GPT-2 124M; the other variants one for every model; the remedies none. Stochastic rounding
    with compiling off has no target any more, the first call of a fresh process keeps its 2 s."""
    assert bench_report.step_target("nanogpt-quick", "plain+watch") == 1.10
    assert bench_report.step_target("gpt2", "plain+watch") == 1.05
    assert bench_report.step_target("shakespeare-char", "plain+watch") is None
    assert [bench_report.step_target(m, "plain+predictor") for m in ("nanogpt-quick", "gpt2")] == [1.15, 1.15]
    assert bench_report.step_target("gpt2", "stochastic") == bench_report.TARGETS["stochastic step"]
    assert bench_report.step_target("nanogpt-quick", "kahan") is None
    assert "cold stochastic" not in bench_report.TARGETS and bench_report.TARGETS["first call seconds"] == 2.0
    machine_ = {"date": "2026-12-02T00:00:00+00:00", "device_name": "CPU", "device": "cpu", "threads": 1,
                "cpu_count": 2, "torch": "2", "package_version": "0.1.0", "git_commit": None}
    step = {"model": "gpt2", "step_ms": {"plain": 100.0, "plain+watch": 106.0, "plain+predictor": 110.0},
            "ratio": {"plain": 1.0, "plain+watch": 1.06, "plain+predictor": 1.10},
            "ratio_from_parts": {"plain": 1.0, "plain+watch": 1.04, "plain+predictor": 1.10}}
    rows = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[8:10]]
            for line in bench_report.summary({"machine": machine_, "quick": False, "training": [step]}).splitlines()
            if line.startswith("| gpt2 ")}
    assert rows == {"plain+watch": ["<= 1.05", "no / yes"], "plain+predictor": ["<= 1.15", "yes / yes"]}


def test_rounds_times_short_cases_over_several_runs(monkeypatch):
    """On a clock that only the cases move (2 and 3 ms a call), the warmup's slowest case sets
    the runs per round (ceil(20 / 3) = 7, the same for both) and each time is one call's."""
    clock = {"now": 0.0}
    calls = {"a": 0, "b": 0}

    def case(name, seconds):
        def fn():
            calls[name] += 1
            clock["now"] += seconds
        return fn
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["now"])
    times = timing.median_times({"a": case("a", 0.002), "b": case("b", 0.003)}, "cpu", repeats=3, warmup=1,
                                min_seconds=0.02)
    assert calls == {"a": 1 + 3 * 7, "b": 1 + 3 * 7}
    assert times == pytest.approx({"a": 0.002, "b": 0.003}, rel=1e-9)


# ------------------------------------------------------------------------------------------------
# CUDA: the compiled GPU kernels give the CPU's bits
# ------------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@cuda
@pytest.mark.parametrize("key", ["bf16", "fp16", "e4m3", "e5m2", "e5m3", "e2m1", "e8m0", "tf32"])
def test_cuda_compiled_kernels_match_the_cpu(key):
    fmt = ROUND_FORMATS[key]
    x = sample_fp32(fmt, 11)
    previous = round_to_grid.set_mode("on")
    try:
        for policy in TR.policies(fmt):
            got = round_to_grid.run(nearest_bits, x.cuda().view(torch.int32), round_params(fmt, policy).tensor("cuda"))
            assert same_bits(got.view(torch.float32).cpu(), TR.generic_nearest(x, fmt, policy))
            for k in (None, 3):
                cpu = on_floats(stochastic_bits, x, round_params(fmt, policy, k, 99).tensor())
                got = round_to_grid.run(stochastic_bits, x.cuda().view(torch.int32),
                                        round_params(fmt, policy, k, 99).tensor("cuda"))
                assert same_bits(got.view(torch.float32).cpu(), cpu)
        old, new = x[:20_000].nan_to_num(0.0, 0.0, 0.0), (x[:20_000] * (1 + 2.0**-9)).nan_to_num(0.0, 0.0, 0.0)
        tensor_id = (torch.arange(len(old), dtype=torch.int32) * 3) // len(old)
        log_lr, grad = torch.tensor([0.0, -7.3, -12.0]), torch.where(torch.arange(len(old)) % 5 == 0, 0.0, 1.0)
        code, moves = freeze_rule.step_codes(old.cuda(), new.cuda(), grad.cuda(), tensor_id.cuda(), log_lr.cuda(), fmt, 3)
        p = freeze_rule.rule_params(fmt, 3).tensor()
        want_code, want_moves = freeze_rule._step_kernel(old, new, grad, tensor_id, freeze_rule.bin_thresholds(log_lr), p)
        assert torch.equal(code.cpu(), want_code) and same_bits(moves.cpu(), want_moves)   # every bin exactly
        code, moves = freeze_rule.step_codes(old.cuda(), new.cuda(), None, tensor_id.cuda(), None, fmt, 3)   # the predictor's
        want_code, want_moves = freeze_rule._step_kernel(old, new, None, tensor_id, freeze_rule.bin_thresholds(), p)
        assert torch.equal(code.cpu(), want_code) and same_bits(moves.cpu(), want_moves)
    finally:
        round_to_grid.set_mode(previous)
