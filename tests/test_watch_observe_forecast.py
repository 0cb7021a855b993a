"""The freeze watch's forecast and plan on a model stored in bf16 or fp16: the update the optimizer meant, read from
its state after the step (:mod:`lowprec_demo.monitor.intended`), is the float32 step's ``new - old`` to a few ulps;
the frozen share it predicts by the rule is the observed one to within 0.03 at every watched step of a fine-tune; an
optimizer whose state the watch does not read gets a clear error; reports with and without the expected record load.
"""

import copy
import json
from functools import partial

import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.monitor.intended import intended_update
from lowprec_demo.monitor.report import load_watch, WatchReport
from lowprec_demo.freeze.sampling import Sample
from lowprec_demo.monitor.forecast import forecast_curves, update_ratios
from lowprec_demo.optim.plan import FreezePlan, load_plan

TOLERANCE = 0.03        # expected vs observed frozen share, every watched step (set before any run)
VOCAB = 64


class Net(torch.nn.Module):
    """Embedding, LayerNorm, two Linear layers, and a parameter no loss reaches (no gradient: no update)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.hidden = torch.nn.Linear(32, 64)
        self.out = torch.nn.Linear(64, VOCAB)
        self.unused = torch.nn.Parameter(torch.ones(5))

    def forward(self, x):
        return self.out(torch.relu(self.hidden(self.norm(self.emb(x)))))


def _batches(seed):
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, VOCAB, (64,), generator=g)
        yield x, (3 * x + 1) % VOCAB


def _train(model, opt, steps, seed=0, sched=None, each=None):
    data = _batches(seed)
    for i in range(steps):
        x, y = next(data)
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        if each is not None:
            each(i, "before")
        opt.step()
        if each is not None:
            each(i, "after")
        if sched is not None:
            sched.step()


_PRETRAINED = {}


def pretrained():
    """Net pretrained in float32 (AdamW at 1e-2, 150 steps), a fresh copy each call."""
    if not _PRETRAINED:
        torch.manual_seed(0)
        model = Net()
        _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 150, seed=1)
        _PRETRAINED["model"] = model
    return copy.deepcopy(_PRETRAINED["model"])


def _ulp(x):
    x = x.float().abs()
    return torch.nextafter(x, torch.full_like(x, float("inf"))) - x


OPTIMIZERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1),
    "adam_l2": lambda groups: torch.optim.Adam(groups, lr=1e-3, weight_decay=0.05),
    "adam_l2_amsgrad_maximize": lambda groups: torch.optim.Adam(groups, lr=1e-3, weight_decay=0.05, amsgrad=True,
                                                                maximize=True),
    "sgd_momentum": lambda groups: torch.optim.SGD(groups, lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    "sgd_nesterov": lambda groups: torch.optim.SGD(groups, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "sgd_plain_maximize": lambda groups: torch.optim.SGD(groups, lr=1e-2, weight_decay=1e-3, maximize=True),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_update_meant_is_the_float32_step_on_every_followed_element(name):
    torch.manual_seed(0)
    model = Net()
    names, params = zip(*model.named_parameters())
    # two param groups with their own learning rate and decay, one scheduled
    groups = [{"params": params[:3]}, {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0}]
    opt = OPTIMIZERS[name](groups)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    sample = Sample(list(params), 37)          # the larger tensors strided
    assert max(sample.strides) > 1
    seen, worst = {}, []

    @torch.no_grad()
    def each(i, when):
        if when == "before":
            seen["old"] = sample.gather(params).clone()
            seen["lrs"] = [opt.param_groups[gi]["lr"] for gi, g in enumerate(groups) for _ in g["params"]]
            return
        old, new, grad = seen["old"], sample.gather(params), sample.grads(params)
        d = intended_update(opt, sample, params, seen["lrs"], old, grad)
        step = new - old
        tol = 2 * (_ulp(old) + _ulp(new)) + 8 * _ulp(d)
        assert torch.all((d - step.double()).abs() <= tol.double()), (name, i, float((d - step.double()).abs().max()))
        worst.append(float(((d - step.double()).abs() / tol.double()).max()))
        unused = sample.tensor_id == names.index("unused")       # no gradient: the step skips it
        assert torch.all(d[unused] == 0) and torch.all(step[unused] == 0)
        assert (step != 0).float().mean() > 0.5           # (the steps are not all nothing)

    _train(model, opt, 6, sched=sched, each=each)
    assert len(worst) == 6


def _finetune(dtype, lr, steps=60, optimizer=torch.optim.AdamW, **watch_options):
    """The pretrained Net cast to ``dtype`` and fine-tuned with ``optimizer`` at peak ``lr``, cosine to 0, watched."""
    model = pretrained().to(dtype)
    opt = optimizer(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    w = lp.watch(model, opt, scheduler=sched, **watch_options)
    _train(model, opt, steps // 2, seed=2, sched=sched)
    return model, opt, w


# fp16 with torch's eps=1e-8: eps and Adam's v underflow to 0 in fp16, so the first step stores 0/0 = NaN in every
# weight (the run is lost, whatever the watch says); fp16 runs take eps >= 1e-4, as here
@pytest.mark.parametrize("dtype, lr, eps", [(torch.bfloat16, 2e-5, 1e-8), (torch.bfloat16, 1e-4, 1e-8),
                                            (torch.float16, 1e-4, 1e-4)])
def test_a_low_precision_fine_tune_forecasts_plans_and_predicts_its_frozen_share(dtype, lr, eps):
    model, opt, w = _finetune(dtype, lr, optimizer=lambda params, lr: torch.optim.AdamW(params, lr=lr, eps=eps))
    assert all(p.isfinite().all() for p in model.parameters())
    fmt = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    assert w.mode == "observe" and w.formats == [fmt] and w.total_steps == 60 and len(w.steps) == 30
    observed, expected = w.record(fmt), w.expected_record(fmt)
    assert expected.kind == "predicted" and len(expected.overall) == len(observed.overall) == 30
    gaps = [abs(e - o) for e, o in zip(expected.overall, observed.overall)]
    assert max(gaps) <= TOLERANCE, gaps
    assert 0.05 < observed.overall[-1] < 1.0            # some frozen, some not: the comparison means something
    fc = w.forecast(fmt)
    assert set(fc["by_tensor"]) == set(w.tracked)
    assert all(fc["by_tensor"][n]["step"] is None or 0 <= fc["by_tensor"][n]["step"] < 60 for n in w.tracked)
    curves = forecast_curves(w, fmt)
    assert sorted(curves["overall"]) == list(range(30, 60)) and all(0 <= v <= 1 for v in curves["overall"].values())
    ratios = update_ratios(w, fmt)
    assert ratios["norm.weight"] > 0 and ratios["unused"] == 0.0       # no gradient: no update
    plan = w.plan(fmt)
    assert isinstance(plan, FreezePlan) and plan.format == fmt and set(plan.remedies) == set(w.tracked)
    assert plan.step == 29 and plan.total_steps == 60
    assert "n/a" not in w.summary(show=False)             # the forecast column is filled


def test_a_low_precision_optimizer_reads_the_inner_optimizers_state():
    model = pretrained()
    opt = lp.LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), "bf16")
    w = lp.watch(model, opt, total_steps=40)
    _train(model, opt, 20, seed=2)
    assert w.mode == "observe" and w.no_forecast is None
    gaps = [abs(e - o) for e, o in zip(w.expected_record().overall, w.record().overall)]
    assert max(gaps) <= TOLERANCE, gaps
    assert w.plan("bf16").format == "bf16"


def test_an_optimizer_the_watch_cannot_read_observes_and_says_why_it_cannot_forecast():
    model, opt, w = _finetune(torch.bfloat16, 1e-3, optimizer=torch.optim.Adagrad)
    assert len(w.record("bf16").overall) == 30            # observation works as before
    expected = r"torch\.optim\.AdamW, torch\.optim\.Adam, torch\.optim\.SGD"
    for call in (w.forecast, partial(forecast_curves, w), partial(update_ratios, w), w.plan, w.expected_record):
        with pytest.raises(ValueError, match=expected) as error:
            call("bf16")
        assert "torch.optim.adagrad.Adagrad" in str(error.value)
    data = w.report().data
    assert data["forecast"] == {} and "expected" not in data
    assert "n/a" in w.summary(show=False)


def test_what_has_no_expected_record_says_so():
    model = pretrained()
    w = lp.watch(model, torch.optim.AdamW(model.parameters(), lr=1e-4), total_steps=10)     # float32: prediction
    _train(model, w.optimizer, 2)
    with pytest.raises(ValueError, match="this watch predicts bf16: record"):
        w.expected_record()
    assert "expected" not in w.report().data
    mixed = torch.nn.ParameterDict({"a": torch.ones(8, dtype=torch.bfloat16), "b": torch.ones(8, dtype=torch.float16)})
    opt = torch.optim.AdamW(mixed.parameters(), lr=1e-4)     # two storage formats: no forecast, observation as before
    wm = lp.watch(mixed, opt, total_steps=10)
    for _ in range(2):
        opt.zero_grad()
        sum(p.float().pow(2).sum() for p in mixed.values()).backward()
        opt.step()
    assert wm.formats == ["bf16", "fp16"] and wm.record("fp16").overall == [1.0, 1.0]
    with pytest.raises(ValueError, match="needs one storage format; this watch observes bf16, fp16"):
        wm.forecast("bf16")


def test_reports_with_the_expected_record_and_older_ones_without_it_load(tmp_path):
    model, opt, w = _finetune(torch.bfloat16, 1e-4)
    w.save(tmp_path / "new.json")
    data = json.loads((tmp_path / "new.json").read_text())
    assert data["expected"]["bf16"]["kind"] == "predicted"
    assert data["expected"]["bf16"]["overall"] == pytest.approx(w.expected_record().overall)
    assert data["forecast"]["bf16"]["overall"] == w.forecast("bf16")["overall"]
    new = load_watch(tmp_path / "new.json")
    assert "n/a" not in new.summary(show=False)
    # a report saved before: no "expected", no forecast in observation
    old = {k: v for k, v in w.report().data.items() if k != "expected"} | {"forecast": {}, "forecast_curves": {}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    report = load_watch(tmp_path / "old.json")
    assert isinstance(report, WatchReport) and "n/a" in report.summary(show=False)
    assert report.rows()[0]["frozen_now"] == pytest.approx(w.record().overall[-1])
    report.plot()


# ---- the trainers' callbacks: plan_after on a bf16 model -----------------------------------------

def test_hf_plan_after_plans_a_bf16_model(tmp_path, hf):
    from lowprec_demo.monitor.integrations import hf_callback
    callback = hf_callback(plan_after=3)
    trainer = hf.trainer(tmp_path, callback, dtype=torch.bfloat16, steps=6, samples=32, lr=1e-4)
    trainer.train()
    plan = callback.plan
    assert isinstance(plan, FreezePlan) and plan.format == "bf16" and plan.step == 2
    assert load_plan(tmp_path / "freeze_plan.json") == plan
    assert callback.plan_optimizer is not None and trainer.state.global_step == 6
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())


def test_hf_plan_after_on_a_bf16_model_refuses_a_format_it_is_not_stored_in(tmp_path, hf):
    from lowprec_demo.monitor.integrations import hf_callback
    callback = hf_callback(plan_after=3, plan_format="fp16")
    trainer = hf.trainer(tmp_path, callback, dtype=torch.bfloat16, steps=6, samples=32, lr=1e-4)
    with pytest.raises(ValueError, match=r"plan_format='fp16'.*observes.*one of bf16"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_lightning_plan_after_plans_a_bf16_model(tmp_path, lightning):
    from lowprec_demo.monitor.integrations import lightning_callback

    def adamw(parameters):
        opt = torch.optim.AdamW(parameters, lr=1e-4)
        return lightning.stepwise(opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12))

    module = lightning.module(pretrained().to(torch.bfloat16),
                              lambda net, x: torch.nn.functional.cross_entropy(net(x).float(), (3 * x + 1) % VOCAB), adamw)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (256,))), batch_size=16)
    callback = lightning_callback(path=tmp_path / "watch.json", plan_after=6)
    lightning.trainer(12, callback).fit(module, data)
    assert callback.plan is not None and callback.plan.format == "bf16" and callback.plan.step == 5
    assert load_plan(tmp_path / "freeze_plan.json") == callback.plan
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
