"""The training loop on the quadratic, the JSON layout, the command line and its errors."""

import json
import math
import os

import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.book.cli import main
from lowprec_demo.book.config import lr_factor
from lowprec_demo.book.results import TrainResult


def test_quadratic_freezes_at_predicted_step_for_three_mantissa_lengths():
    rows = lp.book.sweep("quadratic", man_bits=[3, 5, 7], steps=200)
    assert all(r["agree"] for r in rows), rows
    steps = [r["predicted"] for r in rows]
    assert steps == sorted(steps)  # fewer bits: earlier freeze


def test_variants_share_initialisation_and_batches():
    r = lp.book.run_experiment("quadratic", steps=30, progress=False, variants=("reference", "nearest", "stochastic", "kahan"))
    first = {v: run.loss[0] for v, run in r.runs.items()}
    # the low-precision runs start from the rounded initial point (w = 0 is on every grid)
    assert len(set(first.values())) == 1
    assert r.runs["kahan"].frozen is not None
    # Kahan compensation tracks the reference much better than nearest rounding
    assert r.final_loss("kahan") < r.final_loss("nearest")


def test_stochastic_rounding_tracks_reference_and_nearest_stalls():
    r = lp.book.run_experiment("quadratic", fmt="bf16", progress=False)
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


@pytest.mark.parametrize("argv, message", [
    (["--set", "nosuchkey=3"], "unknown setting 'nosuchkey' for quadratic; quadratic's options: dim, c_min"),
    (["--set", "nosuchkey=3"], "config fields: format, steps, lr"),
    (["--set", "lr=abc"], "--set lr=abc: lr takes a number"),
    (["--set", "steps=1.5"], "--set steps=1.5: steps takes an integer"),
    (["--set", "dim=abc"], "--set dim=abc: dim takes an integer"),
    (["--set", "sr_seed=x"], "sr_seed takes an integer or None"),
    (["--set", "betas=0.9"], "betas takes two numbers"),
    (["--set", "options={}"], "give each option as its own --set"),
    (["--set", "dim"], "--set expects key=value"),
    (["--lr", "0.1", "--set", "lr=0.2"], "lr is given twice: --lr 0.1 and --set lr="),
    (["--steps", "5", "--set", "steps=6"], "steps is given twice"),
])
def test_cli_refuses_bad_settings_before_training(tmp_path, capsys, monkeypatch, argv, message):
    def no_training(*args, **kwargs):
        raise AssertionError("training started")
    monkeypatch.setattr("lowprec_demo.book.experiments.train_variants", no_training)
    out = tmp_path / "r.json"
    assert main(["run", "quadratic", *argv, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and "python -m lowprec_demo run: error: " in err
    assert message in err
    assert not out.exists()


def test_cli_set_reads_each_field_as_its_type(tmp_path):
    from lowprec_demo.book.cli import parse_sets
    sets = parse_sets("quadratic", ["lr=5e-2", "steps=7", "momentum=0", "betas=(0.9, 0.95)", "sr_seed=None",
                                    "variants=reference,nearest", "predict_formats=e8m4", "optimizer=sgd",
                                    "dim=4", "noise=0"])
    assert sets == {"lr": 0.05, "steps": 7, "momentum": 0.0, "betas": (0.9, 0.95), "sr_seed": None,
                    "variants": ("reference", "nearest"), "predict_formats": ("e8m4",), "optimizer": "sgd",
                    "dim": 4, "noise": 0.0}
    assert all(type(sets[k]) is float for k in ("lr", "momentum", "noise"))
    assert parse_sets("mnist", ["prefer_full=False"]) == {"prefer_full": False}
    # fields with a flag of their own work through --set too
    out = tmp_path / "r.json"
    assert main(["run", "quadratic", "--set", "lr=0.05", "--set", "steps=6", "--set", "seed=3", "--set", "dim=4",
                 "--set", "threshold=0.4", "--out", str(out), "--no-progress"]) == 0
    config = json.loads(out.read_text())["config"]
    assert (config["lr"], config["steps"], config["seed"], config["threshold"], config["options"]["dim"]) == \
        (0.05, 6, 3, 0.4, 4)


def test_unknown_settings_are_refused_from_python_too():
    with pytest.raises(ValueError, match="unknown setting 'nosuchkey' for quadratic"):
        lp.book.make_config("quadratic", nosuchkey=3)
    with pytest.raises(ValueError, match="unknown setting 'depth' for quadratic"):
        lp.book.make_config("quadratic", options={"depth": 2})
    assert lp.book.make_config("quadratic", dim=3, momentum=0.5).options["dim"] == 3


def test_every_experiment_declares_the_options_of_its_defaults():
    from lowprec_demo.book.experiments import experiment_names, get_experiment
    for name in experiment_names():
        exp = get_experiment(name)
        for scale in ("quick", "full"):
            assert set(exp.defaults(scale).get("options", {})) <= set(exp.options), (name, scale)


@pytest.mark.parametrize("where", ["folder", "missing_under_file", "unwritable", "unwritable_missing"])
def test_cli_checks_out_before_training(tmp_path, capsys, monkeypatch, where):
    def no_training(*args, **kwargs):
        raise AssertionError("training started")
    monkeypatch.setattr("lowprec_demo.book.experiments.train_variants", no_training)
    if where == "folder":
        out, message = tmp_path, "is a folder; give a file name"
    elif where == "missing_under_file":
        (tmp_path / "plain").write_text("")
        out, message = tmp_path / "plain" / "r.json", "plain is a file, not a folder"
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            (locked / "probe").write_text("")
            writable = True
        except OSError:
            writable = False
        if writable:   # root ignores permissions
            locked.chmod(0o700)
            pytest.skip("this user can write into a folder without write permission")
        out = locked / "r.json" if where == "unwritable" else locked / "sub" / "r.json"
        message = "cannot write a file in the folder" if where == "unwritable" else "does not exist and cannot be made"
    try:
        assert main(["run", "quadratic", "--steps", "5", "--out", str(out), "--no-progress"]) == 2
    finally:
        if where.startswith("unwritable"):
            (tmp_path / "locked").chmod(0o700)
    err = capsys.readouterr().err
    assert f"error: --out {out}: " in err and message in err


def test_cli_out_in_a_folder_that_takes_no_file(capsys, monkeypatch):
    """As root a folder without write permission still takes files; /proc takes none."""
    if not os.path.isdir("/proc"):
        pytest.skip("no /proc")
    monkeypatch.setattr("lowprec_demo.book.experiments.train_variants", lambda *a, **k: pytest.fail("training started"))
    assert main(["run", "quadratic", "--out", "/proc/lowprec-test/r.json", "--no-progress"]) == 2
    assert "--out /proc/lowprec-test/r.json: the folder /proc/lowprec-test does not exist" in capsys.readouterr().err


def test_cli_out_makes_missing_folders(tmp_path):
    out = tmp_path / "new" / "deeper" / "r.json"
    assert main(["run", "quadratic", "--steps", "5", "--set", "dim=4", "--out", str(out), "--no-progress"]) == 0
    assert out.is_file()


def test_cli_list(capsys):
    assert main(["list"]) == 0
    assert "quadratic" in capsys.readouterr().out


def test_lr_schedule():
    cfg = lp.book.TrainConfig(steps=101, schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1)
    assert lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    assert lr_factor(100, cfg) == pytest.approx(0.1)
    mid = lr_factor(55, cfg)
    assert mid == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_config_validation():
    with pytest.raises(ValueError, match="reference"):
        lp.book.TrainConfig(variants=("nearest",))
    with pytest.raises(ValueError, match="constant, cosine"):
        lp.book.TrainConfig(schedule="linear")
    with pytest.raises(ValueError, match="valid names"):
        lp.book.TrainConfig(format="bf99")


def test_sr_seed_redraws_stochastic_rounding_only():
    """``sr_seed`` changes the random bits of SR and nothing else; None is ``seed + 1``."""
    def run(**kw):
        return lp.book.run_experiment("quadratic", fmt="bf16", steps=60, dim=16, rand_bits=2, progress=False,
                                 variants=("reference", "stochastic"), **kw)
    default, same, other = run(), run(sr_seed=1), run(sr_seed=7)
    assert default.runs["stochastic"].loss == same.runs["stochastic"].loss
    assert default.runs["reference"].loss == other.runs["reference"].loss
    assert default.prediction.fewbit_frozen == other.prediction.fewbit_frozen
    assert default.runs["stochastic"].loss != other.runs["stochastic"].loss
    assert other.config.sr_seed == 7 and TrainResult.from_dict(other.to_dict()).config.sr_seed == 7
    with pytest.raises(ValueError, match="sr_seed must be None or a non-negative integer"):
        run(sr_seed=-1)
