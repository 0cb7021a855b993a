"""quantize_ rounds in place with the bits of ``x.copy_(quantize(x, ...))``: on the exhaustive
point sets of test_rounding.py (every overflow policy), on random inputs with stochastic
rounding (every few-bit setting), for every dtype quantize takes, in every fused mode."""

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_rounding as TR  # the exhaustive point sets and helpers

from lowprec_demo.rounding import round_to_grid
from lowprec_demo.rounding import quantize, quantize_

pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.reshape(-1), b.reshape(-1)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan]) and torch.equal(a[~nan].signbit(), b[~nan].signbit())


@pytest.mark.parametrize("key,policy", TR.EXHAUSTIVE_CASES)
def test_quantize_in_place_is_quantize_on_the_exhaustive_points(key, policy):
    fmt = TR.EXHAUSTIVE[key]
    x = torch.from_numpy(TR.exhaustive_points(key).astype(np.float32))
    want = x.clone().copy_(quantize(x, fmt, overflow=policy))
    y = x.clone()
    pointer = y.data_ptr()
    assert quantize_(y, fmt, overflow=policy) is y and y.data_ptr() == pointer
    assert same_bits(y, want)


@pytest.mark.parametrize("mode", ["off", "auto"])
@pytest.mark.parametrize("key", ["bf16", "fp16", "e4m3", "e5m2", "e5m3", "e2m1"])
def test_stochastic_quantize_in_place_is_quantize(mode, key):
    fmt = TR.SR_FORMATS.get(key) or TR.EXHAUSTIVE[key]
    x = torch.from_numpy(np.concatenate([TR.random_fp32(3000, 4), TR.focused(fmt, 3000, 5, np.float32)]).astype(np.float32))
    previous = round_to_grid.set_mode(mode)
    try:
        for policy in TR.policies(fmt):
            for k in (None, 3):
                want = quantize(x, fmt, "stochastic", generator=11, rand_bits=k, overflow=policy)
                y = x.clone()
                quantize_(y, fmt, "stochastic", generator=11, rand_bits=k, overflow=policy)
                assert same_bits(y, want), (policy, k)
                g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
                y = x.clone()
                quantize_(y, fmt, "stochastic", generator=g1, rand_bits=k, overflow=policy)
                assert same_bits(y, quantize(x, fmt, "stochastic", generator=g2, rand_bits=k, overflow=policy))
    finally:
        round_to_grid.set_mode(previous)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_other_dtypes_and_layouts_round_in_place(dtype):
    x = (torch.randn(40, 30, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    for t in (x.clone(), x.clone().t()):   # contiguous and not
        want = quantize(t, "e4m3", "stochastic", generator=2)
        assert quantize_(t, "e4m3", "stochastic", generator=2) is not None
        assert t.dtype == dtype and torch.equal(t, want)
    t = x.clone().float().t()
    want = quantize(t, "e5m3")
    quantize_(t, "e5m3")
    assert torch.equal(t, want)


def test_quantize_in_place_records_no_gradient():
    w = torch.nn.Parameter(torch.randn(100))
    quantize_(w, "bf16")
    assert torch.equal(w.detach(), quantize(w, "bf16")) and w.grad_fn is None


def test_quantize_in_place_errors_name_the_allowed_values():
    with pytest.raises(TypeError, match="float32, float64, float16 or bfloat16"):
        quantize_(torch.zeros(3, dtype=torch.int32), "bf16")
    with pytest.raises(TypeError, match="torch.Tensor"):
        quantize_([1.0], "bf16")
    with pytest.raises(ValueError, match="nearest, stochastic"):
        quantize_(torch.zeros(3), "bf16", rounding="up")
    with pytest.raises(ValueError, match="rand_bits"):
        quantize_(torch.zeros(3), "bf16", "stochastic", rand_bits=40)
    with pytest.raises(ValueError):
        quantize_(torch.zeros(3, dtype=torch.float16), "bf16")   # bf16 values that float16 cannot hold
