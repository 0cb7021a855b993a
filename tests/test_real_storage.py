"""Parameters really stored in torch.bfloat16 / torch.float16 under LowPrecisionOptimizer: the same bits as the
simulation, the remainder remedy as the fp32 master, bytes by the tensors' own sizes, a resume to the same bits."""

import copy

import pytest
import torch

from lowprec_demo.monitor.integrations import attach_plan
from lowprec_demo.optim import FreezePlan, LowPrecisionOptimizer, bytes_per_parameter
from lowprec_demo.optim import storage

# CI runs these once more at torch's default thread count: parameters really stored in bf16/fp16:
# torch's own low-precision kernels, whose element paths depend on the thread count.
pytestmark = pytest.mark.threads

REMEDIES = {"nearest": {}, "stochastic": {"rounding": "stochastic", "generator": 7},
            "kahan": {"compensation": "kahan"}, "kahan_lp": {"compensation": "kahan", "compensation_format": "bf16"},
            "master": {"master_weights": True}, "remainder": {"compensation": "remainder"},
            "feedback": {"compensation": "feedback"},
            "feedback_sr": {"compensation": "feedback", "rounding": "stochastic", "generator": 3}}


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 1700))  # a large one
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(dtype).float())
    return m


def _grads(model, steps, dtype=torch.bfloat16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(p.shape, generator=g) * 0.1).to(dtype) for p in model.parameters()] for _ in range(steps)]


def _run(model, opt, grads, real):
    for step in grads:
        for p, g in zip(model.parameters(), step):
            p.grad = g.clone() if real else g.float()
        opt.step()


def _make(model, remedy, real, fmt="bf16", inner=None, **extra):
    inner = inner or torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    kw = dict(REMEDIES[remedy], **extra)
    if not real:
        kw.setdefault("state_format", fmt)     # real storage keeps the state in the parameters' dtype
    return LowPrecisionOptimizer(inner, fmt, **kw)


def _bits(tensors):
    return [t.detach().float().view(torch.int32).clone() for t in tensors]


@pytest.mark.parametrize("remedy", list(REMEDIES))
def test_real_storage_takes_the_simulations_steps_to_the_bit(remedy):
    sim, real = _model(), _model().to(torch.bfloat16)
    grads = _grads(sim, 12)
    o_sim, o_real = _make(sim, remedy, False), _make(real, remedy, True)
    _run(sim, o_sim, grads, False)
    _run(real, o_real, grads, True)
    assert all(p.dtype == torch.bfloat16 for p in real.parameters())
    assert all(torch.equal(a, b) for a, b in zip(_bits(sim.parameters()), _bits(real.parameters())))
    moved = sum(int((p.float() != q).sum()) for p, q in zip(real.parameters(), _model().parameters()))
    assert moved > 1000    # not a trivial case: the steps moved weights
    for p, q in zip(sim.parameters(), real.parameters()):
        a, b = o_sim.state[p], o_real.state[q]
        assert b["exp_avg"].dtype == torch.bfloat16 and b["exp_avg_sq"].dtype == torch.bfloat16
        assert torch.equal(a["exp_avg"], b["exp_avg"].float()) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"].float())


@pytest.mark.parametrize("remedy", ["nearest", "stochastic", "kahan", "master", "feedback"])
def test_fp16_storage_matches_the_simulation(remedy):
    sim, real = _model(torch.float16), _model(torch.float16).to(torch.float16)
    grads = _grads(sim, 8, torch.float16)
    o_sim = _make(sim, remedy, False, fmt="fp16")
    o_real = _make(real, remedy, True, fmt="fp16")
    _run(sim, o_sim, grads, False)
    _run(real, o_real, grads, True)
    assert all(torch.equal(a, b) for a, b in zip(_bits(sim.parameters()), _bits(real.parameters())))


