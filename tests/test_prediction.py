"""The freeze predictor against a brute-force reference, the observer, freeze steps."""

import math
from fractions import Fraction

import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.freeze import (RATIO_BINS, FreezeObserver, FreezePredictor, FreezeTracker, freeze_order,
                                 freeze_step, steps_agree)


def brute_force_frozen(old: torch.Tensor, new: torch.Tensor, fmt: str) -> float:
    """Element by element: q(q(w) + d) == q(w), with the exact sum rounded by the package's fp64
    path (single rounding of an exactly representable sum: w and d are fp32 and close)."""
    stored = lp.quantize(old, fmt).double()
    update = new.double() - old.double()
    exact_sum = stored + update          # exact in fp64 here: |d| << |w| or both tiny
    return (lp.quantize(exact_sum, fmt) == stored).double().mean().item()


@pytest.mark.parametrize("fmt", ["bf16", "e4m3", "fp16", "e3m2"])
def test_predictor_matches_brute_force(fmt):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(500) * 3)
    v = torch.nn.Parameter(torch.rand(7, 11) + 0.5)
    predictor = FreezePredictor({"w": w, "v": v}, formats=[fmt, "bf16"])
    expected_w, expected_v = [], []
    for step in range(6):
        scale = 10.0 ** -(step + 1)
        predictor.before_step()
        old_w, old_v = w.detach().clone(), v.detach().clone()
        with torch.no_grad():
            w += scale * torch.randn_like(w)
            v -= scale * torch.rand_like(v)
        predictor.after_step()
        expected_w.append(brute_force_frozen(old_w, w.detach(), fmt))
        expected_v.append(brute_force_frozen(old_v, v.detach(), fmt))
    rec = predictor.record(fmt)
    assert rec.by_tensor["w"] == pytest.approx(expected_w, abs=1e-12)
    assert rec.by_tensor["v"] == pytest.approx(expected_v, abs=1e-12)
    overall = [(500 * a + 77 * b) / 577 for a, b in zip(expected_w, expected_v)]
    assert rec.overall == pytest.approx(overall, abs=1e-12)
    assert set(predictor.records) == {lp.get_format(fmt).name, "bf16"}
    # fractions rise as updates shrink
    assert rec.overall[-1] >= rec.overall[0]


def test_sr_move_fraction_is_mean_probability():
    w = torch.nn.Parameter(torch.ones(1000))
    predictor = FreezePredictor({"w": w}, formats=["bf16"], rand_bits=2)
    predictor.before_step()
    with torch.no_grad():
        w[:500] += 2**-10      # 1/8 of the gap above 1.0: p = 0.125; with 2 bits rounds to 0
        w[500:] -= 2**-10      # 1/4 of the gap below 1.0: p = 0.25; with 2 bits stays 0.25
    predictor.after_step()
    rec = predictor.record()
    # the move probabilities of the SR that runs: 2 random bits resolve 0.125 to 0
    assert rec.move_fraction == [pytest.approx((0.0 + 0.25) / 2)]
    assert rec.fewbit_frozen == [pytest.approx(0.5)]
    full = FreezePredictor({"w": w}, formats=["bf16"])
    with torch.no_grad():
        w.fill_(1.0)
    full.before_step()
    with torch.no_grad():
        w[:500] += 2**-10
        w[500:] -= 2**-10
    full.after_step()
    assert full.record().move_fraction == [pytest.approx((0.125 + 0.25) / 2)]
    assert rec.overall == [1.0]
    # histogram: log2 ratios -3 and -2
    assert sum(rec.ratio_histogram) == 1000


def test_observer_counts_unchanged_elements_and_state_appears_later():
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.Adam([w], lr=0.1)
    state = lambda: {"exp_avg": opt.state[w]["exp_avg"]} if opt.state[w] else {}
    obs_params = FreezeObserver({"w": w})
    obs_state = FreezeObserver(state)
    for step in range(3):
        w.grad = torch.tensor([1.0, 0.0, 0.0, 0.0])
        obs_params.before_step(); obs_state.before_step()
        opt.step()
        obs_params.after_step(); obs_state.after_step()
    assert obs_params.record().overall == [0.75, 0.75, 0.75]
    assert math.isnan(obs_state.record().overall[0])  # no state before the first step
    assert obs_state.record().by_tensor["exp_avg"][1:] == [0.75, 0.75]


def test_freeze_step_definition():
    assert freeze_step([0, 0.6, 0.4, 0.7, 0.9], 0.5) == 3
    assert freeze_step([0.9, 0.9], 0.5) == 0
    assert freeze_step([0.9, 0.1], 0.5) is None
    assert freeze_step([], 0.5) is None
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        freeze_step([1.0], 0.0)


def test_steps_agree_tolerance():
    assert steps_agree(10, 12, 50)        # 2 steps
    assert not steps_agree(10, 13, 50)
    assert steps_agree(100, 110, 500)     # 2 % of 500
    assert not steps_agree(100, 111, 500)
    assert not steps_agree(None, 3, 10) and not steps_agree(3, None, 10)


