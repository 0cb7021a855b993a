"""The watch's kept share (lowprec_demo/monitor/kept.py): how much of the update the optimizer meant reaches the stored
bf16 weights. Frozen under round to nearest: about 0; under a plan that fixes the freeze: about 1, though the frozen
share of a step stays high."""

import math

import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.freeze.sampling import Sample
from lowprec_demo.monitor.kept import KeptRecord, kept_sums
from lowprec_demo.optim.plan import FreezePlan
from tiny_run import tiny_model, train

LR, STEPS = 1e-4, 200     # AdamW's |d| <= ~lr, below half the bf16 gap of nearly every weight (|w| >= 2^-5)


def run(remedy=None, steps=STEPS):
    """The tiny model in bf16 under AdamW (no decay) at LR, watched, with ``remedy`` for every tensor attached."""
    model = tiny_model().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    w = lp.watch(model, opt, formats=("bf16",))
    if remedy is not None:
        plan = FreezePlan("bf16", {n: remedy for n, _ in model.named_parameters()})
        lp.attach_plan(opt, plan, model=model, watch=w, generator=0)
    train(model, opt, steps)
    return model, w


def mean(values):
    return sum(values) / len(values)


def sr_sd(model, w, last):
    """A bound on the standard deviation of the mean of the last ``last`` overall kept shares under stochastic
    rounding. From a stored weight w on the grid, SR lands on the grid point beyond w + d with probability f and
    moves ``g f``-on-average where g is the spacing there, so a step's moved amount has mean |d| and variance
    g^2 f (1 - f) <= g |d|. Per tensor, kept = sum(moved) / D with D = sum(|d|) known before the draw: E = 1,
    Var <= g_max / D. The steps' draws are martingale differences (uncorrelated), and overall = sum_j s_j kept_j,
    s_j = size_j / sum(size): Var(mean over K steps) <= sum_t sum_j s_j^2 g_max,j / D_tj / K^2."""
    rec = w.kept["bf16"]
    total = sum(rec.sizes.values())
    var = 0.0
    for name, p in model.named_parameters():
        top = p.detach().float().abs().max().item() + LR * STEPS * 2      # the largest |w| the run reached, at most
        g = 2.0 ** (math.floor(math.log2(top)) - 7)                        # its bf16 gap: the largest of the tensor
        count = w.tracker.sample.counts[w.tracked.index(name)]
        for per_element in rec.meant[name][-last:]:
            var += (rec.sizes[name] / total) ** 2 * g / (per_element * count)
    return math.sqrt(var) / last


def test_formula_by_hand():
    """Moved with d's sign counts +, against it -, unmoved 0; the denominator is sum |d|, per tensor."""
    a, b = torch.zeros(3), torch.zeros(2)
    sample = Sample([a, b], None)
    old = torch.tensor([1.0, 2.0, -1.0, 0.5, 0.5])
    new = torch.tensor([1.25, 2.0, -1.125, 0.25, 0.5])   # a: +0.25 (d > 0), -0.125 (d < 0); b: -0.25 against d > 0
    d = torch.tensor([0.25, 0.125, -0.125, 0.25, 0.0])
    moved, meant = kept_sums(sample, old, new, d).tolist()
    assert moved == [0.375, -0.25] and meant == [0.5, 0.25]
    rec = KeptRecord("bf16")
    overall = rec.add_step(["a", "b"], [3, 2], {"a": 3, "b": 2}, moved, meant)
    assert rec.by_tensor == {"a": [0.75], "b": [-1.0]} and rec.meant["a"] == [0.5 / 3]
    assert overall == pytest.approx((0.75 * 3 - 1.0 * 2) / 5, abs=1e-15)
    rec.add_step(["a", "b"], [3, 2], {"a": 3, "b": 2}, [0.0, 0.0], [0.0, 1.0])      # a: no update meant
    assert math.isnan(rec.by_tensor["a"][1]) and rec.overall[1] == 0.0
    assert rec.window(1) == 0.0 and rec.window() == pytest.approx((overall + 0.0) / 2, abs=1e-15)


def test_nearest_keeps_almost_nothing():
    """Plain bf16 AdamW at lr 1e-4: the update is below half the gap of nearly every weight, so almost none of it is
    stored (measured 0.069 over the run: the LayerNorm biases, which start at 0, keep theirs)."""
    _, w = run()
    kept, frozen = w.kept["bf16"], w.record("bf16").overall
    assert mean(kept.overall) < 0.1 and kept.window() < 0.1 and mean(frozen) > 0.9
    assert mean(kept.by_tensor["1.weight"]) == 0.0      # LayerNorm gains at 1: never move
    assert mean(kept.by_tensor["1.bias"]) == pytest.approx(1.0, abs=0.01)


