"""The freeze watch's report: JSON-ready data (:func:`report_data`), saved (:func:`save_report`)
and read back (:func:`load_watch`, ``python -m lowprec_demo report PATH``) as a :class:`WatchReport`,
whose ``summary()``, ``plot()`` and ``forecast()`` are those of the live watch, and whose ``plan`` is the
:class:`~lowprec_demo.optim.plan.FreezePlan` the run applied (saved with it, or ``freeze_plan.json`` beside it).

A report carries what the forecast reads (``"forecast_state"``, :mod:`~lowprec_demo.monitor.saved`), so that
``load_watch(path).forecast(fmt, threshold)`` returns the dict the live watch returned when it was saved; reports saved
before it still load, and give the forecast they stored, or say why they cannot.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from typing import Dict, List, Optional

import torch

from lowprec_demo.common.output import atomic_write_json
from lowprec_demo.formats import DTYPE_FORMATS, FloatFormat, get_format
from lowprec_demo.monitor import forecast as watch_forecast
from lowprec_demo.monitor.saved import SavedWatch, forecast_state
from lowprec_demo.monitor.diagnoses import group_lines
from lowprec_demo.optim.plan import FreezePlan, load_plan

PLAN_FILE = "freeze_plan.json"     # the plan the trainers' callbacks save beside the report

__all__ = ["WatchReport", "load_watch", "jsonable", "watch_format", "report_data", "save_report"]


def no_step_yet(watch, what: str) -> None:
    """Raise ValueError, in one line that says what to do, when ``watch`` has watched no step yet."""
    if not watch.steps:
        raise ValueError(f"no step watched yet: {what} reads what the watch measures at the optimizer's steps; call "
                         f"it after at least one optimizer step (optimizer.step())"
                         + (", or lp.preflight(model, optimizer, ...) for a plan before the first step"
                            if what == "plan()" else ""))


def watch_format(fmt) -> FloatFormat:
    """A format as the watch takes it: a name, a :class:`~lowprec_demo.formats.FloatFormat`, or the
    torch dtype that stores it, as the model was cast (``watch_format(torch.bfloat16).name`` -> ``"bf16"``)."""
    if isinstance(fmt, torch.dtype):
        names = {**DTYPE_FORMATS, torch.float32: "fp32"}
        if fmt not in names:
            raise ValueError(f"{fmt} stores no format the watch knows; the torch dtypes it takes: "
                             f"{', '.join(str(d) for d in names)} (or a name such as 'bf16' or 'e8m5')")
        fmt = names[fmt]
    return get_format(fmt)


def jsonable(x):
    """``x`` as JSON can hold it: keys as strings, tuples and tensors as lists, NaN as None."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if torch.is_tensor(x):
        return x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else x
    return x


def report_data(watch, plan=None) -> dict:
    """A :class:`~lowprec_demo.monitor.freeze_watch.FreezeWatch`'s report as JSON-ready data:
    settings, steps, records, freeze steps, forecast (with a known run length), diagnoses, the forecast's inputs
    (:func:`forecast_state`); in observation under a supported optimizer, ``"expected"``: the records of the update
    meant, and ``"kept"``: the share of it stored (:mod:`~lowprec_demo.monitor.kept`; older reports lack them);
    ``plan`` (a FreezePlan or the path of its JSON): the plan applied, embedded."""
    forecasts, curves = {}, {}
    if not watch.no_forecast and watch.steps and watch.total_steps:
        for f in watch.formats:
            forecasts[f] = watch_forecast.forecast(watch, f, curves=True, relative="auto")   # (started frozen: 0.9)
            curves[f] = {n: {str(s): v for s, v in c.items()} for n, c in forecasts[f].pop("curves").items()}
    if plan is not None and not isinstance(plan, FreezePlan):
        plan = load_plan(plan)
    return {"kind": "lowprec_demo.watch", "mode": watch.mode, "formats": watch.formats, "threshold": watch.threshold,
            "every": watch.every, "total_steps": watch.total_steps, "steps": watch.steps, "lrs": watch.lrs,
            "sizes": {n: watch.sizes[n] for n in watch.tracked}, "groups": watch.groups,
            "records": {f: r.to_dict() for f, r in watch.records.items()}, "idle": watch.idle,
            "frozen_since": {f: watch.frozen_since(f) for f in watch.formats},
            "forecast": forecasts, "forecast_curves": curves, "no_forecast": watch.no_forecast,
            "forecast_state": forecast_state(watch),
            "diagnoses": [asdict(d) for d in watch.diagnoses()] if watch.steps else []} | (
        {"expected": {f: r.to_dict() for f, r in watch.expected.items()},
         "kept": {f: r.to_dict() for f, r in watch.kept.items()}} if watch.expected else {}) | (
        {"plan": plan.to_dict()} if plan is not None else {})


