"""One freeze rule, every caller: the same weights and updates through each place in the package
that decides "does this update freeze" or "how likely does stochastic rounding move it", against
the exact ``fractions.Fraction`` reference of ``tests/exact_reference.py``.

Callers: ``rounding.would_freeze`` and ``rounding.move_probability`` (a weight and an update);
the step kernel ``freeze_rule.step_codes`` (the code's frozen bit, and the move probability of
each element, with and without few-bit resolution); ``FreezePredictor`` (its kept masks and its
move share); the freeze watch (its frozen and move shares); ``LowPrecisionOptimizer`` with round to
nearest (a stored weight that did not change). The cases: +-max with outward and inward updates
(E4M3 saturates, E5M2 and bf16 overflow to inf), one below max, powers of two in both directions
(where the grid below is twice as fine), ties at even and odd neighbours, subnormals, zero, +-inf
weights and NaN updates.
"""

import math
import os
import sys
from fractions import Fraction

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_reference as ER  # noqa: E402

import lowprec_demo as lp  # noqa: E402
from lowprec_demo.rounding.freeze_rule import step_codes  # noqa: E402

FORMATS = ["e4m3", "e5m2", "bf16", "fp16"]
FACTORS = [0.0, 0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 3.0]   # updates in ulps of the weight, both signs


def grid_weights(fmt) -> list:
    """Finite grid values of ``fmt`` where the rule has its edges, both signs."""
    top = fmt.max
    below_top = lp.quantize(torch.tensor([top], dtype=torch.float64) * (1 - 2.0 ** -(fmt.man_bits + 1)) * 0.999, fmt).item()
    normal = 2.0 ** fmt.e_min
    values = [top, below_top, 1.0, 2.0, 0.75, 1.0 + 2.0 ** -fmt.man_bits, 3.0, normal, normal * 2,
              normal * 2.0 ** -fmt.man_bits, 3 * normal * 2.0 ** -fmt.man_bits, 0.0]
    values = [v for v in values if v <= top]
    return sorted({s * v for v in values for s in (1.0, -1.0)}, key=lambda v: (abs(v), v))


def cases(fmt) -> tuple:
    """``(old, new)`` float32 pairs, with ``new - old`` computed exactly in float32, for every
    weight of :func:`grid_weights` and every update of ``FACTORS`` in its ulps, both ways, plus
    the outward and inward steps at +-max of an eighth and a 64th of max."""
    olds, news = [], []
    for w in grid_weights(fmt):
        gap = lp.ulp(torch.tensor([w], dtype=torch.float64), fmt).item()
        for f in FACTORS:
            for sign in (1.0, -1.0):
                olds.append(w)
                news.append(w + sign * f * gap)
    for w in (fmt.max, -fmt.max):
        for d in (fmt.max / 8, -fmt.max / 8, fmt.max / 64):
            olds.append(w)
            news.append(w + d)
    old = torch.tensor(olds, dtype=torch.float64)
    new = torch.tensor(news, dtype=torch.float64)
    exact = (new.float().double() - old.float().double()) == (new - old)   # keep pairs float32 carries exactly
    return old[exact].float(), new[exact].float()


def reference(w: float, d: float, fmt, rand_bits=None):
    frozen = ER.would_freeze(w, d, fmt)
    p = ER.move_probability(w, d, fmt, rand_bits=rand_bits)
    return frozen, (math.nan if isinstance(p, float) else float(p))


