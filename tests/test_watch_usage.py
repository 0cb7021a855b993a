"""The freeze watch as a user meets it: misconfiguration refused before any step of work, a
report that cannot be saved (a warning; training goes on), the report command on malformed
files, torch dtypes as formats, the run length of a cosine schedule, parameters that do not
train, the Hugging Face values in the Trainer's history and TensorBoard, compiling up front,
and grouped diagnoses. The trainers' tests use the real packages and are skipped, with the
package named, when one is missing."""

import json
import warnings

import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.rounding import round_to_grid
from lowprec_demo.book.cli import main
from lowprec_demo.monitor.diagnoses import Diagnosis, group_lines
from tiny_run import tiny_model, train


# ---- misconfiguration: at construction or before the first step -------------------------------

def test_bad_watch_options_fail_at_construction():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="save_every"):
            lp.watch(model, opt, path="w.json", save_every=bad)
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match="total_steps"):
            lp.watch(model, opt, total_steps=bad)
    with pytest.raises(TypeError, match="SummaryWriter"):
        lp.watch(model, opt, writer="runs/")
    assert not opt._optimizer_step_pre_hooks          # nothing was attached


def test_plan_options_fail_when_the_callback_is_made():
    pytest.importorskip("transformers", reason="transformers is not installed: pip install transformers")
    from lowprec_demo.monitor.integrations import hf_callback
    with pytest.raises(ValueError, match="valid names"):
        hf_callback(plan_after=5, plan_format="bf17")
    with pytest.raises(ValueError, match="plan_after"):
        hf_callback(plan_after=-1)


def test_hf_plan_after_on_bf16_weights_under_an_unread_optimizer_fails_before_the_first_step(tmp_path, hf):
    from lowprec_demo.monitor.integrations import hf_callback
    callback = hf_callback(plan_after=3)
    trainer = hf.trainer(tmp_path, callback, dtype=torch.bfloat16, optim="adagrad")
    with pytest.raises(ValueError, match=r"plan_after=3.*torch\.optim\.AdamW.*Adagrad"):
        trainer.train()
    assert trainer.state.global_step == 0                     # no step of work was lost
    assert callback.watch.steps == [] and not (tmp_path / "freeze_watch.json").exists()
    # a plan format the watch does not predict: the same, before the first step
    callback = hf_callback(plan_after=2, plan_format="e4m3", formats=("bf16",))
    trainer = hf.trainer(tmp_path / "b", callback)
    with pytest.raises(ValueError, match="plan_format='e4m3'"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_lightning_plan_after_on_bf16_weights_under_an_unread_optimizer_fails_before_the_first_step(tmp_path,
                                                                                                     lightning):
    from lowprec_demo.monitor.integrations import lightning_callback

    module = lightning.module(tiny_model().to(torch.bfloat16),
                              lambda net, x: torch.nn.functional.cross_entropy(net(x).float(), (x + 1) % 12),
                              lambda parameters: torch.optim.Adagrad(parameters, lr=1e-3))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 12, (64,))), batch_size=8)
    callback = lightning_callback(path=tmp_path / "watch.json", plan_after=4)
    trainer = lightning.trainer(8, callback)
    with pytest.raises(ValueError, match=r"plan_after=4.*Adagrad"):
        trainer.fit(module, data)
    assert trainer.global_step == 0 and callback.watch.steps == []


# ---- saving -----------------------------------------------------------------------------------

def test_an_unwritable_periodic_save_warns_once_and_training_goes_on(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    path = blocker / "watch.json"              # its folder is a file: no report can be written there
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = lp.watch(model, opt, path=path, save_every=2)
    with pytest.warns(RuntimeWarning, match="cannot save the freeze watch's report to " + str(path)) as caught:
        train(model, opt, 7)
        w.detach()                               # the save on detach: the same warning, not again
    assert w.steps == list(range(7))             # every step trained and watched
    assert len([c for c in caught if issubclass(c.category, RuntimeWarning)]) == 1
    target = tmp_path / "elsewhere.json"
    w.save(target)                               # the measurements stayed: saved elsewhere
    assert lp.load_watch(target).data["steps"] == list(range(7))


def test_save_errors_name_the_target_not_a_temporary_file(tmp_path):
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    w = lp.watch(model, opt)
    train(model, opt, 2)
    target = tmp_path / "report.json"
    target.mkdir()                               # a folder where the file should go: the rename fails
    with pytest.raises(OSError) as error:
        w.save(target)
    assert str(target) in str(error.value) and ".tmp" not in str(error.value)
    assert not list(tmp_path.glob(".*tmp"))      # no temporary file left behind


# ---- the report command -----------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = lp.watch(model, opt, total_steps=10)
    train(model, opt, 3)
    path = tmp_path / "watch.json"
    w.save(path)
    return path


def report_error(capsys, *argv):
    status = main(["report", *map(str, argv)])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if "error:" in line]
    return status, lines, err


