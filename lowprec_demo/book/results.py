"""What a run produced and where it came from: :class:`RunRecord` (one variant's run) and
:class:`TrainResult` (every variant, the prediction, the baselines and the element-level
agreement), their JSON files (written atomically by :func:`atomic_write_json`), the
:func:`provenance` a result carries, and the stored full-scale results under ``book/results/``.

Stored results: JSON files under ``book/results/``, loaded when present.

A full-scale run needs a GPU, so its result is written by the command line (or
``tools/gpu_check.sh``) and committed as ``book/results/NAME.json``; a chapter loads it with
:func:`load_result` and plots it next to the quick run it executes live. Nothing is made up: when
the file is absent, :func:`load_result` returns None and the chapter says so.

Where the folder is looked for, in order: ``$LOWPREC_RESULTS_DIR``; ``results/`` in the current
directory (a chapter runs in ``book/``); ``book/results/`` in the current directory; and
``book/results/`` next to the package (a checkout of the repository).

Example:
    >>> result = load_result("nanogpt_bf16_full")   # None when no such result is stored
"""

from __future__ import annotations

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
from typing import Dict, List, Optional

import torch

from lowprec_demo.book.config import TrainConfig
from lowprec_demo.formats import get_format
from lowprec_demo.freeze.prediction import FreezeRecord, freeze_step, steps_agree
from lowprec_demo.common.output import atomic_write_json
from lowprec_demo.version import __version__

__all__ = ["RunRecord", "TrainResult", "evidence_table", "atomic_write_json", "git_commit", "provenance",
           "cpuinfo", "results_dir", "load_result", "stored_results", "describe"]


@dataclass
class RunRecord:
    """One variant's run: per-step training loss, evaluations, and (low precision) freezing."""

    variant: str
    loss: List[float] = field(default_factory=list)
    lr: List[float] = field(default_factory=list)
    evals: List[dict] = field(default_factory=list)      # {"step": t, "metric": value, ...}
    frozen: Optional[FreezeRecord] = None               # observed, low-precision variants only
    seconds: float = 0.0
    bytes_per_param: dict = field(default_factory=dict)   # optimizer.bytes_per_parameter at the end
    plan: Optional[dict] = None                          # the reference's freeze plan (FreezePlan.to_dict)

    @property
    def final_eval(self) -> dict:
        return self.evals[-1] if self.evals else {}

    def to_dict(self, max_points: int = 0) -> dict:
        d = {"loss": self.loss, "lr": self.lr, "evals": self.evals, "seconds": self.seconds}
        if self.bytes_per_param:
            d["bytes_per_param"] = self.bytes_per_param
        if self.plan is not None:
            d["plan"] = self.plan
        if self.frozen is not None:
            d["frozen_observed"] = self.frozen.overall
            d["frozen_observed_record"] = _thin(self.frozen.to_dict(), max_points)
        return d

    @classmethod
    def from_dict(cls, variant: str, d: dict) -> "RunRecord":
        rec = cls(variant=variant, loss=d.get("loss", []), lr=d.get("lr", []), evals=d.get("evals", []),
                  seconds=d.get("seconds", 0.0), bytes_per_param=d.get("bytes_per_param", {}), plan=d.get("plan"))
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

    ``baselines`` maps each baseline predictor of the main format (``"schedule"``,
    ``"schedule_fitted"``, ``"always"``, ``"never"``; see :mod:`lowprec_demo.prediction`) to its
    per-step frozen fraction, as long as the prediction; ``agreement`` holds, per step of the
    round-to-nearest run, ``element_mismatch`` (the fraction of elements whose predicted and
    observed frozen states differ), ``chance_mismatch`` (what independent masks with the same two
    fractions would give) and ``stratified_chance_mismatch`` (independent masks within each tensor
    and binade of the weights, :func:`~lowprec_demo.agreement.stratified_chance_mismatch`)."""

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
        ``mean_abs_error`` (mean over the run of ``abs(F_predicted - F_observed)``), ``freeze_step``,
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
        mean = lambda key: (sum(self.agreement[key]) / len(self.agreement[key])
                            if self.agreement.get(key) else math.nan)   # results stored before it: NaN
        m, c, s = mean("element_mismatch"), mean("chance_mismatch"), mean("stratified_chance_mismatch")
        return {"element_mismatch": m, "chance_mismatch": c, "ratio": m / c if c > 0 else math.nan,
                "stratified_chance_mismatch": s, "stratified_ratio": m / s if s > 0 else math.nan}

    def loss_falls(self, step: Optional[int] = None, window: Optional[int] = None) -> dict:
        """How far each run's training loss falls before and after ``step`` (default: the predicted
        freeze step), from means over windows of ``window`` steps (default: a tenth of the run):
        ``before`` from the end of the warmup to the step, ``after`` from the step to the end of
        the run, by variant, each with its window (shortened to half the span when the span is
        shorter than two windows; None when that leaves under 2 steps). The runs see the same
        batches, so their falls compare like with like.

        Example: ``result.loss_falls()["after"]["reference"]`` -> nats the fp32 run still gains
        after the predicted wall."""
        T, W = self.config.steps, min(self.config.warmup_steps, self.config.steps)
        step = self.predicted_freeze_step() if step is None else step
        out = {"step": step, "before": None, "after": None, "window_before": None, "window_after": None}
        if step is None:
            return out
        window = window or max(2, T // 10)

        def mean(v, a, b):
            losses = self.runs[v].loss[a:b]
            return sum(losses) / len(losses)

        for part, start, end in (("before", W, step), ("after", step, T)):
            w = min(window, (end - start) // 2)
            if w >= 2:
                out[part] = {v: mean(v, start, start + w) - mean(v, end - w, end) for v in self.runs}
                out[f"window_{part}"] = w
        return out

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
    (``abs(F - F_observed)`` over the run) of the prediction and of every baseline; the element-level
    mismatch against chance; and whether the run is decisive (no baseline agrees).

    Example: ``print(evidence_table({"bf16": result}))``."""
    lines = []
    for label, r in cases.items():
        errors, a = r.predictor_errors(threshold), r.element_agreement()
        parts = [f"{name} {e['freeze_step']} ({e['mean_abs_error']:.3f})" for name, e in errors.items()]
        lines.append(f"{label}: observed {r.observed_freeze_step('nearest', threshold)}; step (error): "
                     + ", ".join(parts)
                     + f"; elements {a['element_mismatch']:.3f} vs chance {a['chance_mismatch']:.3f}"
                     + (f" (stratified {a['stratified_chance_mismatch']:.3f})"
                        if not math.isnan(a["stratified_chance_mismatch"]) else "")
                     + ("; decisive" if r.is_decisive(threshold) else "; not decisive"))
    return "\n".join(lines)