def test_remainder_is_bit_equal_to_the_fp32_master():
    a, b = _model().to(torch.bfloat16), _model().to(torch.bfloat16)
    grads = _grads(a, 30)
    o_master, o_rem = _make(a, "master", True), _make(b, "remainder", True)
    _run(a, o_master, grads, True)
    _run(b, o_rem, grads, True)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    masters = [o_master._masters[p] for p in a.parameters()]
    joined = [storage.join_remainder(q, o_rem._remainders[q]) for q in b.parameters()]
    # the masters too, but where a master fell exactly halfway above an even stored weight (one in about 2^17
    # element-steps): that one is kept a float32 ulp nearer the stored weight, and its later steps a few ulps apart
    off = torch.cat([(m.view(torch.int32) - j.view(torch.int32)).flatten() for m, j in zip(masters, joined)])
    steps_elements = 30 * off.numel()
    assert int(off.abs().max()) <= 4 and int((off != 0).sum()) <= 4 * steps_elements / 2 ** 17
    # and nearest storage alone loses what the master keeps
    c = _model().to(torch.bfloat16)
    _run(c, _make(c, "nearest", True), grads, True)
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_remainder_split_is_exact_but_for_ties_rounded_down():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 18, generator=g) * torch.exp2(torch.randint(-30, 30, (1 << 18,), generator=g).float())
    x[:4] = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 3.0e38])   # ties down, up; near max
    stored, rem = storage.split_remainder(x)
    assert torch.equal(stored, x.to(torch.bfloat16).float())          # the stored weight is round to nearest
    back = storage.join_remainder(stored, rem)
    off = back.view(torch.int32) - x.view(torch.int32)
    tie_down = (x.view(torch.int32) - stored.view(torch.int32)) == 1 << 15
    assert torch.equal(off != 0, tie_down) and int(off.abs().max()) == 1
    assert bool(tie_down[0]) and not bool(tie_down[1]) and bool(tie_down[2])


@pytest.mark.parametrize("remedy", ["stochastic", "kahan_lp", "master", "remainder", "feedback"])
@pytest.mark.parametrize("state_format", [None, "fp32"])
def test_resume_from_state_dicts_ends_with_the_same_bits(remedy, state_format):
    grads = _grads(_model(), 16)
    whole = _model().to(torch.bfloat16)
    _run(whole, _make(whole, remedy, True, state_format=state_format), grads, True)
    first = _model().to(torch.bfloat16)
    o1 = _make(first, remedy, True, state_format=state_format)
    _run(first, o1, grads[:8], True)
    saved_model, saved_opt = copy.deepcopy(first.state_dict()), copy.deepcopy(o1.state_dict())
    second = _model().to(torch.bfloat16)
    second.load_state_dict(saved_model)
    o2 = _make(second, remedy, True, state_format=state_format, generator=99) if remedy == "stochastic" else \
        _make(second, remedy, True, state_format=state_format)
    o2.load_state_dict(saved_opt)
    if state_format == "fp32":
        assert all(o2.state[p]["exp_avg"].dtype == torch.float32 for p in second.parameters())
    _run(second, o2, grads[8:], True)
    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), second.parameters()))


@pytest.mark.parametrize("remedy", list(REMEDIES))
def test_bytes_held_are_the_tensors_own_sizes(remedy):
    model = _model().to(torch.bfloat16)
    opt = _make(model, remedy, True)
    _run(model, opt, _grads(model, 2), True)
    params = list(model.parameters())
    count = sum(p.numel() for p in params)
    own = sum(p.numel() * p.element_size() for p in params)
    own += sum(v.numel() * v.element_size() for p in params for v in opt.state[p].values())
    own += sum(t.numel() * t.element_size() for d in (opt._masters, opt._remainders, opt._compensation_buffers)
               for t in d.values())
    b = bytes_per_parameter(opt)
    assert b["held"] == pytest.approx(own / count)
    expected = {"nearest": 6, "stochastic": 6, "kahan": 10, "kahan_lp": 8, "master": 10, "remainder": 8,
                "feedback": 6, "feedback_sr": 6}[remedy]
    assert b["total"] == pytest.approx(expected) and b["held"] == pytest.approx(b["total"], abs=0.01)  # (Adam's step)
    # between steps nothing float32 of a parameter's size is held but the master copies
    big = [t for p in params for t in opt.state[p].values() if t.dtype == torch.float32 and t.numel() > 1]
    assert big == [] and all(p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16 for p in params)


