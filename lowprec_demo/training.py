"""One training loop for every chapter.

``train_variants`` trains, from the same initialisation and on the same batches:

* ``"reference"``: float32 (or float64) weights, with a :class:`FreezePredictor` predicting, for
  one or several formats, which elements would freeze;
* ``"nearest"``: stored weights on the format's grid, round to nearest, with a
  :class:`FreezeObserver` recording which elements really froze;
* ``"stochastic"``: the same with stochastic rounding;
* ``"kahan"``: nearest rounding with Kahan compensation (optional).

An experiment describes itself as a :class:`Task` (model, batches, loss, evaluation); the loop
owns the optimizer, the learning-rate schedule, rounding, tracking and progress bars, and returns
a :class:`TrainResult` that the plotting helpers and the command line take.

Example:
    >>> from lowprec_demo.experiments import run_experiment
    >>> result = run_experiment("quadratic", fmt="bf16", steps=50, progress=False)
    >>> sorted(result.runs)
    ['nearest', 'reference', 'stochastic']
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .formats import get_format
from .optimizer import LowPrecisionOptimizer, select_params
from .prediction import FreezeObserver, FreezePredictor, FreezeRecord, freeze_step, steps_agree
from .runtime import pick_device, progress_bar

__all__ = ["TrainConfig", "Task", "RunRecord", "TrainResult", "train_variants", "lr_factor",
           "VARIANTS", "OPTIMIZERS", "SCHEDULES", "provenance", "atomic_write_json"]

VARIANTS = ("reference", "nearest", "stochastic", "kahan")
OPTIMIZERS = ("sgd", "adamw", "adam")
SCHEDULES = ("constant", "cosine")


@dataclass
class TrainConfig:
    """Everything that defines a training run, shared by all variants.

    ``lowprec_params`` chooses which parameters live in low precision (``"all"`` or
    ``"matrices"``); ``predict_formats`` lists extra formats the reference run predicts besides
    ``format``; ``threshold`` is the frozen fraction that defines the freeze step; ``options``
    holds experiment-specific settings (model sizes and the like).
    """

    format: str = "bf16"
    steps: int = 200
    lr: float = 0.1
    seed: int = 0
    optimizer: str = "sgd"
    momentum: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    threshold: float = 0.5
    lowprec_params: str = "all"
    rand_bits: Optional[int] = None
    predict_formats: tuple = ()
    variants: tuple = ("reference", "nearest", "stochastic")
    eval_every: int = 0
    reference_dtype: str = "float32"
    device: str = "auto"
    options: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        get_format(self.format)
        for f in self.predict_formats:
            get_format(f)
        checks = (("optimizer", self.optimizer, OPTIMIZERS), ("schedule", self.schedule, SCHEDULES),
                  ("reference_dtype", self.reference_dtype, ("float32", "float64")),
                  ("lowprec_params", self.lowprec_params, ("all", "matrices")))
        for name, value, allowed in checks:
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or "reference" not in self.variants:
            raise ValueError(f"variants must include 'reference' and be drawn from {', '.join(VARIANTS)}; "
                             f"got {list(self.variants)}")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be a positive integer, got {self.steps!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")

    @property
    def formats(self) -> List[str]:
        """The main format first, then the other predicted formats (no duplicates)."""
        names = [get_format(self.format).name]
        for f in self.predict_formats:
            name = get_format(f).name
            if name not in names:
                names.append(name)
        return names

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        d["predict_formats"] = list(self.predict_formats)
        d["variants"] = list(self.variants)
        return d


@dataclass
class Task:
    """What an experiment provides to the training loop.

    Attributes:
        make_model: ``f(generator) -> nn.Module`` building the model with a seeded initialisation
            (float32, on the CPU; the loop moves it).
        batch: ``f(step) -> batch`` (tensors on the device), the same for every variant.
        loss: ``f(model, batch) -> scalar tensor``.
        evaluate: optional ``f(model) -> dict of floats`` (e.g. validation loss, accuracy).
        param_groups: optional ``f(model, config) -> list of dicts`` for the optimizer (e.g. weight
            decay only on matrices); default: one group.
        description: one line for the output, e.g. which data was used.
    """

    make_model: Callable[[torch.Generator], torch.nn.Module]
    batch: Callable[[int], Any]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    evaluate: Optional[Callable[[torch.nn.Module], Dict[str, float]]] = None
    param_groups: Optional[Callable[[torch.nn.Module, TrainConfig], list]] = None
    description: str = ""


@dataclass
class RunRecord:
    """One variant's run: per-step training loss, evaluations, and (low precision) freezing."""

    variant: str
    loss: List[float] = field(default_factory=list)
    lr: List[float] = field(default_factory=list)
    evals: List[dict] = field(default_factory=list)      # {"step": t, "metric": value, ...}
    frozen: Optional[FreezeRecord] = None               # observed, low-precision variants only
    seconds: float = 0.0

    @property
    def final_eval(self) -> dict:
        return self.evals[-1] if self.evals else {}

    def to_dict(self, max_points: int = 0) -> dict:
        d = {"loss": self.loss, "lr": self.lr, "evals": self.evals, "seconds": self.seconds}
        if self.frozen is not None:
            d["frozen_observed"] = self.frozen.overall
            d["frozen_observed_record"] = _thin(self.frozen.to_dict(), max_points)
        return d

    @classmethod
    def from_dict(cls, variant: str, d: dict) -> "RunRecord":
        rec = cls(variant=variant, loss=d.get("loss", []), lr=d.get("lr", []), evals=d.get("evals", []),
                  seconds=d.get("seconds", 0.0))
        if "frozen_observed_record" in d:
            rec.frozen = FreezeRecord.from_dict(d["frozen_observed_record"])
        return rec


