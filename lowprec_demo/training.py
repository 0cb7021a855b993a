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
a :class:`TrainResult` that the plotting helpers and the command line take. ``train_formats`` runs
one reference for several formats at once (the reference predicts them all).

The reference and the round-to-nearest runs are stepped in lockstep (the same step of each, in
turn), so that the predicted and observed frozen masks of every step are compared element by
element without keeping either beyond the step (``TrainResult.agreement``); the result is the
same as running them one after the other. Beside the prediction, the result holds baselines
that do not use the reference trajectory (``TrainResult.baselines``): the schedule rule, and
the trivial "always frozen" and "never frozen".

Under ``torchrun --nproc_per_node=N`` the same functions train data-parallel: each process a
replica on its share of every batch, gradients averaged (DistributedDataParallel), stochastic
rounding seeded alike everywhere so the replicas stay bit-identical.

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
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

from .formats import get_format
from .optimizer import LowPrecisionOptimizer, select_params
from .prediction import FreezeObserver, FreezePredictor, FreezeRecord, freeze_step, mask_mismatch, steps_agree
from .runtime import default_file_mode, pick_device, progress_bar

__all__ = ["TrainConfig", "Task", "RunRecord", "TrainResult", "train_variants", "train_formats", "run_formats",
           "lr_factor", "VARIANTS", "OPTIMIZERS", "SCHEDULES", "provenance", "atomic_write_json",
           "Distributed", "init_distributed", "finish_distributed", "evidence_table"]

VARIANTS = ("reference", "nearest", "stochastic", "kahan")
OPTIMIZERS = ("sgd", "adamw", "adam")
SCHEDULES = ("constant", "cosine", "wsd", "step")


