"""Tests of lowprec_demo.rounding against the exact reference (tests/exact_reference.py), torch's
casts and ml_dtypes' casts.

Three oracles:

* the exact reference (``fractions.Fraction``), always;
* torch's casts ``x.to(dtype)`` for fp32 input, where torch has the dtype (bfloat16, float16,
  float8_e4m3fn with saturation, float8_e5m2);
* ml_dtypes' casts for fp32 input, where ml_dtypes has the type (its float8_e4m3fn sends overflow
  to NaN, so it is compared with ``overflow="nan"``; its fp6 / fp4 types have no NaN and turn a NaN
  input into -0.0, while the package keeps NaN, so NaN inputs are left out of those comparisons).

``quantize`` takes a native shortcut (``x.to(dtype)``) for fp32 input to bf16 / fp16 / E4M3 / E5M2,
so the package's own code is also called directly (the round-to-nearest kernel
``rounding.round_to_grid.nearest_bits`` run eagerly, as ``quantize`` runs it where there is no native cast)
and checked against all three oracles.
Results are compared bit for bit in the output dtype, any NaN matching any NaN.

Statistical checks of stochastic rounding use fixed seeds and a 5-sigma binomial tolerance.
"""

import math
import os
import sys
from fractions import Fraction
from functools import lru_cache

import ml_dtypes
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_reference as ref

from lowprec_demo.rounding import round_to_grid as R
from lowprec_demo.formats import FloatFormat, get_format
from lowprec_demo.rounding.round_to_grid import LAYOUTS as BIT_LAYOUTS, nearest_bits, round_params
from lowprec_demo.rounding import move_probability, quantize, random_bits, ulp, update_ulp_ratio, would_freeze

SIGMAS = 5.0

# random bit patterns include signalling NaNs and numbers beyond float32: numpy warns on casting them
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tensors here are small: with several intra-op threads on a busy 2-core machine torch
    spends far more time waiting on its threads than computing (the suite runs ~15x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# ------------------------------------------------------------------------------------------------
# formats
# ------------------------------------------------------------------------------------------------
# every format of 16 bits or fewer that is checked exhaustively
EXHAUSTIVE = {
    "bf16": get_format("bf16"),
    "fp16": get_format("fp16"),
    "e4m3": get_format("e4m3"),
    "e5m2": get_format("e5m2"),
    "e3m2": get_format("e3m2"),
    "e2m3": get_format("e2m3"),
    "e2m1": get_format("e2m1"),
    "e5m3": get_format("e5m3"),
    "e3m4": get_format("e3m4"),
    "e4m3-ieee": FloatFormat(4, 3, name="e4m3-ieee"),
    "e2m0": get_format("e2m0"),
    "e3m0": get_format("e3m0"),
    "e8m0": get_format("e8m0"),
    "e8m3": get_format("e8m3"),
    "e3m1-fn": FloatFormat(3, 1, "fn", name="e3m1-fn"),
    "e4m2-finite": FloatFormat(4, 2, "finite", name="e4m2-finite"),
    "e2m0-finite": FloatFormat(2, 0, "finite", name="e2m0-finite"),
}
# wider formats, checked on random samples
WIDE = {
    "fp32": get_format("fp32"),
    "tf32": get_format("tf32"),
    "e5m23": get_format("e5m23"),
    "e7m20": get_format("e7m20"),
    "e6m5": get_format("e6m5"),
    "e8m15": get_format("e8m15"),
}
# formats fp32 cannot hold (their largest binade is 2**128): float64 input only
FP64_ONLY = {
    "e8m7-finite": FloatFormat(8, 7, "finite", name="e8m7-finite"),
    "e8m3-fn": FloatFormat(8, 3, "fn", name="e8m3-fn"),
}
ALL_FORMATS = {**EXHAUSTIVE, **WIDE}

# torch's CPU cast to float8_e4m3fn saturates (torch 2.13); older versions (2.11) give NaN
_E4M3_OVER = torch.tensor([1e4, math.inf]).to(torch.float8_e4m3fn).float()
TORCH_E4M3_POLICY = "saturate" if _E4M3_OVER.tolist() == [448.0, 448.0] else "nan"

# (E, m, kind) -> (torch dtype, the overflow policy of torch's CPU cast)
TORCH_CASTS = {
    (8, 7, "ieee"): (torch.bfloat16, "inf"),
    (5, 10, "ieee"): (torch.float16, "inf"),
    (4, 3, "fn"): (torch.float8_e4m3fn, TORCH_E4M3_POLICY),
    (5, 2, "ieee"): (torch.float8_e5m2, "inf"),
}
# (E, m, kind) -> (ml_dtypes type name, the overflow policy of ml_dtypes' cast)
ML_CASTS = {
    (8, 7, "ieee"): ("bfloat16", "inf"),
    (4, 3, "fn"): ("float8_e4m3fn", "nan"),
    (5, 2, "ieee"): ("float8_e5m2", "inf"),
    (4, 3, "ieee"): ("float8_e4m3", "inf"),
    (3, 4, "ieee"): ("float8_e3m4", "inf"),
    (3, 2, "finite"): ("float6_e3m2fn", "saturate"),
    (2, 3, "finite"): ("float6_e2m3fn", "saturate"),
    (2, 1, "finite"): ("float4_e2m1fn", "saturate"),
}


def _spec(fmt):
    return (fmt.exp_bits, fmt.man_bits, fmt.kind)


def policies(fmt):
    return ref.ref_format(fmt).policies


EXHAUSTIVE_CASES = [(k, p) for k, f in EXHAUSTIVE.items() for p in policies(f)]


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def generic_nearest(x, fmt, policy=None):
    """The package's own round-to-nearest (the kernel function run eagerly), as quantize runs it
    when there is no native cast."""
    layout = BIT_LAYOUTS[x.dtype]
    p = round_params(get_format(fmt), policy, layout=layout).tensor(x.device, layout)
    return nearest_bits(x.view(layout.itype), p).view(x.dtype)


def torch_cast(x32, fmt):
    dtype, _ = TORCH_CASTS[_spec(fmt)]
    return x32.to(dtype).double().numpy()


def ml_cast(xs, fmt):
    name, _ = ML_CASTS[_spec(fmt)]
    with np.errstate(all="ignore"):
        return np.asarray(xs, dtype=np.float32).astype(getattr(ml_dtypes, name)).astype(np.float64)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view({4: np.int32, 8: np.int64}[a.dtype.itemsize])


def assert_bits(actual, expected, inputs=None, what=""):
    """actual (tensor or array) equals expected (float64 values) bit for bit in actual's dtype;
    NaN matches NaN."""
    if isinstance(actual, torch.Tensor):
        if actual.dtype in (torch.bfloat16, torch.float16):
            actual = actual.float()  # exact
        actual = actual.detach().cpu().numpy()
    actual = np.asarray(actual).reshape(-1)
    expected = np.asarray(expected, dtype=np.float64).reshape(-1)
    assert actual.shape == expected.shape
    with np.errstate(all="ignore"):
        exp_cast = expected.astype(actual.dtype)
    representable = (exp_cast.astype(np.float64) == expected) | np.isnan(expected)
    assert representable.all(), "expected values must fit the output dtype"
    ok = (_bits(actual) == _bits(exp_cast)) | (np.isnan(actual) & np.isnan(exp_cast))
    if not ok.all():
        bad = np.flatnonzero(~ok)
        lines = []
        for i in bad[:10]:
            x = "" if inputs is None else f"x={float(np.asarray(inputs).reshape(-1)[i])!r} "
            lines.append(f"  {x}expected {expected[i]!r} got {float(actual[i])!r}")
        raise AssertionError(f"{what}: {len(bad)} of {len(ok)} differ\n" + "\n".join(lines))


def fp32_exact(values) -> np.ndarray:
    """float64 array of values that must all be float32 numbers."""
    xs = np.asarray([float(v) for v in values], dtype=np.float64)
    assert ((xs.astype(np.float32).astype(np.float64) == xs) | np.isnan(xs)).all()
    return xs


# ------------------------------------------------------------------------------------------------
# exhaustive points: every value, the points at 1/4, 1/2, 3/4 of every gap, the float32 numbers
# next to every tie, the overflow region, both signs, zeros, inf, NaN
# ------------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def exhaustive_points(key):
    r = ref.ref_format(EXHAUSTIVE[key])
    values = r.finite_values()
    pts, ties = [], []
    for a, b in zip(values[:-1], values[1:]):
        g = b - a
        pts += [a, a + g / 4, a + g / 2, a + 3 * g / 4]
        ties.append(a + g / 2)
    top = r.max
    up = r.next_up(top)  # the continued grid above max
    g = up - top
    beyond = [top + g / 4, top + g / 2, top + 3 * g / 4, up, up + r.spacing(up) / 2, 2 * up, 4 * up]
    # (for E = 8 the continued grid soon leaves float32: keep what float32 holds)
    pts += [top] + [b for b in beyond if b < 2**128 and float(np.float32(float(b))) == b]
    ties.append(top + g / 2)
    xs = fp32_exact(pts)
    ties32 = fp32_exact(ties).astype(np.float32)
    near = np.concatenate([np.nextafter(ties32, np.float32(0)), np.nextafter(ties32, np.float32(np.inf))])
    big = np.finfo(np.float32)
    specials = [0.0, np.inf, np.nan, float(big.max), float(big.smallest_subnormal), float(big.smallest_normal)]
    xs = np.concatenate([xs, near.astype(np.float64), specials])
    return np.concatenate([xs, -xs])


@lru_cache(maxsize=None)
def exhaustive_expected(key, policy):
    """The reference rounding of every exhaustive point. Points below max in magnitude round to at
    most max whatever the policy, so only the others are recomputed per policy."""
    fmt = EXHAUSTIVE[key]
    xs = exhaustive_points(key)
    default = ref.ref_format(fmt).default_overflow
    if policy == default:
        return ref.round_nearest_many(xs, fmt, policy)
    out = exhaustive_expected(key, default).copy()
    redo = ~(np.abs(xs) < fmt.max)
    out[redo] = ref.round_nearest_many(xs[redo], fmt, policy)
    return out


# ------------------------------------------------------------------------------------------------
# round to nearest: exhaustive
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,policy", EXHAUSTIVE_CASES)
def test_exhaustive_quantize_fp32(key, policy):
    fmt, xs = EXHAUSTIVE[key], exhaustive_points(key)
    expected = exhaustive_expected(key, policy)
    x = torch.from_numpy(xs.astype(np.float32))
    before = x.clone()
    assert_bits(quantize(x, fmt, overflow=policy), expected, xs, f"quantize fp32 {key} {policy}")
    assert_bits(quantize(x, fmt.with_overflow(policy)), expected, xs, f"quantize fp32 {key} {policy}")
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))


