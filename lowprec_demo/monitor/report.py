"""The freeze watch's report: JSON-ready data (:func:`report_data`), saved (:func:`save_report`)
and read back (:func:`load_watch`, ``python -m lowprec_demo report PATH``) as a :class:`WatchReport`,
whose ``summary()`` and ``plot()`` are those of the live watch.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Dict, List, Optional

import torch

from lowprec_demo.common.output import atomic_write_json
from lowprec_demo.formats import DTYPE_FORMATS, FloatFormat, get_format
from lowprec_demo.monitor import forecast as watch_forecast
from lowprec_demo.monitor.diagnoses import group_lines

__all__ = ["WatchReport", "load_watch", "jsonable", "watch_format", "report_data", "save_report"]


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


def report_data(watch) -> dict:
    """A :class:`~lowprec_demo.monitor.freeze_watch.FreezeWatch`'s report as JSON-ready data:
    settings, steps, records, freeze steps, forecast (with a known run length), diagnoses; in observation under a
    supported optimizer, ``"expected"``: the records of the update meant (older reports lack it)."""
    forecasts, curves = {}, {}
    if not watch.no_forecast and watch.steps and watch.total_steps:
        for f in watch.formats:
            forecasts[f] = watch_forecast.forecast(watch, f, curves=True)
            curves[f] = {n: {str(s): v for s, v in c.items()} for n, c in forecasts[f].pop("curves").items()}
    return {"kind": "lowprec_demo.watch", "mode": watch.mode, "formats": watch.formats, "threshold": watch.threshold,
            "every": watch.every, "total_steps": watch.total_steps, "steps": watch.steps, "lrs": watch.lrs,
            "sizes": {n: watch.sizes[n] for n in watch.tracked}, "groups": watch.groups,
            "records": {f: r.to_dict() for f, r in watch.records.items()}, "idle": watch.idle,
            "frozen_since": {f: watch.frozen_since(f) for f in watch.formats},
            "forecast": forecasts, "forecast_curves": curves,
            "diagnoses": [asdict(d) for d in watch.diagnoses()]} | (
        {"expected": {f: r.to_dict() for f, r in watch.expected.items()}} if watch.expected else {})


def save_report(watch, path) -> None:
    """Write the watch's report to ``path`` as JSON, atomically; sharded, from rank 0 only."""
    import torch.distributed as dist
    if watch.sharded and dist.get_rank() != 0:
        return
    data = jsonable(report_data(watch))
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
            (f"points for the tensor {n!r} in the {f} record", rec["by_tensor"].get(n)) for n in sizes]
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
    """A watch's report (:func:`report_data`), with the same table and figure as the live watch."""

    def __init__(self, data: dict) -> None:
        check_report(data)
        self.data = data

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
        rows, d = self.rows(fmt), self.data
        width = max(len(r["tensor"]) for r in rows)
        lines = [f"freeze watch ({d['mode']}, {rows[0]['format']}): {len(d['steps'])} watched steps"
                 + (f" of {d['total_steps']}" if d.get("total_steps") else "")
                 + f", threshold {d['threshold']:g}; 'since' and 'forecast': the step from which the tensor stays "
                   f"at or above it",
                 f"{'tensor':<{width}}  {'size':>11}  {'format':>6}  {'frozen now':>10}  {'since':>6}  "
                 f"{'forecast (band)':>16}  diagnosis"]
        for r in rows:
            now = "-" if r["frozen_now"] is None else f"{r['frozen_now']:.3f}"
            ahead = _band(r["forecast"]) if d["mode"] == "predict" or d["forecast"] else "n/a"
            lines.append(f"{r['tensor']:<{width}}  {r['size']:>11,}  {r['format']:>6}  {now:>10}  "
                         f"{_step(r['frozen_since']):>6}  {ahead:>16}  {r['diagnosis']}")
        text = "\n".join(lines + ([""] + group_lines(d["diagnoses"]) if d["diagnoses"] else []))
        if show:
            print(text)
        return text

    def plot(self, fmt=None, ax=None):
        """The frozen fraction of each group of tensors over the steps, the forecast dashed."""
        import matplotlib.pyplot as plt
        from lowprec_demo.common.style import series_style
        f, d = self._fmt(fmt), self.data
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
        ax.legend(frameon=False, fontsize=8)
        return ax


def load_watch(path) -> WatchReport:
    """A saved watch report (``watch.save(path)``), with ``summary()`` and ``plot()``."""
    import json

    with open(path) as f:
        return WatchReport(json.load(f))
