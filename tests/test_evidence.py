"""Tests of the evidence a run carries beside its prediction: the baselines that do not use the
reference trajectory, the element-level agreement of the predicted and observed frozen masks,
the lockstep that makes it possible, and the schedules that put a wall where fp32 still learns."""

import copy
import json
import math
import subprocess
import sys

import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.book import training
from lowprec_demo.book.experiments import get_experiment, make_config
from lowprec_demo.freeze.agreement import mask_mismatch, stratified_chance_mismatch
from lowprec_demo.freeze import FreezeObserver, FreezePredictor
from lowprec_demo.rounding import quantize


def _sequential(name, cfg):
    """Every variant of ``cfg`` run on its own, one after the other (no lockstep)."""
    task = get_experiment(name).build(cfg)
    init = task.make_model(torch.Generator().manual_seed(cfg.seed))
    return {v: training._run_one(v, copy.deepcopy(init), task, cfg, "cpu", cfg.formats, False)
            for v in cfg.variants}, task


@pytest.mark.parametrize("name,steps", [("quadratic", 150), ("mlp", 60), ("regression", 60)])
def test_lockstep_gives_the_runs_one_after_the_other_bit_for_bit(name, steps):
    cfg = make_config(name, steps=steps, device="cpu")
    seq, task = _sequential(name, cfg)
    result = training.train_variants(name, task, cfg, progress=False)
    for v in cfg.variants:
        assert result.runs[v].loss == seq[v][0].loss, v
        if v != "reference":
            assert result.runs[v].frozen.overall == seq[v][0].frozen.overall, v
    assert result.prediction.overall == seq["reference"][1].record(cfg.format).overall


def test_masks_are_the_counted_fractions_element_by_element():
    """The kept masks give exactly the fractions the trackers count: chance from the records'
    fractions equals chance from the masks, at every step."""
    result = lp.book.experiments.run_experiment("quadratic", steps=200, progress=False, device="cpu")
    p, q = result.prediction.overall, result.runs["nearest"].frozen.overall
    chance = [a * (1 - b) + b * (1 - a) for a, b in zip(p, q)]
    assert chance == pytest.approx(result.agreement["chance_mismatch"], abs=1e-12)
    assert len(result.agreement["element_mismatch"]) == result.config.steps
    # and the masks disagree far less than chance (the prediction is element by element)
    a = result.element_agreement()
    assert a["element_mismatch"] < 0.3 * a["chance_mismatch"], a


def test_tracker_masks_by_hand():
    w = torch.nn.Parameter(torch.tensor([1.0, 1.0, 1.0, 2.0]))
    pred = FreezePredictor({"w": w}, ["bf16"], keep_masks=True)
    pred.before_step()
    w.data -= torch.tensor([1e-3, 3e-3, 2.0**-9, 1e-2])   # gaps below 1: 2^-8; below 2: 2^-7
    pred.after_step()
    # 1e-3 < 2^-9 frozen; 3e-3 > 2^-9 moves; 2^-9 is the tie and 1.0 is even: frozen; 1e-2 > 2^-8
    assert pred.masks["bf16"]["w"].tolist() == [True, False, True, False]
    v = torch.nn.Parameter(quantize(torch.tensor([1.0, 1.0, 3.0]), "bf16"))
    obs = FreezeObserver({"v": v}, "bf16", keep_masks=True)
    obs.before_step()
    v.data[1] = 1.0078125
    obs.after_step()
    assert obs.masks["bf16"]["v"].tolist() == [True, False, True]
    assert mask_mismatch({"v": torch.tensor([True, False, True])}, obs.masks["bf16"]) == (0.0, pytest.approx(4 / 9))


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "e4m3", "e5m2", "e8m4", "e3m2", "e2m1", "tf32"])
def test_fast_mask_is_would_freeze_bit_for_bit(fmt):
    """The predictor's kept mask against the rule, on random weights and updates of every size, the exact ties on
    both sides, zeros, the power-of-two edges and the largest values."""
    from lowprec_demo.rounding import ulp
    f = lp.get_format(fmt)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-12, 4, (200_000,), generator=g).float())
    w = torch.cat([w, torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0, 0.5, f.max, -f.max, f.smallest_normal, f.smallest_subnormal])])
    old = w.float()
    stored = quantize(old, fmt)
    gap = ulp(stored, fmt)
    scale = torch.exp2(torch.randint(-30, 3, old.shape, generator=g).float())
    sign = torch.where(torch.rand(old.shape, generator=g) < 0.5, -1.0, 1.0)
    for d in (sign * scale * gap, sign * gap / 2, -sign * gap / 2, sign * gap / 4, sign * scale * stored.abs()):
        d = d.float()
        new = old + d
        expected = lp.would_freeze(stored, new - old, fmt)
        w = old.clone()
        predictor = FreezePredictor({"w": w}, [fmt], keep_masks=True)
        predictor.before_step()
        w.copy_(new)
        predictor.after_step()
        got = predictor.masks[f.name]["w"]
        bad = (got != expected).nonzero().reshape(-1)[:5]
        assert bad.numel() == 0, [(old[i].item(), (new - old)[i].item(), got[i].item()) for i in bad]