def test_a_simulated_format_still_counts_its_float32_storage_as_held():
    model = _model()
    opt = _make(model, "nearest", False)
    _run(model, opt, _grads(model, 1), False)
    b = bytes_per_parameter(opt)
    assert b["total"] == pytest.approx(6) and b["held"] == pytest.approx(12, abs=0.01)


def test_a_failed_step_leaves_the_stored_weights():
    model = _model().to(torch.bfloat16)
    opt = _make(model, "nearest", True)
    before = [p.clone() for p in model.parameters()]

    def closure():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step(closure)
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_misconfigurations_name_the_values():
    model = _model().to(torch.bfloat16)
    with pytest.raises(ValueError, match="stored in torch.bfloat16.*fmt='bf16'"):
        LowPrecisionOptimizer(torch.optim.AdamW(model.parameters()), "e4m3")
    half = _model().to(torch.float16)
    with pytest.raises(ValueError, match="remainder.*bf16.*got fp16"):
        LowPrecisionOptimizer(torch.optim.AdamW(half.parameters()), "fp16", compensation="remainder")
    with pytest.raises(ValueError, match="feedback.*Adagrad"):
        LowPrecisionOptimizer(torch.optim.Adagrad(model.parameters()), "bf16", compensation="feedback")
    with pytest.raises(ValueError, match="compensation must be one of None, 'kahan', 'remainder', 'feedback'"):
        LowPrecisionOptimizer(torch.optim.AdamW(model.parameters()), "bf16", compensation="ecc")
    with pytest.raises(ValueError, match="round-to-nearest"):
        LowPrecisionOptimizer(torch.optim.AdamW(model.parameters()), "bf16", compensation="remainder",
                              rounding="stochastic")


def test_feedback_with_sgd_momentum_recovers_updates_nearest_loses():
    """Each step a fortieth of half a gap at 1.0: nearest freezes; error feedback (ECO's rule) keeps the lost part in
    the momentum and moves the weights at fp32's pace less a lag of a few gaps, given a momentum that can hold it
    (float32, or bf16 with stochastic rounding: round to nearest freezes a bf16 momentum buffer too)."""
    runs = {}
    for name, kw in (("fp32", None), ("nearest", {"state_format": "fp32"}),
                     ("feedback", {"compensation": "feedback", "state_format": "fp32"}),
                     ("feedback_sr_state", {"compensation": "feedback", "state_rounding": "stochastic", "generator": 2}),
                     ("feedback_bf16_state", {"compensation": "feedback"})):
        w = torch.nn.Parameter(torch.ones(1024, dtype=torch.float32 if kw is None else torch.bfloat16))
        inner = torch.optim.SGD([w], lr=1.0, momentum=0.9)
        opt = inner if kw is None else LowPrecisionOptimizer(inner, "bf16", **kw)
        for _ in range(2000):
            w.grad = torch.full_like(w, -2 ** -12 * 0.02)     # lr * grad / (1 - mu) = 2^-12 * 0.2
            opt.step()
        runs[name] = float((w.detach().float() - 1.0).mean())
    assert runs["nearest"] == 0.0 and runs["fp32"] == pytest.approx(2000 * 2 ** -12 * 0.2, rel=0.01)
    for name in ("feedback", "feedback_sr_state"):
        assert 0.5 * runs["fp32"] < runs[name] <= runs["fp32"] + 2 ** -7
    assert runs["feedback_bf16_state"] == 0.0