def test_neither_freezing_is_agreement_and_the_sweep_says_nothing_froze():
    """Both freeze steps None: the prediction "nothing freezes within the run" holds."""
    assert steps_agree(None, None, 10)
    r = lp.book.run_experiment("quadratic", fmt="bf16", steps=5, dim=4, variants=("reference", "nearest"),
                          progress=False)
    assert r.predicted_freeze_step() is None and r.observed_freeze_step() is None
    assert r.freeze_steps_agree()
    rows = lp.book.sweep("quadratic", man_bits=[3, 7], steps=5, dim=4) + lp.book.sweep("quadratic", man_bits=[3], steps=200)
    assert [(row["agree"], row["froze"]) for row in rows] == [(True, False), (True, False), (True, True)]


def test_observer_and_predictor_have_one_shape():
    w = torch.nn.Parameter(torch.ones(4))
    observer, predictor = FreezeObserver({"w": w}, "bfloat16"), FreezePredictor({"w": w}, ["bf16", "e4m3"])
    for tracker in (observer, predictor):
        assert isinstance(tracker, FreezeTracker)
        tracker.before_step()
    w.data[0] -= 1e-3
    w.data[1] += 1.0
    observer.after_step(), predictor.after_step()
    assert list(observer.records) == ["bf16"] and list(predictor.records) == ["bf16", "e4m3"]
    assert observer.record() is observer.record("bf16") is observer.records["bf16"]
    assert predictor.record() is predictor.record("bf16") is predictor.records["bf16"]
    assert observer.record().overall == [0.5]      # two stored values changed
    assert predictor.record().overall == [0.75]    # -1e-3 is under half a bf16 ulp of 1
    with pytest.raises(KeyError, match="no record for e4m3; recorded: bf16"):
        observer.record("e4m3")
    with pytest.raises(KeyError, match="no record for fp16; recorded: bf16, e4m3"):
        predictor.record("fp16")


def test_freeze_order_lists_first_frozen_first():
    rec = lp.freeze.FreezeRecord(format="bf16", kind="predicted",
                          by_tensor={"a": [0, 0, 1, 1], "b": [1, 1, 1, 1], "c": [0, 0, 0, 0]})
    assert freeze_order(rec, 0.5) == [("b", 0), ("a", 2), ("c", None)]



def test_froze_as_predicted_needs_a_freeze():
    froze = lp.book.run_experiment("quadratic", fmt="bf16", steps=300, progress=False, variants=("reference", "nearest"))
    assert froze.predicted_freeze_step() is not None and froze.froze_as_predicted()
    never = lp.book.run_experiment("quadratic", fmt="bf16", steps=5, dim=4, variants=("reference", "nearest"),
                              progress=False)
    assert never.freeze_steps_agree() and not never.froze_as_predicted()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_predictors_octaves_are_exact_just_above_a_power_of_two(dtype):
    """Updates of 2**j gaps and of just over 2**j gaps (where a float32 log2 rounds down onto j, or a float64 ratio
    rounded to the nearest float32 lands on 2**j): the ratio histogram puts them in the octave ceil(log2 ratio), on
    the float64 path (tensor by tensor) and the float32 one (the kernel), and the few-bit share counts the ratios up
    to 2**-(k+1)."""
    j = torch.arange(-16, 7, dtype=torch.float64)
    w = torch.full((len(j),), 2.0**10, dtype=torch.float64)    # a bf16 gap of 2**3
    d = 2.0**(j + 3)
    if dtype == torch.float64:     # 2**j (1 + 2**-30) gaps: finer than float32 resolves
        w, d = torch.cat([w, w[1:]]), torch.cat([d, d[1:] * (1 + 2.0**-30)])
    else:   # -2**10 moved up by 2**10 + 2**-13: 2**8 (1 + 2**-23) gaps of 4 (inward from a power of two)
        w, d = torch.cat([w, torch.tensor([-(2.0**10)])]), torch.cat([d, torch.tensor([2.0**10 + 2.0**-13])])
    param = torch.nn.Parameter(w.to(dtype, copy=True))
    predictor = FreezePredictor({"w": param}, ["bf16"], rand_bits=4)
    predictor.before_step()
    with torch.no_grad():
        param.add_(d.to(dtype))
    predictor.after_step()
    assert torch.equal(param.detach().double() - w, d)          # the updates are exactly these
    ratio = lp.rounding.update_ulp_ratio(w, d, "bf16")                    # exact: a division by a power of two
    mantissa, exponent = torch.frexp(ratio)
    octave = torch.where(mantissa == 0.5, exponent - 1, exponent)
    edge = ratio > 2.0 ** (octave - 1).double()     # not powers of two...
    rounded = ratio.float() if dtype == torch.float64 else torch.exp2(torch.log2(ratio.float()))
    assert (edge & (rounded.double() == 2.0 ** (octave - 1).double())).any()   # ...that a float32 step rounds onto one
    want = torch.bincount((octave - RATIO_BINS[0]).clamp(0, len(RATIO_BINS)), minlength=len(RATIO_BINS) + 1)
    rec = predictor.record("bf16")
    assert rec.ratio_histogram == want.tolist()
    assert rec.fewbit_frozen == [(ratio <= 2.0**-5).double().mean().item()]
