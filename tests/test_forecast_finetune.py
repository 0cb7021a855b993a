"""The relative forecast: what the watch forecasts for a run that starts mostly frozen (a bf16 fine-tune), its band,
its place in the summary and a saved report, and its bad input."""

import json

import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.freeze.records import freeze_step
from lowprec_demo.monitor import forecast as F
from tiny_run import tiny_model, train

STEPS, ASKED = 80, 30


def _finetune_like(lr=3e-4, asked=ASKED):
    """The tiny model stored in bf16, AdamW with a cosine to 0: over three quarters frozen from the first step."""
    model = tiny_model().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, STEPS)
    w = lp.watch(model, opt, scheduler=sched)
    made = {}
    train(model, opt, STEPS, sched, each=lambda t: made.setdefault("fc", w.forecast()) if t + 1 == asked else None)
    return w, made["fc"]


@pytest.fixture(scope="module")
def finetuned():
    return _finetune_like()


def _rows(fc):
    return [("(all)", {"step": fc["overall"], "low": fc["low"], "high": fc["high"], "level": fc["level"],
                       "base": fc["base"]}), *fc["by_tensor"].items()]


def test_a_run_that_starts_mostly_frozen_gets_the_relative_forecast(finetuned):
    w, fc = finetuned
    assert w.record().overall[0] > 0.75 and w.frozen_since()["overall"] == 0    # the absolute one: "0 (0-0)"
    assert fc["relative"] == F.RELATIVE == 0.9
    for name, b in _rows(fc):
        assert set(b) == {"step", "low", "high", "level", "base"}, name
        assert b["level"] == pytest.approx(b["base"] + 0.9 * (1 - b["base"]))
        assert b["step"] is not None and b["low"] is not None and b["low"] <= b["step"], name
        assert b["high"] is None or b["step"] <= b["high"], name
    # the tensors still moving when asked are forecast ahead, not at 0
    moving = [n for n, b in fc["by_tensor"].items() if b["base"] < 1.0]
    assert len(moving) == 4 and all(fc["by_tensor"][n]["step"] >= ASKED for n in moving)
    assert fc["by_tensor"]["1.weight"]["base"] == 1.0 and fc["by_tensor"]["1.weight"]["step"] == 0  # never moved


def test_the_band_holds_what_the_rest_of_the_run_did(finetuned):
    w, fc = finetuned
    rec = w.record()
    held = 0
    for name, b in _rows(fc):
        i = freeze_step(rec.overall if name == "(all)" else rec.by_tensor[name], b["level"])
        observed = w.steps[i]
        held += b["low"] <= observed <= (STEPS if b["high"] is None else b["high"])
    assert held == 6       # the whole model and its 5 tensors; the benchmark measures held-out runs


def test_a_run_that_starts_unfrozen_keeps_the_threshold_forecast():
    model = tiny_model()          # float32: prediction of bf16, at a rate that moves most weights at first
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 40)
    w = lp.watch(model, opt, scheduler=sched)
    train(model, opt, 20, sched)
    assert not F.started_frozen(w)
    assert w.forecast() == w.forecast(relative=None) and "relative" not in w.forecast()
    assert "relative" in w.forecast(relative=0.5)


def test_the_summary_and_a_saved_report_show_it(finetuned, tmp_path):
    w, _ = finetuned
    text = w.summary(show=False)
    assert "90% of the way from its least frozen share" in text
    rows = [line for line in text.splitlines() if line.startswith(("2.weight", "0.weight"))]
    assert len(rows) == 2 and not any("(0-0)" in line for line in rows)
    w.save(tmp_path / "w.json")
    saved = lp.load_watch(tmp_path / "w.json")
    assert json.loads(json.dumps(saved.forecast())) == saved.data["forecast"]["bf16"]
    assert saved.data["forecast"]["bf16"]["relative"] == 0.9
    assert saved.summary(show=False) == text


def test_the_plan_keeps_the_threshold_forecast(finetuned):
    w, _ = finetuned
    assert w.forecast(threshold=w.threshold) == w.forecast(relative=None)
    assert "relative" not in w.forecast(threshold=0.9)


@pytest.mark.parametrize("relative", [0, -0.1, 1.5, True, "most", float("nan")])
def test_a_bad_relative_is_one_clear_error(finetuned, relative):
    w, _ = finetuned
    with pytest.raises(ValueError, match=r"relative must be a share of the way in \(0, 1\] or 'auto', got "
                                         + repr(relative).replace("(", r"\(").replace(")", r"\)")):
        w.forecast(relative=relative)


@pytest.mark.parametrize("threshold", [0, 1.5, True, "high"])
def test_a_bad_threshold_is_one_clear_error(finetuned, threshold):
    w, _ = finetuned
    with pytest.raises(ValueError, match=r"threshold must be in \(0, 1\], got " + repr(threshold)):
        w.forecast(threshold=threshold)


def test_threshold_and_relative_together_is_an_error(finetuned):
    w, _ = finetuned
    with pytest.raises(ValueError, match=r"not both; got threshold=0.9, relative=0.9"):
        w.forecast(threshold=0.9, relative=0.9)


def test_the_passage_rule_on_known_points():
    # past: below the level at step 2, above from 3; ahead: certain (dips 0 or 1)
    steps, past = [0, 1, 2, 3, 4], [0.5, 0.9, 0.7, 0.95, 0.99]
    assert F._median(steps, past, [5, 6], [0.0, 0.0], 0.9) == 3
    assert F._median(steps, past, [5, 6, 7], [0.0, 1.0, 0.0], 0.9) == 7
    assert F._median(steps, past, [5], [1.0], 0.9) is None           # below at the last step: not within the run
    assert F._median(steps, past, [5, 6], [0.3, 0.3], 0.9) == 6      # 0.7 * 0.7 < 1/2 <= 0.7
    # the chance of a step below the level: none where every element is frozen, certain where none is
    assert F._below(1.0, 0.99, 64, 1.0) == 0.0 and F._below(0.0, 0.5, 64, 1.0) == 1.0
    assert 0.0 < F._below(0.99, 0.99, 64, 1.0) < 1.0
