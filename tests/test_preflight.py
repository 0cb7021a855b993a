"""lp.preflight: the advice before the first step, on a copy; the user's model, optimizer, scheduler and random
state left as they were; its verdict on runs that clearly need a remedy and clearly do not; bad input."""

import copy
import warnings

import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.monitor.preflight import CUTOFF, PROBE_STEPS, Preflight
from tiny_run import batches, tiny_model, train


def _loss(calls=None, noise=False):
    """The next batch's loss of the tiny run, batch after batch; ``calls`` counts them; ``noise`` draws from torch's
    generator (as dropout would)."""
    data, at = batches(400, seed=3), [0]

    def loss(model):
        x = data[at[0] % len(data)]
        at[0] += 1
        if calls is not None:
            calls.append(1)
        out = model(x).float()
        if noise:
            out = out + 1e-3 * torch.randn_like(out)
        return torch.nn.functional.cross_entropy(out, (x + 1) % 12)
    return loss


def _run(lr=1e-4, dtype=torch.bfloat16, steps=100):
    model = tiny_model().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    return model, opt, sched


def test_contract():
    model, opt, sched = _run()
    pf = lp.preflight(model, opt, sched, loss=_loss())
    assert isinstance(pf, Preflight) and pf.format == "bf16" and pf.total_steps == 100
    assert pf.probe_steps == PROBE_STEPS and pf.cutoff == CUTOFF
    assert isinstance(pf.plan, lp.FreezePlan) and pf.plan.format == "bf16" and pf.plan.total_steps == 100
    names = [n for n, _ in model.named_parameters()]
    assert list(pf.by_tensor) == names == list(pf.plan.remedies)
    for n, p in model.named_parameters():
        t = pf.by_tensor[n]
        assert t["size"] == p.numel() and 0.0 <= t["frozen_share"] <= 1.0 and t["remedy"] == pf.plan.remedies[n]
        assert t["remedy"] in lp.optim.plan.PLAN_REMEDIES and t["why"] == pf.plan.reasons.get(n, "")
    weighted = sum(t["frozen_share"] * t["size"] for t in pf.by_tensor.values()) / sum(
        t["size"] for t in pf.by_tensor.values())
    assert pf.frozen_share == pytest.approx(weighted, rel=1e-12)
    assert pf.needs_remedy == (pf.frozen_share >= CUTOFF)
    assert pf.bytes_per_parameter == pf.plan.bytes_per_parameter()
    assert sorted(pf.curve) == list(range(100))      # measured probe steps, then the forecast to the run's end
    # the plan goes onto the user's optimizer, by name or by position
    lp.LowPrecisionOptimizer(opt, "bf16", plan=pf.plan, model=model)


def test_summary_lists_the_tensors_that_need_something():
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)]).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x = torch.randn(8, 4)
    pf = lp.preflight(model, opt, total_steps=30, probe_steps=3,
                      loss=lambda m: m(x.to(torch.float32)).pow(2).mean())
    lines = str(pf).splitlines()
    assert lines[0].startswith("preflight for bf16: the run needs a remedy: ") and "bytes per parameter" in lines[0]
    fixes = [n for n, r in pf.plan.remedies.items() if r != "nearest"]
    first = pf.plan.remedies[fixes[0]]
    assert len(fixes) > 12 and lines[1].startswith(f"  {fixes[0]} (16): {first}, +{pf.plan.extra_bytes(first):g} bytes")
    assert lines[-1] == f"  and {len(fixes) - 12} more tensors (by_tensor, or plan.summary(), lists them all)"
    assert len(lines) == 14 and pf.summary(show=False) == str(pf)


def test_probe_steps_bounded_by_the_run():
    calls = []
    model, opt, sched = _run(steps=7)
    pf = lp.preflight(model, opt, sched, loss=_loss(calls))
    assert pf.probe_steps == 7 == len(calls) and sorted(pf.curve) == list(range(7))
    calls.clear()
    pf = lp.preflight(model, opt, total_steps=50, probe_steps=3, loss=_loss(calls))
    assert pf.probe_steps == 3 == len(calls) and pf.total_steps == 50


