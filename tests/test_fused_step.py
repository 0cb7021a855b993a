"""The fused Adam step (lowprec_demo.optim.fused) against the generic one: the same bits of weights, moments,
remainders, step counts and generator, on every case it takes; the generic step on every case it must leave."""

import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.optim import fused
from lowprec_demo.rounding import round_to_grid as rg


@pytest.fixture
def small_chunks(monkeypatch):
    # chunks of 1000 elements: chunk edges inside tensors, at no multiple of a vector's width
    monkeypatch.setattr(fused, "CHUNK", 1000)


def _model(dtype, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 61), torch.nn.LayerNorm(61), torch.nn.Linear(61, 5)).to(dtype)


def _train(mode, dtype=torch.bfloat16, steps=5, make_inner=None, no_grad_for=(), scheduler=False, **kw):
    """Run ``steps`` steps in compile mode ``mode`` ("off": the generic step); the bits it ends with, and how many
    steps were fused."""
    previous = rg.set_mode(mode)
    try:
        model = _model(dtype)
        params = list(model.parameters())
        inner = (make_inner or (lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.05)))(params)
        opt = lp.LowPrecisionOptimizer(inner, "bf16" if dtype == torch.bfloat16 else "fp16", generator=11, **kw)
        sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 1 / (1 + s)) if scheduler else None
        x = torch.randn(32, 40, generator=torch.Generator().manual_seed(3)).to(dtype)
        taken = 0
        for _ in range(steps):
            opt.zero_grad()
            (model(x).float() ** 2).mean().backward()
            for i in no_grad_for:
                params[i].grad = None
            taken += mode != "off" and fused.eligible(opt)
            opt.step()
            if sched is not None:
                sched.step()
        bits = [p.detach().view(torch.int16).clone() for p in params]
        bits += [v.clone() for p in params for v in inner.state[p].values()]
        bits += [r.clone() for r in opt._remainders.values()] + [opt.generator.get_state()]
        return bits, taken
    finally:
        rg.set_mode(previous)


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kw", [dict(rounding="stochastic"), dict(rounding="nearest"),
                                dict(compensation="remainder"), dict(rounding="stochastic", rand_bits=6)],
                         ids=["stochastic", "nearest", "remainder", "stochastic-6-bits"])
def test_fused_step_gives_the_generic_steps_bits(kw, small_chunks):
    generic, _ = _train("off", **kw)
    fast, taken = _train("on", **kw)
    assert taken == 5, "the fused step was not taken"
    assert _same(generic, fast)


def test_fused_step_on_adam_without_decay_groups_a_scheduler_and_missing_grads(small_chunks):
    def inner(ps):
        return torch.optim.Adam([{"params": ps[:2], "lr": 2e-3}, {"params": ps[2:], "lr": 5e-4, "eps": 1e-6}])
    generic, _ = _train("off", make_inner=inner, no_grad_for=(3,), scheduler=True, rounding="stochastic")
    fast, taken = _train("on", make_inner=inner, no_grad_for=(3,), scheduler=True, rounding="stochastic")
    assert taken == 5 and _same(generic, fast)


def test_a_plan_mixing_remedies_draws_the_generic_steps_seeds(small_chunks):
    model = _model(torch.bfloat16)
    plan = lp.FreezePlan("bf16", {name: remedy for (name, _), remedy in zip(
        model.named_parameters(), ["stochastic", "remainder", "stochastic", "nearest", "stochastic", "stochastic"])})

    def run(mode):
        previous = rg.set_mode(mode)
        try:
            m = _model(torch.bfloat16)
            inner = torch.optim.AdamW(m.parameters(), lr=3e-3)
            opt = lp.LowPrecisionOptimizer(inner, "bf16", plan=plan, model=m, generator=4)
            x = torch.randn(16, 40, generator=torch.Generator().manual_seed(1)).bfloat16()
            for _ in range(3):
                opt.zero_grad()
                m(x).float().pow(2).mean().backward()
                opt.step()
            assert mode == "off" or fused.eligible(opt)
            return [p.detach().view(torch.int16).clone() for p in m.parameters()] + [opt.generator.get_state()]
        finally:
            rg.set_mode(previous)
    assert _same(run("off"), run("on"))


def test_a_state_dict_saved_by_the_fused_step_resumes_the_generic_one():
    previous = rg.set_mode("on")
    try:
        model = _model(torch.bfloat16)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt = lp.LowPrecisionOptimizer(inner, "bf16", rounding="stochastic", generator=2)
        x = torch.randn(8, 40).bfloat16()
        for _ in range(2):
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()
        assert fused.eligible(opt)
        saved = opt.state_dict()
    finally:
        rg.set_mode(previous)
    assert saved["state"][0]["exp_avg"].dtype == torch.bfloat16 and float(saved["state"][0]["step"]) == 2.0
    twin = _model(torch.bfloat16)
    twin.load_state_dict(model.state_dict())
    other = lp.LowPrecisionOptimizer(torch.optim.AdamW(twin.parameters(), lr=1e-3), "bf16", rounding="stochastic",
                                     generator=99)
    other.load_state_dict(saved)
    assert torch.equal(other.generator.get_state(), opt.generator.get_state())