@dataclass
class TrainConfig:
    """Everything that defines a training run, shared by all variants.

    ``lowprec_params`` chooses which parameters live in low precision (``"all"`` or
    ``"matrices"``); ``predict_formats`` lists extra formats the reference run predicts besides
    ``format``; ``threshold`` is the frozen fraction that defines the freeze step. The schedule
    (:data:`SCHEDULES`, see :func:`lr_factor`) uses ``warmup_steps`` and ``min_lr_ratio``;
    ``"wsd"`` also ``decay_fraction``, ``"step"`` ``step_milestones`` and ``step_gamma``. ``options``
    holds experiment-specific settings (model sizes and the like). ``sr_seed`` seeds stochastic
    rounding's random bits (None: ``seed + 1``), so that SR can be drawn again on the same problem
    and initialisation.
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
    decay_fraction: float = 0.2
    step_milestones: tuple = (0.5, 0.75)
    step_gamma: float = 0.1
    threshold: float = 0.5
    lowprec_params: str = "all"
    rand_bits: Optional[int] = None
    sr_seed: Optional[int] = None
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
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"decay_fraction must be in (0, 1], got {self.decay_fraction!r}")
        if not 0 < self.step_gamma <= 1:
            raise ValueError(f"step_gamma must be in (0, 1], got {self.step_gamma!r}")
        if any(not 0 < m < 1 for m in self.step_milestones):
            raise ValueError(f"step_milestones are fractions of the run in (0, 1), got {list(self.step_milestones)}")
        if self.sr_seed is not None and (isinstance(self.sr_seed, bool) or not isinstance(self.sr_seed, int)
                                         or self.sr_seed < 0):
            raise ValueError(f"sr_seed must be None or a non-negative integer, got {self.sr_seed!r}")

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
        d["step_milestones"] = list(self.step_milestones)
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
        shard: optional ``f(batch, rank, world_size) -> this process's share of the batch`` for
            data-parallel training under torchrun (e.g. an equal block of rows); without it every
            process computes the loss of the whole batch (correct, but no faster).
        description: one line for the output, e.g. which data was used.
    """

    make_model: Callable[[torch.Generator], torch.nn.Module]
    batch: Callable[[int], Any]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    evaluate: Optional[Callable[[torch.nn.Module], Dict[str, float]]] = None
    param_groups: Optional[Callable[[torch.nn.Module, TrainConfig], list]] = None
    shard: Optional[Callable[[Any, int, int], Any]] = None
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
    """Everything a run produced: config, provenance, runs, and the prediction per format.

    ``baselines`` maps each baseline predictor of the main format (``"schedule"``, ``"always"``,
    ``"never"``) to its per-step frozen fraction, as long as the prediction; ``agreement`` holds,
    per step of the round-to-nearest run, ``element_mismatch`` (the fraction of elements whose
    predicted and observed frozen states differ) and ``chance_mismatch`` (what independent masks
    with the same two fractions would give)."""

    experiment: str
    config: TrainConfig
    runs: Dict[str, RunRecord]
    predictions: Dict[str, FreezeRecord]
    provenance: dict = field(default_factory=dict)
    description: str = ""
    baselines: Dict[str, List[float]] = field(default_factory=dict)
    agreement: Dict[str, List[float]] = field(default_factory=dict)

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
        """Whether the predicted and observed (nearest) freeze steps agree within max(2 steps,
        2 % of the run), by :func:`~lowprec_demo.prediction.steps_agree`: also True when neither
        reaches the threshold within the run (nothing freezes, as predicted), False when only
        one does. To count only runs where something froze, use :meth:`froze_as_predicted`.

        Example: ``run_experiment("quadratic", steps=300, progress=False).freeze_steps_agree()``
        -> ``True``."""
        return steps_agree(self.predicted_freeze_step(threshold), self.observed_freeze_step("nearest", threshold),
                           self.config.steps)

    def froze_as_predicted(self, threshold: Optional[float] = None) -> bool:
        """Whether the round-to-nearest run froze, and at the step the reference run predicted:
        both freeze steps exist and :meth:`freeze_steps_agree` holds. Unlike that method, False
        when nothing freezes, so that a check or a tally of it counts only runs with a freeze.

        Example: ``run_experiment("quadratic", steps=300, progress=False).froze_as_predicted()``
        -> ``True``."""
        return self.predicted_freeze_step(threshold) is not None and self.freeze_steps_agree(threshold)

    def predictor_errors(self, threshold: Optional[float] = None) -> Dict[str, dict]:
        """How far each predictor is from the observed (round-to-nearest) frozen fraction: the
        reference run's prediction (``"fp32"``) and every baseline, each with
        ``mean_abs_error`` (mean over the run of |F_predicted - F_observed|), ``freeze_step``,
        ``step_error`` (its freeze step minus the observed one; None unless both exist) and
        ``agrees`` (:func:`~lowprec_demo.prediction.steps_agree` with the observed step).

        Example: ``run_experiment("quadratic", steps=300, progress=False).predictor_errors()["fp32"]``."""
        threshold = threshold or self.config.threshold
        observed = self.runs["nearest"].frozen.overall
        obs_step = freeze_step(observed, threshold)
        out = {}
        for name, curve in {"fp32": self.prediction.overall, **self.baselines}.items():
            pairs = [(a, b) for a, b in zip(curve, observed) if not (math.isnan(a) or math.isnan(b))]
            step = freeze_step(curve, threshold)
            out[name] = {"mean_abs_error": sum(abs(a - b) for a, b in pairs) / len(pairs) if pairs else math.nan,
                         "freeze_step": step,
                         "step_error": None if step is None or obs_step is None else step - obs_step,
                         "agrees": steps_agree(step, obs_step, self.config.steps)}
        return out

    def is_decisive(self, threshold: Optional[float] = None) -> bool:
        """Whether this run can tell the prediction from the baselines: the round-to-nearest run
        froze, not in the first or last 5 % of the run, and no baseline of ``baselines`` puts
        its freeze step within the tolerance of the observed one. Tallies of agreement count
        only such runs (where any predictor would agree, agreement shows nothing).

        Example: ``run_experiment("quadratic", steps=300, progress=False).is_decisive()`` -> ``True``."""
        threshold = threshold or self.config.threshold
        observed = self.observed_freeze_step("nearest", threshold)
        T = self.config.steps
        if observed is None or not 0.05 * T <= observed <= 0.95 * T:
            return False
        errors = self.predictor_errors(threshold)
        return not any(errors[name]["agrees"] for name in self.baselines)

    def element_agreement(self) -> dict:
        """The element-level agreement over the run: the mean per-step ``element_mismatch`` and
        ``chance_mismatch`` (see the class docstring), and ``ratio``, the first over the second
        (0: the masks agree everywhere; 1: no better than chance).

        Example: ``run_experiment("quadratic", steps=300, progress=False).element_agreement()["ratio"] < 0.5``."""
        if not self.agreement:
            raise ValueError("no element-level agreement in this result (it needs a reference and a nearest run)")
        mism, chance = self.agreement["element_mismatch"], self.agreement["chance_mismatch"]
        m, c = sum(mism) / len(mism), sum(chance) / len(chance)
        return {"element_mismatch": m, "chance_mismatch": c, "ratio": m / c if c > 0 else math.nan}

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
                "baselines": self.baselines,
            },
            "agreement": self.agreement,
            "predictions": {name: _thin(rec.to_dict(), max_points) for name, rec in self.predictions.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "TrainResult":
        cfg = dict(d["config"])
        cfg["betas"] = tuple(cfg.get("betas", (0.9, 0.999)))
        cfg["predict_formats"] = tuple(cfg.get("predict_formats", ()))
        cfg["step_milestones"] = tuple(cfg.get("step_milestones", (0.5, 0.75)))
        cfg["variants"] = tuple(cfg.get("variants", ()))
        config = TrainConfig(**{k: v for k, v in cfg.items() if k in {f.name for f in dataclasses.fields(TrainConfig)}})
        runs = {v: RunRecord.from_dict(v, r) for v, r in d["runs"].items()}
        preds = {name: FreezeRecord.from_dict(r) for name, r in d["predictions"].items()}
        return cls(experiment=d["experiment"], config=config, runs=runs, predictions=preds,
                   provenance=d.get("provenance", {}), description=d.get("description", ""),
                   baselines=d.get("prediction", {}).get("baselines", {}), agreement=d.get("agreement", {}))

    def save(self, path, max_points: int = 0) -> Path:
        """Write the result as JSON, atomically."""
        return atomic_write_json(path, self.to_dict(max_points))

    @classmethod
    def load(cls, path) -> "TrainResult":
        with open(path) as f:
            return cls.from_dict(json.load(f))


def evidence_table(cases: Dict[str, "TrainResult"], threshold: Optional[float] = None) -> str:
    """One line per run: the observed freeze step; the freeze step and mean error
    (|F - F_observed| over the run) of the prediction and of every baseline; the element-level
    mismatch against chance; and whether the run is decisive (no baseline agrees).

    Example: ``print(evidence_table({"bf16": result}))``."""
    lines = []
    for label, r in cases.items():
        errors, a = r.predictor_errors(threshold), r.element_agreement()
        parts = [f"{name} {e['freeze_step']} ({e['mean_abs_error']:.3f})" for name, e in errors.items()]
        lines.append(f"{label}: observed {r.observed_freeze_step('nearest', threshold)}; step (error): "
                     + ", ".join(parts)
                     + f"; elements {a['element_mismatch']:.3f} vs chance {a['chance_mismatch']:.3f}"
                     + ("; decisive" if r.is_decisive(threshold) else "; not decisive"))
    return "\n".join(lines)


def atomic_write_json(path, data: dict) -> Path:
    """Write JSON to a temporary file beside ``path``, then rename it into place: a reader never
    sees a half-written file. Example: ``atomic_write_json("r.json", {"a": 1})``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        default_file_mode(fd)
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
    """The checkout's commit (with ``-dirty`` for uncommitted changes); where there is no git
    repository (a copied working tree), ``$LOWPREC_GIT_COMMIT`` if set."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("LOWPREC_GIT_COMMIT") or None


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
    """Learning-rate multiplier at ``step``: linear warmup over ``warmup_steps``, then

    * ``"constant"``: 1;
    * ``"cosine"``: cosine decay from 1 to ``min_lr_ratio`` at the last step;
    * ``"wsd"`` (warmup, stable, decay): 1 until the last ``decay_fraction`` of the run, then a
      linear cooldown to ``min_lr_ratio`` at the last step;
    * ``"step"``: 1, multiplied by ``step_gamma`` at each of ``step_milestones`` (fractions of the
      run: step ``round(f * steps)`` is the first at the lower rate).

    Example:
        >>> cfg = TrainConfig(steps=101, schedule="cosine", min_lr_ratio=0.0)
        >>> lr_factor(0, cfg), lr_factor(100, cfg)
        (1.0, 0.0)
        >>> cfg = TrainConfig(steps=100, schedule="step", step_milestones=(0.5,), step_gamma=0.1)
        >>> lr_factor(49, cfg), lr_factor(50, cfg)
        (1.0, 0.1)
    """
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    if config.schedule == "step":
        return config.step_gamma ** sum(step >= round(f * config.steps) for f in config.step_milestones)
    last = config.steps - 1
    if config.schedule == "wsd":
        start = max(config.warmup_steps, last - max(1, round(config.decay_fraction * config.steps)))
        if step <= start:
            return 1.0
        progress = min(1.0, (step - start) / max(1, last - start))
        return 1.0 - (1.0 - config.min_lr_ratio) * progress
    span = max(1, last - config.warmup_steps)
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


# ------------------------------------------------------------------------------------------------
# Data parallel training under torchrun
# ------------------------------------------------------------------------------------------------
@dataclass
class Distributed:
    """This process's place in a data-parallel job: ``world_size`` processes, this one ``rank``.

    One process (``world_size == 1``) is the ordinary case; ``torchrun --nproc_per_node=N`` sets
    ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK``, and :func:`init_distributed` joins the group.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = ""

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Only the main process (rank 0) writes files and shows progress."""
        return self.rank == 0


def init_distributed(device: str = "auto") -> Distributed:
    """Join the process group that ``torchrun`` describes in the environment (``WORLD_SIZE > 1``),
    with the NCCL backend on GPUs (one per process, ``LOCAL_RANK``) and gloo on CPUs. A single
    process gets ``Distributed()`` and nothing happens. Safe to call more than once.

    Example:
        >>> init_distributed("cpu").world_size   # without torchrun
        1
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Distributed()
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    on_gpu = pick_device(device).startswith("cuda")
    if on_gpu:
        torch.cuda.set_device(local_rank)   # so that "cuda" means this process's GPU
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if on_gpu else "gloo")
    return Distributed(rank=rank, world_size=world_size, local_rank=local_rank, backend=dist.get_backend())


def finish_distributed() -> None:
    """Leave the process group, if this process joined one (the end of a torchrun job)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class _DataParallel(torch.nn.parallel.DistributedDataParallel):
    """DistributedDataParallel that also answers the wrapped model's attributes, so a task's
    ``loss(model, batch)`` works unchanged with or without torchrun."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def _mean_over_ranks(value: torch.Tensor, dist_info: Distributed) -> torch.Tensor:
    """The mean of a scalar over all processes: the loss of the whole batch, as one process
    would compute it."""
    if not dist_info.enabled:
        return value
    import torch.distributed as dist
    total = value.clone()
    dist.all_reduce(total)
    return total / dist_info.world_size


def _replicas_identical(model: torch.nn.Module, dist_info: Distributed) -> bool:
    """Whether every process holds bit-identical parameters (compares a sha256 of their bytes)."""
    import hashlib
    import torch.distributed as dist
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    digests = [None] * dist_info.world_size
    dist.all_gather_object(digests, digest.hexdigest())
    return len(set(digests)) == 1


# ------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------
def _run_steps(variant: str, model: torch.nn.Module, task: Task, config: TrainConfig, device: str,
               predictor_formats: Sequence[str], progress: bool, dist_info: Distributed = Distributed(),
               keep_masks: bool = False, position: Optional[int] = None):
    """One variant's run, as a generator: yields its tracker after every step (masks included
    with ``keep_masks``) and returns ``(record, predictor, model)``."""
    dtype = torch.float64 if (variant == "reference" and config.reference_dtype == "float64") else torch.float32
    model = model.to(device=device, dtype=dtype)
    net = model
    if dist_info.enabled:   # gradients are averaged over processes, each on its share of the batch
        net = _DataParallel(model, device_ids=[dist_info.local_rank] if device.startswith("cuda") else None)
    opt = _make_optimizer(model, task, config)
    tracked = _named_lowprec(model, config)
    predictor = observer = None
    if variant == "reference":
        predictor = FreezePredictor(tracked, predictor_formats, rand_bits=config.rand_bits, keep_masks=keep_masks)
    else:
        # the same seed on every process: stochastic rounding draws the same bits everywhere,
        # so data-parallel replicas stay bit-identical
        gen = torch.Generator().manual_seed(config.seed + 1 if config.sr_seed is None else config.sr_seed)
        opt = LowPrecisionOptimizer(opt, config.format, rounding="stochastic" if variant == "stochastic" else "nearest",
                                    generator=gen, rand_bits=config.rand_bits,
                                    params=list(tracked.values()),
                                    compensation="kahan" if variant == "kahan" else None)
        observer = FreezeObserver(tracked, config.format, keep_masks=keep_masks)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, config))
    record = RunRecord(variant=variant)
    start = datetime.now()
    bar = progress_bar(range(config.steps), desc=f"{variant:>10}", disable=not progress, position=position)
    for step in bar:
        model.train()
        batch = task.batch(step)
        if dist_info.enabled and task.shard is not None:
            batch = task.shard(batch, dist_info.rank, dist_info.world_size)
        loss = task.loss(net, batch)
        loss_value = _mean_over_ranks(loss.detach(), dist_info)
        if not torch.isfinite(loss_value):
            raise FloatingPointError(f"{variant}: loss became {loss_value.item()} at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        tracker = predictor or observer
        tracker.before_step()
        record.lr.append(opt.param_groups[0]["lr"])
        opt.step()
        tracker.after_step()
        sched.step()
        record.loss.append(float(loss_value.item()))
        last = step == config.steps - 1
        if task.evaluate and ((config.eval_every and (step + 1) % config.eval_every == 0) or last):
            model.eval()
            with torch.no_grad():
                metrics = task.evaluate(model)
            record.evals.append({"step": step + 1, **{k: float(v) for k, v in metrics.items()}})
        if progress and (step % 10 == 0 or last):
            post = {"loss": f"{record.loss[-1]:.4g}"}
            if observer is not None:
                post["frozen"] = f"{observer.record().overall[-1]:.3f}"
            bar.set_postfix(post)
        yield tracker
    record.seconds = (datetime.now() - start).total_seconds()
    if observer is not None:
        record.frozen = observer.record()
    return record, predictor, model


def _finish(run):
    """Run a generator of :func:`_run_steps` to its end and return its value."""
    while True:
        try:
            next(run)
        except StopIteration as stop:
            return stop.value


def _run_one(*args, **kwargs):
    return _finish(_run_steps(*args, **kwargs))


def _lockstep(reference, nearest: Dict[str, Any]):
    """Step the reference run and the round-to-nearest run of each format in turn, comparing
    their frozen masks at every step; returns the reference's value, each nearest run's value
    and each format's agreement curves."""
    agreement = {name: {"element_mismatch": [], "chance_mismatch": []} for name in nearest}
    while True:
        try:
            predictor = next(reference)
        except StopIteration as stop:
            ref_value = stop.value
            break
        for name, run in nearest.items():
            observer = next(run)
            mismatch, chance = mask_mismatch(predictor.masks[name], observer.masks[name])
            agreement[name]["element_mismatch"].append(mismatch)
            agreement[name]["chance_mismatch"].append(chance)
    return ref_value, {name: _finish(run) for name, run in nearest.items()}, agreement