@pytest.mark.parametrize("key,policy", EXHAUSTIVE_CASES)
def test_exhaustive_generic_path_fp32(key, policy):
    """The package's generic code (not the native cast) against the reference, torch and ml_dtypes."""
    fmt, xs = EXHAUSTIVE[key], exhaustive_points(key)
    expected = exhaustive_expected(key, policy)
    x = torch.from_numpy(xs.astype(np.float32))
    ours = generic_nearest(x, fmt, policy)
    assert_bits(ours, expected, xs, f"generic fp32 {key} {policy}")
    if TORCH_CASTS.get(_spec(fmt), (None, None))[1] == policy:
        theirs = torch_cast(x, fmt)
        assert_bits(theirs.astype(np.float32), expected, xs, f"torch cast {key}")  # torch = reference
        assert_bits(ours, theirs, xs, f"generic fp32 vs torch {key}")
    if ML_CASTS.get(_spec(fmt), (None, None))[1] == policy:
        keep = ~np.isnan(xs) if not fmt.has_nan else np.ones(len(xs), bool)
        theirs = ml_cast(xs[keep], fmt)
        assert_bits(theirs.astype(np.float32), expected[keep], xs[keep], f"ml_dtypes cast {key}")
        assert_bits(ours[torch.from_numpy(keep)], theirs, xs[keep], f"generic fp32 vs ml_dtypes {key}")


@pytest.mark.parametrize("key,policy", EXHAUSTIVE_CASES)
def test_exhaustive_fp64(key, policy):
    """float64 input is rounded once, exactly: the same points give the same results."""
    fmt, xs = EXHAUSTIVE[key], exhaustive_points(key)
    expected = exhaustive_expected(key, policy)
    x = torch.from_numpy(xs)
    assert_bits(quantize(x, fmt, overflow=policy), expected, xs, f"quantize fp64 {key} {policy}")
    assert_bits(generic_nearest(x, fmt, policy), expected, xs, f"generic fp64 {key} {policy}")


def test_exhaustive_point_counts():
    """How many points the exhaustive tests check per format (documentation and a guard)."""
    counts = {k: len(exhaustive_points(k)) for k in EXHAUSTIVE}
    assert counts["bf16"] > 6 * 32000 * 2 and counts["fp16"] > 6 * 30000 * 2
    assert counts["e4m3"] > 6 * 120 * 2


# the formats a bfloat16 / float16 tensor can hold, decided from the formats' values alone: the
# extremes (range) and 1 + eps (precision) must survive a round trip through the dtype
def _fits(fmt, dtype):
    r = ref.ref_format(fmt)
    probes = [r.max, r.smallest_positive, 1 + r.eps, r.smallest_normal + r.smallest_positive]
    vals = np.array([float(v) for v in probes])
    back = torch.from_numpy(vals).float().to(dtype).double().numpy()
    return bool((back == vals).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_bf16_fp16_input(dtype):
    """All 65536 bit patterns of a bfloat16 / float16 tensor, rounded to every format the dtype can
    hold: the result stays in the dtype and equals the generic fp32 path (checked above), the
    ml_dtypes cast, and the reference on a sample. Formats the dtype cannot hold are refused."""
    x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    x32 = x.float()
    xs = x32.double().numpy()
    rng = np.random.default_rng(7)
    sample = rng.choice(len(xs), 1500, replace=False)
    for key, fmt in {**EXHAUSTIVE, **WIDE}.items():
        if not _fits(fmt, dtype):
            with pytest.raises(ValueError, match="float32 or float64 tensor|float64 tensor"):
                quantize(x, fmt)
            continue
        for policy in policies(fmt):
            out = quantize(x, fmt, overflow=policy)
            assert out.dtype == dtype and out.shape == x.shape
            assert_bits(out.float(), generic_nearest(x32, fmt, policy).double().numpy(), xs,
                        f"{dtype} input, {key} {policy}")
            if ML_CASTS.get(_spec(fmt), (None, None))[1] == policy:
                keep = ~np.isnan(xs) if not fmt.has_nan else np.ones(len(xs), bool)
                assert_bits(out.float()[torch.from_numpy(keep)], ml_cast(xs[keep], fmt), xs[keep],
                            f"{dtype} input vs ml_dtypes, {key}")
            expected = ref.round_nearest_many(xs[sample], fmt, policy)
            assert_bits(out.float()[torch.from_numpy(sample)], expected, xs[sample],
                        f"{dtype} input vs reference, {key} {policy}")


# ------------------------------------------------------------------------------------------------
# round to nearest: random samples over the whole range
# ------------------------------------------------------------------------------------------------
def random_fp32(n, seed):
    """Random bit patterns: every exponent equally likely, subnormals, zeros, inf and NaN included."""
    rng = np.random.default_rng(seed)
    xs = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([xs, np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32)])


def random_fp64(n, seed):
    rng = np.random.default_rng(seed)
    xs = rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64).view(np.float64)
    return np.concatenate([xs, np.array([0.0, -0.0, np.inf, -np.inf, np.nan])])


def focused(fmt, n, seed, dtype):
    """Random numbers with exponents from below the format's smallest subnormal to beyond its
    max, random signs and full random mantissas of the input dtype."""
    rng = np.random.default_rng(seed)
    r = ref.ref_format(fmt)
    lo_e, hi_e = r.e_min - r.m - 3, ref.floor_log2(r.max) + 3
    if dtype == np.float32:
        lo_e, hi_e, p = max(lo_e, -149), min(hi_e, 127), 23
    else:
        p = 52
    e = rng.integers(lo_e, hi_e + 1, n)
    mant = rng.integers(0, 2**p, n, dtype=np.int64)
    sign = rng.choice([-1.0, 1.0], n)
    with np.errstate(all="ignore"):
        xs = sign * np.ldexp((mant + 2**p).astype(np.float64), (e - p).astype(np.int32))
    return xs.astype(dtype)


LIBRARY_KEYS = [k for k, f in EXHAUSTIVE.items() if _spec(f) in TORCH_CASTS or _spec(f) in ML_CASTS]


@pytest.mark.parametrize("key", LIBRARY_KEYS)
def test_random_fp32_against_library_casts(key):
    """300k random bit patterns and 300k random numbers around the format's range, fp32 input:
    generic path and quantize against torch's and ml_dtypes' casts."""
    fmt = EXHAUSTIVE[key]
    xs = np.concatenate([random_fp32(300_000, 1), focused(fmt, 300_000, 2, np.float32)])
    x = torch.from_numpy(xs)
    if _spec(fmt) in TORCH_CASTS:
        policy = TORCH_CASTS[_spec(fmt)][1]
        theirs = torch_cast(x, fmt)
        assert_bits(generic_nearest(x, fmt, policy), theirs, xs, f"generic vs torch {key}")
        assert_bits(quantize(x, fmt, overflow=policy), theirs, xs, f"quantize vs torch {key}")
    if _spec(fmt) in ML_CASTS:
        policy = ML_CASTS[_spec(fmt)][1]
        keep = np.ones(len(xs), bool) if fmt.has_nan else ~np.isnan(xs)
        theirs = ml_cast(xs[keep], fmt)
        k = torch.from_numpy(keep)
        assert_bits(generic_nearest(x, fmt, policy)[k], theirs, xs[keep], f"generic vs ml_dtypes {key}")
        assert_bits(quantize(x, fmt, overflow=policy)[k], theirs, xs[keep], f"quantize vs ml_dtypes {key}")


RANDOM_CASES = [(k, p) for k, f in {**ALL_FORMATS, **FP64_ONLY}.items() for p in policies(f)]


