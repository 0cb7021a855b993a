"""What every test may rely on, whatever ran before it in its process.

A test that changes process-wide state (torch's thread count, default dtype, deterministic flag,
grad mode, the kernels' compile mode, an environment variable the package reads) must put it back
itself, with a fixture or ``monkeypatch``. The autouse guard below checks that after every test
and fails the test that left something changed (then restores it, so that one leak is reported
once, not by every test after it). pytest itself restores the warning filters after every test,
and a module's import may add one for good, so they are not checked. So the suite passes in any
order (``pytest -p randomly``) and on any number of workers.

The package's caches of loaded data (the corpora behind the GPT experiments, MNIST) key on the
environment that chose the data (``lowprec_demo.book.data.cached_per_data_environment``) and give their
warnings on every call, so what a test sees does not depend on what loaded them first.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from lowprec_demo.rounding import round_to_grid

# variables whose value changes what the package loads or computes
WATCHED_ENV_PREFIXES = ("LOWPREC_", "OMP_", "MKL_")


def _snapshot() -> dict:
    return {
        "torch threads": torch.get_num_threads(),
        "torch default dtype": torch.get_default_dtype(),
        "torch deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "torch grad mode": torch.is_grad_enabled(),
        "kernel compile mode": round_to_grid.get_mode(),
        "environment": {k: v for k, v in os.environ.items() if k.startswith(WATCHED_ENV_PREFIXES)},
    }


def _restore(before: dict) -> None:
    torch.set_num_threads(before["torch threads"])
    torch.set_default_dtype(before["torch default dtype"])
    torch.use_deterministic_algorithms(before["torch deterministic algorithms"])
    torch.set_grad_enabled(before["torch grad mode"])
    round_to_grid.set_mode(before["kernel compile mode"])
    for key in [k for k in os.environ if k.startswith(WATCHED_ENV_PREFIXES)]:
        if key not in before["environment"]:
            del os.environ[key]
    os.environ.update(before["environment"])


@pytest.fixture(autouse=True)
def process_state_is_left_as_found(request):
    """Fail a test that leaves process-wide state changed (module-scoped fixtures that set it for
    their module, such as the one-thread fixtures, are set before and undone after this check)."""
    before = _snapshot()
    yield
    after = _snapshot()
    changed = [key for key in before if before[key] != after[key]]
    if changed:
        _restore(before)
        details = "; ".join(f"{key}: {before[key]!r} -> {after[key]!r}" for key in changed)
        pytest.fail(f"{request.node.nodeid} left process-wide state changed: {details}", pytrace=False)


@pytest.fixture
def lightning():
    """Lightning (``lightning.pytorch``, else ``pytorch_lightning``), or the test skips:
    ``.module(net, loss, optimizers)`` a LightningModule around ``net`` (``loss(net, x)`` on each batch
    ``(x,)``; ``optimizers(parameters)`` returns what ``configure_optimizers`` returns), and
    ``.trainer(max_steps, callback, **options)`` a CPU Trainer without logger, checkpoints or bars, and
    ``.stepwise(optimizer, scheduler)`` what ``configure_optimizers`` returns for a scheduler stepped every batch."""
    try:
        import lightning.pytorch as pl
    except ImportError:
        pl = pytest.importorskip("pytorch_lightning", reason="Lightning is not installed: pip install pytorch-lightning")

    def module(net, loss, optimizers):
        class Module(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = net

            def training_step(self, batch, batch_idx):
                return loss(self.net, batch[0])

            def configure_optimizers(self):
                return optimizers(self.parameters())

        return Module()

    def trainer(max_steps, callback, **options):
        return pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **options)

    def stepwise(optimizer, scheduler):
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return SimpleNamespace(module=module, trainer=trainer, stepwise=stepwise)


@pytest.fixture
def hf():
    """transformers, or the test skips: ``.trainer(tmp_path, callback=None, dtype=torch.float32, steps=4, samples=16,
    lr=1e-3, logging_steps=2, **options)`` a CPU ``Trainer`` of a one-layer GPT-2 (a vocabulary of 40, 16 tokens, built
    from its config: no download) on ``samples`` random sequences (torch's seed 0: the same model and data each time),
    a cosine schedule, no reporting, checkpoints or bars (``options`` override the TrainingArguments); ``.module`` is
    transformers."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install transformers")

    def trainer(tmp_path, callback=None, dtype=torch.float32, steps=4, samples=16, lr=1e-3, logging_steps=2, **options):
        config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                         bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).to(dtype)
        data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 40, (samples, 16))]
        settings = dict(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, learning_rate=lr,
                        lr_scheduler_type="cosine", logging_steps=logging_steps, report_to=[], save_strategy="no",
                        use_cpu=True, disable_tqdm=True)
        args = transformers.TrainingArguments(**(settings | options))
        return transformers.Trainer(model=model, args=args, train_dataset=data,
                                    callbacks=None if callback is None else [callback])

    return SimpleNamespace(trainer=trainer, module=transformers)


# Tests that skip because an optional library is missing ("... is not installed", the reason every
# such skip gives). With LOWPREC_LIBRARY_SKIPS=FILE their ids are written to FILE, one a line, so
# that CI runs exactly those once more after installing the optional libraries.
LIBRARY_SKIP_REASON = "is not installed"
_library_skips: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and LIBRARY_SKIP_REASON in str(report.longrepr):
        _library_skips.append(report.nodeid)


pytest_collectreport = pytest_runtest_logreport   # a whole module skipped at import


def pytest_sessionfinish(session):
    path = os.environ.get("LOWPREC_LIBRARY_SKIPS")
    if path and not hasattr(session.config, "workerinput"):   # the controller, or a run without workers
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(f"{nodeid}\n" for nodeid in sorted(set(_library_skips)))
