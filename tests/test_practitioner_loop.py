"""The practitioner's loop through the trainers (issue 51): a plan from the preflight before the first step
(``plan_after=0``), the watch going on through the fix and counting what the stored bits do, the plan's state in
Hugging Face and Lightning checkpoints (a resumed run ends with the bits of an unbroken one; a checkpoint without it
warns), and bad options refused when the callback is made or when training starts."""

import os
import warnings

import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.monitor.integrations import STATE_FILE, attach_plan, hf_callback
from lowprec_demo.optim.plan import FreezePlan, load_plan
from tiny_run import batches, tiny_model

REMEDIES = {"0.weight": "kahan", "1.weight": "master", "1.bias": "remainder", "2.weight": "stochastic",
            "2.bias": "nearest"}


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


class Observer:
    """Counts, step by step, the share of the stored elements a step left bit for bit the same (what the watch's
    observation should log), from hooks of its own: a snapshot before, a comparison after."""

    def __init__(self, params):
        self.params, self.shares, self._before = list(params), [], None

    def before(self):
        self._before = [p.detach().clone() for p in self.params]

    def after(self):
        same = sum(int((_bits(p.detach()) == _bits(b)).sum()) for p, b in zip(self.params, self._before))
        self.shares.append(same / sum(p.numel() for p in self.params))


def _bf16_loop(steps=12):
    """A bf16 tiny model under AdamW with every remedy attached; the watch's record and an observer's counts."""
    model = tiny_model().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    w = lp.watch(model, opt, sample=None)
    plan = attach_plan(opt, FreezePlan("bf16", REMEDIES), model=model, generator=1, watch=w)
    seen = Observer(model.parameters())
    for x in batches(steps):
        seen.before()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x).float(), (x + 1) % 12).backward()
        opt.step()
        seen.after()
    w.detach()
    return w, plan, seen


def test_the_watch_through_a_plan_counts_the_stored_bits():
    w, plan, seen = _bf16_loop()
    assert {plan.remedy_of(p) for p in w.params.values()} == set(REMEDIES.values())
    assert w.mode == "observe" and len(seen.shares) == 12
    assert w.record("bf16").overall == pytest.approx(seen.shares, abs=1e-12)
    assert 0 < min(seen.shares) and max(seen.shares) < 1


def test_a_second_watch_on_one_optimizer_warns():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    w = lp.watch(model, opt)
    with pytest.warns(UserWarning, match="this SGD has a freeze watch attached already: a second one copies"):
        lp.watch(model, opt, formats=("fp16",)).detach()
    w.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lp.watch(model, opt).detach()         # once the first is detached, a new one goes on quietly
        lp.watch(model, torch.optim.SGD(model.parameters(), lr=1e-2)).detach()     # another optimizer: quietly


# ---- the optimizer's own state --------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, lost", [(dict(compensation="remainder"), "remainder"),
                                           (dict(compensation="kahan"), "kahan"), (dict(master_weights=True), "master"),
                                           (dict(rounding="stochastic", generator=3), "SR generator")])
def test_a_low_precision_optimizer_loaded_without_its_own_state_warns(options, lost):
    model = tiny_model()
    opt = lp.LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), "bf16", **options)
    for x in batches(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), (x + 1) % 12).backward()
        opt.step()
    full = opt.state_dict()
    with pytest.warns(UserWarning, match=f"no 'lowprec' part \\(only the inner optimizer's\\): the {lost} state"):
        opt.load_state_dict(opt.optimizer.state_dict())         # what a trainer saves: the inner optimizer's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(full)


def test_a_plain_low_precision_optimizer_loads_an_inner_state_dict_quietly():
    model = tiny_model()
    opt = lp.LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), "bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(opt.optimizer.state_dict())


# ---- bad options: when the callback is made, or when training starts ------------------------------------------------

@pytest.mark.parametrize("options, error, match", [
    (dict(formats=("bf17",)), ValueError, "bf17"), (dict(every=0), ValueError, "every"),
    (dict(threshold=2.0), ValueError, "threshold"), (dict(sample=0), ValueError, "sample"),
    (dict(writer="runs/"), TypeError, "SummaryWriter"), (dict(total_steps=5), TypeError, "total_steps"),
    (dict(fromats=("bf16",)), TypeError, r"unknown watch option fromats: the callback takes formats"),
    (dict(plan_after=-1), ValueError, r"plan_after is a number of optimizer steps >= 0.*-1"),
    (dict(preflight_loss="loss"), TypeError, "preflight_loss must be a callable")])