@pytest.mark.parametrize("key,policy", RANDOM_CASES)
def test_random_against_reference(key, policy):
    """Random fp32 and fp64 inputs against the exact reference: 1000 random bit patterns and 2000
    numbers around the format's range per dtype (fp32 only where the format fits fp32)."""
    fmt = {**ALL_FORMATS, **FP64_ONLY}[key]
    seed = sum(map(ord, key + policy))
    dtypes = [np.float64] if key in FP64_ONLY else [np.float32, np.float64]
    for dtype in dtypes:
        rnd = random_fp32(1000, seed) if dtype == np.float32 else random_fp64(1000, seed)
        xs = np.concatenate([rnd, focused(fmt, 2000, seed + 1, dtype)])
        expected = ref.round_nearest_many(xs.astype(np.float64), fmt, policy)
        x = torch.from_numpy(xs)
        assert_bits(quantize(x, fmt, overflow=policy), expected, xs, f"quantize {dtype.__name__} {key} {policy}")
        assert_bits(generic_nearest(x, fmt, policy), expected, xs, f"generic {dtype.__name__} {key} {policy}")


@pytest.mark.parametrize("key", list(FP64_ONLY))
def test_formats_beyond_fp32_refuse_fp32_tensors(key):
    fmt = FP64_ONLY[key]
    x = torch.tensor([3.4e38, 1.0])
    with pytest.raises(ValueError, match="quantize a float64 tensor instead"):
        quantize(x, fmt)
    with pytest.raises(ValueError, match="float64 tensor"):
        quantize(x.bfloat16(), fmt)
    out = quantize(x.double(), fmt)
    assert out.dtype == torch.float64
    assert out.tolist() == [ref.round_nearest(float(np.float32(3.4e38)), fmt), 1.0] == [2.0**128, 1.0]
    assert out[0].item() > float(torch.finfo(torch.float32).max)


def test_mantissa_23_with_narrow_exponent_rounds_its_subnormals():
    """e5m23 has fp32's mantissa but fp16's exponent range: below 2**-14 its spacing is 2**-37,
    coarser than fp32's own, so fp32 input there must be rounded."""
    fmt = get_format("e5m23")
    xs = np.array([2.0**-20 * (1 + 2.0**-23), 2.0**-38 * 3, -(2.0**-38), 2.0**-15 + 2.0**-38], np.float32)
    expected = [2.0**-20, 2.0**-36, -0.0, 2.0**-15]
    assert ref.round_nearest_many(xs, fmt).tolist() == expected
    assert_bits(quantize(torch.from_numpy(xs), fmt), expected, xs, "e5m23 fp32")
    assert_bits(quantize(torch.from_numpy(xs).double(), fmt), expected, xs, "e5m23 fp64")


def test_no_mantissa_ties_agree_between_paths():
    """With m = 0 a tie between 2**e and 2**(e+1) goes to 2**(e+1) (the even multiple of the gap,
    as chop and CPFloat do), on the fp32 bit path (E = 8) as on the float64 path."""
    xs = np.array([1.5, 3.0, 6.0, 0.75, 2.0**-127, 2.0**-126 * 1.5], np.float32)
    expected = [2.0, 4.0, 8.0, 1.0, 0.0, 2.0**-125]
    fmt = get_format("e8m0")
    assert ref.round_nearest_many(xs, fmt).tolist() == expected
    assert_bits(quantize(torch.from_numpy(xs), fmt), expected, xs, "e8m0 fp32")
    assert_bits(quantize(torch.from_numpy(xs).double(), fmt), expected, xs, "e8m0 fp64")
    fmt = get_format("e3m0")  # e_min = -2
    xs = np.array([1.5, 3.0, 0.125, 0.1875], np.float32)
    expected = [2.0, 4.0, 0.0, 0.25]
    assert ref.round_nearest_many(xs, fmt).tolist() == expected
    assert_bits(quantize(torch.from_numpy(xs), fmt), expected, xs, "e3m0 fp32")


# ------------------------------------------------------------------------------------------------
# float64: rounded once (torch rounds twice, through float32; so did ml_dtypes before 0.7)
# ------------------------------------------------------------------------------------------------
# Measured: ml_dtypes 0.6.0 casts float64 through float32, 0.7.0 rounds it once.
ML_DTYPES_ROUNDS_FP64_ONCE = tuple(int(p) for p in ml_dtypes.__version__.split(".")[:2]) >= (0, 7)

def _double_rounding_inputs(fmt):
    """float64 numbers just off a tie of the format: float32 cannot hold the offset, so a cast
    through float32 lands on the tie and rounds to even, which is the wrong neighbour half the time."""
    r = ref.ref_format(fmt)
    xs = []
    for v in (1, 3, 5 * r.smallest_normal, r.smallest_normal, r.max / 2):
        v = r.rne_magnitude(Fraction(v))  # a grid value
        for lo in (v, r.next_up(v)):  # one even, one odd
            if r.next_up(lo) > r.max:  # (beyond max both routes overflow alike)
                continue
            g = r.next_up(lo) - lo
            tiny = g * Fraction(1, 2**30)
            # lo even: a float32 tie rounds down, but the exact value is above the tie: up
            # lo odd: a float32 tie rounds up, but the exact value is below the tie: down
            xs += [lo + g / 2 + tiny, lo + g / 2 - tiny]
    xs = [float(x) for x in xs]
    return np.array(xs + [-x for x in xs])


@pytest.mark.parametrize("key", ["bf16", "fp16", "e4m3", "e5m2", "e4m3-ieee", "e3m4", "e3m2", "e2m3", "e2m1"])
def test_fp64_is_rounded_once_where_libraries_round_twice(key):
    fmt = EXHAUSTIVE[key]
    xs = _double_rounding_inputs(fmt)
    expected = ref.round_nearest_many(xs, fmt)
    x = torch.from_numpy(xs)
    assert_bits(quantize(x, fmt), expected, xs, f"quantize fp64 {key}")
    # the same numbers through float32 first: every one lands on a tie and half go wrong
    via32 = ref.round_nearest_many(xs.astype(np.float32), fmt)
    assert (via32 != expected).sum() == len(xs) // 2
    # documented library behaviour: their fp64 casts are the float32 route
    if _spec(fmt) in TORCH_CASTS and TORCH_CASTS[_spec(fmt)][1] == fmt.overflow:
        theirs = x.to(TORCH_CASTS[_spec(fmt)][0]).double().numpy()
        assert (theirs != expected).sum() == len(xs) // 2
        assert_bits(theirs, via32, xs, "torch fp64 cast = float32 route")
    if _spec(fmt) in ML_CASTS and ML_CASTS[_spec(fmt)][1] == fmt.overflow:
        theirs = xs.astype(getattr(ml_dtypes, ML_CASTS[_spec(fmt)][0])).astype(np.float64)
        if ML_DTYPES_ROUNDS_FP64_ONCE:  # 0.7 and later: one rounding, the package's answer
            assert_bits(theirs, expected, xs, f"ml_dtypes {ml_dtypes.__version__} fp64 cast = rounded once")
        else:  # before 0.7: the float32 route
            assert (theirs != expected).sum() == len(xs) // 2
            assert_bits(theirs, via32, xs, f"ml_dtypes {ml_dtypes.__version__} fp64 cast = float32 route")


# ------------------------------------------------------------------------------------------------
# special values, overflow, sign of zero
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,below,above,at_max,policy_results", [
    # the overflow boundary is max + half a gap of the continued grid
    ("e5m2", 61439.0, 61440.0, 57344.0, {"inf": math.inf, "saturate": 57344.0, "nan": math.nan}),
    ("fp16", 65519.0, 65520.0, 65504.0, {"inf": math.inf, "saturate": 65504.0, "nan": math.nan}),
    ("bf16", float.fromhex("0x1.fefffep+127"), float.fromhex("0x1.ff0000p+127"), 3.3895313892515355e38,
     {"inf": math.inf, "saturate": 3.3895313892515355e38, "nan": math.nan}),
    # E4M3: 464 is the tie between 448 and the NaN pattern's 480 and goes to 448 (even)
    ("e4m3", 464.0, float(np.nextafter(np.float32(464), np.float32(500))), 448.0,
     {"saturate": 448.0, "nan": math.nan}),
    ("e2m1", 6.5, 7.0, 6.0, {"saturate": 6.0}),
    ("e3m2", 29.5, 30.0, 28.0, {"saturate": 28.0}),
    ("e2m3", 7.75, 7.75 + 2.0**-20, 7.5, {"saturate": 7.5}),
])
def test_overflow_boundary(name, below, above, at_max, policy_results):
    fmt = get_format(name)
    for policy, over in policy_results.items():
        for dtype in (torch.float32, torch.float64):
            x = torch.tensor([below, above, -below, -above, math.inf, -math.inf], dtype=dtype)
            expected = [at_max, over, -at_max, -over, over, -over]
            assert_bits(quantize(x, fmt, overflow=policy), expected, None, f"{name} {policy} {dtype}")
            if dtype == torch.float32:
                assert_bits(generic_nearest(x, fmt, policy), expected, None, f"{name} generic {policy}")
            assert ref.round_nearest_many(x.double().numpy(), fmt, policy).tolist() == pytest.approx(
                expected, nan_ok=True)


def test_e5m2_example_from_the_notes():
    x = torch.tensor([61439.0, 61440.0])
    assert quantize(x, "e5m2").tolist() == [57344.0, math.inf]
    assert torch.tensor([61439.0, 61440.0]).to(torch.float8_e5m2).float().tolist() == [57344.0, math.inf]
    assert quantize(x, "e4m3").tolist() == [448.0, 448.0]
    assert torch.isnan(quantize(x, "e4m3", overflow="nan")).all()


