"""Tests of lowprec_demo.formats: every format's landmarks against torch.finfo, ml_dtypes.finfo,
the table in the science notes, the bit patterns torch and ml_dtypes decode, and the exact
reference (tests/exact_reference.py, which derives everything from decoding encodings)."""

import dataclasses
import os
import sys
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_reference as ref

from lowprec_demo.formats import FORMAT_NAMES, KINDS, OVERFLOW_POLICIES, FloatFormat, format_table, get_format

# ------------------------------------------------------------------------------------------------
# the table of the science notes (docs/science.md), written out by hand
# name: (E, m, max, smallest normal, smallest subnormal, has inf, has NaN)
# ------------------------------------------------------------------------------------------------
SCIENCE_TABLE = {
    "fp32": (8, 23, 3.4028e38, 2.0**-126, 2.0**-149, True, True),
    "tf32": (8, 10, 3.40e38, 2.0**-126, 2.0**-136, True, True),
    "bf16": (8, 7, 3.3895e38, 2.0**-126, 2.0**-133, True, True),
    "fp16": (5, 10, 65504.0, 2.0**-14, 2.0**-24, True, True),
    "e4m3": (4, 3, 448.0, 2.0**-6, 2.0**-9, False, True),
    "e5m2": (5, 2, 57344.0, 2.0**-14, 2.0**-16, True, True),
    "e3m2": (3, 2, 28.0, 2.0**-2, 2.0**-4, False, False),
    "e2m3": (2, 3, 7.5, 1.0, 2.0**-3, False, False),
    "e2m1": (2, 1, 6.0, 1.0, 0.5, False, False),
}
# the freeze threshold as a fraction of |w|, in percent, as the notes quote it
SCIENCE_THRESHOLDS = {"bf16": (0.20, 0.39), "fp16": (0.024, 0.049), "e4m3": (3.1, 6.25),
                      "e5m2": (6.25, 12.5), "e2m1": (12.5, 25.0)}

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# ml_dtypes type -> the format with the same grid
ML_DTYPES = {
    "bfloat16": get_format("bf16"),
    "float8_e4m3fn": get_format("e4m3"),
    "float8_e5m2": get_format("e5m2"),
    "float8_e4m3": FloatFormat(4, 3),      # IEEE-like E4M3: inf and NaN, max 240
    "float8_e3m4": get_format("e3m4"),     # IEEE-like E3M4
    "float6_e3m2fn": get_format("e3m2"),
    "float6_e2m3fn": get_format("e2m3"),
    "float4_e2m1fn": get_format("e2m1"),
}
_UINT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _torch_all_values(dtype):
    """Every bit pattern of an 8- or 16-bit torch float dtype, decoded by torch, as float64."""
    bits = torch.finfo(dtype).bits
    if bits == 8:
        patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    else:
        patterns = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    return patterns.view(dtype).double().numpy()


def _ml_all_values(name):
    """Every bit pattern of an ml_dtypes type, decoded by ml_dtypes, as float64."""
    dtype = getattr(ml_dtypes, name)
    bits = ml_dtypes.finfo(dtype).bits
    if bits <= 8:
        patterns = np.arange(2**bits, dtype=np.uint8)
    else:
        patterns = np.arange(2**bits, dtype=np.uint32).astype(np.uint16)
    with np.errstate(invalid="ignore"):
        return patterns.view(dtype).astype(np.float64)


def _finite_nonneg_set(values):
    v = values[np.isfinite(values)]
    return sorted({Fraction(float(x)) for x in np.abs(v)})


# ------------------------------------------------------------------------------------------------
# named formats against the science table
# ------------------------------------------------------------------------------------------------
def test_named_formats_are_the_table():
    assert set(FORMAT_NAMES) == set(SCIENCE_TABLE)