def _thin(record: dict, max_points: int) -> dict:
    """Keep per-tensor curves at most ``max_points`` long (for small JSON files); the overall
    curve is kept whole."""
    if not max_points:
        return record
    out = dict(record)
    by = record.get("by_tensor", {})
    if by:
        n = len(next(iter(by.values())))
        if n > max_points:
            idx = sorted(set(round(i * (n - 1) / (max_points - 1)) for i in range(max_points)))
            out["by_tensor"] = {k: [v[i] for i in idx] for k, v in by.items()}
            out["by_tensor_steps"] = idx
            out["note"] = f"per-tensor curves thinned to {len(idx)} of {n} steps; overall curves complete"
    return out


@dataclass
class TrainResult:
    """Everything a run produced: config, provenance, runs, and the prediction per format."""

    experiment: str
    config: TrainConfig
    runs: Dict[str, RunRecord]
    predictions: Dict[str, FreezeRecord]
    provenance: dict = field(default_factory=dict)
    description: str = ""

    # --- the numbers the book talks about -----------------------------------------------------
    @property
    def format(self) -> str:
        return get_format(self.config.format).name

    @property
    def prediction(self) -> FreezeRecord:
        """The prediction for the main format."""
        return self.predictions[self.format]

    def predicted_freeze_step(self, threshold: Optional[float] = None) -> Optional[int]:
        return self.prediction.freeze_step(threshold or self.config.threshold)

    def observed_freeze_step(self, variant: str = "nearest", threshold: Optional[float] = None) -> Optional[int]:
        run = self.runs[variant]
        return run.frozen.freeze_step(threshold or self.config.threshold) if run.frozen else None

    def freeze_steps_agree(self, threshold: Optional[float] = None) -> bool:
        """Predicted and observed (nearest) freeze steps within max(2 steps, 2 % of the run)."""
        return steps_agree(self.predicted_freeze_step(threshold), self.observed_freeze_step("nearest", threshold),
                           self.config.steps)

    def final_loss(self, variant: str, window: int = 0) -> float:
        """The last training loss (or the mean of the last ``window`` losses)."""
        losses = self.runs[variant].loss
        window = window or 1
        tail = losses[-window:]
        return sum(tail) / len(tail)

    def summary(self) -> dict:
        """A compact, deterministic summary (rounded numbers) for printing and checks."""
        s = {"experiment": self.experiment, "format": self.format, "steps": self.config.steps,
             "threshold": self.config.threshold,
             "predicted_freeze_step": self.predicted_freeze_step(),
             "observed_freeze_step": self.observed_freeze_step() if "nearest" in self.runs else None}
        for v, run in self.runs.items():
            s[f"final_loss_{v}"] = float(f"{run.loss[-1]:.4g}")
        return s

    # --- serialisation --------------------------------------------------------------------
    def to_dict(self, max_points: int = 0) -> dict:
        """The JSON layout of the command line (see README): experiment, config, provenance,
        runs (loss; frozen_observed for low precision), prediction (main format) and
        predictions (every format)."""
        threshold = self.config.threshold
        main = self.prediction
        return {
            "experiment": self.experiment,
            "description": self.description,
            "config": self.config.to_dict(),
            "provenance": self.provenance,
            "runs": {v: r.to_dict(max_points) for v, r in self.runs.items()},
            "prediction": {
                "format": self.format,
                "threshold": threshold,
                "frozen_predicted": main.overall,
                "freeze_step": main.freeze_step(threshold),
                "observed_freeze_step": self.observed_freeze_step() if "nearest" in self.runs else None,
                "sr_move_fraction": main.move_fraction,
            },
            "predictions": {name: _thin(rec.to_dict(), max_points) for name, rec in self.predictions.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "TrainResult":
        cfg = dict(d["config"])
        cfg["betas"] = tuple(cfg.get("betas", (0.9, 0.999)))
        cfg["predict_formats"] = tuple(cfg.get("predict_formats", ()))
        cfg["variants"] = tuple(cfg.get("variants", ()))
        config = TrainConfig(**{k: v for k, v in cfg.items() if k in {f.name for f in dataclasses.fields(TrainConfig)}})
        runs = {v: RunRecord.from_dict(v, r) for v, r in d["runs"].items()}
        preds = {name: FreezeRecord.from_dict(r) for name, r in d["predictions"].items()}
        return cls(experiment=d["experiment"], config=config, runs=runs, predictions=preds,
                   provenance=d.get("provenance", {}), description=d.get("description", ""))

    def save(self, path, max_points: int = 0) -> Path:
        """Write the result as JSON, atomically."""
        return atomic_write_json(path, self.to_dict(max_points))

    @classmethod
    def load(cls, path) -> "TrainResult":
        with open(path) as f:
            return cls.from_dict(json.load(f))


def atomic_write_json(path, data: dict) -> Path:
    """Write JSON to a temporary file beside ``path``, then rename it into place: a reader never
    sees a half-written file. Example: ``atomic_write_json("r.json", {"a": 1})``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, allow_nan=True, separators=(",", ":"))
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _git_commit() -> Optional[str]:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def provenance(device: str) -> dict:
    """Where a result came from: package and torch versions, device, git commit, date."""
    from . import __version__
    dev = torch.device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = platform.processor() or platform.machine() or "cpu"
    return {
        "package_version": __version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "device": str(dev),
        "device_name": name,
        "git_commit": _git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hostname_platform": platform.platform(),
    }


# ------------------------------------------------------------------------------------------------
def lr_factor(step: int, config: TrainConfig) -> float:
    """Learning-rate multiplier at ``step``: linear warmup over ``warmup_steps``, then constant or
    cosine decay to ``min_lr_ratio`` at the last step.

    Example:
        >>> cfg = TrainConfig(steps=101, schedule="cosine", min_lr_ratio=0.0)
        >>> lr_factor(0, cfg), lr_factor(100, cfg)
        (1.0, 0.0)
    """
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    span = max(1, config.steps - 1 - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine


def _make_optimizer(model: torch.nn.Module, task: Task, config: TrainConfig) -> torch.optim.Optimizer:
    groups = task.param_groups(model, config) if task.param_groups else [{"params": list(model.parameters())}]
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    cls = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
    return cls(groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps, weight_decay=config.weight_decay,
               foreach=False)


def _named_lowprec(model: torch.nn.Module, config: TrainConfig) -> Dict[str, torch.Tensor]:
    chosen = {id(p) for p in select_params(model.parameters(), config.lowprec_params)}
    return {n: p for n, p in model.named_parameters() if id(p) in chosen}


def _run_one(variant: str, model: torch.nn.Module, task: Task, config: TrainConfig, device: str,
             predictor_formats: Sequence[str], progress: bool):
    dtype = torch.float64 if (variant == "reference" and config.reference_dtype == "float64") else torch.float32
    model = model.to(device=device, dtype=dtype)
    opt = _make_optimizer(model, task, config)
    tracked = _named_lowprec(model, config)
    predictor = observer = None
    if variant == "reference":
        predictor = FreezePredictor(tracked, predictor_formats, rand_bits=config.rand_bits)
    else:
        gen = torch.Generator().manual_seed(config.seed + 1)
        opt = LowPrecisionOptimizer(opt, config.format, rounding="stochastic" if variant == "stochastic" else "nearest",
                                    generator=gen, rand_bits=config.rand_bits,
                                    params=list(tracked.values()),
                                    compensation="kahan" if variant == "kahan" else None)
        observer = FreezeObserver(tracked, config.format)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, config))
    record = RunRecord(variant=variant)
    start = datetime.now()
    bar = progress_bar(range(config.steps), desc=f"{variant:>10}", disable=not progress)
    for step in bar:
        model.train()
        batch = task.batch(step)
        loss = task.loss(model, batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{variant}: loss became {loss.item()} at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        tracker = predictor or observer
        tracker.before_step()
        record.lr.append(opt.param_groups[0]["lr"])
        opt.step()
        tracker.after_step()
        sched.step()
        record.loss.append(float(loss.item()))
        last = step == config.steps - 1
        if task.evaluate and ((config.eval_every and (step + 1) % config.eval_every == 0) or last):
            model.eval()
            with torch.no_grad():
                metrics = task.evaluate(model)
            record.evals.append({"step": step + 1, **{k: float(v) for k, v in metrics.items()}})
        if progress and (step % 10 == 0 or last):
            post = {"loss": f"{record.loss[-1]:.4g}"}
            if observer is not None:
                post["frozen"] = f"{observer.record.overall[-1]:.3f}"
            bar.set_postfix(post)
    record.seconds = (datetime.now() - start).total_seconds()
    if observer is not None:
        record.frozen = observer.record
    return record, predictor


def train_variants(experiment: str, task: Task, config: TrainConfig, progress: bool = True) -> TrainResult:
    """Train the reference and every low-precision variant of ``config.variants`` from one
    initialisation on the same batches, predicting and observing freezes.

    Example: see the module docstring (``run_experiment`` builds the task and config)."""
    device = pick_device(config.device)
    init = task.make_model(torch.Generator().manual_seed(config.seed))
    runs: Dict[str, RunRecord] = {}
    predictions: Dict[str, FreezeRecord] = {}
    for variant in config.variants:
        model = copy.deepcopy(init)
        record, predictor = _run_one(variant, model, task, config, device, config.formats, progress)
        runs[variant] = record
        if predictor is not None:
            predictions = dict(predictor.records)
    return TrainResult(experiment=experiment, config=config, runs=runs, predictions=predictions,
                       provenance=provenance(device), description=task.description)