def test_bad_callback_options_fail_when_it_is_made(options, error, match, lightning):
    from lowprec_demo.monitor.integrations import lightning_callback
    pytest.importorskip("transformers", reason="transformers is not installed: pip install transformers")
    for make in (hf_callback, lightning_callback):
        with pytest.raises(error, match=match):
            make(**options)


def test_plan_after_past_the_run_fails_when_training_starts(tmp_path, hf):
    callback = hf_callback(plan_after=500)
    trainer = hf.trainer(tmp_path, callback, steps=20)
    with pytest.raises(ValueError, match=r"plan_after=500 is not before the run's end: the run has 20 optimizer steps"):
        trainer.train()
    assert trainer.state.global_step == 0 and not (tmp_path / "freeze_watch.json").exists()


# ---- plan_after=0 and the watch after the plan, through the Hugging Face Trainer ------------------------------------

def _observer_callback(hf):
    class Counts(hf.module.TrainerCallback):
        seen = None

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if self.seen is None:
                self.seen = Observer(model.parameters())
            self.seen.before()

        def on_step_end(self, args, state, control, **kwargs):
            self.seen.after()

        def on_log(self, args, state, control, logs=None, **kwargs):     # (after the watch's: what it added)
            if "loss" in logs:
                self.logged.append(logs["frozen_bf16"])
    counts = Counts()
    counts.logged = []
    return counts


class RandomState:
    """The torch random state when training starts, before and after the callbacks between."""

    def __init__(self, hf):
        outer = self

        class At(hf.module.TrainerCallback):
            def __init__(self, key):
                self.key = key

            def on_train_begin(self, *args, **kwargs):
                outer.states[self.key] = torch.get_rng_state()
        self.states, self.before, self.after = {}, At("before"), At("after")


@pytest.mark.parametrize("plan_after, dtype", [(0, torch.bfloat16), (3, torch.bfloat16), (0, torch.float32)])
def test_hf_plan_then_watch_logs_what_the_stored_bits_do(tmp_path, hf, plan_after, dtype):
    callback = hf_callback(plan_after=plan_after, sample=None)
    trainer = hf.trainer(tmp_path, callback, dtype=dtype, steps=8, samples=32, lr=1e-4, logging_steps=1)
    counts, rng = _observer_callback(hf), RandomState(hf)
    trainer.add_callback(counts)
    trainer.callback_handler.callbacks.insert(trainer.callback_handler.callbacks.index(callback), rng.before)
    trainer.callback_handler.callbacks.insert(trainer.callback_handler.callbacks.index(callback) + 1, rng.after)
    trainer.train()
    assert torch.equal(rng.states["before"], rng.states["after"])       # the preflight's data drew nothing
    plan, w = callback.plan, callback.watch
    assert plan is not None and plan.step == max(plan_after - 1, 0) and load_plan(tmp_path / "freeze_plan.json") == plan
    assert (callback.preflight is not None) == (plan_after == 0)
    assert w.steps == list(range(8)) and w.forecast("bf16") is not None     # still usable after the plan
    logged = counts.logged
    assert logged == w.record("bf16").overall and len(logged) == 8
    assert logged[plan_after:] == pytest.approx(counts.seen.shares[plan_after:], abs=1e-12)
    report = lp.load_watch(tmp_path / "freeze_watch.json")
    assert report.data["steps"] == list(range(8)) and report.plan == plan


def _hf_resume_pair(tmp_path, hf, plan_after, drop_state=False, drop_plan=False):
    """An unbroken run of 8 steps saving at step 4, and a run resumed from that checkpoint; their parameters."""
    options = dict(dtype=torch.bfloat16, steps=8, samples=32, lr=1e-4, save_strategy="steps", save_steps=4)
    callback = hf_callback(plan_after=plan_after, plan_budget=4.0)
    unbroken = hf.trainer(tmp_path / "a", callback, **options)
    unbroken.train()
    state = torch.load(tmp_path / "a" / "checkpoint-4" / STATE_FILE, weights_only=True)
    assert FreezePlan.from_dict(state["plan"]) == callback.plan
    count = sum(p.numel() for p in unbroken.model.parameters())     # the file: the plan's extra bytes, and a little
    held = callback.plan.bytes_per_parameter()["extra"] * count
    assert held <= os.path.getsize(tmp_path / "a" / "checkpoint-4" / STATE_FILE) <= held + 32768
    if drop_state:
        os.remove(tmp_path / "a" / "checkpoint-4" / STATE_FILE)
    if drop_plan:
        os.remove(tmp_path / "a" / "freeze_plan.json")
    resumed_cb = hf_callback(plan_after=plan_after, plan_budget=4.0)
    resumed = hf.trainer(tmp_path / "a", resumed_cb, **options)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    return callback, resumed_cb, dict(unbroken.model.named_parameters()), dict(resumed.model.named_parameters())


