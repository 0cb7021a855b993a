"""The remedies: fp32 master weights, a Kahan buffer on a grid of its own, the bytes each setting
stores, the training loop's remedy variants and :func:`lowprec_demo.book.remedies.compare_remedies`."""

import json
import math

import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.optim.plan import FreezePlan
from lowprec_demo.book.config import VARIANTS
from lowprec_demo.book.experiments import run_experiment
from lowprec_demo.optim import LowPrecisionOptimizer, bytes_per_parameter
from lowprec_demo.book.remedies import REMEDIES, compare_remedies, floor_ratio
from lowprec_demo.book.results import TrainResult
from lowprec_demo.book.training import variant_wrapper


def _on_grid(t, fmt):
    return torch.equal(lp.quantize(t, fmt), t)


def _sgd_run(steps, lr=1e-3, **wrapper):
    w = torch.nn.Parameter(torch.ones(64))
    opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=lr), "bf16", **wrapper)
    for _ in range(steps):
        w.grad = torch.ones(64)
        opt.step()
    return w, opt


def test_master_weights_follow_the_fp32_run_bit_for_bit():
    torch.manual_seed(0)
    init = torch.randn(1000) * 0.02
    grads = [torch.randn(1000) for _ in range(30)]
    ref = torch.nn.Parameter(init.clone())
    ref_opt = torch.optim.SGD([ref], lr=1e-4)
    w = torch.nn.Parameter(init.clone())
    opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-4), "bf16", master_weights=True)
    assert _on_grid(w.detach(), "bf16")
    for g in grads:   # the same gradients: the master copy takes exactly the fp32 steps
        ref.grad, w.grad = g.clone(), g.clone()
        ref_opt.step()
        opt.step()
        assert torch.equal(opt._masters[w], ref.detach())
        assert torch.equal(w.detach(), lp.quantize(ref.detach(), "bf16"))
    # nearest alone loses these updates: 1e-4 x N(0, 1) against gaps of about 1e-4
    lost, _ = _sgd_run(30, lr=1e-4)
    assert torch.all(lost == 1.0)


def test_master_weights_move_where_nearest_freezes_and_survive_a_state_dict():
    frozen, _ = _sgd_run(100)
    moved, opt = _sgd_run(100, master_weights=True)
    assert torch.all(frozen == 1.0)                 # 1 - 0.001 rounds back to 1 every step
    assert torch.all(moved == lp.quantize(torch.tensor(1.0 - 100 * 0.001), "bf16"))
    state = opt.state_dict()
    assert state["lowprec"]["master_weights"][0].shape == (64,)
    w2 = torch.nn.Parameter(torch.ones(64))
    opt2 = LowPrecisionOptimizer(torch.optim.SGD([w2], lr=1e-3), "bf16", master_weights=True)
    opt2.load_state_dict(state)
    assert torch.equal(opt2._masters[w2], opt._masters[moved])
    assert "master_weights=True" in repr(opt)


def test_kahan_buffer_on_a_grid_of_its_own():
    w, opt = _sgd_run(100, compensation="kahan", compensation_format="bf16")
    buf = opt._compensation_buffers[w]
    assert _on_grid(buf, "bf16") and _on_grid(w.detach(), "bf16")
    exact = 1.0 - 100 * 0.001
    # the lost updates pile up in the buffer and move the weight (nearest alone stays at 1)
    assert torch.all((w.detach() - exact).abs() <= lp.ulp(torch.tensor(exact), "bf16"))
    full, opt32 = _sgd_run(100, compensation="kahan")
    assert opt32.held_bytes() == 64 * 4 and opt.held_bytes() == 64 * 4   # simulated in float32 either way
    assert "compensation_format='bf16'" in repr(opt)


def test_remedy_arguments_are_checked():
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="compensation='kahan' too"):
        LowPrecisionOptimizer(torch.optim.SGD(p, lr=1), "bf16", compensation_format="bf16")
    with pytest.raises(ValueError, match="master_weights"):
        LowPrecisionOptimizer(torch.optim.SGD(p, lr=1), "bf16", rounding="stochastic", master_weights=True)
    with pytest.raises(ValueError, match="master_weights"):
        LowPrecisionOptimizer(torch.optim.SGD(p, lr=1), "bf16", compensation="kahan", master_weights=True)
    with pytest.raises(TypeError, match="master_weights"):
        LowPrecisionOptimizer(torch.optim.SGD(p, lr=1), "bf16", master_weights="yes")
    with pytest.raises(ValueError, match="unknown format|format"):
        LowPrecisionOptimizer(torch.optim.SGD(p, lr=1), "bf16", compensation="kahan", compensation_format="bf17")


@pytest.mark.parametrize("wrapper, total", [
    ({}, 2 + 8), ({"master_weights": True}, 2 + 4 + 8), ({"compensation": "kahan"}, 2 + 8 + 4),
    ({"compensation": "kahan", "compensation_format": "bf16"}, 2 + 8 + 2), ({"state_format": "bf16"}, 2 + 4),
    ({"state_format": "e4m3"}, 2 + 2),
])
def test_bytes_per_parameter_of_each_setting(wrapper, total):
    w = torch.nn.Parameter(torch.ones(10))
    opt = LowPrecisionOptimizer(torch.optim.AdamW([w]), "bf16", **wrapper)
    w.grad = torch.ones(10)
    opt.step()
    got = bytes_per_parameter(opt)
    assert got["total"] == total
    assert got["total"] == got["weights"] + got["master"] + got["state"] + got["compensation"]