def same_probability(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.parametrize("key", FORMATS)
def test_rounding_functions_are_the_exact_rule(key):
    fmt = lp.get_format(key)
    old, new = cases(fmt)
    w, d = old.double(), (new - old).double()
    # and the weights nobody steps from in a float32 run: +-inf under finite and infinite
    # updates, and NaN updates
    inf = torch.tensor([math.inf, math.inf, -math.inf, -math.inf, math.inf, 1.0, math.inf, -math.inf],
                       dtype=torch.float64)
    inf_d = torch.tensor([1.0, -1.0, 1.0, -math.inf, math.inf, math.nan, math.nan, math.nan], dtype=torch.float64)
    if fmt.has_inf:
        w, d = torch.cat([w, inf]), torch.cat([d, inf_d])
    frozen = lp.would_freeze(w, d, fmt).tolist()
    for k in (None, 3):
        moves = lp.move_probability(w, d, fmt, rand_bits=k).tolist()
        for i in range(len(w)):
            want_frozen, want_move = reference(w[i].item(), d[i].item(), fmt, k)
            assert frozen[i] == want_frozen, (w[i].item(), d[i].item())
            assert same_probability(moves[i], want_move), (w[i].item(), d[i].item(), k, moves[i], want_move)
    # an eighth of max outward: past the last midpoint, so it freezes only where the format saturates
    outward = [i for i in range(len(w)) if abs(w[i].item()) == fmt.max and d[i].item() * w[i].item() > 0
               and abs(d[i].item()) == fmt.max / 8]
    # (bf16's max plus an eighth is beyond float32: no such float32 step)
    assert len(outward) == (2 if fmt.max * 1.125 < torch.finfo(torch.float32).max else 0)
    assert all(frozen[i] == (fmt.overflow == "saturate") for i in outward)
    assert all((moves[i] == 0) == (fmt.overflow == "saturate") for i in outward)


@pytest.mark.parametrize("key", FORMATS)
def test_the_freeze_kernel_is_the_exact_rule(key):
    """Element by element (one call each, eagerly: the compiled kernel gives the eager bits,
    tests/test_bench.py)."""
    fmt = lp.get_format(key)
    old, new = cases(fmt)
    for k in (None, 3):
        zero = torch.zeros((), dtype=torch.int32)
        for i in range(len(old)):
            code, moves = step_codes(old[i:i + 1], new[i:i + 1], None, zero, None, fmt, k)
            moved = moves.item()
            w, d = old[i].item(), (new[i] - old[i]).item()
            want_frozen, want_move = reference(w, d, fmt, k)
            assert bool(code.item() & 2) == want_frozen, (w, d)
            assert same_probability(moved, want_move), (w, d, k, moved, want_move)


def _one_step(fmt, old, new, wrap=False):
    """A module holding ``old`` trained one SGD step (lr 1) to ``new``, optionally under
    LowPrecisionOptimizer; returns (model, optimizer, param)."""
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(old.clone())
    opt = torch.optim.SGD([model.w], lr=1.0)
    if wrap:
        opt = lp.LowPrecisionOptimizer(opt, fmt)
    model.w.grad = (old - new).clone()
    return model, opt


@pytest.mark.parametrize("key", FORMATS)
def test_predictor_watch_and_optimizer_are_the_exact_rule(key):
    fmt = lp.get_format(key)
    old, new = cases(fmt)
    wants = [reference(old[i].item(), (new[i] - old[i]).item(), fmt) for i in range(len(old))]
    want_frozen = torch.tensor([f for f, _ in wants])
    want_move = sum(m for _, m in wants) / len(wants)

    model, opt = _one_step(fmt, old, new)
    predictor = lp.freeze.FreezePredictor(model, formats=(fmt,), keep_masks=True)
    watch = lp.watch(model, opt, formats=(fmt,))
    predictor.before_step()
    opt.step()
    predictor.after_step()
    assert torch.equal(model.w.detach(), new)     # the step is the update of the cases, exactly
    assert torch.equal(predictor.masks[fmt.name]["w"].reshape(-1), want_frozen)
    # (the records hold float32 shares; one element of these ~200 is a share of 0.005)
    assert predictor.record(fmt).overall[-1] == pytest.approx(want_frozen.float().mean().item(), abs=1e-6)
    assert predictor.record(fmt).move_fraction[-1] == pytest.approx(want_move, rel=1e-6)
    assert watch.record(fmt).overall[-1] == pytest.approx(want_frozen.float().mean().item(), abs=1e-6)
    assert watch.record(fmt).move_fraction[-1] == pytest.approx(want_move, rel=1e-6)

    model, opt = _one_step(fmt, old, new, wrap=True)
    opt.step()
    assert torch.equal(model.w.detach() == old, want_frozen)