def _baselines(predictor: FreezePredictor, fmt: str, lrs: Sequence[float]) -> Dict[str, List[float]]:
    """The baseline predictors of format ``fmt`` over the run's learning rates ``lrs``."""
    return {"schedule": predictor.schedule_rule(fmt, [lr / lrs[0] for lr in lrs]),
            "always": [1.0] * len(lrs), "never": [0.0] * len(lrs)}


def _setup(config: TrainConfig, progress: bool):
    dist_info = init_distributed(config.device)
    device = pick_device(config.device)
    if device == "cuda" and dist_info.enabled:
        device = f"cuda:{dist_info.local_rank}"
    return dist_info, device, progress and dist_info.is_main


def _provenance(device: str, dist_info: Distributed, identical: Dict[str, bool]) -> dict:
    p = provenance(device)
    if dist_info.enabled:
        p["distributed"] = {"world_size": dist_info.world_size, "backend": dist_info.backend,
                            "replicas_identical": identical}
    return p


def train_variants(experiment: str, task: Task, config: TrainConfig, progress: bool = True) -> TrainResult:
    """Train the reference and every low-precision variant of ``config.variants`` from one
    initialisation on the same batches, predicting and observing freezes.

    Under ``torchrun`` with several processes, each trains a replica on its share of every batch
    (``task.shard``; the whole batch when the task has none) and gradients are averaged, so the
    global batch is the one a single process uses; every process returns the same result, and
    ``provenance["distributed"]`` records whether the replicas ended bit-identical.

    Example: see the module docstring (``run_experiment`` builds the task and config)."""
    dist_info, device, progress = _setup(config, progress)
    init = task.make_model(torch.Generator().manual_seed(config.seed))
    runs: Dict[str, RunRecord] = {}
    identical: Dict[str, bool] = {}
    agreement: Dict[str, List[float]] = {}
    fmt = get_format(config.format).name

    def start(variant, **kwargs):
        return _run_steps(variant, copy.deepcopy(init), task, config, device, config.formats, progress, dist_info,
                          **kwargs)

    def keep(variant, record, model):
        runs[variant] = record
        if dist_info.enabled:
            identical[variant] = _replicas_identical(model, dist_info)

    if "nearest" in config.variants:   # the reference and nearest runs in lockstep
        (record, predictor, model), nearest, curves = _lockstep(
            start("reference", keep_masks=True), {fmt: start("nearest", keep_masks=True, position=1)})
        keep("reference", record, model)
        keep("nearest", nearest[fmt][0], nearest[fmt][2])
        agreement = curves[fmt]
        del model, nearest
    else:
        record, predictor, model = _finish(start("reference"))
        keep("reference", record, model)
        del model
    for variant in config.variants:
        if variant not in runs:
            record, _, model = _finish(start(variant))
            keep(variant, record, model)
            del model
    runs = {v: runs[v] for v in config.variants}
    return TrainResult(experiment=experiment, config=config, runs=runs, predictions=dict(predictor.records),
                       provenance=_provenance(device, dist_info, identical), description=task.description,
                       baselines=_baselines(predictor, fmt, runs["reference"].lr), agreement=agreement)


