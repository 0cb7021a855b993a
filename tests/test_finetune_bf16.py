"""The practitioner's bf16 fine-tune (lowprec_demo.book.finetune) at tiny sizes, and the freeze watch on a model
cast to bf16 in the Hugging Face Trainer and in Lightning's ``precision="bf16-true"``: it sees the weights freeze and
names them, and its plan_after= makes and attaches a plan on the bf16 weights.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.book import finetune as ft

TINY = dict(shape=dict(n_layer=1, n_head=2, n_embd=32, block_size=32), batch_size=8, pretrain_steps=400,
            pretrain_lr=3e-3, steps=100, eval_batches=8)
LIBRARIES = {"torchao_sr": "torchao", "optimi_kahan": "optimi"}


@pytest.fixture
def tiny(monkeypatch):
    """The tiny sizes as the quick mode, on one thread, the data's fallback warning silenced."""
    monkeypatch.setitem(ft.SETTINGS, True, TINY)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lp.book.data.DataFallbackWarning)
        yield
    torch.set_num_threads(threads)


def test_plain_bf16_leaves_a_gap_to_fp32(tiny):
    # the same pretrained model, batches and schedule: fp32 learns from the fine-tune text, plain bf16 (torch's AdamW
    # on bf16 weights, round to nearest) makes well under its improvement, whatever the seed
    for seed in (0, 1):
        fp32, bf16 = ft.finetune("fp32", seed, steps=60), ft.finetune("bf16", seed, steps=60)
        start = fp32["start_loss"]
        assert start - fp32["final_loss"] > 0.004, (start, fp32["final_loss"])
        assert start - bf16["final_loss"] < 0.7 * (start - fp32["final_loss"]), (start, fp32["final_loss"],
                                                                                 bf16["final_loss"])
        assert bf16["bytes_per_parameter_held"] == pytest.approx(6.0, abs=0.01)      # 2-byte weights and moments
        assert fp32["bytes_per_parameter_held"] == pytest.approx(12.0, abs=0.01)


def test_a_run_is_deterministic_per_seed(tiny):
    a, b = ft.finetune("bf16", 3, steps=5), ft.finetune("bf16", 3, steps=5)
    assert a["losses"] == b["losses"] and a["final_loss"] == b["final_loss"]
    assert ft.finetune("bf16", 4, steps=5)["losses"] != a["losses"]


def test_the_watch_over_a_fine_tune_observes_the_bf16_weights(tiny):
    w = ft.finetune("bf16", 0, steps=10, watch={"formats": ("bf16",)})["watch"]
    assert w.mode == "observe" and len(w.record("bf16").overall) == 10
    assert w.record("bf16").by_tensor["transformer.ln_f.weight"][-1] > 0.9     # gains at 1.0: frozen in bf16


@pytest.mark.parametrize("variant", [v for v in ft.VARIANTS if v != "fp32"])
def test_variants_keep_their_parameters_in_bfloat16(tiny, variant):
    if variant in LIBRARIES:
        pytest.importorskip(LIBRARIES[variant], reason=f"{LIBRARIES[variant]} is not installed: the {variant} variant "
                                                         f"needs it (pip install torchao torch-optimi)")
    result = ft.finetune(variant, 0, steps=10)
    dtypes = {name: p.dtype for name, p in result["model"].named_parameters()}
    assert set(dtypes.values()) == {torch.bfloat16}, dtypes
    assert result["final_loss"] < result["start_loss"] + 0.05
    assert result["bytes_per_parameter_held"] >= 6.0 - 1e-6      # the weights and Adam's two moments, 2 bytes each


def _hf_run(hf, tmp_path, callback, steps=12):
    trainer = hf.trainer(tmp_path, callback, dtype=torch.bfloat16, steps=steps, samples=64, lr=1e-4, logging_steps=4,
                         bf16=False)
    trainer.train()
    return trainer.model


def _sees_bf16_freezing(w, model):
    assert w.mode == "observe" and w.formats == ["bf16"]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    record = w.record("bf16")
    assert record.overall[-1] > 0.2, record.overall
    since = {name: step for name, step in w.frozen_since().items() if name != "overall" and step is not None}
    gains = [name for name in since if "ln" in name and name.endswith("weight")]
    assert gains, since     # Adam's steps of about 1e-4 cannot move a LayerNorm gain at 1.0 in bf16 (half ulp 2^-8)
    assert all(record.by_tensor[name][-1] > 0.9 for name in gains)


