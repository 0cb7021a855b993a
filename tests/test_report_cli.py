"""The saved report (forecast and plan read back), the command line (``--version``, ``report PLAN.json``, ``--plot``
checked first) and the watch's answers before its first step."""

import json
import subprocess
import sys

import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.book.cli import main
from lowprec_demo.monitor.report import WatchReport, load_watch
from lowprec_demo.version import __version__
from tiny_run import tiny_model, train


def _run(dtype=torch.float32, steps=6, total=40, every=1):
    """A tiny AdamW run with two param groups at different rates and a cosine (LambdaLR) schedule."""
    model = tiny_model().to(dtype)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": params[:3]}, {"params": params[3:], "lr": 3e-3}], lr=1e-3,
                            weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + torch.cos(torch.tensor(s / total * 3.14159))))
    w = lp.watch(model, opt, scheduler=sched, total_steps=total, every=every)
    train(model, opt, steps, sched=sched)
    return model, opt, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["predict", "observe"])
def test_saved_report_forecasts_as_the_live_watch(dtype, tmp_path):
    _, _, w = _run(dtype, every=2)
    path = tmp_path / "freeze_watch.json"
    w.save(path)
    saved = load_watch(path)
    for threshold in (None, 0.2, 0.9):
        assert saved.forecast(threshold=threshold) == w.forecast(threshold=threshold)
    assert saved.forecast("bf16") == saved.forecast(torch.bfloat16) == w.forecast()
    assert json.loads(json.dumps(saved.forecast())) == saved.data["forecast"]["bf16"]     # and the one it stored
    with pytest.raises(KeyError, match="no record for fp16; this report holds: bf16"):
        saved.forecast("fp16")
    with pytest.raises(ValueError, match="threshold must be in"):
        saved.forecast(threshold=1.5)


def test_older_reports_forecast_what_they_stored_or_say_why(tmp_path):
    _, _, w = _run()
    data = w.report().data
    old = {k: v for k, v in data.items() if k not in ("forecast_state", "no_forecast")}
    report = WatchReport(old)
    assert report.forecast() == json.loads(json.dumps(w.forecast()))
    with pytest.raises(ValueError, match=r"holds only the forecast at its threshold 0.5 .* not threshold=0.9: save it"):
        report.forecast(threshold=0.9)
    no_length = WatchReport({**old, "total_steps": None, "forecast": {}, "forecast_curves": {}})
    with pytest.raises(ValueError, match="no forecast in this report: the watch had no run length"):
        no_length.forecast()
    broken = WatchReport({**data, "forecast_state": {**data["forecast_state"], "ratios": {"tensor": {}}}})
    with pytest.raises(ValueError, match="'forecast_state' cannot be read"):
        broken.forecast()


def test_saved_report_shows_the_plan_applied(tmp_path):
    _, _, w = _run(steps=8)
    plan = w.plan()
    assert plan.tensors("kahan") or plan.tensors("master")
    w.save(tmp_path / "with.json", plan=plan)
    saved = load_watch(tmp_path / "with.json")
    assert saved.plan.to_dict() == plan.to_dict()
    text = saved.summary(show=False)
    lines = text.splitlines()
    head = [line for line in lines if line.startswith("plan")]
    assert len(head) == 1 and head[0].startswith(f"plan applied (bf16, made at step 7; saved with the report): ")
    assert f"{plan.bytes_per_parameter()['extra']:.3g} bytes per parameter" in head[0]
    at = next(i for i, line in enumerate(lines) if line.startswith("tensor "))
    col = lines[at].index("remedy")
    rows = {line.split()[0]: line[col:col + 10].strip() for line in lines[at + 1:at + 7]}
    assert rows == {"(all)": "-", **plan.remedies}, text
    # beside it, as the trainers' callbacks save it
    folder = tmp_path / "run"
    folder.mkdir()
    w.save(folder / "freeze_watch.json")
    assert load_watch(folder / "freeze_watch.json").plan is None
    assert "plan" not in load_watch(folder / "freeze_watch.json").summary(show=False)
    plan.save(folder / "freeze_plan.json")
    beside = load_watch(folder / "freeze_watch.json")
    assert beside.plan.to_dict() == plan.to_dict()
    assert f"; from {folder / 'freeze_plan.json'}): " in beside.summary(show=False)
    w.save(tmp_path / "by_path.json", plan=folder / "freeze_plan.json")      # a path: embedded
    assert load_watch(tmp_path / "by_path.json").plan.to_dict() == plan.to_dict()
    # another run's plan beside it is not shown as this one's
    other = tiny_model(norms=2)
    opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    w2 = lp.watch(other, opt, total_steps=10)
    train(other, opt, 2)
    w2.plan().save(folder / "freeze_plan.json")
    elsewhere = load_watch(folder / "freeze_watch.json")
    assert elsewhere.plan is None and "\nplan: " in elsewhere.summary(show=False)
    assert f"{folder / 'freeze_plan.json'} is another run's plan" in elsewhere.summary(show=False)