def _differ(a, b):
    return [n for n in a if not torch.equal(_bits(a[n]), _bits(b[n]))]


@pytest.mark.parametrize("plan_after", [0, 2])
def test_hf_resumed_run_ends_with_the_bits_of_an_unbroken_one(tmp_path, hf, plan_after):
    callback, resumed_cb, a, b = _hf_resume_pair(tmp_path, hf, plan_after)
    assert resumed_cb.plan == callback.plan and resumed_cb.preflight is None      # the same plan, not a new one
    stateful = {r for r in callback.plan.remedies.values()} - {"nearest"}
    assert stateful, callback.plan.remedies
    assert all(p.dtype == torch.bfloat16 for p in b.values())
    assert _differ(a, b) == []
    assert resumed_cb.watch.steps == [4, 5, 6, 7]


def test_hf_resume_without_the_plans_state_warns(tmp_path, hf):
    with pytest.warns(UserWarning, match=r"resuming at step 4 without the freeze plan's state \(lowprec_state.pt"):
        callback, resumed_cb, a, b = _hf_resume_pair(tmp_path, hf, 2, drop_state=True)
    assert resumed_cb.plan == callback.plan        # the saved plan again, with fresh state: other bits
    assert {"master", "kahan"} & set(callback.plan.remedies.values()), callback.plan.remedies
    assert _differ(a, b) != []


def test_hf_resume_without_the_plans_state_or_file_plans_again_from_the_preflight(tmp_path, hf):
    with pytest.warns(UserWarning, match=r"resuming at step 4 without .* the preflight plans again now"):
        _, resumed_cb, _, _ = _hf_resume_pair(tmp_path, hf, 0, drop_state=True, drop_plan=True)
    assert resumed_cb.preflight is not None and resumed_cb.plan.step == 0


# ---- Lightning ------------------------------------------------------------------------------------------------------

def _lightning_fit(lightning, callback, steps, tmp_path, ckpt=None, save_at=None):
    """A bf16 tiny model, 4 batches an epoch (no shuffle), AdamW with a cosine over 8 steps."""
    import math
    pl = pytest.importorskip("pytorch_lightning")

    def adamw(parameters):
        opt = torch.optim.AdamW(parameters, lr=3e-3)
        return lightning.stepwise(opt, torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / 8))))
    torch.manual_seed(0)
    module = lightning.module(tiny_model().to(torch.bfloat16),
                              lambda net, x: torch.nn.functional.cross_entropy(net(x).float(), (x + 1) % 12), adamw)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(batches(4))), batch_size=16)
    counts = LightningCounts(pl)
    saver = [] if save_at is None else [pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=save_at,
                                                                    save_top_k=-1, filename="{step}")]
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=bool(saver),
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback, counts, *saver],
                         default_root_dir=tmp_path)
    trainer.fit(module, data, ckpt_path=ckpt)
    return module, counts.seen.shares


def LightningCounts(pl):
    class Counts(pl.Callback):
        seen = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.seen is None:
                self.seen = Observer(pl_module.parameters())
            self.seen.before()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen.after()
    return Counts()