@pytest.mark.parametrize("case", ["amsgrad", "coupled decay", "hook", "float32 parameter", "fp16 storage", "foreach",
                                  "off"])
def test_the_fused_step_leaves_what_it_cannot_match(case):
    previous = rg.set_mode("off" if case == "off" else "on")
    try:
        model = _model({"float32 parameter": torch.float32, "fp16 storage": torch.float16}.get(case, torch.bfloat16))
        options = {"amsgrad": dict(amsgrad=True), "foreach": dict(foreach=True)}.get(case, {})
        cls = torch.optim.Adam if case == "coupled decay" else torch.optim.AdamW
        inner = cls(model.parameters(), lr=1e-3, weight_decay=0.1, **options)
        if case == "hook":
            inner.register_step_post_hook(lambda *a: None)
        opt = lp.LowPrecisionOptimizer(inner, "fp16" if case == "fp16 storage" else "bf16", rounding="stochastic",
                                       generator=0)
        model[0](torch.ones(2, 40, dtype=model[0].weight.dtype)).float().sum().backward()
        assert not fused.eligible(opt)
    finally:
        rg.set_mode(previous)


def test_auto_mode_waits_for_the_budget(monkeypatch):
    monkeypatch.setattr(fused, "_work", {"elements": 0})
    monkeypatch.setattr(fused, "_ready", {})
    monkeypatch.setattr(rg, "EAGER_BUDGET", 10_000)
    previous = rg.set_mode("auto")
    try:
        model = _model(torch.bfloat16)
        opt = lp.LowPrecisionOptimizer(torch.optim.AdamW(model.parameters()), "bf16", rounding="stochastic")
        numel = sum(p.numel() for p in model.parameters())
        answers = [fused.eligible(opt) for _ in range(10_000 // numel + 2)]
    finally:
        rg.set_mode(previous)
    assert answers[0] is False and answers[-1] is True
    assert answers.index(True) == -(-10_000 // numel)


def test_a_probe_that_disagrees_turns_the_fused_step_off(monkeypatch):
    def decay_fused_into_the_update(p, grad, m, v, root, c, remainder=None):   # the product not rounded first
        mf = torch.lerp(m.float(), grad.float(), c[1])
        p.copy_((p.float() * c[0] + c[6] * mf / (root / c[4] + c[5])).to(p.dtype))
    monkeypatch.setattr(fused, "_ready", {})
    monkeypatch.setitem(fused._UPDATE, "nearest", decay_fused_into_the_update)
    previous = rg.set_mode("on")
    try:
        model = _model(torch.bfloat16)
        opt = lp.LowPrecisionOptimizer(torch.optim.AdamW(model.parameters()), "bf16")
        with pytest.warns(RuntimeWarning, match="fused Adam step .* is not used: its bits differ"):
            assert not fused.eligible(opt)
        assert not fused.eligible(opt)     # (once: not checked again)
    finally:
        rg.set_mode(previous)


@pytest.mark.parametrize("overflow", [None, "saturate"])
def test_bf16_stochastic_bits_are_stochastic_bits_onto_bf16(overflow):
    """Every class of float32 pattern: random ones, zeros, subnormals, the largest finite, inf, NaNs, both signs."""
    fmt = lp.get_format("bf16")
    gen = torch.Generator().manual_seed(0)
    special = [0, 1, 0xFFFF, 0x10000, 0x007FFFFF, 0x00800000, 0x3F800000, 0x3F808000, 0x3F80FFFF, 0x7F7EFFFF,
               0x7F7F0000, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF]
    special += [b | 1 << 31 for b in special]
    bits = torch.cat([torch.randint(-2 ** 31, 2 ** 31, (1 << 18,), generator=gen, dtype=torch.int64),
                      torch.tensor(special, dtype=torch.int64)])
    bits = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)
    for seed, offset in ((0, 0), (2 ** 40 + 3, 12345)):
        q = rg.round_params(fmt, overflow, None, seed, offset).tensor()
        expected = rg.stochastic_bits(bits.clone(), q)
        got = fused.bf16_stochastic_bits(bits.clone(), q)
        assert got.dtype == torch.int32 and torch.equal(got, expected)
    moved = (fused.bf16_stochastic_bits(bits, q) != (bits & -(1 << 16))).float().mean()
    assert 0.3 < moved < 0.7      # (about half the random patterns move up: the check compares real draws)