Variants = Union[Sequence[str], Dict[str, Sequence[str]]]


def train_formats(experiment: str, task: Task, config: TrainConfig, formats: Sequence[str],
                  variants: Variants = ("nearest",), progress: bool = True) -> Dict[str, TrainResult]:
    """One reference run predicting every format of ``formats`` at once, then the low-precision
    ``variants`` in each format, all from one initialisation on the same batches. Returns one
    TrainResult per format (keyed by format name) that share the reference run: the same as
    ``train_variants`` per format, for one reference run instead of one per format.

    ``variants`` is a list for every format, or a dict ``{format: list}`` (formats left out get
    ``("nearest",)``).

    Example:
        >>> results = run_formats("quadratic", ["e8m3", "bf16"], steps=50, progress=False)
        >>> sorted(results)
        ['bf16', 'e8m3']
    """
    names = [get_format(f).name for f in formats]
    if not names:
        raise ValueError("give at least one format")
    if isinstance(variants, dict):
        chosen = {get_format(f).name: tuple(v) for f, v in variants.items()}
        per_format = {n: chosen.get(n, ("nearest",)) for n in names}
    else:
        per_format = {n: tuple(variants) for n in names}
    bad = [v for vs in per_format.values() for v in vs if v not in VARIANTS or v == "reference"]
    if bad:
        raise ValueError(f"variants are the low-precision runs, drawn from nearest, stochastic, kahan; got {bad}")
    dist_info, device, progress = _setup(config, progress)
    init = task.make_model(torch.Generator().manual_seed(config.seed))
    ref_config = dataclasses.replace(config, format=names[0], predict_formats=tuple(names[1:]),
                                     variants=("reference",))
    configs = {name: dataclasses.replace(config, format=name, predict_formats=tuple(n for n in names if n != name),
                                         variants=("reference", *per_format[name])) for name in names}
    # the reference in lockstep with every format's nearest run (masks compared step by step)
    lockstep = [name for name in names if "nearest" in per_format[name]]
    reference = _run_steps("reference", copy.deepcopy(init), task, ref_config, device, ref_config.formats, progress,
                           dist_info, keep_masks=bool(lockstep))
    nearest = {name: _run_steps("nearest", copy.deepcopy(init), task, configs[name], device, configs[name].formats,
                                progress, dist_info, keep_masks=True, position=i + 1)
               for i, name in enumerate(lockstep)}
    (ref_record, predictor, model), near_values, agreement = _lockstep(reference, nearest)
    identical = {"reference": _replicas_identical(model, dist_info)} if dist_info.enabled else {}
    del model
    results: Dict[str, TrainResult] = {}
    for name in names:
        cfg = configs[name]
        runs = {"reference": ref_record}
        ident = dict(identical)
        for variant in per_format[name]:
            if variant == "nearest":
                record, _, model = near_values.pop(name)
            else:
                record, _, model = _run_one(variant, copy.deepcopy(init), task, cfg, device, cfg.formats, progress,
                                            dist_info)
            runs[variant] = record
            if dist_info.enabled:
                ident[variant] = _replicas_identical(model, dist_info)
            del model
        results[name] = TrainResult(experiment=experiment, config=cfg, runs=runs, predictions=dict(predictor.records),
                                    provenance=_provenance(device, dist_info, ident), description=task.description,
                                    baselines=_baselines(predictor, name, ref_record.lr),
                                    agreement=agreement.get(name, {}))
    return results


def run_formats(name: str, formats: Sequence[str], variants: Variants = ("nearest",), seed: int = 0,
                device: str = "auto", scale: Optional[str] = None, progress: bool = True,
                **overrides) -> Dict[str, TrainResult]:
    """:func:`train_formats` for a named experiment: one reference run predicting every format,
    then ``variants`` in each format. Other arguments as for
    :func:`lowprec_demo.experiments.run_experiment`.

    Example:
        >>> results = run_formats("quadratic", ["e8m4", "e8m5", "bf16"], steps=100, progress=False)
        >>> [r.predicted_freeze_step() is not None for r in results.values()]
        [True, True, True]
    """
    from .experiments import get_experiment, make_config   # the registry builds on this module
    config = make_config(name, scale, format=get_format(formats[0]).name if formats else None, seed=seed,
                         device=device, **overrides)
    task = get_experiment(name).build(config)
    return train_formats(name, task, config, formats, variants=variants, progress=progress)
