"""Tests of lowprec_demo.book.demos: bit fields against torch and ml_dtypes, repeated addition, SR samples."""

import math

import numpy as np
import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.book.demos import (BitFields, decode_bits, grid_neighbours, repeated_add, sr_samples, value_from_bits)

ml_dtypes = pytest.importorskip("ml_dtypes")

# format name -> (torch dtype, unsigned integer dtype of the same width)
TORCH_VIEWS = {
    "bf16": (torch.bfloat16, torch.uint16),
    "fp16": (torch.float16, torch.uint16),
    "e4m3": (torch.float8_e4m3fn, torch.uint8),
    "e5m2": (torch.float8_e5m2, torch.uint8),
}
ML_DTYPES = {"e3m2": "float6_e3m2fn", "e2m3": "float6_e2m3fn", "e2m1": "float4_e2m1fn"}


def torch_value(pattern: int, name: str) -> float:
    dtype, itype = TORCH_VIEWS[name]
    return torch.tensor([pattern], dtype=itype).view(dtype).float().item()


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_every_8bit_pattern_matches_torch(name):
    for pattern in range(256):
        ours, theirs = value_from_bits(pattern, name), torch_value(pattern, name)
        if math.isnan(theirs):
            assert math.isnan(ours), (name, pattern)
            continue
        assert ours == theirs, (name, pattern)
        assert decode_bits(ours, name).pattern == pattern, (name, pattern)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_16bit_patterns_match_torch(name):
    # every exponent field, a spread of mantissas, both signs
    patterns = list(range(0, 2**16, 97)) + [0x0000, 0x0001, 0x3F80, 0x3FC0, 0x7F7F, 0x7F80, 0xFF80, 0x7BFF, 0x8000]
    for pattern in patterns:
        ours, theirs = value_from_bits(pattern, name), torch_value(pattern, name)
        if math.isnan(theirs):
            assert math.isnan(ours), (name, hex(pattern))
            continue
        assert ours == theirs, (name, hex(pattern))
        assert decode_bits(ours, name).pattern == pattern, (name, hex(pattern))


@pytest.mark.parametrize("name", sorted(ML_DTYPES))
def test_mx_patterns_match_ml_dtypes(name):
    dtype = getattr(ml_dtypes, ML_DTYPES[name])
    fmt = lp.get_format(name)
    for pattern in range(2**fmt.bits):
        theirs = float(np.array([pattern], dtype=np.uint8).view(dtype).astype(np.float64)[0])
        assert value_from_bits(pattern, name) == theirs, (name, pattern)
        assert decode_bits(theirs, name).pattern == pattern, (name, pattern)


def test_decode_fields_by_hand():
    f = decode_bits(1.5, "bf16")
    assert (f.sign, f.exponent, f.mantissa) == (0, 127, 64)
    assert f.fields == "0 01111111 1000000" and f.hex == "0x3fc0"
    f = decode_bits(448.0, "e4m3")
    assert (f.sign, f.exponent, f.mantissa, f.pattern) == (0, 15, 6, 0x7E)
    f = decode_bits(-2.0**-9, "e4m3")          # smallest subnormal, negative
    assert (f.sign, f.exponent, f.mantissa) == (1, 0, 1)
    assert decode_bits(-0.0, "bf16").pattern == 0x8000
    assert decode_bits(math.inf, "e5m2").pattern == 0x7C
    assert decode_bits(math.nan, "e4m3").pattern == 0x7F
    assert decode_bits(math.nan, "bf16").pattern == 0x7FC0
    assert str(decode_bits(-0.75, "e4m3")) == "e4m3: 1 0110 100 (0xb4)"
    assert isinstance(decode_bits(torch.tensor(1.0), "fp16"), BitFields)


def test_decode_rejects_values_off_the_grid():
    with pytest.raises(ValueError, match="quantize it first"):
        decode_bits(1.001, "bf16")
    with pytest.raises(ValueError, match="no infinity"):
        decode_bits(math.inf, "e4m3")
    with pytest.raises(ValueError, match="no NaN"):
        decode_bits(math.nan, "e2m1")
    with pytest.raises(ValueError, match="not a value"):
        decode_bits(500.0, "e4m3")
    with pytest.raises(ValueError, match="pattern"):
        value_from_bits(256, "e4m3")
    assert decode_bits(1.0, lp.FloatFormat(8, 23)).pattern == 0x3F800000   # 32 bits: fp32 itself