def _state(model, opt, sched):
    return copy.deepcopy((model.state_dict(), opt.state_dict(), sched.state_dict(),
                          [p.grad for p in model.parameters()], [p.dtype for p in model.parameters()]))


def _same(a, b):
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_user_state_untouched():
    """Model (weights, grads, dtypes), optimizer state, scheduler and torch's CPU random state: the same after the
    preflight, and the run that follows takes the same steps bit for bit as one without a preflight."""
    runs = []
    for with_preflight in (False, True):
        model, opt, sched = _run(lr=3e-3, steps=30)
        train(model, opt, 3, sched)        # a run part way: optimizer state, a scheduler past its start, grads
        torch.manual_seed(7)
        before, rng = _state(model, opt, sched), torch.get_rng_state()
        if with_preflight:
            pf = lp.preflight(model, opt, sched, loss=_loss(noise=True))
            assert pf.probe_steps == PROBE_STEPS
            assert _same(_state(model, opt, sched), before) and torch.equal(torch.get_rng_state(), rng)
            assert sched.last_epoch == 3 and opt.param_groups[0]["lr"] == sched.get_last_lr()[0]
        train(model, opt, 5, sched, seed=1, each=lambda t: torch.randn(3))
        runs.append((model.state_dict(), torch.randn(4)))
    assert _same(runs[0], runs[1])


def test_a_watch_on_the_users_optimizer_sees_no_probe_step():
    model, opt, sched = _run()
    with lp.watch(model, opt, scheduler=sched) as w:
        pf = lp.preflight(model, opt, sched, loss=_loss())
        assert pf.probe_steps == PROBE_STEPS and w.steps == []
        train(model, opt, 2, sched)
    assert w.steps == [0, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_random_state_untouched():
    model = tiny_model().cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = [x.cuda() for x in batches(40)]
    at = [0]

    def loss(m):
        x, at[0] = data[at[0] % 40], at[0] + 1
        out = m(x).float() + 1e-3 * torch.randn(1, device="cuda")
        return torch.nn.functional.cross_entropy(out, (x + 1) % 12)
    rng, params = torch.cuda.get_rng_state(), [p.detach().clone() for p in model.parameters()]
    lp.preflight(model, opt, total_steps=50, loss=loss)
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))


def test_needs_a_remedy_when_updates_are_far_below_half_a_gap():
    """lr 1e-6 against weights of order 0.1-1: Adam's updates (about lr) sit far below half a bf16 gap."""
    model, opt, sched = _run(lr=1e-6)
    pf = lp.preflight(model, opt, sched, loss=_loss())
    assert pf.needs_remedy and pf.frozen_share > 0.95
    # the watch's plan within the budget (1 byte per parameter): master copies and Kahan buffers first
    assert 0.0 < pf.bytes_per_parameter["extra"] <= 1.0 + 1e-9 and {"master", "kahan"} & set(pf.plan.remedies.values())
    # no budget: stochastic rounding wherever a remedy is due, no byte more
    free = lp.preflight(*_run(lr=1e-6), loss=_loss(), budget=0)
    assert free.bytes_per_parameter["extra"] == 0.0 and "stochastic" in free.plan.remedies.values()
    assert set(free.plan.remedies.values()) <= {"stochastic", "nearest"}
    assert pf.by_tensor["1.bias"]["frozen_share"] < 0.45     # LayerNorm's bias starts at 0: the finest gaps
    assert str(pf).splitlines()[0].startswith("preflight for bf16: the run needs a remedy: ")


def test_no_remedy_where_the_format_does_not_freeze():
    """fp32 storage asked for: every update of this run lies far above half a float32 gap."""
    model, opt, sched = _run(lr=1e-3, dtype=torch.float32)
    pf = lp.preflight(model, opt, sched, formats="fp32", loss=_loss())
    assert pf.format == "fp32" and not pf.needs_remedy and pf.frozen_share < 0.05
    assert set(pf.plan.remedies.values()) == {"nearest"}
    text = str(pf)
    assert text.splitlines()[0].startswith("preflight for fp32: the run needs no remedy: ")
    assert text.splitlines()[1] == "  every tensor: round to nearest"