@pytest.mark.parametrize("case", ["list", "directory", "missing key", "sizes", "format record", "not json"])
def test_report_command_names_what_is_wrong_in_one_line(case, saved, tmp_path, capsys):
    data = json.loads(saved.read_text())
    bad = tmp_path / "bad.json"
    if case == "list":
        bad.write_text(json.dumps([data]))
        expect = "JSON list, not an object"
    elif case == "directory":
        bad = tmp_path / "folder"
        bad.mkdir()
        expect = "is a directory"
    elif case == "missing key":
        del data["records"]
        bad.write_text(json.dumps(data))
        expect = "has no 'records'"
    elif case == "sizes":
        tensor = next(iter(data["sizes"]))
        data["records"]["bf16"]["by_tensor"][tensor].pop()
        bad.write_text(json.dumps(data))
        expect = f"sizes disagree: 3 watched steps but 2 points for the tensor '{tensor}'"
    elif case == "format record":
        data["formats"].append("e4m3")
        bad.write_text(json.dumps(data))
        expect = "holds no record of it"
    else:
        bad.write_text("{not json")
        expect = "not a JSON file"
    status, lines, err = report_error(capsys, bad)
    assert status == 2 and len(lines) == 1 and expect in lines[0], err
    assert "Traceback" not in err


def test_report_command_unwritable_plot(saved, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    status, lines, err = report_error(capsys, saved, "--plot", blocker / "w.png")
    assert status == 2 and len(lines) == 1 and "--plot" in lines[0] and "cannot write" in lines[0], err
    status, lines, err = report_error(capsys, saved, "--plot", tmp_path / "w.unknown_type")
    assert status == 2 and len(lines) == 1 and "--plot" in lines[0], err
    assert main(["report", str(saved), "--plot", str(tmp_path / "w.png")]) == 0     # a good one still draws
    assert (tmp_path / "w.png").stat().st_size > 1000


# ---- formats as torch dtypes ------------------------------------------------------------------

def test_torch_dtypes_are_formats_wherever_the_watch_takes_one():
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = lp.watch(model, opt, formats=(torch.bfloat16, torch.float16, "e8m5"), total_steps=20)
    assert w.formats == ["bf16", "fp16", "e8m5"]
    train(model, opt, 5)
    assert w.record(torch.bfloat16) is w.record("bf16")
    assert w.forecast(torch.bfloat16) == w.forecast("bf16")
    assert w.frozen_since(torch.float16) == w.frozen_since("fp16")
    assert w.plan(torch.float16).format == "fp16"
    assert "(predict, fp16)" in w.summary(torch.float16, show=False)
    other = tiny_model()
    single = lp.watch(other, torch.optim.SGD(other.parameters(), lr=1e-3), formats=torch.bfloat16)
    assert single.formats == ["bf16"]
    if hasattr(torch, "float8_e4m3fn"):
        fp8 = lp.watch(model, torch.optim.AdamW(model.parameters()), formats=(torch.float8_e4m3fn, torch.float8_e5m2))
        assert fp8.formats == ["e4m3", "e5m2"]
    with pytest.raises(ValueError, match=r"torch\.int8 stores no format.*torch\.bfloat16"):
        lp.watch(model, opt, formats=(torch.int8,))
    saved = w.report()
    assert saved.rows(torch.float16)[0]["format"] == "fp16"


# ---- the run's length -------------------------------------------------------------------------

def test_cosine_annealing_run_length_is_t_max():
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=300)
    w = lp.watch(model, opt, scheduler=sched)
    assert w.total_steps == 300
    train(model, opt, 3, sched=sched)
    curve = lp.monitor.forecast.forecast_curves(w)["overall"]
    assert max(curve) == 299                 # the last optimizer step of a 300-step run


# ---- nothing to train -------------------------------------------------------------------------

def test_a_warning_when_no_watched_parameter_requires_grad():
    model = tiny_model().requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.warns(UserWarning, match="requires grad, so none will get a gradient and nothing will train"):
        lp.watch(model, opt).detach()
    model[0].weight.requires_grad_(True)        # one that trains: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lp.watch(model, opt)


# ---- Hugging Face: the values in the history and in TensorBoard -------------------------------

def test_hf_values_reach_log_history_and_tensorboard_when_attached(tmp_path, hf):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from lowprec_demo.monitor.integrations import hf_callback
    callback = hf_callback(formats=("bf16", "e8m5"))
    trainer = hf.trainer(tmp_path, report_to=["tensorboard"])
    assert callback.attach(trainer) is callback
    trainer.train()
    logged = [h for h in trainer.state.log_history if "frozen_bf16" in h]   # a log of their own, once per step
    assert [h["step"] for h in logged] == [2, 4] == [h["step"] for h in trainer.state.log_history if "loss" in h]
    for h in logged:
        assert 0.0 <= h["frozen_bf16"] <= 1.0 and "frozen_e8m5" in h
    assert logged[-1]["frozen_bf16"] == callback.watch.record("bf16").overall[-1]
    events = list(tmp_path.rglob("events.out.tfevents.*"))
    assert events, "the Trainer wrote no TensorBoard events"
    tags = set()
    for e in events:
        acc = EventAccumulator(str(e))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert "train/frozen_bf16" in tags and "train/frozen_e8m5" in tags, tags