def test_stochastic_plan_keeps_the_update():
    """Stochastic rounding for every tensor: the frozen share of a step stays high, but the kept share's mean is 1
    within 4 standard deviations of the binomial noise (computed from the run: sr_sd)."""
    model, w = run("stochastic")
    kept, frozen = w.kept["bf16"], w.record("bf16").overall
    assert mean(frozen) > 0.8                   # the frozen share alone does not show the fix
    for last in (STEPS, 10):                  # the run, and the callbacks' window
        sd = sr_sd(model, w, last)
        assert sd < (0.06 if last == STEPS else 0.3)    # (the bound is tight enough to tell 1 from 0)
        assert kept.window(last) == pytest.approx(1.0, abs=4 * sd)


@pytest.mark.parametrize("remedy", ["master", "kahan"])
def test_accumulating_plans_keep_the_update_over_a_window(remedy):
    """Master copies and Kahan: the stored weight trails the exact sum of updates by at most half a gap, so over a
    window the share stored tends to 1 as sum(|d|) outgrows the gap, for updates that keep their sign (measured over
    the run: 1.0025 master, 1.0035 Kahan; 0.02 is a margin, not a derived bound, since AdamW's updates change sign).
    Over the callbacks' 10 steps, sum(|d|) is about a gap, and the share is noisier (measured 0.77, 0.78)."""
    model, w = run(remedy)
    kept = w.kept["bf16"]
    assert kept.window(STEPS) == pytest.approx(1.0, abs=0.02)
    assert kept.window(10) > 0.5


def test_absent_without_a_meant_update():
    """Prediction (float32 weights) records no kept share; the callbacks log none."""
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    w = lp.watch(model, opt, formats=("bf16",))
    train(model, opt, 2)
    assert w.kept == {} and w.mode == "predict"


def windows(record):
    """The callbacks' kept_bf16 after each watched step: the mean of the last 10 overall shares."""
    return [mean(record.overall[max(0, t - 9):t + 1]) for t in range(len(record.overall))]


def test_hf_callback_logs_kept_beside_frozen(tmp_path, hf):
    """The Trainer's logs carry kept_bf16 at every step, the window mean of the watch's record, beside frozen_bf16."""
    callback = lp.hf_callback(plan_after=0, sample=None)
    trainer = hf.trainer(tmp_path, dtype=torch.bfloat16, steps=12, samples=48, lr=1e-4, logging_steps=1)
    callback.attach(trainer)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "kept_bf16" in h]
    record = callback.watch.kept["bf16"]
    assert [h["kept_bf16"] for h in logged] == pytest.approx(windows(record), abs=1e-12) and len(logged) == 12
    assert [h["frozen_bf16"] for h in logged] == callback.watch.record("bf16").overall
    assert lp.load_watch(tmp_path / "freeze_watch.json").data["kept"]["bf16"]["overall"] == pytest.approx(
        record.overall, abs=0, nan_ok=True)


def test_lightning_callback_logs_kept_beside_frozen(tmp_path, lightning):
    """Lightning's logger gets kept_bf16 at every step, the window mean of the watch's record."""
    from lowprec_demo.monitor.integrations import lightning_callback
    from tiny_run import batches
    pl = pytest.importorskip("pytorch_lightning")

    class Seen(pl.loggers.Logger):
        name, version, metrics = "seen", 0, []

        def log_hyperparams(self, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            self.metrics.append(dict(metrics))

    callback, seen = lightning_callback(path=tmp_path / "w.json", sample=None), Seen()
    module = lightning.module(tiny_model().to(torch.bfloat16),
                              lambda net, x: torch.nn.functional.cross_entropy(net(x).float(), (x + 1) % 12),
                              lambda parameters: torch.optim.AdamW(parameters, lr=LR, weight_decay=0.0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(batches(4))), batch_size=16)
    pl.Trainer(max_steps=12, accelerator="cpu", logger=seen, log_every_n_steps=1, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=[callback]).fit(module, data)
    logged = [m["kept_bf16"] for m in seen.metrics if "kept_bf16" in m]
    assert logged == pytest.approx(windows(callback.watch.kept["bf16"]), abs=1e-6) and len(logged) == 12


def test_writer_gets_kept_in_observation():
    """A TensorBoard writer gets freeze/bf16/kept, the step's overall share, beside freeze/bf16/frozen."""
    class Writer:
        def __init__(self):
            self.seen = {}

        def add_scalar(self, tag, value, step):
            self.seen.setdefault(tag, []).append(value)
    writer, model = Writer(), tiny_model().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    w = lp.watch(model, opt, formats=("bf16",), writer=writer)
    train(model, opt, 3)
    assert writer.seen["freeze/bf16/kept"] == w.kept["bf16"].overall and len(w.kept["bf16"].overall) == 3