def test_mask_mismatch_counts_over_every_tensor():
    a = {"x": torch.tensor([True, False]), "y": torch.tensor([True, True, True, False])}
    b = {"x": torch.tensor([False, False]), "y": torch.tensor([True, True, True, True])}
    mismatch, chance = mask_mismatch(a, b)
    p, q = 4 / 6, 4 / 6
    assert mismatch == pytest.approx(2 / 6)
    assert chance == pytest.approx(p * (1 - q) + q * (1 - p))
    assert all(math.isnan(x) for x in mask_mismatch({"x": a["x"]}, {"z": b["x"]}))


def test_schedule_rule_scales_the_first_update_by_the_schedule():
    """SGD on w = 1: the first update is lr * g; the rule freezes an element once lr_t * |g|
    falls below half the gap of its initial stored value, whatever the trajectory does."""
    w = torch.nn.Parameter(torch.ones(4))
    p = FreezePredictor({"w": w}, ["bf16"])
    p.before_step()
    w.data -= torch.tensor([0.5, 1.0, 2.0, 4.0]) * 2.0**-8   # ratios to the gap 2^-8: 0.5, 1, 2, 4
    p.after_step()
    # ratio * s < 1/2: s = 1 -> none (0.5 is not below); s = 0.4 -> 0.5 and 1; s = 0.1 -> all
    assert p.schedule_rule("bf16", [1.0, 0.4, 0.1, 0.0]) == [0.0, 0.5, 1.0, 1.0]
    with pytest.raises(KeyError, match="bf16"):
        p.schedule_rule("fp16", [1.0])


def test_baselines_and_errors_of_a_run():
    result = lp.book.experiments.run_experiment("quadratic", steps=300, progress=False, device="cpu")
    T = result.config.steps
    assert set(result.baselines) == {"schedule", "schedule_fitted", "always", "never"}
    assert all(len(v) == T for v in result.baselines.values())
    assert result.baselines["always"] == [1.0] * T and result.baselines["never"] == [0.0] * T
    errors = result.predictor_errors()
    assert set(errors) == {"fp32", "schedule", "schedule_fitted", "always", "never"}
    obs = result.runs["nearest"].frozen.overall
    assert errors["never"]["mean_abs_error"] == pytest.approx(sum(obs) / T)
    assert errors["always"]["mean_abs_error"] == pytest.approx(sum(1 - x for x in obs) / T)
    assert errors["always"]["freeze_step"] == 0 and errors["never"]["freeze_step"] is None
    # constant-rate SGD on a quadratic: the gradients shrink as the weights converge, which the
    # schedule rule cannot see; it never freezes, the run does, where the fp32 run says
    assert errors["schedule"]["freeze_step"] is None and not errors["schedule"]["agrees"]
    assert errors["fp32"]["agrees"]
    assert errors["fp32"]["mean_abs_error"] < 0.1 * min(e["mean_abs_error"] for k, e in errors.items() if k != "fp32")


def test_result_round_trips_baselines_and_agreement(tmp_path):
    result = lp.book.experiments.run_experiment("quadratic", steps=40, progress=False, device="cpu")
    loaded = lp.book.TrainResult.load(result.save(tmp_path / "r.json"))
    assert loaded.baselines == result.baselines
    assert loaded.agreement == result.agreement
    d = json.loads((tmp_path / "r.json").read_text())
    assert list(d["prediction"]["baselines"]) == ["schedule", "schedule_fitted", "always", "never"]
    assert len(d["prediction"]["baselines"]["schedule"]) == len(d["prediction"]["frozen_predicted"]) == 40
    assert set(d["agreement"]) == {"element_mismatch", "chance_mismatch", "stratified_chance_mismatch"}
    assert all(len(v) == 40 for v in d["agreement"].values())