def test_hf_values_go_into_the_logs_of_the_callbacks_after_it(tmp_path, hf):
    """Given in ``callbacks=[...]``, the callback adds its values to the ``logs`` of ``on_log``, which the callbacks
    after it see (the printer, one added later); the Trainer's history, recorded before the callbacks, has none."""
    from lowprec_demo.monitor.integrations import hf_callback
    seen = []

    class After(hf.module.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))
    trainer = hf.trainer(tmp_path, hf_callback(formats=("bf16",)))
    trainer.add_callback(After())
    trainer.train()
    assert [log["frozen_bf16"] >= 0.0 for log in seen if "loss" in log] == [True, True]
    assert not any("frozen_bf16" in h for h in trainer.state.log_history)


# ---- compiling up front -----------------------------------------------------------------------

def test_auto_mode_compiles_the_watch_kernel_at_the_first_step_when_the_run_would(monkeypatch, capsys):
    monkeypatch.setattr(round_to_grid, "_eager_work", {})
    monkeypatch.setattr(round_to_grid, "EAGER_BUDGET", 5000)
    previous = round_to_grid.set_mode("auto")
    try:
        model = tiny_model()
        n = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        # a short run stays under the budget: eager, no word
        short = lp.watch(model, opt, total_steps=2)
        train(model, opt, 1)
        assert "compiling" not in capsys.readouterr().err and n * 2 < 5000
        short.detach()
        # a run whose watched elements would pass it part way: compiled at the first step, said once
        w = lp.watch(model, opt, total_steps=100)
        train(model, opt, 1)
        err = capsys.readouterr().err
        assert err.count("freeze watch: compiling its kernel now") == 1 and "100 watched steps" in err
        train(model, opt, 3)
        assert "compiling" not in capsys.readouterr().err
        assert w.steps == [0, 1, 2, 3]
    finally:
        round_to_grid.set_mode(previous)


# ---- diagnoses --------------------------------------------------------------------------------

def test_held_at_every_step_is_one_label_in_both_modes_and_grouped_in_one_line():
    labels = {}
    for mode, dtype in (("predict", torch.float32), ("observe", torch.bfloat16)):
        model = tiny_model(norms=3).to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        w = lp.watch(model, opt, patience=5)
        train(model, opt, 8)
        assert w.mode == mode
        gains = {"1.weight", "2.weight", "3.weight"}           # LayerNorm gains at 1: held at every step
        labels[mode] = {d.kind for d in w.diagnoses() if d.tensor in gains}
        lines = w.summary(show=False).split("\n\n", 1)[1].splitlines()
        held = [line for line in lines if line.startswith("[cannot_move] ") and "tensors:" in line]
        assert len(held) == 1 and held[0].startswith("[cannot_move] 3 tensors: 1.weight, 2.weight, 3.weight"), lines
        assert not any(line.startswith("[cannot_move] 1.weight") for line in lines)
    assert labels == {"predict": {"cannot_move"}, "observe": {"cannot_move"}}


def test_group_lines_keeps_lone_diagnoses_and_groups_by_kind_format_and_steps():
    def frozen(name, fmt, steps=10):
        return Diagnosis("frozen", name, f"{name} frozen", {"format": fmt, "frozen": 0.995, "steps": steps,
                                                            "with_gradient": 1.0})
    found = [frozen(f"h.{i}.attn.c_attn.weight", "bf16") for i in range(28)] + [frozen("wte.weight", "e4m3"),
                                                                                 frozen("h.0.ln_1.weight", "bf16", 4)]
    found.append(Diagnosis("weight_decay", None, "weight decay cannot act", {"format": "bf16"}))
    lines = group_lines(found)
    assert len(lines) == 4
    assert lines[0].startswith("[frozen] 28 tensors: h.0.attn.c_attn.weight, h.1.attn.c_attn.weight, "
                               "h.2.attn.c_attn.weight, h.3.attn.c_attn.weight, ... and 24 more")
    assert "bf16" in lines[0] and "99.5%" in lines[0]
    assert lines[1:] == ["[frozen] wte.weight frozen", "[frozen] h.0.ln_1.weight frozen",
                         "[weight_decay] weight decay cannot act"]


def test_idle_rows_reason_fits_positions_as_well_as_tokens():
    class Positions(torch.nn.Module):
        """A position embedding whose last position predicts no label, as in a language model."""

        def __init__(self):
            super().__init__()
            self.wpe = torch.nn.Embedding(6, 4)
            self.head = torch.nn.Linear(4, 3)

        def forward(self):
            h = self.wpe(torch.arange(6))
            return self.head(h[:-1])             # no label is predicted from the last position

    torch.manual_seed(0)
    model = Positions()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    w = lp.watch(model, opt)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(), torch.zeros(5, dtype=torch.long)).backward()
        opt.step()
    idle = [d for d in w.diagnoses() if d.kind == "idle" and d.tensor == "wpe.weight"]
    assert idle and idle[0].numbers["idle_rows"] == 1
    assert "no label is predicted" in idle[0].message and "a token that never occurs" in idle[0].message
    assert "tokens that never occur)" not in idle[0].message
