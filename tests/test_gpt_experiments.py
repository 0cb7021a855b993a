"""The GPT experiments of chapters 6 and 7 (``nanogpt``, ``gpt2``), ``run_formats``, stored results.

Tiny shapes only: the chapters run the real sizes. The 124M model itself is built in
test_models.py; training it for one step with its predictor costs over a minute on a 2-core CPU,
so here GPT-2 keeps its structure (vocabulary 50304, E4M3 on the matrices, GPT-2's initialisation)
at a reduced depth and width.
"""

import json
import os
from pathlib import Path

import pytest

import lowprec_demo as lp
from lowprec_demo.book.cli import main
from lowprec_demo.book.experiments.gpt2 import by_layer, layer_of
from lowprec_demo.book.results import describe, load_result, stored_results
from lowprec_demo.book.experiments import run_formats
from lowprec_demo.book.results import TrainResult

_candidates = [os.environ.get("LOWPREC_DATA_DIR", ""), Path(__file__).resolve().parents[2] / "shared" / "data"]
SHARED_DATA = next((str(c) for c in _candidates if c and (Path(c) / "tinyshakespeare.txt").is_file()), "")

TINY_NANOGPT = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 4, "eval_batches": 1}
TINY_GPT2 = {"n_layer": 2, "n_head": 2, "n_embd": 32, "context": 16, "batch_size": 2, "eval_batches": 1}


@pytest.fixture(autouse=True)
def offline_data(monkeypatch):
    monkeypatch.setenv("LOWPREC_OFFLINE", "1")
    if SHARED_DATA:
        monkeypatch.setenv("LOWPREC_DATA_DIR", SHARED_DATA)


def test_registered():
    assert {"nanogpt", "gpt2"} <= set(lp.book.experiment_names())
    quick, full = lp.book.make_config("nanogpt", "quick"), lp.book.make_config("nanogpt", "full")
    assert (quick.optimizer, quick.schedule, quick.format) == ("adamw", "cosine", "bf16")
    assert full.options["model"] == "shakespeare-char"
    # nanoGPT's recipe: the cosine ends at a tenth of the peak (1e-3 at full size, 2e-4 quick)
    assert (full.lr, full.min_lr_ratio, full.steps, full.warmup_steps) == (1e-3, 0.1, 5000, 100)
    assert (quick.lr, quick.min_lr_ratio, quick.steps, quick.threshold) == (2e-4, 0.1, 600, 0.5)
    assert lp.book.lr_factor(quick.steps - 1, quick) == pytest.approx(0.1)
    g = lp.book.make_config("gpt2", "full")
    assert (g.format, g.lowprec_params, g.options["model"], g.options["context"]) == ("e4m3", "matrices", "gpt2", 1024)
    # the quick GPT-2 run keeps the peak learning rate at every step (chapter 7, section 7.3)
    q = lp.book.make_config("gpt2", "quick")
    assert q.schedule == "constant" and q.warmup_steps == 0 and g.schedule == "cosine"
    assert all(lp.book.lr_factor(s, q) == 1.0 for s in range(q.steps))


def test_nanogpt_tiny_run_predicts_and_observes():
    r = lp.book.run_experiment("nanogpt", steps=40, progress=False, **TINY_NANOGPT)
    assert set(r.runs) == {"reference", "nearest", "stochastic"}
    assert "character-level GPT (1 layers" in r.description
    assert len(r.prediction.overall) == len(r.runs["nearest"].frozen.overall) == 40
    # the cosine ends at a tenth of the peak: most weights frozen at the end, predicted and observed
    assert r.prediction.overall[-1] > 0.5 and r.runs["nearest"].frozen.overall[-1] > 0.5
    assert abs(r.prediction.overall[-1] - r.runs["nearest"].frozen.overall[-1]) < 0.05
    # LayerNorm gains (|w| = 1) never move in bf16 at lr 2e-4 < 2^-9: frozen from the first step
    gains = [n for n in r.prediction.by_tensor if n.endswith("ln_1.weight") or n.endswith("ln_f.weight")]
    assert gains and all(r.prediction.by_tensor[n][0] == 1.0 for n in gains)
    assert all(r.runs["nearest"].frozen.by_tensor[n][0] == 1.0 for n in gains)
    assert r.runs["reference"].evals and "val_loss" in r.runs["reference"].evals[-1]
    assert r.runs["stochastic"].loss[-1] < r.runs["stochastic"].loss[0]


def test_run_formats_shares_the_reference():
    results = run_formats("nanogpt", ["bf16", "e8m4"], variants={"bf16": ("nearest", "stochastic")}, steps=30,
                          progress=False, **TINY_NANOGPT)
    assert list(results) == ["bf16", "e8m4"]
    bf16, e8m4 = results["bf16"], results["e8m4"]
    assert bf16.runs["reference"] is e8m4.runs["reference"]
    assert set(bf16.runs) == {"reference", "nearest", "stochastic"} and set(e8m4.runs) == {"reference", "nearest"}
    assert set(bf16.predictions) == {"bf16", "e8m4"} and e8m4.format == "e8m4"
    # fewer mantissa bits freeze more
    assert sum(e8m4.prediction.overall) > sum(bf16.prediction.overall)
    # one reference predicts the same as a dedicated one
    single = lp.book.run_experiment("nanogpt", fmt="e8m4", steps=30, progress=False, variants=("reference", "nearest"),
                               **TINY_NANOGPT)
    assert single.prediction.overall == e8m4.prediction.overall
    assert single.runs["nearest"].loss == e8m4.runs["nearest"].loss
    with pytest.raises(ValueError):
        run_formats("nanogpt", ["bf16"], variants=("reference",), steps=2, **TINY_NANOGPT)