def test_hugging_face_trainer_watch_sees_bf16_weights_freeze(tmp_path, hf):
    callback = lp.monitor.hf_callback(path=tmp_path / "watch.json")
    model = _hf_run(hf, tmp_path, callback)
    _sees_bf16_freezing(callback.watch, model)
    assert lp.load_watch(tmp_path / "watch.json").data["steps"][-1] == 11


def test_hugging_face_trainer_plans_after_k_steps_on_bf16_weights(tmp_path, hf):
    callback = lp.monitor.hf_callback(path=tmp_path / "watch.json", plan_after=4)
    model = _hf_run(hf, tmp_path, callback)
    plan = callback.plan
    assert plan is not None and plan.format == "bf16" and plan.total_steps == 12
    assert plan.bytes_per_parameter()["extra"] <= 1.0 + 1e-9
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    named = dict(model.named_parameters())
    _plan_applied(callback, plan, named)


def _plan_applied(callback, plan, named):
    """Every tensor stored with its remedy; the remedies' own tensors made by the steps after the plan, in the bytes
    counted, and nothing float32 of a parameter's size left from a step."""
    opt = callback.plan_optimizer
    assert all(opt.remedy_of(named[n]) == r for n, r in plan.remedies.items())
    assert set(plan.remedies.values()) - {"nearest"}, plan.remedies
    kahan = [named[n] for n, r in plan.remedies.items() if r == "kahan"]
    assert all(opt._compensation_buffers[p].dtype == torch.bfloat16 for p in kahan)
    b, count = lp.bytes_per_parameter(opt), sum(p.numel() for p in named.values())
    counters = sum(v.element_size() for st in opt.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.dim() == 0)
    assert b["held"] == pytest.approx(b["total"] + counters / count) and b["total"] > 6.0     # (Adam's step counters)


def _lightning_run(lightning, callback, steps=16):
    from lowprec_demo.book.models import GPT, gpt_config

    def adamw(parameters):
        opt = torch.optim.AdamW(parameters, lr=1e-4)
        cosine = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
        return lightning.stepwise(opt, cosine)

    config = gpt_config("nanogpt-quick", vocab_size=40, n_layer=1, n_head=2, n_embd=16, block_size=16)
    module = lightning.module(GPT(config, generator=torch.Generator().manual_seed(0)),
                              lambda net, ids: net(ids[:, :-1], ids[:, 1:])[1], adamw)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.randint(0, 40, (128, 17), generator=torch.Generator().manual_seed(0))), batch_size=8)
    lightning.trainer(steps, callback, precision="bf16-true").fit(module, data)
    return module


def test_lightning_bf16_true_watch_sees_bf16_weights_freeze(tmp_path, lightning):
    callback = lp.monitor.lightning_callback(path=tmp_path / "watch.json")
    module = _lightning_run(lightning, callback)
    _sees_bf16_freezing(callback.watch, module)


def test_lightning_bf16_true_plans_after_k_steps(tmp_path, lightning):
    callback = lp.monitor.lightning_callback(path=tmp_path / "watch.json", plan_after=6)
    module = _lightning_run(lightning, callback)
    plan = callback.plan
    assert plan is not None and plan.format == "bf16" and plan.step == 5
    assert plan.bytes_per_parameter()["extra"] <= 1.0 + 1e-9
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    _plan_applied(callback, plan, dict(module.named_parameters()))


def test_the_preflight_variant_plans_before_the_first_step_and_beats_plain_bf16(tiny):
    # lp_preflight: lp.preflight on a float32 copy before step 0, its plan attached from the first step
    plain, fixed = ft.finetune("bf16", 0, steps=60), ft.finetune("lp_preflight", 0, steps=60)
    plan = fixed["plan"]
    assert plan is not None and plan.format == "bf16" and plan.step == 0, plan
    assert set(plan.remedies.values()) - {"nearest"} and plan.bytes_per_parameter()["extra"] <= 1.0 + 1e-9, plan
    assert fixed["optimizer"] is not None and fixed["losses"][0] == plain["losses"][0]    # the same first batch
    assert fixed["final_loss"] < plain["final_loss"], (fixed["final_loss"], plain["final_loss"])