def test_train_formats_compares_every_formats_masks():
    results = lp.book.run_formats("quadratic", ["e8m3", "bf16"], variants={"e8m3": ("nearest", "stochastic")},
                             steps=80, progress=False, device="cpu")
    for name, r in results.items():
        assert r.format == name
        assert len(r.agreement["element_mismatch"]) == 80
        single = lp.book.experiments.run_experiment("quadratic", fmt=name, steps=80, progress=False, device="cpu",
                                               variants=("reference", "nearest"))
        assert r.runs["nearest"].loss == single.runs["nearest"].loss
        assert r.agreement == single.agreement
        assert r.baselines == single.baselines
    assert "stochastic" in results["e8m3"].runs and "stochastic" not in results["bf16"].runs


def test_no_nearest_run_no_agreement():
    r = lp.book.experiments.run_experiment("quadratic", steps=20, progress=False, device="cpu",
                                      variants=("reference", "stochastic"))
    assert r.agreement == {} and set(r.baselines) == {"schedule", "schedule_fitted", "always", "never"}
    with pytest.raises(ValueError, match="nearest"):
        r.element_agreement()


@pytest.mark.parametrize("schedule,expected", [
    # stable to step 79, then linear from 1 at step 79 to min_lr_ratio at the last step, 99
    ("wsd", [1.0] * 80 + [1 - 0.9 * k / 20 for k in range(1, 21)]),
    # the rate times 0.1 from step 50 and again from step 75
    ("step", [1.0] * 50 + [0.1] * 25 + [0.1 ** 2] * 25),
])
def test_new_schedules(schedule, expected):
    cfg = lp.book.TrainConfig(steps=100, schedule=schedule, min_lr_ratio=0.1, decay_fraction=0.2)
    assert [lp.book.lr_factor(s, cfg) for s in range(100)] == pytest.approx(expected)