def test_repeated_add_nearest_freezes_and_sr_is_unbiased():
    nearest = repeated_add(1.0, 1e-3, 1000, "bf16")
    assert nearest.shape == (1001, 1)
    assert (nearest == 1.0).all()
    gen = torch.Generator().manual_seed(0)
    sr = repeated_add(1.0, 1e-3, 1000, "bf16", "stochastic", generator=gen, paths=400)
    final = sr[-1]
    assert abs(final.mean().item() - 2.0) < 4 * 0.09 / math.sqrt(400)
    assert 0.06 < final.std().item() < 0.12
    # every value stays on the grid, and the sequence never goes down
    assert torch.equal(lp.quantize(sr, "bf16"), sr)
    assert (sr[1:] >= sr[:-1]).all()


def test_repeated_add_is_reproducible_from_the_generator():
    a = repeated_add(1.0, 1e-3, 50, "bf16", "stochastic", generator=torch.Generator().manual_seed(3), paths=5)
    b = repeated_add(1.0, 1e-3, 50, "bf16", "stochastic", generator=torch.Generator().manual_seed(3), paths=5)
    c = repeated_add(1.0, 1e-3, 50, "bf16", "stochastic", generator=torch.Generator().manual_seed(4), paths=5)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_repeated_add_few_bit_sr_freezes():
    # 1e-3 is 0.128 ulp of 1.0 in bf16: with 1 random bit it rounds to 0 halves, so nothing moves;
    # with 2 bits to 1 quarter (moves twice as often as it should); with 3 bits to 1 eighth
    frozen = repeated_add(1.0, 1e-3, 200, "bf16", "stochastic", generator=0, paths=50, rand_bits=1)
    assert (frozen == 1.0).all()
    fast = repeated_add(1.0, 1e-3, 200, "bf16", "stochastic", generator=0, paths=200, rand_bits=2)
    three = repeated_add(1.0, 1e-3, 200, "bf16", "stochastic", generator=0, paths=200, rand_bits=3)
    ups = lambda t: ((t[-1] - 1.0) / 2**-7).mean().item() / 200  # noqa: E731
    assert abs(ups(fast) - 0.25) < 0.02 and abs(ups(three) - 0.125) < 0.02


def test_repeated_add_int_seed_draws_fresh_bits_each_step():
    # an int seed seeds one generator for the whole sequence, not the same bits at every step
    sr = repeated_add(1.0, 1e-3, 100, "bf16", "stochastic", generator=7, paths=100)
    moves = (sr[1:] != sr[:-1]).double()
    per_path = moves.sum(0)
    assert 0 < per_path.min() and per_path.max() < 100
    assert torch.equal(sr, repeated_add(1.0, 1e-3, 100, "bf16", "stochastic", generator=7, paths=100))


def test_sr_samples_frequencies():
    x = 1.0 + 0.3 * 2**-7
    s = sr_samples(x, "bf16", 20000, generator=torch.Generator().manual_seed(1))
    assert set(s.tolist()) == {1.0, 1.0078125}
    p = (s > 1.0).double().mean().item()
    assert abs(p - 0.3) < 4 * math.sqrt(0.3 * 0.7 / 20000)


def test_grid_neighbours():
    x = torch.tensor([1.3, -1.3, 1.5, 0.2, 3.9], dtype=torch.float64)
    lo, hi = grid_neighbours(x, "e2m1")
    assert lo.tolist() == [1.0, -1.0, 1.5, 0.0, 3.0]
    assert hi.tolist() == [1.5, -1.5, 1.5, 0.5, 4.0]
    # just below a power of two the gap is the finer one of the binade below
    lo, hi = grid_neighbours(torch.tensor([1.0 - 2**-12]), "bf16")
    assert (lo.item(), hi.item()) == (1.0 - 2**-8, 1.0)


def test_argument_checks():
    with pytest.raises(ValueError):
        repeated_add(1.0, 1e-3, -1, "bf16")
    with pytest.raises(ValueError):
        repeated_add(1.0, 1e-3, 5, "bf16", paths=0)
    with pytest.raises(ValueError):
        sr_samples(1.0, "bf16", 0)
    with pytest.raises(ValueError):
        decode_bits(torch.ones(2), "bf16")