def test_nanogpt_cli_writes_json(tmp_path):
    out = tmp_path / "nanogpt.json"
    sets = [x for k, v in TINY_NANOGPT.items() for x in ("--set", f"{k}={v}")]
    assert main(["run", "nanogpt", "--format", "bf16", "--scale", "quick", "--steps", "25", "--no-progress",
                 "--out", str(out), *sets]) == 0
    d = json.loads(out.read_text())
    assert d["experiment"] == "nanogpt" and d["config"]["format"] == "bf16"
    assert len(d["runs"]["nearest"]["frozen_observed"]) == 25
    assert d["prediction"]["freeze_step"] is not None and d["prediction"]["observed_freeze_step"] is not None


def test_gpt2_structure_locks_on_e4m3_and_stochastic_rounding_trains(tmp_path):
    out = tmp_path / "gpt2.json"
    sets = [x for k, v in TINY_GPT2.items() for x in ("--set", f"{k}={v}")]
    assert main(["run", "gpt2", "--format", "e4m3", "--scale", "quick", "--steps", "3", "--no-progress",
                 "--out", str(out), *sets]) == 0
    r = TrainResult.load(out)
    assert r.config.lowprec_params == "matrices" and r.config.options["n_layer"] == 2
    # only tensors with 2 or more dimensions are tracked: embeddings and linear weights
    assert all(n.endswith("weight") and "ln_" not in n for n in r.prediction.by_tensor)
    assert min(r.prediction.overall) >= 0.99 and min(r.runs["nearest"].frozen.overall) >= 0.99
    assert r.predicted_freeze_step() == 0 and r.observed_freeze_step() == 0
    assert r.runs["stochastic"].loss[-1] < r.runs["stochastic"].loss[0]
    assert "vocab 50304" in r.description
    layers = by_layer(r.prediction)
    assert list(layers) == ["embeddings", "block 0", "block 1"]
    assert all(min(v) >= 0.99 for v in layers.values())


def test_layer_of():
    assert layer_of("transformer.wte.weight") == "embeddings"
    assert layer_of("transformer.h.11.attn.c_proj.weight") == "block 11"
    assert layer_of("transformer.ln_f.weight") == "final"


def test_stored_results_load_when_present(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWPREC_RESULTS_DIR", str(tmp_path))
    assert load_result("nanogpt_bf16_full") is None and stored_results("nanogpt") == {}
    r = lp.book.run_experiment("quadratic", steps=20, progress=False)
    r.save(tmp_path / "nanogpt_bf16_full.json")
    loaded = load_result("nanogpt_bf16_full")
    assert loaded is not None and loaded.runs["nearest"].loss == r.runs["nearest"].loss
    assert list(stored_results("nanogpt")) == ["nanogpt_bf16_full"]
    assert "commit" not in describe(loaded) and "20 steps" in describe(loaded)
    assert "git_commit" in loaded.provenance


def test_offline_without_shakespeare_falls_back_and_says_so(monkeypatch):
    """Every run on the fallback corpus warns and says so, however many runs loaded it before in
    this process (the corpus is read once and cached; the warning is given on every call)."""
    monkeypatch.delenv("LOWPREC_DATA_DIR", raising=False)
    monkeypatch.setenv("LOWPREC_CACHE_DIR", "/nonexistent-lowprec-cache")
    for _ in range(2):
        with pytest.warns(lp.book.data.DataFallbackWarning, match="Tiny Shakespeare is unavailable"):
            r = lp.book.run_experiment("nanogpt", steps=3, progress=False, variants=("reference",), **TINY_NANOGPT)
        assert "fallback corpus" in r.description
    for _ in range(2):
        with pytest.warns(lp.book.data.DataFallbackWarning, match="Tiny Shakespeare is unavailable"):
            tokens, vocab, how = lp.book.experiments.gpt2.text_tokens()
        assert "fallback corpus" in how
    assert lp.book.experiments.nanogpt._char_tokens.cache_info().hits >= 1   # read once, from the cache after


@pytest.mark.parametrize("value, has_bias", [(False, False), ("false", False), ("true", True)])
def test_nanogpt_bias_option(value, has_bias):
    config = lp.book.make_config("nanogpt", "quick", steps=2, bias=value, **TINY_NANOGPT)
    model = lp.book.experiments.get_experiment("nanogpt").build(config).make_model(None)
    biases = [n for n, _ in model.named_parameters() if n.endswith(".bias")]
    assert bool(biases) == has_bias


def test_nanogpt_bias_option_rejects_other_text():
    config = lp.book.make_config("nanogpt", "quick", steps=2, bias="maybe", **TINY_NANOGPT)
    with pytest.raises(ValueError, match="true or false"):
        lp.book.experiments.get_experiment("nanogpt").build(config)