def test_the_watch_before_its_first_step_says_so(tmp_path, capsys):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = lp.watch(model, opt, total_steps=10)
    for call, what in ((w.plan, "plan()"), (w.forecast, "forecast()"), (w.diagnoses, "diagnoses()")):
        with pytest.raises(ValueError) as error:
            call()
        message = str(error.value)
        assert message.startswith(f"no step watched yet: {what} reads") and "\n" not in message
        assert "after at least one optimizer step" in message
    with pytest.raises(ValueError, match="or lp.preflight"):
        w.plan()
    line = "freeze watch (predict, bf16): no step watched yet; train at least one optimizer step, then call summary()"
    assert w.summary(show=False).startswith(line) and "\n" not in w.summary(show=False)
    w.save(tmp_path / "empty.json")
    saved = load_watch(tmp_path / "empty.json")
    assert saved.summary(show=False) == w.summary(show=False)
    with pytest.raises(ValueError, match="no step watched yet"):
        saved.forecast()
    capsys.readouterr()
    assert main(["report", str(tmp_path / "empty.json"), "--plot", str(tmp_path / "w.png")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "no step watched yet, nothing to draw" in err and not (tmp_path / "w.png").exists()
    train(model, opt, 1)
    assert "1 watched steps of 10" in w.summary(show=False) and w.forecast()["by_tensor"]


# ---- the command line ------------------------------------------------------------------------

def test_version():
    out = subprocess.run([sys.executable, "-m", "lowprec_demo", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"lowprec_demo {__version__}", out.stderr


def test_version_through_main(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"lowprec_demo {__version__}"


@pytest.fixture
def saved_run(tmp_path):
    _, _, w = _run(steps=8)
    w.save(tmp_path / "freeze_watch.json")
    plan = w.plan(budget=0.5)
    plan.save(tmp_path / "plan.json")
    return tmp_path / "freeze_watch.json", tmp_path / "plan.json", plan


def _errors(capsys, *argv):
    status = main(["report", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, [line for line in err.splitlines() if "error:" in line]


def test_report_prints_a_saved_plan(saved_run, capsys):
    _, plan_path, plan = saved_run
    status, out, errors = _errors(capsys, plan_path)
    assert status == 0 and not errors
    lines = out.splitlines()
    b = plan.bytes_per_parameter()
    assert lines[0] == (f"freeze plan for bf16, made at step 7 of 40: {b['extra']:.3g} bytes per parameter above "
                        f"round to nearest (budget 0.5), {b['total']:.3g} in all")
    assert lines[1].split() == ["tensor", "elements", "remedy", "extra", "bytes", "why"]
    assert len(lines) == 2 + len(plan.remedies)
    for line, (name, remedy) in zip(lines[2:], plan.remedies.items()):
        size = plan.sizes[name]
        assert line.split()[:4] == [name, f"{size:,}", remedy, f"{round(size * plan.extra_bytes(remedy)):,}"]
        assert line.rstrip().endswith(plan.reasons[name][-30:])
    assert _errors(capsys, plan_path, "--format", "bf16")[0] == 0
    broken = json.loads(plan_path.read_text())
    del broken["remedies"]
    plan_path.write_text(json.dumps(broken))
    status, out, errors = _errors(capsys, plan_path)
    assert status == 2 and out == "" and len(errors) == 1 and "that cannot be read: KeyError('remedies')" in errors[0]
    plan.save(plan_path)
    status, out, errors = _errors(capsys, plan_path, "--format", "fp16")
    assert status == 2 and out == "" and errors == ["python -m lowprec_demo report: error: "
                                                    f"{plan_path}: --format fp16: this plan is for bf16 only"]


@pytest.mark.parametrize("case", ["missing folder", "folder is a file", "a folder", "suffix", "no suffix",
                                  "not writable", "plan"])
def test_report_plot_path_fails_before_the_table(case, saved_run, tmp_path, capsys, monkeypatch):
    watch_path, plan_path, _ = saved_run
    report, target = watch_path, tmp_path / "w.png"
    if case == "missing folder":
        target, expect = tmp_path / "no" / "such" / "w.png", f"the folder {tmp_path / 'no' / 'such'} does not exist"
    elif case == "folder is a file":
        (tmp_path / "a_file").write_text("")
        target, expect = tmp_path / "a_file" / "w.png", f"{tmp_path / 'a_file'} is a file, not a folder"
    elif case == "a folder":
        target = tmp_path / "pictures.png"
        target.mkdir()
        expect = "cannot write it: is a folder"
    elif case == "suffix":
        target, expect = tmp_path / "w.pnj", "the suffix '.pnj' is no image type matplotlib writes; give one of ."
    elif case == "no suffix":
        target, expect = tmp_path / "w", "no suffix names its type; give one of ."
    elif case == "not writable":
        import tempfile

        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied")
        monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
        expect = f"cannot write it in the folder {tmp_path} (Permission denied)"
    else:
        report, expect = plan_path, "a freeze plan has no figure"
    status, out, errors = _errors(capsys, report, "--plot", target)
    assert status == 2 and out == "", out
    assert len(errors) == 1 and f"--plot {target}" in errors[0] and expect in errors[0], errors
    assert case not in ("suffix", "no suffix") or ".png, " in errors[0]
    assert not (tmp_path / "w.png").exists()
    monkeypatch.undo()
    assert _errors(capsys, watch_path, "--plot", tmp_path / "w.png")[0] == 0 and (tmp_path / "w.png").exists()