def save_report(watch, path, plan=None) -> None:
    """Write the watch's report to ``path`` as JSON, atomically, with ``plan`` (:func:`report_data`); sharded, from
    rank 0 only."""
    import torch.distributed as dist
    if watch.sharded and dist.get_rank() != 0:
        return
    data = jsonable(report_data(watch, plan))
    try:
        atomic_write_json(path, data)
    except OSError as error:     # it may name the temporary file beside the target: name the target
        raise type(error)(f"cannot save the freeze watch's report to {path}: {error.strerror or error}") from error


# what a saved report holds, as report_data writes it (total_steps may be None)
REPORT_KEYS = ("mode", "formats", "threshold", "steps", "sizes", "groups", "records", "frozen_since", "forecast",
               "forecast_curves", "diagnoses")


def check_report(data) -> None:
    """Raise ValueError, in one line that names what is wrong, unless ``data`` is a freeze-watch
    report whose parts agree (checked before anything is printed from a file)."""
    if not isinstance(data, dict):
        raise ValueError(f"not a freeze-watch report: it holds a JSON {type(data).__name__}, not an object")
    if data.get("kind") != "lowprec_demo.watch":
        raise ValueError("not a freeze-watch report (its 'kind' is not 'lowprec_demo.watch')")
    missing = [k for k in REPORT_KEYS if k not in data]
    if missing:
        raise ValueError(f"the report has no {', '.join(repr(k) for k in missing)} (a saved watch holds "
                         f"{', '.join(REPORT_KEYS)})")
    steps, sizes, records = data["steps"], data["sizes"], data["records"]
    if not (isinstance(steps, list) and isinstance(sizes, dict) and isinstance(records, dict)
            and isinstance(data["formats"], list) and data["formats"]):
        raise ValueError("the report's 'steps' and 'formats' must be lists (formats not empty), its 'sizes' and "
                         "'records' objects")
    for f in data["formats"]:
        rec = records.get(f)
        if not (isinstance(rec, dict) and isinstance(rec.get("overall"), list)
                and isinstance(rec.get("by_tensor"), dict)):
            raise ValueError(f"the report lists the format {f!r} but holds no record of it ('records' -> {f!r} "
                             f"with 'overall' and 'by_tensor')")
        counts = [(f"points in the {f} record's 'overall'", rec["overall"])] + [
            (f"points for the tensor {n!r} in the {f} record", rec["by_tensor"].get(n, [] if not steps else None))
            for n in sizes]
        for what, points in counts:
            if not isinstance(points, list) or len(points) != len(steps):
                raise ValueError(f"the sizes disagree: {len(steps)} watched steps but "
                                 f"{len(points) if isinstance(points, list) else 'none'} {what}")
        if f not in data["frozen_since"]:
            raise ValueError(f"the report has no 'frozen_since' of the format {f!r}")
    for group, members in data["groups"].items():
        unknown = [n for n in members if n not in sizes]
        if unknown:
            raise ValueError(f"the group {group!r} names tensors the report has no size of: {', '.join(unknown[:3])}")
    if data.get("plan") is not None:
        try:
            FreezePlan.from_dict(data["plan"])
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"the report's 'plan' is not a freeze plan ({error})") from None


def _step(x) -> str:
    return "-" if x is None else str(x)


def _band(x) -> str:
    """A forecast as ``step (low-high)``; a report saved before the band: the step."""
    if not isinstance(x, dict):
        return _step(x)
    if x.get("low") is None and x.get("high") is None:
        return _step(x["step"])
    return f"{_step(x['step'])} ({_step(x.get('low'))}-{'end' if x.get('high') is None else x['high']})"


