"""The training loop on the quadratic, the JSON layout, the command line and its errors."""

import json
import math
import os

import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.cli import main
from lowprec_demo.training import TrainResult, lr_factor


def test_quadratic_freezes_at_predicted_step_for_three_mantissa_lengths():
    rows = lp.sweep("quadratic", man_bits=[3, 5, 7], steps=200)
    assert all(r["agree"] for r in rows), rows
    steps = [r["predicted"] for r in rows]
    assert steps == sorted(steps)  # fewer bits: earlier freeze


def test_variants_share_initialisation_and_batches():
    r = lp.run_experiment("quadratic", steps=30, progress=False, variants=("reference", "nearest", "stochastic", "kahan"))
    first = {v: run.loss[0] for v, run in r.runs.items()}
    # the low-precision runs start from the rounded initial point (w = 0 is on every grid)
    assert len(set(first.values())) == 1
    assert r.runs["kahan"].frozen is not None
    # Kahan compensation tracks the reference much better than nearest rounding
    assert r.final_loss("kahan") < r.final_loss("nearest")


def test_stochastic_rounding_tracks_reference_and_nearest_stalls():
    r = lp.run_experiment("quadratic", fmt="bf16", progress=False)
    assert r.final_loss("nearest") > 100 * r.final_loss("stochastic")
    assert r.freeze_steps_agree()
    # SR's predicted fraction of elements left in place matches the observed one at the end
    pred_still = 1 - sum(r.prediction.move_fraction[-50:]) / 50
    obs_still = sum(r.runs["stochastic"].frozen.overall[-50:]) / 50
    assert abs(pred_still - obs_still) < 0.05


def test_json_layout_round_trip_and_atomic_write(tmp_path):
    out = tmp_path / "r.json"
    assert main(["run", "quadratic", "--format", "bf16", "--steps", "80", "--out", str(out), "--no-progress"]) == 0
    d = json.loads(out.read_text())
    for key in ("experiment", "config", "provenance", "runs", "prediction"):
        assert key in d
    for key in ("package_version", "torch_version", "device", "device_name", "git_commit", "date"):
        assert key in d["provenance"]
    assert set(d["runs"]) == {"reference", "nearest", "stochastic"}
    for v in ("reference", "nearest", "stochastic"):
        assert len(d["runs"][v]["loss"]) == 80
    for v in ("nearest", "stochastic"):
        assert len(d["runs"][v]["frozen_observed"]) == 80
    p = d["prediction"]
    assert len(p["frozen_predicted"]) == 80 and "threshold" in p and "freeze_step" in p
    assert [f.name for f in tmp_path.iterdir()] == ["r.json"]  # no temporary file left behind
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask   # readable as a file open() makes
    result = TrainResult.load(out)
    assert result.predicted_freeze_step() == p["freeze_step"]
    assert result.runs["nearest"].loss == d["runs"]["nearest"]["loss"]


@pytest.mark.parametrize("argv, message", [
    (["run", "nosuch"], "valid experiments: "),
    (["run", "quadratic", "--format", "bf17"], "valid names: fp32, tf32, bf16"),
    (["run", "quadratic", "--device", "tpu"], "auto, cpu, cuda"),
    (["run", "quadratic", "--scale", "huge"], "quick, full"),
    (["run", "quadratic", "--set", "optimizer=lion"], "sgd, adamw, adam"),
    (["run", "quadratic", "--steps", "0"], "positive integer"),
])
def test_cli_errors_name_valid_values_and_write_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "r.json"
    assert main(argv + ["--out", str(out), "--no-progress"]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_cli_list(capsys):
    assert main(["list"]) == 0
    assert "quadratic" in capsys.readouterr().out


def test_lr_schedule():
    cfg = lp.TrainConfig(steps=101, schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1)
    assert lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    assert lr_factor(100, cfg) == pytest.approx(0.1)
    mid = lr_factor(55, cfg)
    assert mid == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_config_validation():
    with pytest.raises(ValueError, match="reference"):
        lp.TrainConfig(variants=("nearest",))
    with pytest.raises(ValueError, match="constant, cosine"):
        lp.TrainConfig(schedule="linear")
    with pytest.raises(ValueError, match="valid names"):
        lp.TrainConfig(format="bf99")


def test_sr_seed_redraws_stochastic_rounding_only():
    """``sr_seed`` changes the random bits of SR and nothing else; None is ``seed + 1``."""
    def run(**kw):
        return lp.run_experiment("quadratic", fmt="bf16", steps=60, dim=16, rand_bits=2, progress=False,
                                 variants=("reference", "stochastic"), **kw)
    default, same, other = run(), run(sr_seed=1), run(sr_seed=7)
    assert default.runs["stochastic"].loss == same.runs["stochastic"].loss
    assert default.runs["reference"].loss == other.runs["reference"].loss
    assert default.prediction.fewbit_frozen == other.prediction.fewbit_frozen
    assert default.runs["stochastic"].loss != other.runs["stochastic"].loss
    assert other.config.sr_seed == 7 and TrainResult.from_dict(other.to_dict()).config.sr_seed == 7
    with pytest.raises(ValueError, match="sr_seed must be None or a non-negative integer"):
        run(sr_seed=-1)
