"""A saved freeze watch: the report as JSON-ready data, read back with the same table and figure.

:meth:`FreezeWatch.save <lowprec_demo.watch.FreezeWatch.save>` writes
:meth:`~lowprec_demo.watch.FreezeWatch.to_dict` through :func:`jsonable`; :func:`load_watch`
(and ``python -m lowprec_demo report PATH``) reads it back as a :class:`WatchReport`, whose
``summary()`` and ``plot()`` are those of the live watch.

Example:
    >>> jsonable({1: (float("nan"), float("inf"))})
    {'1': [None, inf]}
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

from lowprec_demo.formats import DTYPE_FORMATS, FloatFormat, get_format
from lowprec_demo.monitor.diagnoses import group_lines

__all__ = ["WatchReport", "load_watch", "jsonable", "watch_format"]


def watch_format(fmt) -> FloatFormat:
    """A format as the watch takes it: a name (``"bf16"``), a :class:`~lowprec_demo.formats.FloatFormat`,
    or the torch dtype that stores it (``torch.bfloat16`` -> bf16, ``torch.float16`` -> fp16, the
    float8 dtypes -> e4m3 and e5m2, ``torch.float32`` -> fp32), so that a format can be named the
    way the model was cast. Example: ``watch_format(torch.bfloat16).name`` -> ``"bf16"``."""
    if isinstance(fmt, torch.dtype):
        names = {**DTYPE_FORMATS, torch.float32: "fp32"}
        if fmt not in names:
            raise ValueError(f"{fmt} stores no format the watch knows; the torch dtypes it takes: "
                             f"{', '.join(str(d) for d in names)} (or a name such as 'bf16' or 'e8m5')")
        fmt = names[fmt]
    return get_format(fmt)


def jsonable(x):
    """``x`` as JSON can hold it: dict keys as strings, tuples as lists, tensors as lists, NaN as
    None (infinities stay, as JSON's ``Infinity``). Example: ``jsonable({1: (2, 3)})`` -> ``{'1': [2, 3]}``."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if torch.is_tensor(x):
        return x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else x
    return x


# what a saved report holds, as FreezeWatch.to_dict writes it (total_steps may be None)
REPORT_KEYS = ("mode", "formats", "threshold", "steps", "sizes", "groups", "records", "frozen_since", "forecast",
               "forecast_curves", "diagnoses")


def check_report(data) -> None:
    """Raise ValueError, in one line that names what is wrong, unless ``data`` is a freeze-watch
    report whose parts agree: a JSON object of kind ``lowprec_demo.watch`` with every key of
    :data:`REPORT_KEYS`, a record for each of its formats, and per tensor as many points as
    watched steps. A report read from a file is checked before anything is printed from it."""
    if not isinstance(data, dict):
        raise ValueError(f"not a freeze-watch report: it holds a JSON {type(data).__name__}, not an object")
    if data.get("kind") != "lowprec_demo.watch":
        raise ValueError("not a freeze-watch report (its 'kind' is not 'lowprec_demo.watch')")
    missing = [k for k in REPORT_KEYS if k not in data]
    if missing:
        raise ValueError(f"the report has no {', '.join(repr(k) for k in missing)} (a saved watch holds "
                         f"{', '.join(REPORT_KEYS)})")
    steps, sizes, records = data["steps"], data["sizes"], data["records"]
    if not isinstance(steps, list) or not isinstance(sizes, dict) or not isinstance(records, dict) \
            or not isinstance(data["formats"], list) or not data["formats"]:
        raise ValueError("the report's 'steps' and 'formats' must be lists (formats not empty), its 'sizes' and "
                         "'records' objects")
    for f in data["formats"]:
        rec = records.get(f)
        if not isinstance(rec, dict) or not isinstance(rec.get("overall"), list) \
                or not isinstance(rec.get("by_tensor"), dict):
            raise ValueError(f"the report lists the format {f!r} but holds no record of it ('records' -> {f!r} "
                             f"with 'overall' and 'by_tensor')")
        if len(rec["overall"]) != len(steps):
            raise ValueError(f"the sizes disagree: {len(steps)} watched steps but {len(rec['overall'])} points in "
                             f"the {f} record's 'overall'")
        for n in sizes:
            points = rec["by_tensor"].get(n)
            if not isinstance(points, list) or len(points) != len(steps):
                got = "none" if not isinstance(points, list) else len(points)
                raise ValueError(f"the sizes disagree: {len(steps)} watched steps but {got} points for the tensor "
                                 f"{n!r} in the {f} record")
        if f not in data["frozen_since"]:
            raise ValueError(f"the report has no 'frozen_since' of the format {f!r}")
    for group, members in data["groups"].items():
        unknown = [n for n in members if n not in sizes]
        if unknown:
            raise ValueError(f"the group {group!r} names tensors the report has no size of: {', '.join(unknown[:3])}")


class WatchReport:
    """A saved watch (:meth:`FreezeWatch.to_dict <lowprec_demo.watch.FreezeWatch.to_dict>`), with the
    same table and figure. Made by :func:`load_watch` and by ``python -m lowprec_demo report PATH``."""

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
        rec = d["records"][f]
        since, forecast = d["frozen_since"][f], d["forecast"].get(f)
        kinds: Dict[Optional[str], List[str]] = {}
        for diag in d["diagnoses"]:
            if diag["numbers"].get("format", f) == f or diag["kind"] in ("idle", "counter"):
                kinds.setdefault(diag["tensor"], []).append(diag["kind"])
        out = [{"tensor": "(all)", "size": sum(d["sizes"].values()), "format": f,
                "frozen_now": rec["overall"][-1] if rec["overall"] else None, "frozen_since": since.get("overall"),
                "forecast": None if forecast is None else {"step": forecast["overall"], "low": forecast.get("low"),
                                                           "high": forecast.get("high")},
                "diagnosis": ", ".join(sorted(set(kinds.get(None, []))))}]
        for n, size in d["sizes"].items():
            values = rec["by_tensor"].get(n, [])
            out.append({"tensor": n, "size": size, "format": f, "frozen_now": values[-1] if values else None,
                        "frozen_since": since.get(n), "forecast": None if forecast is None else forecast["by_tensor"].get(n),
                        "diagnosis": ", ".join(sorted(set(kinds.get(n, []))))})
        return out

    def summary(self, fmt=None, show: bool = True) -> str:
        rows = self.rows(fmt)
        d = self.data
        head = (f"freeze watch ({d['mode']}, {rows[0]['format']}): {len(d['steps'])} watched steps"
                + (f" of {d['total_steps']}" if d.get("total_steps") else "")
                + f", threshold {d['threshold']:g}; 'since' and 'forecast': the step from which the tensor stays "
                  f"at or above it")
        width = max(len(r["tensor"]) for r in rows)
        lines = [head, f"{'tensor':<{width}}  {'size':>11}  {'format':>6}  {'frozen now':>10}  {'since':>6}  "
                       f"{'forecast (band)':>16}  diagnosis"]

        def step(x):
            return "-" if x is None else str(x)

        def band(x):    # a forecast: the step (low-high); a report saved before the band: the step
            if not isinstance(x, dict):
                return step(x)
            edges = "" if x.get("low") is None and x.get("high") is None else \
                f" ({step(x.get('low'))}-{'end' if x.get('high') is None else x['high']})"
            return step(x["step"]) + edges

        for r in rows:
            now = "-" if r["frozen_now"] is None else f"{r['frozen_now']:.3f}"
            lines.append(f"{r['tensor']:<{width}}  {r['size']:>11,}  {r['format']:>6}  {now:>10}  "
                         f"{step(r['frozen_since']):>6}  {band(r['forecast']) if d['mode'] == 'predict' else 'n/a':>16}  "
                         f"{r['diagnosis']}")
        if d["diagnoses"]:
            lines.append("")
            lines += group_lines(d["diagnoses"])      # one line for the tensors that share a diagnosis
        text = "\n".join(lines)
        if show:
            print(text)
        return text

    def plot(self, fmt=None, ax=None):
        import matplotlib.pyplot as plt

        f = self._fmt(fmt)
        d = self.data
        rec, sizes = d["records"][f], d["sizes"]
        if ax is None:
            _, ax = plt.subplots(figsize=(8, 4))
        from lowprec_demo.common.style import series_style

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
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("step")
        ax.set_ylabel(f"fraction frozen ({'predicted' if d['mode'] == 'predict' else 'observed'})")
        ax.set_title(f"freeze watch, {f}" + (" (dashed: forecast)" if ahead else ""), fontsize=10)
        ax.legend(frameon=False, fontsize=8)
        return ax


def load_watch(path) -> WatchReport:
    """A saved watch report (``watch.save(path)``), with ``summary()`` and ``plot()``."""
    import json

    with open(path) as f:
        return WatchReport(json.load(f))