def test_no_remedy_at_a_large_rate_in_bf16():
    """A constant lr of 0.05 on weights of order 0.1-1: Adam's updates are several bf16 gaps wide."""
    model = tiny_model().to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    pf = lp.preflight(model, opt, total_steps=100, loss=_loss())
    assert not pf.needs_remedy and pf.frozen_share < 0.25


def test_format_from_storage_and_fp8_plan():
    model, opt, sched = _run(dtype=torch.float32)
    assert lp.preflight(model, opt, sched, probe_steps=2, loss=_loss()).format == "bf16"   # float32: bf16
    pf = lp.preflight(model.to(torch.float16), opt, sched, probe_steps=2, loss=_loss())
    assert pf.format == "fp16"
    model, opt, sched = _run(lr=1e-3, dtype=torch.float32)
    pf = lp.preflight(model, opt, sched, formats="e4m3", budget=1.0, loss=_loss())
    assert pf.format == pf.plan.format == "e4m3" and pf.needs_remedy
    assert {"master", "kahan"} & set(pf.plan.remedies.values())        # the watch's plan, not stochastic alone
    assert pf.bytes_per_parameter["extra"] <= 1.0 + 1e-9
    assert "kahan" in str(pf) or "master" in str(pf)


def test_format_of_a_low_precision_optimizer():
    model, opt, _ = _run(dtype=torch.float32)
    lpo = lp.LowPrecisionOptimizer(opt, "e5m2")
    before = _state(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    pf = lp.preflight(model, lpo, total_steps=40, probe_steps=2, loss=_loss())
    assert pf.format == "e5m2"
    assert _same(_state(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)), before)


def test_a_scheduler_on_the_wrapper():
    """A scheduler built on a LowPrecisionOptimizer: the copies step the wrapped optimizer, no scheduler warning."""
    model = tiny_model().to(torch.bfloat16)
    lpo = lp.LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), "bf16", rounding="stochastic",
                                   generator=0)
    sched = torch.optim.lr_scheduler.LambdaLR(lpo, lambda t: 1 - t / 50)
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pf = lp.preflight(model, lpo, sched, 50, loss=_loss())
    assert pf.needs_remedy and sched.last_epoch == 0 and lpo.param_groups[0]["lr"] == 1e-4
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("kwargs, error, words", [
    ({}, TypeError, "needs loss="),
    ({"loss": 3}, TypeError, "got 3"),
    ({"formats": "bf17"}, ValueError, "bf17"),
    ({"formats": ("bf16", "fp16")}, ValueError, "one storage format"),
    ({"probe_steps": 0}, ValueError, "probe_steps must be"),
    ({"budget": -1}, ValueError, "budget must be"),
    ({"total_steps": 0}, ValueError, "total_steps must be"),
])
def test_bad_input_before_any_work(kwargs, error, words):
    calls = []
    model, opt, sched = _run()
    kwargs = {"loss": _loss(calls), **kwargs} if "loss" not in kwargs and kwargs else kwargs
    with pytest.raises(error, match=words):
        lp.preflight(model, opt, sched, **kwargs)
    assert not calls


def test_no_run_length():
    model = tiny_model().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(ValueError, match="pass total_steps="):
        lp.preflight(model, opt, sched, loss=_loss())
    with pytest.raises(ValueError, match="pass total_steps="):
        lp.preflight(model, opt, loss=_loss())


def test_float_inputs_of_the_wrong_dtype_get_a_hint():
    model = torch.nn.Linear(4, 1).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.ones(2, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="copy of the model is float32"):
        lp.preflight(model, opt, total_steps=10, loss=lambda m: m(x).sum())
    pf = lp.preflight(model, opt, total_steps=10, loss=lambda m: m(x.to(m.weight.dtype)).float().sum())
    assert pf.needs_remedy in (True, False)