def test_schedule_settings_are_checked():
    for bad in (dict(decay_fraction=0.0), dict(step_gamma=1.5), dict(step_milestones=(0.5, 1.0)),
                dict(min_lr_ratio=-0.1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            lp.book.TrainConfig(**bad)
    with pytest.raises(ValueError, match="constant, cosine, wsd, step"):
        lp.book.TrainConfig(schedule="linear")


def test_command_line_writes_the_evidence(tmp_path):
    out = tmp_path / "q.json"
    proc = subprocess.run([sys.executable, "-m", "lowprec_demo", "run", "quadratic", "--steps", "60",
                           "--set", "schedule=step", "--set", "step_milestones=0.5", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "element mismatch" in proc.stdout and "predictor schedule" in proc.stdout
    d = json.loads(out.read_text())
    assert d["config"]["schedule"] == "step" and d["config"]["step_milestones"] == [0.5]
    assert len(d["agreement"]["element_mismatch"]) == 60
    lrs = d["runs"]["reference"]["lr"]
    assert lrs[29] == pytest.approx(d["config"]["lr"]) and lrs[30] == pytest.approx(0.1 * d["config"]["lr"])


def test_fitted_schedule_rule_by_hand():
    """Adam-like steps that shrink: the fitted rule measures them over the fit steps (summed gaps
    of the initial stored value over summed learning rates) and scales that by lr_t; the plain
    rule scales the first step alone. Ratios to the gap below 1 (2^-8): step 0 gives 2 and 4,
    step 1 gives 0.5 and 1 at the same lr: fitted 1.25 and 2.5 per unit of lr."""
    w = torch.nn.Parameter(torch.ones(2))
    p = FreezePredictor({"w": w}, ["bf16"], fit_steps=2)
    for d in ([2.0, 4.0], [0.5, 1.0]):
        p.before_step()
        w.data -= torch.tensor(d) * 2.0**-8
        p.after_step()
    assert p._stored0 == {}                           # the initial values go once the fit is done
    lrs = [1.0, 1.0, 0.3, 0.15, 0.1]
    # fitted 1.25 * lr < 0.5 from lr 0.3 on (0.375), 2.5 * lr < 0.5 from 0.15 on (0.375)
    assert p.fitted_schedule_rule("bf16", lrs) == [0.0, 0.0, 0.5, 1.0, 1.0]
    # first step alone: 2 * s < 0.5 from s 0.15 on; 4 * s < 0.5 from s 0.1 on (0.4)
    assert p.schedule_rule("bf16", lrs) == [0.0, 0.0, 0.0, 0.5, 1.0]
    # the sum of the fit steps' learning rates divides: twice the rate, half the ratio
    assert p.fitted_schedule_rule("bf16", [2.0, 2.0, 0.6, 0.3, 0.2]) == [0.0, 0.0, 0.5, 1.0, 1.0]
    with pytest.raises(ValueError, match="not all zero"):
        p.fitted_schedule_rule("bf16", [0.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="fit_steps"):
        FreezePredictor({"w": w}, ["bf16"], fit_steps=0)
    early = FreezePredictor({"w": w}, ["bf16"], fit_steps=3)
    early.before_step(); w.data -= 1e-3; early.after_step()
    with pytest.raises(ValueError, match="3 steps"):
        early.fitted_schedule_rule("bf16", [1.0] * 5)


def test_fitted_rule_with_one_fit_step_is_the_schedule_rule():
    """With the first step only and Adam's first update (about lr_0 per element) the fitted rule
    is the plain one, on a real run."""
    cfg = make_config("quadratic", steps=60, device="cpu", optimizer="adam", lr=1e-2, schedule="cosine",
                      min_lr_ratio=0.0, warmup_steps=1)
    assert training.fit_steps(cfg) == 1
    result = training.train_variants("quadratic", get_experiment("quadratic").build(cfg), cfg, progress=False)
    assert result.baselines["schedule_fitted"] == result.baselines["schedule"]


def test_stratified_chance_by_hand():
    """Strata are the binades of the weights within each tensor (zeros one of their own): masks
    that follow the binade exactly have stratified chance 0, though global chance is 1/2."""
    w = {"a": torch.tensor([1.0, 1.9, 0.01, 0.0]), "b": torch.tensor([-4.0, 5.0])}
    p = {"a": torch.tensor([True, True, False, False]), "b": torch.tensor([True, False])}
    q = {"a": torch.tensor([True, True, False, True]), "b": torch.tensor([False, True])}
    # a: binade [1, 2) p = q = 1 -> 0; 0.01 -> 0; the zero alone: p 0, q 1 -> 1
    # b: -4 and 5 share the binade [4, 8): p = q = 1/2 -> 1/2 per element, 2 elements
    assert stratified_chance_mismatch(p, q, w) == pytest.approx((0 + 0 + 0 + 1 + 0.5 * 2) / 6)
    assert math.isnan(stratified_chance_mismatch(p, q, {}))
    # one stratum: the global chance
    same = {"a": torch.tensor([1.0, 1.1, 1.2, 1.3])}
    pa, qa = {"a": torch.tensor([True, False, True, True])}, {"a": torch.tensor([False, False, True, True])}
    assert stratified_chance_mismatch(pa, qa, same) == pytest.approx(mask_mismatch(pa, qa)[1])


def test_a_run_carries_the_stratified_chance_and_it_is_below_the_global():
    result = lp.book.experiments.run_experiment("mlp", steps=60, progress=False, device="cpu")
    a = result.element_agreement()
    assert len(result.agreement["stratified_chance_mismatch"]) == 60
    assert a["stratified_chance_mismatch"] <= a["chance_mismatch"] + 1e-12
    assert a["stratified_ratio"] == pytest.approx(a["element_mismatch"] / a["stratified_chance_mismatch"])


def test_loss_falls_by_hand():
    result = lp.book.experiments.run_experiment("quadratic", steps=100, progress=False, device="cpu",
                                           variants=("reference", "nearest"))
    result.config = lp.book.TrainConfig(**{**result.config.to_dict(), "warmup_steps": 10})
    result.runs["reference"].loss = [float(100 - t) for t in range(100)]
    result.runs["nearest"].loss = [float(100 - min(t, 40)) for t in range(100)]
    falls = result.loss_falls(step=40, window=10)
    # before: mean of 10..19 minus mean of 30..39 = 20 for both; after: mean of 40..49 minus 90..99
    assert falls["before"] == {"reference": 20.0, "nearest": 20.0} and falls["window_before"] == 10
    assert falls["after"] == {"reference": 50.0, "nearest": 0.0} and falls["window_after"] == 10
    short = result.loss_falls(step=13, window=10)           # 3 steps after the warmup: too few
    assert short["before"] is None and short["after"] is not None
    assert result.loss_falls(step=16, window=10)["window_before"] == 3