def test_e4m3_saturates_whatever_torch_does():
    """The package's E4M3 rule (saturate) does not depend on how this torch version casts."""
    assert TORCH_E4M3_POLICY in ("saturate", "nan")
    x = torch.tensor([464.0, 464.0001, 1e4, math.inf, -math.inf, -500.0])
    assert quantize(x, "e4m3").tolist() == [448.0, 448.0, 448.0, 448.0, -448.0, -448.0]
    assert R._cpu_cast_saturates(torch.float8_e4m3fn) == (TORCH_E4M3_POLICY == "saturate")


@pytest.mark.parametrize("key", list(ALL_FORMATS))
def test_sign_of_zero_is_kept(key):
    fmt = ALL_FORMATS[key]
    tiny = float(ref.ref_format(fmt).smallest_positive) / 4
    for dtype in (torch.float32, torch.float64):
        x = torch.tensor([0.0, -0.0, tiny, -tiny], dtype=dtype)
        for rounding in ("nearest", "stochastic"):
            y = quantize(x, fmt, rounding, generator=0)
            if rounding == "nearest":
                assert_bits(y, [0.0, -0.0, 0.0, -0.0], None, f"{key} {dtype}")
            else:
                assert_bits(y[:2], [0.0, -0.0], None, f"{key} {dtype} SR")
                assert torch.signbit(y).tolist() == [False, True, False, True]
    if _fits(fmt, torch.bfloat16):
        y = quantize(torch.tensor([0.0, -0.0], dtype=torch.bfloat16), fmt)
        assert torch.signbit(y).tolist() == [False, True]


@pytest.mark.parametrize("key", list(ALL_FORMATS))
def test_nan_stays_nan_and_infinities_follow_the_policy(key):
    fmt = ALL_FORMATS[key]
    for policy in policies(fmt):
        over = {"inf": math.inf, "saturate": fmt.max, "nan": math.nan}[policy]
        for dtype in (torch.float32, torch.float64):
            x = torch.tensor([math.nan, -math.nan, math.inf, -math.inf], dtype=dtype)
            for rounding in ("nearest", "stochastic"):
                y = quantize(x, fmt, rounding, generator=1, overflow=policy)
                assert_bits(y, [math.nan, math.nan, over, -over], None, f"{key} {policy} {rounding}")


# ------------------------------------------------------------------------------------------------
# ulp
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", list(EXHAUSTIVE))
def test_ulp_exhaustive(key):
    fmt, xs = EXHAUSTIVE[key], exhaustive_points(key)
    expected = np.array([ref.ulp(x, fmt) for x in xs])
    for dtype in (torch.float32, torch.float64):
        assert_bits(ulp(torch.from_numpy(xs).to(dtype), fmt), expected, xs, f"ulp {key} {dtype}")


@pytest.mark.parametrize("key", list(ALL_FORMATS) + list(FP64_ONLY))
def test_ulp_random(key):
    fmt = {**ALL_FORMATS, **FP64_ONLY}[key]
    dtypes = [np.float64] if key in FP64_ONLY else [np.float32, np.float64]
    for dtype in dtypes:
        rnd = random_fp32(500, 3) if dtype == np.float32 else random_fp64(500, 3)
        xs = np.concatenate([rnd, focused(fmt, 1500, 4, dtype)])
        expected = np.array([ref.ulp(x, fmt) for x in xs.astype(np.float64)])
        assert_bits(ulp(torch.from_numpy(xs), fmt), expected, xs, f"ulp {key} {dtype.__name__}")


def test_ulp_examples_and_narrow_input():
    assert ulp(torch.tensor([1.0, 1.5, 2.0, 0.0, 448.0]), "e4m3").tolist() == [0.125, 0.125, 0.25, 2.0**-9, 32.0]
    y = ulp(torch.tensor([1.0, 0.0, 2.0**-130], dtype=torch.bfloat16), "bf16")
    assert y.dtype == torch.bfloat16 and y.float().tolist() == [2.0**-7, 2.0**-133, 2.0**-133]
    y = ulp(torch.tensor([1.0, 65504.0], dtype=torch.float16), "e5m2")
    assert y.dtype == torch.float16 and y.float().tolist() == [0.25, 8192.0]


# ------------------------------------------------------------------------------------------------
# the freeze rule: would_freeze, update_ulp_ratio, move_probability
# ------------------------------------------------------------------------------------------------
FREEZE_FORMATS = {k: ALL_FORMATS[k] for k in
                  ["bf16", "fp16", "e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "e5m3", "e4m3-ieee", "e3m0",
                   "e2m0", "e8m0", "e8m3", "e3m1-fn", "tf32", "fp32", "e5m23"]}


def _landmark_weights(r: "ref.RefFormat", rng, n_random):
    """Grid values where the freeze rule has edges, and random grid values."""
    sub, sn = r.smallest_positive, r.smallest_normal
    ws = {Fraction(0), sub, 2 * sub, 3 * sub, sn, r.next_up(sn), 2 * sn, 4 * sn, r.max, r.next_down(r.max),
          ref.pow2(ref.floor_log2(r.max)), r.next_down(sn) if sn > 0 else sn}
    for v in (1, 2, 3, 4, Fraction(3, 2)):
        v = Fraction(v)
        if v <= r.max and r.on_grid(v):
            ws |= {v, r.next_up(v) if r.next_up(v) <= r.max else v, r.next_down(v)}
    ws = {w for w in ws if w <= r.max and r.on_grid(w)}
    if r.E + r.m <= 7:
        ws |= set(r.finite_values())
    else:
        top = ref.floor_log2(r.max)
        for _ in range(n_random):
            e = int(rng.integers(r.e_min - 1, top + 1))
            if e < r.e_min:  # subnormal
                w = int(rng.integers(1, 2**r.m)) * ref.pow2(r.e_min - r.m) if r.m else sn
            else:
                w = (2**r.m + int(rng.integers(0, 2**r.m))) * ref.pow2(e - r.m)
            if w <= r.max:
                ws.add(w)
    return sorted(ws)


D_FRACTIONS = [Fraction(0), Fraction(1, 2**20), Fraction(1, 4), Fraction(1, 2) - Fraction(1, 2**11),
               Fraction(1, 2), Fraction(1, 2) + Fraction(1, 2**11), Fraction(3, 4), Fraction(1),
               Fraction(3, 2), Fraction(2)]


@lru_cache(maxsize=None)
def freeze_edge_cases(key, dtype_name):
    """(w, d) pairs: every landmark weight, both signs, with updates that are fixed fractions of
    the gap on each side (outward and toward zero), kept where the dtype holds d exactly."""
    fmt = FREEZE_FORMATS[key]
    r = ref.ref_format(fmt)
    rng = np.random.default_rng(11)
    np_dtype = {"float32": np.float32, "float64": np.float64}[dtype_name]
    pairs = []
    for w in _landmark_weights(r, rng, 40):
        for sign in (1, -1):
            wf = sign * float(w)
            for outward in (True, False):
                if w == 0 and not outward:
                    continue
                dir_sign = sign if outward else -sign
                g = ref.side_gap(wf, dir_sign, fmt)
                for frac in D_FRACTIONS:
                    d = float(dir_sign * g * frac)
                    if Fraction(d) == dir_sign * g * frac and float(np_dtype(d)) == d:
                        pairs.append((wf, d))
            pairs += [(wf, math.inf), (wf, -math.inf)]
    return pairs


def _check_freeze_functions(fmt, pairs, dtype, what, brute_force=False, rand_bits=(None, 1, 3, 8)):
    w = torch.tensor([p[0] for p in pairs], dtype=dtype)
    d = torch.tensor([p[1] for p in pairs], dtype=dtype)
    finite = [math.isfinite(p[0]) and math.isfinite(p[1]) for p in pairs]
    for policy in policies(fmt):
        got = would_freeze(w, d, fmt, overflow=policy).tolist()
        want = [ref.would_freeze(a, b, fmt, policy) for a, b in pairs]
        # an infinite weight is a stored value of the format's own policy only
        keep = [policy == fmt.overflow or math.isfinite(p[0]) for p in pairs]
        bad = [(p, x, y) for p, x, y, k in zip(pairs, want, got, keep) if k and x != y]
        assert not bad, f"would_freeze {what} {policy}: {len(bad)} differ, e.g. (w, d, expected, got) {bad[:6]}"
        if brute_force:
            brute = (quantize(w.double() + d.double(), fmt, overflow=policy) == w.double()).tolist()
            bad = [(p, x, y) for p, x, y, f in zip(pairs, brute, got, finite) if f and x != y]
            assert not bad, f"would_freeze vs quantize(w + d) {what} {policy}: {bad[:6]}"
    got = update_ulp_ratio(w, d, fmt).tolist()
    want = [float(ref.update_ulp_ratio(*p, fmt)) if f else None for p, f in zip(pairs, finite)]
    bad = [(p, x, y) for p, x, y, f in zip(pairs, want, got, finite) if f and x != y]
    assert not bad, f"update_ulp_ratio {what}: {len(bad)} differ, e.g. {bad[:6]}"
    for k in rand_bits:
        got = move_probability(w, d, fmt, rand_bits=k).tolist()
        want = [float(ref.move_probability(a, b, fmt, rand_bits=k)) for a, b in pairs]
        bad = [(p, x, y) for p, x, y in zip(pairs, want, got) if x != y and not (math.isnan(x) and math.isnan(y))]
        assert not bad, f"move_probability {what} rand_bits={k}: {len(bad)} differ, e.g. {bad[:6]}"


