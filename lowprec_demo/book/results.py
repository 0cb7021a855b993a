"""What a run produced and where it came from: :class:`RunRecord`, :class:`TrainResult`, their JSON
and :func:`provenance`; and stored full-scale results, ``book/results/NAME.json`` written by
the CLI on a GPU, read by :func:`load_result` (None if absent) from
``$LOWPREC_RESULTS_DIR``, ``results/`` or ``book/results/`` here, or the checkout's."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional

import torch

from lowprec_demo.book.config import TrainConfig
from lowprec_demo.common.output import atomic_write_json
from lowprec_demo.formats import get_format
from lowprec_demo.freeze import FreezeRecord, freeze_step, steps_agree
from lowprec_demo.version import __version__

__all__ = ["RunRecord", "TrainResult", "evidence_table", "atomic_write_json", "git_commit", "provenance",
           "cpuinfo", "results_dir", "load_result", "stored_results", "describe"]


@dataclass
class RunRecord:
    """One variant's run: per-step loss and learning rate, evaluations, and for a low-precision
    run its observed freezing and the bytes it stored per parameter."""

    variant: str
    loss: List[float] = field(default_factory=list)
    lr: List[float] = field(default_factory=list)
    evals: List[dict] = field(default_factory=list)        # {"step": t, "metric": value, ...}
    frozen: Optional[FreezeRecord] = None
    seconds: float = 0.0
    bytes_per_param: dict = field(default_factory=dict)    # bytes_per_parameter at the end
    plan: Optional[dict] = None                            # the reference's FreezePlan.to_dict()

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
    """Per-tensor curves thinned to at most ``max_points`` steps; the overall curve stays whole."""
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
    """Everything a run produced: config, provenance, runs, the prediction per format, ``baselines``
    (per-step frozen fractions of predictors that never look at the reference trajectory:
    ``schedule``, ``schedule_fitted``, ``always``, ``never``) and ``agreement`` (per step:
    ``element_mismatch``, the share of elements whose predicted and observed states differ; ``chance_mismatch`` and
    ``stratified_chance_mismatch``, what independent masks would give, overall and within each tensor and binade)."""

    experiment: str
    config: TrainConfig
    runs: Dict[str, RunRecord]
    predictions: Dict[str, FreezeRecord]
    provenance: dict = field(default_factory=dict)
    description: str = ""
    baselines: Dict[str, List[float]] = field(default_factory=dict)
    agreement: Dict[str, List[float]] = field(default_factory=dict)

    @property
    def format(self) -> str:
        return get_format(self.config.format).name

    @property
    def prediction(self) -> FreezeRecord:   # the main format's
        return self.predictions[self.format]

    def predicted_freeze_step(self, threshold: Optional[float] = None) -> Optional[int]:
        return self.prediction.freeze_step(threshold or self.config.threshold)

    def observed_freeze_step(self, variant: str = "nearest", threshold: Optional[float] = None) -> Optional[int]:
        run = self.runs[variant]
        return run.frozen.freeze_step(threshold or self.config.threshold) if run.frozen else None

    def freeze_steps_agree(self, threshold: Optional[float] = None) -> bool:
        """Whether predicted and observed (nearest) freeze steps agree within max(2 steps, 2 % of the run)
        (:func:`lowprec_demo.freeze.steps_agree`); True if neither reaches the threshold, False if only one does."""
        return steps_agree(self.predicted_freeze_step(threshold), self.observed_freeze_step("nearest", threshold),
                           self.config.steps)

    def froze_as_predicted(self, threshold: Optional[float] = None) -> bool:
        """Whether the round-to-nearest run froze at the predicted step: as :meth:`freeze_steps_agree`, but False when
        nothing freezes, so a tally counts only runs with a freeze."""
        return self.predicted_freeze_step(threshold) is not None and self.freeze_steps_agree(threshold)

    def predictor_errors(self, threshold: Optional[float] = None) -> Dict[str, dict]:
        """How far each predictor, the reference's prediction (``"fp32"``) and every baseline, is from the observed
        (round-to-nearest) frozen fraction: ``mean_abs_error`` (over the run), ``freeze_step``, ``step_error`` (minus
        the observed step; None unless both exist) and ``agrees`` (:func:`lowprec_demo.freeze.steps_agree`)."""
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
        """Whether this run can tell the prediction from the baselines: the round-to-nearest run froze, not in the
        first or last 5 % of the run, and no baseline agrees with its step. Tallies of agreement count only such runs
        (where any predictor agrees, agreement shows nothing)."""
        threshold = threshold or self.config.threshold
        observed = self.observed_freeze_step("nearest", threshold)
        T = self.config.steps
        if observed is None or not 0.05 * T <= observed <= 0.95 * T:
            return False
        errors = self.predictor_errors(threshold)
        return not any(errors[name]["agrees"] for name in self.baselines)

    def element_agreement(self) -> dict:
        """The run's means of the per-step mismatches (see the class docstring), and ``ratio``, element over chance
        mismatch (0: masks agree everywhere; 1: no better than chance), ``stratified_ratio`` likewise."""
        if not self.agreement:
            raise ValueError("no element-level agreement in this result (it needs a reference and a nearest run)")
        mean = lambda key: (sum(self.agreement[key]) / len(self.agreement[key])
                            if self.agreement.get(key) else math.nan)   # a key a stored result lacks: NaN
        m, c, s = mean("element_mismatch"), mean("chance_mismatch"), mean("stratified_chance_mismatch")
        return {"element_mismatch": m, "chance_mismatch": c, "ratio": m / c if c > 0 else math.nan,
                "stratified_chance_mismatch": s, "stratified_ratio": m / s if s > 0 else math.nan}

    def loss_falls(self, step: Optional[int] = None, window: Optional[int] = None) -> dict:
        """How far each run's loss falls ``before`` ``step`` (default: the predicted freeze step, from the end of the
        warmup) and ``after`` it (to the end), by variant, from means over windows of ``window`` steps (default a
        tenth of the run; at most half the span, None under 2 steps). E.g. ``loss_falls()["after"]["reference"]``:
        what fp32 still gains after the wall."""
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
        tail = self.runs[variant].loss[-(window or 1):]
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

    def to_dict(self, max_points: int = 0) -> dict:
        """The JSON layout of the command line: experiment, config, provenance, runs, prediction
        (main format, with its baselines), agreement and predictions (every format)."""
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
        for key, default in (("betas", (0.9, 0.999)), ("predict_formats", ()), ("step_milestones", (0.5, 0.75)),
                             ("variants", ())):
            cfg[key] = tuple(cfg.get(key, default))
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
    """One line per run: the observed freeze step; the freeze step and mean error of the
    prediction and of every baseline; the element mismatch against chance; whether the run is
    decisive. E.g. ``print(evidence_table({"bf16": result}))``."""
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
    """The git commit (``-dirty`` with uncommitted changes); outside a checkout, ``$LOWPREC_GIT_COMMIT`` if set."""
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
    """The fields ``/proc/cpuinfo`` gives for the first processor (empty without that file)."""
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


def provenance(device: str) -> dict:
    """Provenance: package, torch and Python versions, device and its model, git commit, date, platform."""
    dev = torch.device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = cpuinfo().get("model name") or platform.processor() or platform.machine() or "cpu"
    return {"package_version": __version__, "torch_version": torch.__version__,
            "python_version": platform.python_version(), "device": str(dev), "device_name": name,
            "git_commit": git_commit(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "hostname_platform": platform.platform()}


def results_dir() -> Optional[Path]:
    """The folder of stored results (see the module docstring), or None."""
    candidates = [Path(os.environ["LOWPREC_RESULTS_DIR"]).expanduser()] if os.environ.get("LOWPREC_RESULTS_DIR") else []
    candidates += [Path("results"), Path("book") / "results", Path(__file__).resolve().parents[2] / "book" / "results"]
    return next((c for c in candidates if c.is_dir()), None)


def load_result(name: str, folder=None) -> Optional[TrainResult]:
    """The stored result ``NAME.json`` as a :class:`TrainResult`, or None when it is not there."""
    folder = Path(folder) if folder is not None else results_dir()
    if folder is None:
        return None
    path = folder / (name if name.endswith(".json") else f"{name}.json")
    return TrainResult.load(path) if path.is_file() else None


def stored_results(prefix: str = "", folder=None) -> Dict[str, TrainResult]:
    """Every stored result whose file name starts with ``prefix``, by name (without ``.json``)."""
    folder = Path(folder) if folder is not None else results_dir()
    if folder is None:
        return {}
    return {p.stem: TrainResult.load(p) for p in sorted(folder.glob(f"{prefix}*.json"))}


def describe(result: TrainResult) -> str:
    """One line saying where a stored result came from, for a reader: device, date, torch version, steps and seed (the
    commit stays in the stored provenance, ``result.provenance["git_commit"]``)."""
    p = result.provenance or {}
    return (f"{p.get('device_name', p.get('device', '?'))}, {(p.get('date') or '?')[:10]}, "
            f"torch {p.get('torch_version', '?')}; {result.config.steps} steps, seed {result.config.seed}")