def test_bytes_per_parameter_weighs_tensors_by_their_elements():
    big, small = torch.nn.Parameter(torch.ones(30, 10)), torch.nn.Parameter(torch.ones(100))
    opt = LowPrecisionOptimizer(torch.optim.SGD([big, small], lr=0.1), "e4m3", params="matrices")
    assert bytes_per_parameter(opt)["weights"] == (300 * 1 + 100 * 4) / 400     # SGD keeps no state
    plain = torch.optim.SGD([big], lr=0.1, momentum=0.9)
    big.grad = torch.ones(30, 10)
    plain.step()
    assert bytes_per_parameter(plain) == {"weights": 4.0, "master": 0.0, "state": 4.0, "compensation": 0.0,
                                          "total": 8.0, "held": 8.0}


def test_every_variant_has_a_wrapper():
    for v in VARIANTS[1:]:
        LowPrecisionOptimizer(torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]), "bf16",
                              **variant_wrapper(v, "bf16"))
    assert variant_wrapper("stochastic_state", "e5m2") == {"rounding": "stochastic", "state_format": "e5m2",
                                                           "state_rounding": "stochastic"}
    with pytest.raises(ValueError, match="kahan_lp"):
        variant_wrapper("reference", "bf16")


def test_the_loop_trains_every_remedy_and_keeps_its_bytes(tmp_path):
    result = run_experiment("mlp", steps=30, variants=VARIANTS, progress=False, options={"samples": 256})
    assert list(result.runs) == list(VARIANTS)
    bytes_ = {v: r.bytes_per_param["total"] for v, r in result.runs.items()}
    plan = FreezePlan.from_dict(result.runs["reference"].plan)      # made by the watch on the reference
    assert bytes_ == {"reference": 12, "nearest": 10, "stochastic": 10, "kahan": 14, "kahan_lp": 12, "master": 14,
                      "nearest_state": 6, "stochastic_state": 6,
                      "plan": pytest.approx(10 + plan.bytes_per_parameter()["extra"])}
    assert plan.bytes_per_parameter()["extra"] <= result.config.plan_budget + 1e-9
    ref = result.runs["reference"].loss
    for v in ("kahan", "kahan_lp", "master"):   # nothing lost: these end close to fp32, nearest does not
        assert abs(result.runs[v].loss[-1] - ref[-1]) < abs(result.runs["nearest"].loss[-1] - ref[-1])
    path = tmp_path / "r.json"
    result.save(path)
    again = TrainResult.load(path)
    assert again.runs["master"].bytes_per_param == result.runs["master"].bytes_per_param
    assert json.loads(path.read_text())["runs"]["kahan_lp"]["bytes_per_param"]["compensation"] == 2


def test_compare_remedies_on_a_small_model():
    c = compare_remedies("mlp", steps=120, fewbit=(2, 8), progress=False, options={"samples": 256})
    rows = {r["remedy"]: r for r in c.rows()}
    assert list(rows) == ["fp32", "nearest", "stochastic", "sr2", "sr8", "kahan", "kahan_lp", "master",
                          "nearest_state", "stochastic_state", "plan", "floor"]
    assert rows["fp32"]["gap"] == 0 and rows["fp32"]["bytes"] == 12
    assert all(math.isfinite(r["gap"]) for r in rows.values())
    # the moved fraction SR achieves is the one the fp32 run predicted, exact and few-bit
    for k in (None, 2, 8):
        assert c.moved_error(k) < 0.02
    pred2, _ = c.moved(2)
    pred8, _ = c.moved(8)
    assert sum(pred2) < sum(pred8)                  # fewer random bits, fewer moves
    assert c.floor_ratio == floor_ratio(c.main)
    assert c.state_freezes()                        # AdamW's beta2 = 0.999 in bf16: 1e-3 < 2^-8
    bench = {"ratio": {"plain": 1.0, "nearest": 1.03, "stochastic": 1.06, "kahan": 1.09}}
    timed = {r["remedy"]: r["time"] for r in c.rows(bench)}
    assert timed["fp32"] == 1.0 and timed["sr2"] == 1.06 and timed["floor"] == 1.03 and timed["master"] is None
    assert c.table().count("\n") == len(rows) + 1
    import matplotlib
    matplotlib.use("Agg")
    from lowprec_demo.book import plots
    ax = plots.plot_remedies(c, relative=True)
    assert len(ax.collections) == len(rows)              # one point per remedy
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [r["label"] for r in c.rows()]


def test_compare_remedies_checks_its_arguments():
    with pytest.raises(ValueError, match="remedies must be drawn from"):
        compare_remedies("mlp", remedies=("nearest", "pairwise"), progress=False)
    with pytest.raises(ValueError, match="random bits"):
        compare_remedies("mlp", fewbit=(0,), progress=False)
    assert set(REMEDIES) == set(VARIANTS[1:])


def test_floor_ratio_needs_a_schedule_with_a_floor():
    r = run_experiment("quadratic", steps=40, progress=False, variants=("reference", "nearest"))
    assert r.config.schedule == "constant" and floor_ratio(r) is None
    cos = run_experiment("mlp", steps=60, progress=False, variants=("reference", "nearest"),
                         options={"samples": 256})
    step = cos.predicted_freeze_step()
    assert step is not None
    assert floor_ratio(cos, 2.0) == min(1.0, 2 * lp.book.lr_factor(step, cos.config))
    assert not math.isnan(floor_ratio(cos, 0.5))