@pytest.mark.parametrize("key", list(FREEZE_FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_freeze_rule_edges(key, dtype):
    """Ties at exactly half a gap (even and odd w), the power-of-two edge (toward zero the grid is
    twice as fine), zero, subnormals, the smallest normal, max under each overflow policy,
    infinite updates."""
    fmt = FREEZE_FORMATS[key]
    pairs = freeze_edge_cases(key, str(dtype).split(".")[1])
    if fmt.has_inf:
        pairs = pairs + [(s * math.inf, d) for s in (1, -1) for d in (1.0, -1.0, 0.0, math.inf, -math.inf)]
    pairs = pairs + [(1.0, math.nan), (0.0, math.nan)]
    _check_freeze_functions(fmt, pairs, dtype, f"{key} {dtype}", brute_force=(dtype == torch.float32),
                            rand_bits=(None, 3))


@pytest.mark.parametrize("key", list(FREEZE_FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_freeze_rule_random_pairs(key, dtype):
    """Random grid weights with updates from 2**-30 to 2**2 gaps, both signs."""
    fmt = FREEZE_FORMATS[key]
    r = ref.ref_format(fmt)
    rng = np.random.default_rng(sum(map(ord, key)) + (dtype == torch.float64))
    ws = [w for w in _landmark_weights(r, rng, 600) if w > 0]
    ws = [float(w) for w in rng.choice(np.array(ws, dtype=object), 600)]
    signs = rng.choice([-1.0, 1.0], (600, 2))
    scales = 2.0 ** rng.uniform(-30, 2, 600)
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    pairs = []
    for w, (sw, sd), s in zip(ws, signs, scales):
        d = float(np_dtype(sd * ref.ulp(w, fmt) * s))
        pairs.append((sw * w, d))
    _check_freeze_functions(fmt, pairs, dtype, f"random {key} {dtype}", brute_force=(dtype == torch.float32))


def test_freeze_rule_worked_examples():
    """bf16 at w = 1 (ulp 2**-7): upward the threshold is half an ulp, toward zero a quarter."""
    one = torch.ones(6)
    d = torch.tensor([2.0**-8, 2.0**-8 + 2.0**-20, -(2.0**-9), -(2.0**-9) - 2.0**-20, 2.0**-9, -(2.0**-10)])
    assert would_freeze(one, d, "bf16").tolist() == [True, False, True, False, True, True]
    assert update_ulp_ratio(one, d, "bf16").tolist() == [0.5, 0.5 + 2.0**-13, 0.5, 0.5 + 2.0**-12, 0.25, 0.25]
    # an odd w moves at a tie: 1 + 2**-7 with +-2**-8 goes to the even neighbour
    odd = torch.full((2,), 1 + 2.0**-7)
    assert would_freeze(odd, torch.tensor([2.0**-8, -(2.0**-8)]), "bf16").tolist() == [False, False]
    # AdamW's decay lr * wd * w cannot move a bf16 weight when lr * wd < 2**-9 (science notes)
    w = torch.tensor([1.0, 1.5, 1.9921875])
    assert would_freeze(w, -w * (2.0**-9 - 2.0**-20), "bf16").all()
    # a bf16 EMA with beta2 = 0.999 never decays: 0.999 v rounds back to v
    v = quantize(torch.tensor([1.0, 0.3, 1e-3, 123.0]), "bf16")
    assert torch.equal(quantize(0.999 * v.double(), "bf16"), v.double())
    # E4M3 at max: saturation keeps 448 under any outward update; inf / nan policies do not
    w, d = torch.tensor([448.0, 448.0]), torch.tensor([16.0, 17.0])
    assert would_freeze(w, d, "e4m3").tolist() == [True, True]
    assert would_freeze(w, d, "e4m3", overflow="nan").tolist() == [True, False]
    assert move_probability(w, d, "e4m3").tolist() == [0.0, 0.0]
    assert would_freeze(torch.tensor([57344.0] * 2), torch.tensor([4095.0, 4096.0]), "e5m2").tolist() == [True, False]


def test_would_freeze_rounds_the_weight_first():
    w = torch.tensor([1.001, 1.3, -2.7, 1e-42])
    d = torch.tensor([1e-3, -1e-3, 3e-3, 1e-44])
    for fmt in ("bf16", "e4m3", "fp16"):
        q = quantize(w, fmt)
        assert torch.equal(would_freeze(w, d, fmt), would_freeze(q, d, fmt))
        assert torch.equal(update_ulp_ratio(w, d, fmt), update_ulp_ratio(q, d, fmt))
        assert torch.equal(move_probability(w, d, fmt), move_probability(q, d, fmt))


def test_freeze_functions_broadcast_and_promote():
    w = torch.ones(3, 1)
    d = torch.tensor([1e-3, 1e-2], dtype=torch.float64)
    assert would_freeze(w, d, "bf16").shape == (3, 2)
    assert would_freeze(w, d, "bf16").dtype == torch.bool
    assert update_ulp_ratio(w, d, "bf16").dtype == torch.float64
    assert move_probability(w.bfloat16(), d.float(), "bf16").dtype == torch.float32
    assert would_freeze(torch.tensor(1.0), torch.tensor(1e-3), "bf16").shape == ()


# ------------------------------------------------------------------------------------------------
# stochastic rounding
# ------------------------------------------------------------------------------------------------
def _binomial_ok(count, n, p):
    p = float(p)
    if p in (0.0, 1.0):
        return count == n * p
    return abs(count - n * p) <= SIGMAS * math.sqrt(n * p * (1 - p)) + 1


def check_sr_distribution(x, fmt, dtype, n, seed, rand_bits=None, overflow=None, what=""):
    """quantize(stochastic) of n copies of x: every result is an outcome of the exact distribution
    and every outcome's frequency is within 5 sigma of its probability."""
    t = torch.full((n,), x, dtype=dtype)
    assert t[0].item() == x or math.isnan(x)
    y = quantize(t, fmt, "stochastic", generator=seed, rand_bits=rand_bits, overflow=overflow)
    assert y.dtype == dtype and y.shape == t.shape
    outcomes = ref.sr_outcomes(x, fmt, overflow, rand_bits)
    yv = y.double().numpy()
    accounted = np.zeros(n, bool)
    for value, p in outcomes:
        hit = np.isnan(yv) if math.isnan(value) else (_bits(yv) == _bits(np.array([value])))
        count = int(hit.sum())
        accounted |= hit
        assert _binomial_ok(count, n, p), f"{what} x={x!r}: {value!r} {count}/{n} times, p={float(p)}"
    assert accounted.all(), f"{what} x={x!r}: results {np.unique(yv[~accounted])[:5]} are not neighbours"
    return y


def sr_points(fmt):
    """Points where SR has something to show: normal, power-of-two edges, subnormal, negative,
    beyond max, on the grid."""
    r = ref.ref_format(fmt)
    eps, sub, sn = r.eps, r.smallest_positive, r.smallest_normal
    one = Fraction(1) if r.on_grid(Fraction(1)) and r.max > 2 else r.smallest_normal
    up = r.next_up(r.max)
    pts = [one + eps * one * Fraction(5, 16), one + eps * one / 2, one - r.spacing(one / 2) * Fraction(3, 16),
           2 * one + 2 * eps * one * Fraction(13, 16), -(one + eps * one * Fraction(11, 16)),
           sub * Fraction(3, 8), -sub * Fraction(21, 8), sn - sub / 4, 2 * sn - r.spacing(sn) / 8,
           r.max - r.spacing(r.max) * Fraction(3, 8), r.max + (up - r.max) * Fraction(3, 8),
           -(r.max + (up - r.max) * Fraction(7, 8)), one + eps * one]
    out = []
    for p in pts:
        f = float(p)
        if Fraction(f) == p and float(np.float32(f)) == f and math.isfinite(f):
            out.append(f)
    return out


SR_FORMATS = {k: ALL_FORMATS[k] for k in
              ["bf16", "fp16", "e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "tf32", "e8m3", "e3m0", "e8m0",
               "e5m3", "e4m3-ieee", "e3m1-fn", "e5m23"]}


@pytest.mark.parametrize("key", list(SR_FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sr_frequencies_match_exact_probabilities(key, dtype):
    fmt = SR_FORMATS[key]
    pts = sr_points(fmt)
    assert len(pts) >= (3 if fmt.man_bits > 20 else 10)  # (fp32 holds few points for m = 23)
    for i, x in enumerate(pts):
        check_sr_distribution(x, fmt, dtype, 40_000, seed=1000 + i, what=f"{key} {dtype}")


@pytest.mark.parametrize("key,policy", [("e4m3", "nan"), ("e4m3", "saturate"), ("e5m2", "inf"),
                                        ("e5m2", "saturate"), ("e5m2", "nan"), ("bf16", "saturate"),
                                        ("bf16", "inf"), ("e2m1", "saturate"), ("e8m3", "nan")])
def test_sr_overflow_policies(key, policy):
    fmt = ALL_FORMATS[key]
    r = ref.ref_format(fmt)
    up = r.next_up(r.max)
    for frac in (Fraction(1, 8), Fraction(5, 8)):
        x = float(r.max + (up - r.max) * frac)
        for dtype in (torch.float32, torch.float64):
            check_sr_distribution(x, fmt, dtype, 20_000, seed=5, overflow=policy, what=f"{key} {policy}")
            check_sr_distribution(-x, fmt, dtype, 20_000, seed=6, overflow=policy, what=f"{key} {policy}")


@pytest.mark.parametrize("key", list(SR_FORMATS) + list(FP64_ONLY))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sr_random_inputs_land_on_neighbours(key, dtype):
    """1000 random inputs (random bit patterns and numbers around the format's range), 50 draws
    each: every result is one of the input's two neighbours (after the overflow policy), and the
    number of moves away from zero matches the sum of the exact probabilities."""
    fmt = {**SR_FORMATS, **FP64_ONLY}[key]
    if key in FP64_ONLY and dtype == torch.float32:
        pytest.skip("fp32 cannot hold this format")
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    seed = sum(map(ord, key))
    rnd = random_fp32(300, seed) if dtype == torch.float32 else random_fp64(300, seed)
    xs = np.concatenate([rnd, focused(fmt, 700, seed + 1, np_dtype)])
    reps = 50
    x = torch.from_numpy(xs).repeat(reps)
    y = quantize(x, fmt, "stochastic", generator=torch.Generator().manual_seed(seed)).double().numpy()
    y = y.reshape(reps, -1)
    total_p = total_var = 0.0
    away = 0
    for j, xv in enumerate(xs.astype(np.float64)):
        outcomes = ref.sr_outcomes(float(xv), fmt)
        col = y[:, j]
        ok = np.zeros(reps, bool)
        for value, _ in outcomes:
            ok |= np.isnan(col) if math.isnan(value) else (_bits(col) == _bits(np.array([value])))
        assert ok.all(), f"{key} {dtype}: x={float(xv)!r} gave {col[~ok][:3]}, outcomes {outcomes}"
        if math.isfinite(xv) and abs(xv) <= fmt.max:
            lo, hi = ref.neighbours(float(xv), fmt)
            if lo != hi:
                p = float(ref.sr_probability_away(float(xv), fmt))
                total_p += reps * p
                total_var += reps * p * (1 - p)
                away += int((col == hi).sum())
    assert abs(away - total_p) <= SIGMAS * math.sqrt(total_var) + 1, (away, total_p, total_var)


@pytest.mark.parametrize("key", ["bf16", "e4m3", "e5m2", "fp16", "tf32", "e2m1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sr_is_unbiased(key, dtype):
    """E[q(x)] = x: the sample mean is within 5 standard errors of x, for single values (fp64: with
    probabilities that are no short binary fraction) and summed over a vector of random values."""
    fmt = ALL_FORMATS[key]
    r = ref.ref_format(fmt)
    n = 100_000
    xs = [1 + float(r.eps) / 3, -(3 + float(r.eps) * 0.7), float(r.max) * 0.61]
    for x in xs:
        x = float(np.float32(x)) if dtype == torch.float32 else x
        y = quantize(torch.full((n,), x, dtype=dtype), fmt, "stochastic", generator=42).double()
        lo, hi = ref.neighbours(x, fmt)
        p = float(ref.sr_probability_away(x, fmt))
        se = abs(hi - lo) * math.sqrt(p * (1 - p) / n)
        assert abs(y.mean().item() - x) <= SIGMAS * se, (key, x, y.mean().item(), se)
    # many values at once, all inside the range
    rng = np.random.default_rng(3)
    v = rng.uniform(-float(r.max) / 2, float(r.max) / 2, 200_000).astype(np.float32 if dtype == torch.float32 else np.float64)
    y = quantize(torch.from_numpy(v), fmt, "stochastic", generator=9).double().numpy()
    gaps = ulp(torch.from_numpy(v), fmt).double().numpy()
    # the variance of each draw is at most gap**2 / 4
    bound = SIGMAS * math.sqrt((gaps**2 / 4).sum())
    assert abs((y - v.astype(np.float64)).sum()) <= bound


def test_sr_on_grid_is_exact():
    for fmt in SR_FORMATS.values():
        r = ref.ref_format(fmt)
        vals = [0.0, float(r.smallest_positive), float(r.smallest_normal), float(r.max), 1.0]
        vals = [v for v in vals if v <= float(r.max)]
        for dtype in (torch.float32, torch.float64):
            x = torch.tensor(vals + [-v for v in vals], dtype=dtype).repeat(100)
            for k in (None, 1, 4):
                assert torch.equal(quantize(x, fmt, "stochastic", generator=3, rand_bits=k), x)


# --- few-bit SR ----------------------------------------------------------------------------------
FEW_BIT_PATHS = {
    # the one stochastic-rounding kernel on float32 and float64 bit patterns
    "fp32-bits-bf16": ("bf16", torch.float32),
    "fp64-bf16": ("bf16", torch.float64),
    "fp32-e4m3": ("e4m3", torch.float32),
    "fp32-fp16": ("fp16", torch.float32),
    "fp64-e5m2": ("e5m2", torch.float64),
}


@pytest.mark.parametrize("path", list(FEW_BIT_PATHS))
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_few_bit_sr_probabilities(path, k):
    """With k random bits the probability is round_half_even(frac * 2**k) / 2**k, frac the
    position in the gap: checked at every multiple of a quarter step (ties at half steps
    included), outward from 1, toward zero from 2 (the finer grid below a power of two) and for
    negative values."""
    name, dtype = FEW_BIT_PATHS[path]
    fmt = get_format(name)
    r = ref.ref_format(fmt)
    eps = r.eps
    js = list(range(2 ** (k + 2) + 1)) if k <= 3 else \
        [0, 1, 2, 3, 5, 6, 7, 2**(k + 1) - 2, 2**(k + 1) - 1, 2**(k + 1), 2**(k + 1) + 1, 2**(k + 1) + 2,
         2**(k + 2) - 2, 2**(k + 2) - 1]
    n = 20_000
    for j in js:
        frac = Fraction(j, 2 ** (k + 2))
        for x in (1 + eps * frac, -(1 + eps * frac), 2 - eps * frac):
            x = float(x)
            assert float(np.float32(x)) == x
            p = ref.sr_probability_away(x, fmt, rand_bits=k)
            lo, hi = ref.neighbours(x, fmt)
            if lo != hi:
                assert p == Fraction(ref.round_half_even((abs(Fraction(x)) - abs(Fraction(lo))) / abs(Fraction(hi - lo)) * 2**k), 2**k)
            check_sr_distribution(x, fmt, dtype, n, seed=j, rand_bits=k, what=f"{path} k={k}")
        # the freeze rule's view of the same thing
        w = torch.tensor([1.0, -1.0, 2.0], dtype=dtype)
        d = torch.tensor([float(eps * frac), -float(eps * frac), -float(eps * frac)], dtype=dtype)
        got = move_probability(w, d, fmt, rand_bits=k).tolist()
        want = [float(ref.move_probability(a, b, fmt, rand_bits=k)) for a, b in zip(w.tolist(), d.tolist())]
        assert got == want, (path, k, j, got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", list(range(1, 15)))
def test_few_bit_sr_freezes_below_half_a_step(k, dtype):
    """1.0 + 2**-(7+k+2) in bf16 (a quarter of a k-bit step) never moves with k random bits, nor
    does the exact half step (round half to even gives 0); just above half a step it does."""
    n = 20_000
    for x in (1 + 2.0 ** -(7 + k + 2), 1 + 2.0 ** -(7 + k + 1), -(1 + 2.0 ** -(7 + k + 2))):
        y = quantize(torch.full((n,), x, dtype=dtype), "bf16", "stochastic", generator=k, rand_bits=k)
        assert (y.abs() == 1.0).all(), (k, x)
    # exact SR does move it
    x = 1 + 2.0 ** -(7 + k + 2)
    p = 2.0 ** -(k + 2)
    y = quantize(torch.full((n,), x, dtype=dtype), "bf16", "stochastic", generator=k)
    if n * p >= 50:
        assert _binomial_ok(int((y != 1).sum()), n, p)
    if k <= 8:
        x = 1 + 2.0 ** -(7 + k + 1) + 2.0 ** -(7 + k + 3)
        y = quantize(torch.full((n,), x, dtype=dtype), "bf16", "stochastic", generator=k, rand_bits=k)
        assert _binomial_ok(int((y != 1).sum()), n, 2.0**-k)


@pytest.mark.parametrize("k", [16, 20, 24, 32])
def test_many_random_bits_are_exact_for_float32(k):
    """k at least the dropped bits: few-bit SR is exact SR for float32 input."""
    x = 1 + 2.0**-7 * (1 / 3)
    x = float(np.float32(x))
    for dtype in (torch.float32, torch.float64):
        p = ref.sr_probability_away(x, get_format("bf16"), rand_bits=k)
        assert p == ref.sr_probability_away(x, get_format("bf16"))
        check_sr_distribution(x, get_format("bf16"), dtype, 40_000, seed=k, rand_bits=k, what=f"k={k}")


# --- reproducibility -----------------------------------------------------------------------------
REPRO_CASES = [("bf16", torch.float32), ("bf16", torch.float64), ("e4m3", torch.float32),
               ("e5m2", torch.float64), ("e4m3", torch.bfloat16), ("e5m2", torch.float16)]


@pytest.mark.parametrize("name,dtype", REPRO_CASES)
def test_sr_reproducible(name, dtype):
    torch.manual_seed(0)
    x = (torch.rand(4096, dtype=torch.float64) * 4 - 2).to(dtype)

    def q(g, **kw):
        return quantize(x, name, "stochastic", generator=g, **kw)

    a = q(torch.Generator().manual_seed(123))
    b = q(torch.Generator().manual_seed(123))
    assert torch.equal(a, b)
    c = q(torch.Generator().manual_seed(124))
    assert not torch.equal(a, c)
    assert torch.equal(q(77), q(77)) and not torch.equal(q(77), q(78))
    assert torch.equal(q(77, rand_bits=3), q(77, rand_bits=3))
    # a generator advances: two calls in a row differ, and replaying from a saved state repeats them
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    first, second = q(g), q(g)
    assert not torch.equal(first, second)
    assert not torch.equal(g.get_state(), state)
    g.set_state(state)
    assert torch.equal(q(g), first) and torch.equal(q(g), second)
    # None draws from torch's default generator
    torch.manual_seed(99)
    d1 = q(None)
    torch.manual_seed(99)
    assert torch.equal(q(None), d1)
    # the draws depend on the element's position only: a non-contiguous view draws like its copy
    x2 = x.reshape(64, 64).t()
    assert not x2.is_contiguous()
    assert torch.equal(quantize(x2, name, "stochastic", generator=11),
                       quantize(x2.contiguous(), name, "stochastic", generator=11))


@pytest.mark.parametrize("key", ["bf16", "e4m3", "e5m2", "e2m1", "e8m0", "e2m0", "tf32"])
def test_sr_of_float64_draws_the_float32_stream(key):
    """One stochastic-rounding kernel for both dtypes, one convention for the random bits: a
    float64 tensor holding float32 numbers rounds exactly as the float32 tensor does (the same
    seed, index offset, random bits and overflow policy give the same bits)."""
    fmt = ALL_FORMATS[key]
    x = torch.from_numpy(np.concatenate([random_fp32(2000, 1), focused(fmt, 2000, 2, np.float32)]).astype(np.float32))
    for policy in policies(fmt):
        for k in (None, 1, 3, 8, 31):
            a = quantize(x, fmt, "stochastic", generator=5, rand_bits=k, overflow=policy, index_offset=77)
            b = quantize(x.double(), fmt, "stochastic", generator=5, rand_bits=k, overflow=policy, index_offset=77)
            assert_bits(b, a.double().numpy(), x.numpy(), f"{key} {policy} k={k}")


def test_sr_index_offset_counts_modulo_2_32():
    """Element i of a call with ``index_offset`` draws the hash of ``index_offset + i`` modulo
    2**32, across 2**31 too, whole or in pieces, compiled or eagerly."""
    x = torch.rand(3000, dtype=torch.float64) * 4
    for dtype in (torch.float32, torch.float64):
        t = x.to(dtype)
        whole = quantize(t, "bf16", "stochastic", generator=3, index_offset=2**31 - 1000)
        assert torch.equal(quantize(t[1000:], "bf16", "stochastic", generator=3, index_offset=2**31), whole[1000:])
        assert torch.equal(quantize(t, "bf16", "stochastic", generator=3, index_offset=2**32 + 2**31 - 1000), whole)
        previous = R.set_mode("off")
        try:
            assert torch.equal(quantize(t, "bf16", "stochastic", generator=3, index_offset=2**31 - 1000), whole)
        finally:
            R.set_mode(previous)
    # moves exactly where the public hash says (1 + f * 2**-7 moves up when the top 16 bits are below f)
    frac = torch.randint(0, 1 << 16, (3000,), generator=torch.Generator().manual_seed(0))
    y = quantize(1.0 + frac.double() * 2.0**-23, "bf16", "stochastic", generator=9, index_offset=2**32 - 1500)
    r = torch.cat([random_bits((1500,), 9, index_offset=2**32 - 1500), random_bits((1500,), 9)])
    assert torch.equal(y > 1.0, (r >> 16) < frac)


def test_random_bits_are_a_pure_function():
    a = random_bits((1000,), seed=12345)
    assert torch.equal(a, random_bits((1000,), seed=12345))
    assert torch.equal(a[:10], random_bits((10,), seed=12345))
    assert not torch.equal(a, random_bits((1000,), seed=12346))
    assert not torch.equal(a, random_bits((1000,), seed=12345, stream=1))
    assert a.min() >= 0 and a.max() < 2**32
    # roughly uniform: every bit is set about half the time
    big = random_bits((200_000,), seed=1)
    for bit in range(32):
        assert _binomial_ok(int(((big >> bit) & 1).sum()), len(big), 0.5)


# --- the demonstration of the science notes ------------------------------------------------------
def test_science_demo_one_plus_a_thousandth_a_thousand_times():
    """1.0 + 0.001, a thousand times, stored in bf16. Round to nearest stays at 1.0 (0.001 is
    below half the ulp 2**-8 = 0.0039). SR is unbiased, so the expected end value is 1 + 1000 *
    0.001 = 2.0 (up to the float32 rounding of each sum, below 2**-24 per step). Each step adds
    variance gap**2 * p * (1 - p), p = 0.001 / gap: with gap 2**-7 on [1, 2) and 2**-6 on [2, 4)
    a run ends with a standard deviation of at most sqrt(1000 * 2**-12 * 0.001) ~ 0.11.
    256 independent runs: each within 6 sd = 0.66 of 2.0, their mean within 5 sd / 16 = 0.035."""
    runs = 256
    w_rne = torch.ones(runs).bfloat16()
    w_sr = torch.ones(runs).bfloat16()
    g = torch.Generator().manual_seed(2024)
    for _ in range(1000):
        w_rne = quantize(w_rne.float() + 0.001, "bf16").bfloat16()
        w_sr = quantize(w_sr.float() + 0.001, "bf16", "stochastic", generator=g).bfloat16()
    assert (w_rne == 1.0).all()
    final = w_sr.float()
    assert (final - 2.0).abs().max().item() <= 0.66
    assert abs(final.mean().item() - 2.0) <= 0.035
    # one run as the notes write it: a 0-dim float32 weight, an int seed per step
    w = torch.tensor(1.0)
    for i in range(1000):
        w = quantize(w + 0.001, "bf16", "stochastic", generator=i)
    assert abs(w.item() - 2.0) <= 0.66


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------
DTYPES_MSG = "float32, float64, float16 or bfloat16"


@pytest.mark.parametrize("x", [torch.tensor([1, 2]), torch.tensor([True]), torch.tensor([1 + 2j]),
                               torch.tensor([1.0]).to(torch.float8_e4m3fn),
                               torch.tensor([1.0]).to(torch.float8_e5m2), torch.tensor([1], dtype=torch.uint8)])
def test_unsupported_tensor_dtypes(x):
    with pytest.raises(TypeError, match=DTYPES_MSG):
        quantize(x, "bf16")
    with pytest.raises(TypeError, match=DTYPES_MSG):
        ulp(x, "bf16")
    with pytest.raises(TypeError, match=DTYPES_MSG):
        would_freeze(x, torch.ones(1), "bf16")
    with pytest.raises(TypeError, match=DTYPES_MSG):
        move_probability(torch.ones(1), x, "bf16")


@pytest.mark.parametrize("x", [[1.0, 2.0], 1.0, np.ones(3, np.float32), None])
def test_non_tensors(x):
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        quantize(x, "bf16")
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        update_ulp_ratio(x, torch.ones(1), "bf16")


@pytest.mark.parametrize("rounding", ["stochastic_", "rne", "", None, "Nearest"])
def test_unknown_rounding(rounding):
    with pytest.raises(ValueError, match="rounding must be one of nearest, stochastic"):
        quantize(torch.ones(2), "bf16", rounding)


@pytest.mark.parametrize("k", [0, 33, -1, 1.5, True, "8", 8.0])
def test_bad_rand_bits(k):
    with pytest.raises(ValueError, match=r"rand_bits must be None \(full resolution\) or an integer in 1\.\.32"):
        quantize(torch.ones(2), "bf16", "stochastic", rand_bits=k)
    with pytest.raises(ValueError, match=r"1\.\.32"):
        move_probability(torch.ones(1), torch.ones(1), "bf16", rand_bits=k)


@pytest.mark.parametrize("g", ["seed", 1.5, True, [1]])
def test_bad_generator(g):
    with pytest.raises(TypeError, match="torch.Generator, an int seed or None"):
        quantize(torch.ones(2), "bf16", "stochastic", generator=g)


@pytest.mark.parametrize("fmt", ["fp8", "e9m2", "e4m24", ""])
def test_unknown_format(fmt):
    for call in (lambda: quantize(torch.ones(2), fmt), lambda: ulp(torch.ones(2), fmt),
                 lambda: would_freeze(torch.ones(2), torch.ones(2), fmt)):
        with pytest.raises(ValueError, match="valid names: fp32, tf32, bf16"):
            call()
    with pytest.raises(TypeError, match=r"a name \(str\) or a FloatFormat"):
        quantize(torch.ones(2), 8)


@pytest.mark.parametrize("dtype,fmt", [(torch.bfloat16, "fp32"), (torch.bfloat16, "fp16"), (torch.bfloat16, "tf32"),
                                       (torch.float16, "bf16"), (torch.float16, "e8m3"), (torch.float16, "fp32"),
                                       (torch.float16, "e6m5")])
def test_format_a_narrow_tensor_cannot_hold(dtype, fmt):
    x = torch.ones(3, dtype=dtype)
    msg = f"format {fmt} has values that {dtype} cannot hold.*quantize a float32 or float64 tensor instead"
    with pytest.raises(ValueError, match=msg):
        quantize(x, fmt)
    with pytest.raises(ValueError, match=msg):
        quantize(x, fmt, "stochastic", generator=0)
    with pytest.raises(ValueError, match=msg):
        ulp(x, fmt)


@pytest.mark.parametrize("fmt,policy,allowed", [("e4m3", "inf", "saturate, nan"), ("e2m1", "nan", "saturate"),
                                                ("bf16", "wrap", "inf, saturate, nan"), ("e2m0", "nan", "inf, saturate")])
def test_overflow_policy_the_format_cannot_express(fmt, policy, allowed):
    with pytest.raises(ValueError, match=f"allowed: {allowed}$"):
        quantize(torch.ones(2), fmt, overflow=policy)
    with pytest.raises(ValueError, match=f"allowed: {allowed}$"):
        would_freeze(torch.ones(2), torch.ones(2), fmt, overflow=policy)


# ------------------------------------------------------------------------------------------------
# outputs: dtype, device, shape, no aliasing; inputs untouched
# ------------------------------------------------------------------------------------------------
LAYOUTS = {
    "0-dim": lambda t: t.reshape(-1)[0].clone(),
    "3-d": lambda t: t.reshape(4, 6, 10),
    "transposed": lambda t: t.reshape(24, 10).t(),
    "strided": lambda t: t[::3],
    "expanded": lambda t: t[:10].expand(5, 10),
    "empty": lambda t: t[:0],
}
PATH_CASES = [("bf16", torch.float32), ("fp32", torch.float32), ("e4m3", torch.float32), ("e3m2", torch.float32),
              ("bf16", torch.float64), ("e5m2", torch.float64), ("e4m3", torch.bfloat16), ("fp16", torch.float16),
              ("tf32", torch.float32)]


@pytest.mark.parametrize("name,dtype", PATH_CASES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_output_layout(name, dtype, layout, rounding):
    torch.manual_seed(1)
    base = (torch.randn(240, dtype=torch.float64) * 3).to(dtype)
    base_before = base.clone()
    x = LAYOUTS[layout](base)
    before = x.clone()
    for policy in (None, "saturate"):
        y = quantize(x, name, rounding, generator=4, overflow=policy)
        assert y.dtype == x.dtype and y.device == x.device and y.shape == x.shape
        assert not y.requires_grad
        ref_y = quantize(x.contiguous(), name, rounding, generator=4, overflow=policy)
        assert torch.equal(y, ref_y)
        if y.numel():
            # a new tensor: writing to it leaves the input alone
            assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert torch.equal(x, before) and torch.equal(base, base_before)


def test_outputs_do_not_alias_inputs():
    for name in ("fp32", "bf16", "e4m3", "e8m3"):
        x = torch.tensor([1.0, 2.0, 3.0])
        y = quantize(x, name)
        y.add_(1)
        assert x.tolist() == [1.0, 2.0, 3.0], name


def test_inputs_not_modified_and_no_gradient():
    x = torch.randn(100, requires_grad=True)
    before = x.detach().clone()
    for name in ("bf16", "e4m3", "e3m2", "tf32"):
        for rounding in ("nearest", "stochastic"):
            y = quantize(x, name, rounding, generator=0)
            assert not y.requires_grad
    w = torch.randn(50, dtype=torch.float64)
    d = torch.randn(50, dtype=torch.float64) * 1e-3
    wb, db = w.clone(), d.clone()
    ulp(w, "bf16"), would_freeze(w, d, "bf16"), update_ulp_ratio(w, d, "e4m3"), move_probability(w, d, "e5m2")
    assert torch.equal(x.detach(), before) and torch.equal(w, wb) and torch.equal(d, db)


def test_ulp_keeps_shape_and_dtype():
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        x = torch.ones(3, 4, dtype=dtype).t()
        y = ulp(x, "e4m3")
        assert y.shape == (4, 3) and y.dtype == dtype
        assert ulp(torch.tensor(2.0, dtype=dtype), "e4m3").shape == ()


def test_quantize_formats_by_object_and_name_agree():
    x = torch.from_numpy(random_fp32(5000, 9))
    assert_bits(quantize(x, FloatFormat(5, 2)), quantize(x, "e5m2").double().numpy(), None, "by object")
    assert_bits(quantize(x, "float8_e4m3fn"), quantize(x, "e4m3").double().numpy(), None, "by alias")


# ------------------------------------------------------------------------------------------------
# CUDA: the same bits as on the CPU (run where a GPU is present)
# ------------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@cuda
@pytest.mark.parametrize("key,policy", EXHAUSTIVE_CASES)
def test_cuda_nearest_matches_reference(key, policy):
    """On the GPU there is no native float8 shortcut: every path is the package's own code."""
    fmt, xs = EXHAUSTIVE[key], exhaustive_points(key)
    expected = exhaustive_expected(key, policy)
    for dtype in (torch.float32, torch.float64):
        x = torch.from_numpy(xs).to(dtype).cuda()
        y = quantize(x, fmt, overflow=policy)
        assert y.device == x.device and y.dtype == dtype
        assert_bits(y, expected, xs, f"cuda {key} {policy} {dtype}")
        assert_bits(generic_nearest(x, fmt, policy), expected, xs, f"cuda generic {key} {policy} {dtype}")
        assert_bits(ulp(x, fmt), ulp(x.cpu(), fmt).double().numpy(), xs, f"cuda ulp {key}")


@cuda
@pytest.mark.parametrize("key", list(ALL_FORMATS))
def test_cuda_random_and_stochastic_match_cpu(key):
    """Random inputs: nearest against the reference; SR, few-bit SR and the freeze functions
    bit-identical to the CPU (the random bits are a function of seed and index alone)."""
    fmt = ALL_FORMATS[key]
    for np_dtype in (np.float32, np.float64):
        rnd = random_fp32(20_000, 5) if np_dtype == np.float32 else random_fp64(20_000, 5)
        xs = np.concatenate([rnd, focused(fmt, 50_000, 6, np_dtype)])
        x = torch.from_numpy(xs)
        xc = x.cuda()
        sample = slice(0, 1500)
        expected = ref.round_nearest_many(xs[sample].astype(np.float64), fmt)
        assert_bits(quantize(xc, fmt)[sample], expected, xs[sample], f"cuda random {key}")
        assert_bits(quantize(xc, fmt), quantize(x, fmt).double().numpy(), xs, f"cuda vs cpu {key}")
        for k in (None, 3):
            a = quantize(x, fmt, "stochastic", generator=1234, rand_bits=k)
            b = quantize(xc, fmt, "stochastic", generator=1234, rand_bits=k)
            assert_bits(b, a.double().numpy(), xs, f"cuda SR vs cpu {key} rand_bits={k}")
        w = quantize(x[:20_000].nan_to_num(0.0, 0.0, 0.0), fmt)
        d = w * 2.0 ** -8
        for fn in (would_freeze, update_ulp_ratio, move_probability):
            got, want = fn(w.cuda(), d.cuda(), fmt).cpu(), fn(w, d, fmt)
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), fn


@cuda
def test_cuda_generators_and_random_bits():
    assert torch.equal(random_bits((5000,), 99, device="cuda").cpu(), random_bits((5000,), 99))
    x = torch.rand(10_000, device="cuda") * 4
    g1 = torch.Generator(device="cuda").manual_seed(3)
    g2 = torch.Generator(device="cuda").manual_seed(3)
    assert torch.equal(quantize(x, "bf16", "stochastic", generator=g1), quantize(x, "bf16", "stochastic", generator=g2))
    y = quantize(x, "e4m3", "stochastic", generator=g1)
    assert y.device == x.device and not torch.equal(y, quantize(x, "e4m3", "stochastic", generator=g1))


@pytest.mark.parametrize("key", ["bf16", "fp16", "e4m3", "e5m2", "e8m4"])
def test_decay_rounds_back_is_the_rounding_of_beta_times_v(key):
    """At and above 2**-(m+1), beta * v moves every grid value of a binade; just below it the
    value just above the power of two stays (the largest relative half gap of a grid value is
    2**-(m+1) / (1 + 2**-m)); below 2**-(m+2) every value stays."""
    from lowprec_demo.rounding import decay_rounds_back
    fmt = get_format(key)
    m = fmt.man_bits
    grid = quantize(torch.linspace(1.0, 2.0, 4001, dtype=torch.float64)[:-1], fmt).unique()
    bound = 2.0**-(m + 1)

    def stays(one_minus):
        return quantize(grid * (1 - one_minus), fmt) == grid
    for one_minus in (bound, bound * 1.5, 0.2):
        assert not decay_rounds_back(1 - one_minus, fmt) and not stays(one_minus).any()
    just_below = bound / (1 + 2.0**-m) * 0.99
    assert decay_rounds_back(1 - just_below, fmt)
    assert stays(just_below)[grid == 1 + 2.0**-m].all()
    assert decay_rounds_back(1 - 2.0**-(m + 2) * 0.99, fmt) and stays(2.0**-(m + 2) * 0.99).all()
    assert not decay_rounds_back(None, fmt) and not decay_rounds_back(0.0, fmt)