@pytest.mark.parametrize("name", list(SCIENCE_TABLE))
def test_landmarks_match_science_table(name):
    E, m, mx, normal, sub, inf, nan = SCIENCE_TABLE[name]
    fmt = get_format(name)
    assert (fmt.exp_bits, fmt.man_bits) == (E, m)
    assert fmt.name == name
    # the table shows 5 significant digits (tf32: 3) where the value is not a short number
    assert fmt.max == pytest.approx(mx, rel=2e-3 if name == "tf32" else 2e-5)
    assert fmt.smallest_normal == normal
    assert fmt.smallest_subnormal == sub
    assert fmt.has_inf is inf and fmt.has_nan is nan
    assert fmt.eps == 2.0**-m
    assert fmt.bias == 2 ** (E - 1) - 1
    assert fmt.bits == 1 + E + m
    assert fmt.overflow == ("inf" if inf else "saturate")


@pytest.mark.parametrize("name", list(SCIENCE_THRESHOLDS))
def test_freeze_threshold_range_matches_science_table(name):
    lo, hi = get_format(name).freeze_threshold_range
    m = get_format(name).man_bits
    assert (lo, hi) == (2.0 ** -(m + 2), 2.0 ** -(m + 1))
    lo_pct, hi_pct = SCIENCE_THRESHOLDS[name]
    # the notes round to 2-3 significant digits
    assert 100 * lo == pytest.approx(lo_pct, rel=0.03)
    assert 100 * hi == pytest.approx(hi_pct, rel=0.03)


def test_exact_maxima():
    assert get_format("fp32").max == float(torch.finfo(torch.float32).max)
    assert get_format("bf16").max == (2 - 2.0**-7) * 2.0**127
    assert get_format("tf32").max == (2 - 2.0**-10) * 2.0**127
    assert get_format("e4m3").max == 448.0 and get_format("e5m2").max == 57344.0
    assert FloatFormat(4, 3).max == 240.0
    assert get_format("e5m3").max == 61440.0