def test_lightning_plan_after_0_and_resume_to_the_same_bits(tmp_path, lightning):
    from lowprec_demo.monitor.integrations import lightning_callback
    callback = lightning_callback(path=tmp_path / "w.json", plan_after=0, sample=None)
    unbroken, shares = _lightning_fit(lightning, callback, 8, tmp_path / "a", save_at=4)
    assert callback.preflight is not None and callback.plan.step == 0
    assert callback.watch.steps == list(range(8))
    assert callback.watch.record("bf16").overall == pytest.approx(shares, abs=1e-12)    # the stored bits'
    assert set(callback.plan.remedies.values()) - {"nearest"}
    resumed_cb = lightning_callback(path=tmp_path / "w2.json", plan_after=0, sample=None)
    resumed, _ = _lightning_fit(lightning, resumed_cb, 8, tmp_path / "b", ckpt=str(tmp_path / "a" / "step=4.ckpt"))
    assert resumed_cb.plan == callback.plan and resumed_cb.preflight is None
    assert resumed_cb.watch.steps == [4, 5, 6, 7]
    a, b = dict(unbroken.named_parameters()), dict(resumed.named_parameters())
    assert _differ(a, b) == []
    assert resumed_cb.watch.record("bf16").overall == callback.watch.record("bf16").overall[4:]
    # a checkpoint without the callback's state: a warning, the saved plan again with fresh state
    ckpt = torch.load(tmp_path / "a" / "step=4.ckpt", weights_only=False)
    ckpt["callbacks"] = {k: v for k, v in ckpt["callbacks"].items() if "FreezeWatch" not in k}
    torch.save(ckpt, tmp_path / "a" / "bare.ckpt")
    bare_cb = lightning_callback(path=tmp_path / "w3.json", plan_after=0, plan_path=tmp_path / "a" / "freeze_plan.json")
    callback.plan.save(tmp_path / "a" / "freeze_plan.json")
    with pytest.warns(UserWarning, match=r"resuming at step 4 without the freeze plan's state"):
        _lightning_fit(lightning, bare_cb, 8, tmp_path / "c", ckpt=str(tmp_path / "a" / "bare.ckpt"))
    assert bare_cb.plan == callback.plan and bare_cb.preflight is None


# ---- one run, two trainers: the same values logged ------------------------------------------------------------------

class _Net(torch.nn.Module):
    """The tiny model with the Hugging Face calling convention: ``net(input_ids=x)["loss"]``."""

    def __init__(self):
        super().__init__()
        self.net = tiny_model().to(torch.bfloat16)

    def forward(self, input_ids):
        loss = torch.nn.functional.cross_entropy(self.net(input_ids).float(), (input_ids + 1) % 12)
        return {"loss": loss}


def test_hf_and_lightning_log_the_same_frozen_shares_for_the_same_run(tmp_path, hf, lightning):
    import math
    from lowprec_demo.monitor.integrations import lightning_callback
    data = torch.cat(batches(4))
    hf_cb = hf_callback(plan_after=3, sample=None)

    class InOrder(hf.module.Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)
    args = hf.module.TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=8, per_device_train_batch_size=16,
                                       learning_rate=3e-3, lr_scheduler_type="cosine", optim="adamw_torch",
                                       max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no",
                                       use_cpu=True, disable_tqdm=True)
    hf_model = _Net()
    InOrder(model=hf_model, args=args, train_dataset=[{"input_ids": x} for x in data], callbacks=[hf_cb]).train()

    net = _Net()

    def adamw(parameters):      # the Trainer's groups, in its order: decayed (matrices), then not (norms, biases)
        named = dict(net.named_parameters())
        groups = [[named[n] for n in names] for names in (("net.0.weight", "net.2.weight"),
                                                          ("net.1.weight", "net.1.bias", "net.2.bias"))]
        opt = torch.optim.AdamW([{"params": g} for g in groups], lr=3e-3, weight_decay=0.0)
        return lightning.stepwise(opt, torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(s) / 8.0)))))
    module = lightning.module(net, lambda net, x: net(input_ids=x)["loss"], adamw)
    pl_cb = lightning_callback(path=tmp_path / "pl.json", plan_after=3, sample=None)
    torch.manual_seed(args.seed)     # the process's seed, as the Trainer set it: the plans' SR generators' seed
    lightning.trainer(8, pl_cb).fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data),
                                                                         batch_size=16))
    a, b = dict(hf_model.named_parameters()), dict(module.net.named_parameters())
    assert {n.removeprefix("net."): r for n, r in pl_cb.plan.remedies.items()} == hf_cb.plan.remedies
    assert set(hf_cb.plan.remedies.values()) >= {"kahan", "stochastic"}
    assert _differ(a, b) == []                       # the same run, to the bit
    assert pl_cb.watch.record("bf16").overall == hf_cb.watch.record("bf16").overall