def test_attach_plan_on_a_bf16_model_mixes_remedies():
    model = _model().to(torch.bfloat16)
    names = [n for n, _ in model.named_parameters()]
    remedies = dict(zip(names, ["remainder", "feedback", "kahan", "stochastic", "master", "nearest"]))
    plan = FreezePlan("bf16", remedies, sizes={n: p.numel() for n, p in model.named_parameters()})
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    attached = attach_plan(inner, plan, model=model, generator=1)
    for step in _grads(model, 3):
        for p, g in zip(model.parameters(), step):
            p.grad = g
        inner.step()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert {attached.remedy_of(p) for p in model.parameters()} == set(remedies.values())
    b = bytes_per_parameter(attached)
    assert b["held"] == pytest.approx(b["total"], abs=0.01)
    attached.detach_plan()


def test_no_working_copy_outlives_its_step(monkeypatch):
    """Between steps the process holds the stored tensors, the state in its dtype and the wrapper's own tensors only:
    every float32 tensor the generic step makes is freed (weak references to them die). (The fused step, refused here,
    makes its float32 values inside compiled kernels, in a scratch of lowprec_demo.optim.fused.CHUNK elements.)"""
    import gc
    import weakref
    from lowprec_demo.optim import fused
    monkeypatch.setattr(fused, "eligible", lambda opt: False)
    model = _model().to(torch.bfloat16)
    opt = _make(model, "stochastic", True)
    made = []
    real_float = torch.Tensor.float

    def tracking_float(t, *a, **k):
        out = real_float(t, *a, **k)
        if out is not t:
            made.append(weakref.ref(out))
        return out

    grads = _grads(model, 3)
    try:
        torch.Tensor.float = tracking_float
        _run(model, opt, grads, True)
    finally:
        torch.Tensor.float = real_float
    gc.collect()
    assert made and all(ref() is None for ref in made)
    assert all(not plan for plan in opt.packs.kept.values()) and opt.held_bytes() == 0


def test_a_closure_comes_first_on_the_stored_weights_and_inner_hooks_run_once():
    """A closure (Lightning gives one) is evaluated before the step, on the stored weights, through attach_plan's hooks
    as through the wrapper: the same bits as the gradients set before ``step()``. The hooks on the inner optimizer run
    once per step, over every parameter (those stored in bf16 as float32 working copies)."""
    names = [n for n, _ in _model().named_parameters()]
    remedies = dict(zip(names, ["master", "kahan", "stochastic", "remainder", "nearest", "feedback"]))
    plan = FreezePlan("bf16", remedies, sizes={n: p.numel() for n, p in _model().named_parameters()})
    runs = []
    for closure in (False, True):
        model = _model().to(torch.bfloat16)
        inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
        attached, seen, hooked = attach_plan(inner, plan, model=model, generator=1), [], []
        inner.register_step_pre_hook(lambda o, a, k: hooked.append({p.dtype for g in o.param_groups for p in g["params"]}))
        for step in _grads(model, 3):
            def set_grads(step=step):
                seen.append({p.dtype for p in model.parameters()})
                for p, g in zip(model.parameters(), step):
                    p.grad = g.clone()
                return 0.0
            if closure:
                inner.step(set_grads)
            else:
                set_grads()
                inner.step()
        attached.detach_plan()
        runs.append(_bits(model.parameters()))
        assert seen == [{torch.bfloat16}] * 3 and len(hooked) == 3
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    w = torch.nn.Parameter(torch.ones(4))
    opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-3), "bf16", master_weights=True)
    weights = []

    def closure():
        weights.append(w.detach().clone())
        w.grad = torch.ones(4)
        return 0.0
    for _ in range(3):
        assert opt.step(closure) == 0.0
    # the stored weights, on the grid, not the master (1 - k/1000)
    assert all(torch.equal(x, x.to(torch.bfloat16).float()) for x in weights) and torch.equal(weights[1], weights[0])
    assert torch.equal(opt._masters[w], torch.ones(4) - 1e-3 - 1e-3 - 1e-3)