# ------------------------------------------------------------------------------------------------
# against torch
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_landmarks_match_torch_finfo(name):
    fmt, dtype = get_format(name), TORCH_DTYPES[name]
    fi = torch.finfo(dtype)
    assert fmt.max == fi.max
    assert -fmt.max == fi.min
    assert fmt.smallest_normal == fi.smallest_normal == fi.tiny
    assert fmt.eps == fi.eps
    assert fmt.bits == fi.bits
    # smallest subnormal: the bit pattern 1
    one = torch.tensor([1], dtype=torch.int32).to(_UINT[fi.bits // 8]).view(dtype)
    assert fmt.smallest_subnormal == one.double().item()
    assert fmt.torch_dtype == dtype


@pytest.mark.parametrize("name", ["bf16", "fp16", "e4m3", "e5m2"])
def test_grid_and_specials_match_torch_decoding(name):
    """Every bit pattern torch decodes: the finite values are the format's grid (as the exact
    reference enumerates it) and inf / NaN occur exactly when the format has them."""
    fmt = get_format(name)
    values = _torch_all_values(TORCH_DTYPES[name])
    assert bool(np.isinf(values).any()) is fmt.has_inf
    assert bool(np.isnan(values).any()) is fmt.has_nan
    grid = _finite_nonneg_set(values)
    r = ref.ref_format(fmt)
    assert grid == r.finite_values()
    assert float(grid[-1]) == fmt.max and float(grid[1]) == fmt.smallest_subnormal


def test_fp32_specials_match_torch():
    fmt = get_format("fp32")
    assert fmt.has_inf and fmt.has_nan
    assert (torch.tensor([fmt.max]) * 2).isinf().all()
    assert torch.tensor([fmt.max]).item() == fmt.max
    assert torch.tensor([1], dtype=torch.int32).view(torch.float32).item() == fmt.smallest_subnormal


# ------------------------------------------------------------------------------------------------
# against ml_dtypes
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ml_name", list(ML_DTYPES))
def test_landmarks_match_ml_dtypes_finfo(ml_name):
    fmt = ML_DTYPES[ml_name]
    fi = ml_dtypes.finfo(getattr(ml_dtypes, ml_name))
    assert fmt.max == float(fi.max)
    assert fmt.smallest_normal == float(fi.smallest_normal)
    assert fmt.smallest_subnormal == float(fi.smallest_subnormal)
    assert fmt.eps == float(fi.eps)
    assert fmt.bits == fi.bits
    assert (fmt.exp_bits, fmt.man_bits) == (fi.nexp, fi.nmant)
    assert fmt.e_min == fi.minexp
    assert fmt.bias == 1 - fi.minexp
    assert fmt.e_max == fi.maxexp - 1
    assert fmt.ml_dtypes_name == ml_name


@pytest.mark.parametrize("ml_name", list(ML_DTYPES))
def test_grid_and_specials_match_ml_dtypes_decoding(ml_name):
    fmt = ML_DTYPES[ml_name]
    values = _ml_all_values(ml_name)
    assert bool(np.isinf(values).any()) is fmt.has_inf
    assert bool(np.isnan(values).any()) is fmt.has_nan
    if fmt.kind == "fn":  # NaN only at S.1111.111
        assert int(np.isnan(values).sum()) == 2
    grid = _finite_nonneg_set(values)
    assert grid == ref.ref_format(fmt).finite_values()
    assert float(grid[-1]) == fmt.max


# ------------------------------------------------------------------------------------------------
# every format the package accepts, against the exact reference
# ------------------------------------------------------------------------------------------------
ALL_SPECS = [(E, m, kind) for E in range(2, 9) for m in range(24) for kind in KINDS
             if not (kind == "fn" and m == 0)]


@pytest.mark.parametrize("E", range(2, 9))
def test_landmarks_match_exact_reference_for_every_format(E):
    checked = 0
    for (e, m, kind) in ALL_SPECS:
        if e != E:
            continue
        fmt, r = FloatFormat(e, m, kind), ref.ref_format((e, m, kind))
        what = f"{fmt.name} {kind}"
        assert Fraction(fmt.max) == r.max, what
        assert Fraction(fmt.smallest_normal) == r.smallest_normal, what
        # below the smallest normal the spacing is 2**(e_min - m) (for m = 0 there are no
        # subnormals and that spacing is the smallest normal itself)
        assert Fraction(fmt.smallest_subnormal) == r.smallest_positive, what
        assert Fraction(fmt.eps) == r.eps, what
        assert fmt.bias == r.bias and fmt.e_min == r.e_min, what
        assert fmt.e_max == ref.floor_log2(r.max), what
        assert fmt.has_inf is r.has_inf, what
        assert fmt.has_nan is r.has_nan, what
        assert fmt.overflow == r.default_overflow, what
        assert fmt.bits == 1 + e + m
        checked += 1
    assert checked == sum(1 for s in ALL_SPECS if s[0] == E)


@pytest.mark.parametrize("spec", [(2, 0, "ieee"), (2, 0, "finite"), (3, 0, "ieee"), (2, 1, "ieee"),
                                  (2, 1, "fn"), (3, 1, "fn"), (2, 3, "finite"), (4, 3, "fn"),
                                  (5, 2, "ieee"), (3, 4, "ieee"), (5, 3, "ieee"), (8, 0, "ieee"),
                                  (8, 3, "ieee"), (4, 3, "finite")])
def test_reference_grid_formula_matches_decoded_encodings(spec):
    """The exact reference rounds with the spacing formula 2**(max(e, e_min) - m); walking that
    grid from 0 must visit exactly the decoded values, and go on past max."""
    r = ref.ref_format(spec)
    values = r.finite_values()
    walk = [Fraction(0)]
    while walk[-1] < r.max:
        walk.append(r.next_up(walk[-1]))
    assert walk == values
    assert all(r.next_down(b) == a for a, b in zip(values[:-1], values[1:]))
    assert r.next_up(r.max) > r.max
    fmt = FloatFormat(*spec)
    assert float(values[-1]) == fmt.max and float(values[1]) == fmt.smallest_subnormal


def test_ieee_format_without_mantissa_has_no_nan():
    """With m = 0 the top exponent field has a single pattern, inf: there is no NaN encoding,
    so the "nan" overflow policy is not available."""
    fmt = get_format("e2m0")
    assert fmt.has_inf and not fmt.has_nan
    assert not ref.ref_format(fmt).has_nan and ref.ref_format(fmt).has_inf
    with pytest.raises(ValueError, match="allowed: inf, saturate"):
        fmt.with_overflow("nan")


# ------------------------------------------------------------------------------------------------
# names
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("alias,name", [
    ("float32", "fp32"), ("bfloat16", "bf16"), ("float16", "fp16"), ("half", "fp16"),
    ("fp8_e4m3", "e4m3"), ("e4m3fn", "e4m3"), ("float8_e4m3fn", "e4m3"), ("fp8_e5m2", "e5m2"),
    ("float8_e5m2", "e5m2"), ("fp6_e3m2", "e3m2"), ("fp6_e2m3", "e2m3"), ("fp4_e2m1", "e2m1"),
    ("fp4", "e2m1"), ("BF16", "bf16"), (" e4m3 ", "e4m3"), ("E5M2", "e5m2"),
])
def test_aliases(alias, name):
    assert get_format(alias) is get_format(name)


def test_named_kinds():
    assert get_format("e4m3").kind == "fn" and get_format("e4m3").max == 448.0
    for name in ("e3m2", "e2m3", "e2m1"):
        assert get_format(name).kind == "finite"
    for name in ("fp32", "tf32", "bf16", "fp16", "e5m2"):
        assert get_format(name).kind == "ieee"


@pytest.mark.parametrize("name,E,m", [("e5m3", 5, 3), ("e3m4", 3, 4), ("E6M5", 6, 5), ("e8m3", 8, 3),
                                       ("e8m0", 8, 0), ("e2m0", 2, 0), ("e3m0", 3, 0), ("e8m23", 8, 23),
                                       ("e7m20", 7, 20), ("e5m23", 5, 23)])
def test_generic_names(name, E, m):
    fmt = get_format(name)
    assert (fmt.exp_bits, fmt.man_bits, fmt.kind) == (E, m, "ieee")
    assert fmt.name == name.lower()
    assert fmt.overflow == "inf"
    assert Fraction(fmt.max) == ref.ref_format((E, m, "ieee")).max


def test_generic_name_of_a_named_format_is_the_named_format():
    """'e4m3' is OCP E4M3 ("fn", max 448), also when spelled with leading zeros; the IEEE-like
    E4M3 (max 240) is FloatFormat(4, 3)."""
    assert get_format("e04m3") is get_format("e4m3")
    assert get_format("e002m01") is get_format("e2m1")
    assert get_format("e8m7").max == get_format("bf16").max
    assert FloatFormat(4, 3).max == 240.0


def test_get_format_passes_formats_through():
    fmt = FloatFormat(6, 5, "finite")
    assert get_format(fmt) is fmt


def test_with_overflow_and_torch_dtype():
    e4m3 = get_format("e4m3")
    assert e4m3.overflow == "saturate" and e4m3.torch_dtype == torch.float8_e4m3fn
    nan = e4m3.with_overflow("nan")
    assert nan.overflow == "nan" and nan.name == "e4m3" and nan.max == 448.0
    assert nan.torch_dtype is None  # torch's cast saturates; no native dtype for the NaN rule
    assert get_format("e5m2").with_overflow("saturate").torch_dtype is None
    assert get_format("bf16").torch_dtype == torch.bfloat16
    assert get_format("tf32").torch_dtype is None
    assert FloatFormat(4, 3).torch_dtype is None
    assert FloatFormat(4, 3).ml_dtypes_name == "float8_e4m3"
    assert get_format("e5m3").ml_dtypes_name is None


def test_format_table():
    rows = format_table()
    assert [r["name"] for r in rows] == list(SCIENCE_TABLE)
    for row in rows:
        E, m, _, normal, sub, inf, nan = SCIENCE_TABLE[row["name"]]
        fmt = get_format(row["name"])
        assert (row["E"], row["m"], row["bits"], row["bias"]) == (E, m, 1 + E + m, 2 ** (E - 1) - 1)
        assert row["max"] == fmt.max and row["smallest_normal"] == normal
        assert row["smallest_subnormal"] == sub and row["eps"] == 2.0**-m
        assert row["inf"] is inf and row["nan"] is nan
        assert (row["freeze_rel_min"], row["freeze_rel_max"]) == fmt.freeze_threshold_range
    assert format_table(["e5m3"])[0]["max"] == 61440.0


def test_formats_are_immutable_values():
    fmt = FloatFormat(5, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fmt.man_bits = 4
    assert FloatFormat(5, 3) == fmt and hash(FloatFormat(5, 3)) == hash(fmt)
    assert str(fmt) == "e5m3"


# ------------------------------------------------------------------------------------------------
# bad input: the error names what is allowed
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("E", [0, 1, 9, 16, -2])
def test_bad_exp_bits(E):
    with pytest.raises((ValueError, TypeError), match=r"exp_bits.*2\.\.8"):
        FloatFormat(E, 3)


@pytest.mark.parametrize("m", [-1, 24, 52])
def test_bad_man_bits(m):
    with pytest.raises((ValueError, TypeError), match=r"man_bits.*0\.\.23"):
        FloatFormat(4, m)


@pytest.mark.parametrize("E,m,field", [(4.0, 3, "exp_bits"), (4, 3.0, "man_bits"), ("4", 3, "exp_bits"),
                                       (True, 3, "exp_bits"), (4, None, "man_bits"),
                                       (4, False, "man_bits")])
def test_non_integer_widths(E, m, field):
    with pytest.raises((ValueError, TypeError), match=field + r" must be an integer in \d\.\.\d+"):
        FloatFormat(E, m)


@pytest.mark.parametrize("kind", ["IEEE", "bogus", "", None, "nan"])
def test_unknown_kind(kind):
    with pytest.raises((ValueError, TypeError), match="ieee, fn, finite"):
        FloatFormat(4, 3, kind)


def test_fn_needs_a_mantissa_bit():
    with pytest.raises(ValueError, match="at least one mantissa bit"):
        FloatFormat(4, 0, "fn")


@pytest.mark.parametrize("name,policy,allowed", [
    ("e4m3", "inf", "saturate, nan"),
    ("e3m2", "inf", "saturate"), ("e3m2", "nan", "saturate"),
    ("e2m1", "nan", "saturate"), ("e2m3", "inf", "saturate"),
    ("bf16", "clip", "inf, saturate, nan"), ("e5m2", "", "inf, saturate, nan"),
])
def test_overflow_policy_a_format_cannot_express(name, policy, allowed):
    fmt = get_format(name)
    with pytest.raises(ValueError, match=f"allowed: {allowed}$"):
        fmt.with_overflow(policy)


def test_overflow_policy_in_constructor():
    with pytest.raises(ValueError, match="allowed: saturate$"):
        FloatFormat(2, 1, "finite", overflow="inf")
    with pytest.raises(ValueError, match="allowed: saturate, nan$"):
        FloatFormat(4, 3, "fn", overflow="inf")
    with pytest.raises(ValueError, match="allowed: inf, saturate, nan$"):
        FloatFormat(5, 2, overflow="wrap")
    assert set(OVERFLOW_POLICIES) == {"inf", "saturate", "nan"}
    assert FloatFormat(5, 2, overflow="nan").overflow == "nan"


@pytest.mark.parametrize("name", ["fp8", "e9m3", "e1m2", "e4m24", "e0m0", "bf32", "", "e4", "m3",
                                  "e-4m3", "e4m3x", "float8"])
def test_unknown_names(name):
    with pytest.raises(ValueError, match=r"valid names: fp32, tf32, bf16, fp16, e4m3, e5m2, e3m2, e2m3, e2m1.*"
                                         r"'e<E>m<m>' with E in 2\.\.8 and m in 0\.\.23"):
        get_format(name)


@pytest.mark.parametrize("bad", [3, None, 4.5, ("e4m3",), torch.bfloat16])
def test_format_of_wrong_type(bad):
    with pytest.raises(TypeError, match=r"a name \(str\) or a FloatFormat"):
        get_format(bad)