def git_commit() -> Optional[str]:
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


def cpuinfo() -> Dict[str, str]:
    """The fields ``/proc/cpuinfo`` gives for the first processor, as strings (empty where there
    is no such file). Example: ``cpuinfo()["model name"]`` -> ``"AMD EPYC"``."""
    fields: Dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break               # the first processor only
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def _cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one), else what platform says."""
    return cpuinfo().get("model name") or platform.processor() or platform.machine() or "cpu"


def provenance(device: str) -> dict:
    """Where a result came from: package and torch versions, device (the GPU's or the CPU's
    model), git commit, date. Example: ``provenance("cpu")["device_name"]`` -> ``"AMD EPYC"``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = _cpu_model()
    return {
        "package_version": __version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "device": str(dev),
        "device_name": name,
        "git_commit": git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hostname_platform": platform.platform(),
    }


def results_dir() -> Optional[Path]:
    """The folder of stored results (see the module docstring), or None when there is none.

    Example: ``results_dir()`` -> ``PosixPath('results')`` inside ``book/``."""
    candidates = []
    if os.environ.get("LOWPREC_RESULTS_DIR"):
        candidates.append(Path(os.environ["LOWPREC_RESULTS_DIR"]).expanduser())
    candidates += [Path("results"), Path("book") / "results",
                   Path(__file__).resolve().parents[2] / "book" / "results"]
    return next((c for c in candidates if c.is_dir()), None)


def load_result(name: str, folder=None) -> Optional[TrainResult]:
    """The stored result ``NAME.json`` as a :class:`~lowprec_demo.training.TrainResult`, or None
    when it is not there.

    Example: ``load_result("gpt2_e4m3_full")``."""
    folder = Path(folder) if folder is not None else results_dir()
    if folder is None:
        return None
    path = folder / (name if name.endswith(".json") else f"{name}.json")
    return TrainResult.load(path) if path.is_file() else None


def stored_results(prefix: str = "", folder=None) -> Dict[str, TrainResult]:
    """Every stored result whose file name starts with ``prefix``, by name (without ``.json``).

    Example: ``sorted(stored_results("nanogpt_"))``."""
    folder = Path(folder) if folder is not None else results_dir()
    if folder is None:
        return {}
    return {p.stem: TrainResult.load(p) for p in sorted(folder.glob(f"{prefix}*.json"))}


def describe(result: TrainResult) -> str:
    """One line saying where a stored result came from: device, date, commit, torch version,
    and the size of the run.

    Example: ``describe(result)`` -> ``"NVIDIA H200, 2026-11-30, commit 1a2b3c4, torch 2.11.0; 1200 steps"``."""
    p = result.provenance or {}
    commit = p.get("git_commit") or "unknown"
    commit = commit[:7] + (" (with uncommitted changes)" if commit.endswith("-dirty") else "")
    return (f"{p.get('device_name', p.get('device', '?'))}, {(p.get('date') or '?')[:10]}, commit {commit}, "
            f"torch {p.get('torch_version', '?')}; {result.config.steps} steps, seed {result.config.seed}")