class WatchReport:
    """A watch's report (:func:`report_data`), with the same table, figure and forecast as the live watch; ``path``:
    the file it was read from (where ``plan`` looks for ``freeze_plan.json`` beside it)."""

    def __init__(self, data: dict, path=None) -> None:
        check_report(data)
        self.data, self.path = data, path
        self._plan, self.plan_note = None, None
        if data.get("plan") is not None:
            self._plan = FreezePlan.from_dict(data["plan"])
        elif path is not None and os.path.isfile(beside := os.path.join(os.path.dirname(os.path.abspath(path)),
                                                                        PLAN_FILE)):
            try:
                plan = load_plan(beside)
            except (OSError, ValueError, KeyError, TypeError) as error:
                self.plan_note = f"{beside} is not a freeze plan ({error})"
            else:
                if plan.format in data["formats"] and set(plan.remedies) <= set(data["sizes"]):
                    self._plan, self.plan_note = plan, f"from {beside}"
                else:
                    self.plan_note = f"{beside} is another run's plan ({plan.format}, other tensors): not shown"

    @property
    def plan(self) -> Optional[FreezePlan]:
        """The plan the run applied: saved with the report (``watch.save(path, plan=)``), else ``freeze_plan.json``
        beside the file read when it is a plan of this report's format and tensors; None otherwise."""
        return self._plan

    def forecast(self, fmt=None, threshold: Optional[float] = None) -> Dict[str, object]:
        """The forecast (:meth:`FreezeWatch.forecast <lowprec_demo.monitor.freeze_watch.FreezeWatch.forecast>`) the
        live watch gave when this report was saved, recomputed from the saved inputs (any ``threshold``); a report
        saved without them gives its stored forecast at its own threshold only, and says why otherwise."""
        d, f = self.data, self._fmt(fmt)
        if not d["steps"]:
            raise ValueError("no step watched yet: this report was saved before the first watched optimizer step, "
                             "so it has nothing to forecast from; save it again after training steps")
        if d.get("forecast_state"):
            return watch_forecast.forecast(SavedWatch(d), f, threshold, None, False, "auto")   # as FreezeWatch.forecast
        why = d.get("no_forecast") or ("the watch had no run length (total_steps), which a forecast needs"
                                       if not d.get("total_steps") else None)
        if why:
            raise ValueError(f"no forecast in this report: {why}")
        if f in d["forecast"] and (threshold is None or threshold == d["threshold"]):
            return d["forecast"][f]
        raise ValueError(f"this report holds only the forecast at its threshold {d['threshold']:g} (it was saved "
                         f"before reports kept the forecast's inputs), not threshold={threshold!r}: save it again "
                         f"from the live watch to forecast at other thresholds")

    def _fmt(self, fmt) -> str:
        formats = self.data["formats"]
        name = formats[0] if fmt is None else watch_format(fmt).name
        if name not in formats:
            raise KeyError(f"no record for {name}; this report holds: {', '.join(formats)}")
        return name

    def rows(self, fmt=None) -> List[dict]:
        """One row per tensor, the whole model first."""
        f = self._fmt(fmt)
        d = self.data
        rec, since, forecast = d["records"][f], d["frozen_since"][f], d["forecast"].get(f)
        kinds: Dict[Optional[str], set] = {}
        for diag in d["diagnoses"]:
            if diag["numbers"].get("format", f) == f or diag["kind"] in ("idle", "counter"):
                kinds.setdefault(diag["tensor"], set()).add(diag["kind"])
        whole = None if forecast is None else {k: forecast.get(k) for k in ("low", "high")}
        rows = [("(all)", None, "overall", sum(d["sizes"].values()), rec["overall"],
                 None if whole is None else {"step": forecast["overall"], **whole})]
        rows += [(n, n, n, size, rec["by_tensor"].get(n, []),
                  None if forecast is None else forecast["by_tensor"].get(n)) for n, size in d["sizes"].items()]
        return [{"tensor": name, "size": size, "format": f, "frozen_now": values[-1] if values else None,
                 "frozen_since": since.get(key), "forecast": ahead, "diagnosis": ", ".join(sorted(kinds.get(who, ())))}
                for name, who, key, size, values, ahead in rows]

    def summary(self, fmt=None, show: bool = True) -> str:
        """The table (tensor, size, format, frozen now, since, forecast with its band, diagnosis)
        and the grouped diagnoses, printed unless ``show=False``, and returned."""
        rows, d, plan = self.rows(fmt), self.data, self.plan
        width = max(len(r["tensor"]) for r in rows)
        head = f"freeze watch ({d['mode']}, {rows[0]['format']}): "
        if not d["steps"]:
            text = head + "no step watched yet; train at least one optimizer step, then call summary() again"
            if show:
                print(text)
            return text
        lines = [head + f"{len(d['steps'])} watched steps" + (f" of {d['total_steps']}" if d.get("total_steps") else "")
                 + f", threshold {d['threshold']:g}; 'since' and 'forecast': the step from which the tensor stays "
                   f"at or above it"]
        relative = (d["forecast"].get(rows[0]["format"]) or {}).get("relative")
        if relative is not None:      # started at or above the threshold: the forecast of the way to all frozen
            lines[0] = lines[0][:lines[0].index("; 'since'")] + (
                f"; 'since': the step from which the tensor stays at or above it; the run started there, so "
                f"'forecast' is when the tensor stays {relative:.0%} of the way from its least frozen share to all "
                f"frozen (its band held 87% of held-out cases)")
        if plan is not None:
            made = "" if plan.step is None else f", made at step {plan.step}"
            lines.append(f"plan applied ({plan.format}{made}; {self.plan_note or 'saved with the report'}): "
                         + ", ".join(f"{r} {t} tensors" for r, (t, _) in plan.counts().items() if t)
                         + f"; {plan.bytes_per_parameter()['extra']:.3g} bytes per parameter above round to nearest")
        elif self.plan_note:
            lines.append(f"plan: {self.plan_note}")
        lines.append(f"{'tensor':<{width}}  {'size':>11}  {'format':>6}  {'frozen now':>10}  {'since':>6}  "
                     f"{'forecast (band)':>16}  " + ("remedy      " if plan is not None else "") + "diagnosis")
        for r in rows:
            now = "-" if r["frozen_now"] is None else f"{r['frozen_now']:.3f}"
            ahead = _band(r["forecast"]) if d["mode"] == "predict" or d["forecast"] else "n/a"
            remedy = "" if plan is None else f"{plan.remedies.get(r['tensor'], '-'):<10}  "
            lines.append(f"{r['tensor']:<{width}}  {r['size']:>11,}  {r['format']:>6}  {now:>10}  "
                         f"{_step(r['frozen_since']):>6}  {ahead:>16}  {remedy}{r['diagnosis']}")
        text = "\n".join(lines + ([""] + group_lines(d["diagnoses"]) if d["diagnoses"] else []))
        if show:
            print(text)
        return text

    def plot(self, fmt=None, ax=None):
        """The frozen fraction of each group of tensors over the steps, the forecast dashed."""
        import matplotlib.pyplot as plt
        from lowprec_demo.common.style import series_style
        f, d = self._fmt(fmt), self.data
        if not d["steps"]:
            raise ValueError("no step watched yet: the report has nothing to draw; save it after training steps")
        rec, sizes = d["records"][f], d["sizes"]
        ax = plt.subplots(figsize=(8, 4))[1] if ax is None else ax
        curves = d["forecast_curves"].get(f, {})
        ahead = sorted(int(s) for s in curves.get("overall", {}))
        groups = {"all": list(sizes), **d["groups"]}
        for i, (group, members) in enumerate(groups.items()):
            total = sum(sizes[n] for n in members)
            past = [sum(rec["by_tensor"][n][t] * sizes[n] for n in members) / total for t in range(len(d["steps"]))]
            color = "k" if group == "all" else series_style(i - 1)["color"]
            ax.plot(d["steps"], past, color=color, lw=2.2 if group == "all" else 1.6,
                    label=f"{group} ({total:,} elements)")
            if ahead:
                fut = [sum(curves[n][str(s)] * sizes[n] for n in members) / total for s in ahead]
                ax.plot(ahead, fut, color=color, lw=1.6, ls=(0, (5, 2)))
        ax.axhline(d["threshold"], color="0.6", lw=0.8, ls=":")
        if d.get("total_steps"):
            ax.set_xlim(0, d["total_steps"])
        ax.set(ylim=(-0.02, 1.02), xlabel="step",
               ylabel=f"fraction frozen ({'predicted' if d['mode'] == 'predict' else 'observed'})")
        ax.set_title(f"freeze watch, {f}" + (" (dashed: forecast)" if ahead else ""), fontsize=10)
        ax.legend(frameon=False, fontsize=9)
        return ax


def load_watch(path) -> WatchReport:
    """A saved watch report (``watch.save(path)``), with ``summary()``, ``plot()``, ``forecast()`` and ``plan``."""
    import json

    with open(path) as f:
        return WatchReport(json.load(f), path)
