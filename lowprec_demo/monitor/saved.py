"""What a saved freeze-watch report keeps of the forecast's inputs (:func:`forecast_state`), and the watch it stands
for when read back (:class:`SavedWatch`, on which ``FreezeWatch.forecast`` runs as on the live watch), so that
``lp.load_watch(path).forecast(fmt, threshold)`` gives the dict the live watch gave when the report was saved.

The state is exact: the :class:`~lowprec_demo.monitor.forecast.RatioHistograms` (their tensors as zlib'd, base64'd
bytes; the forecast's objects by their attributes), the elements followed per tensor, each tensor's param group and the
learning rates ahead, step by step, to the run's end. It costs one pass of the schedule over the steps left per save
and, for T tensors, about 2 x 769 x 8 x T bytes of histograms before compression, plus 8 bytes per step left and param
group (and 8 per step for its number). Measured (``benchmarks/cpu-2026-12-06-report-save.md``, 48 tensors, one
thread, a shared 2-core AMD EPYC): a save 1.09x as long and a file 1.41x as large (0.44 MB) for a 300-step run;
1.24x and 1.02x for 10,000 steps, where the forecast curves the report already kept dominate (10 MB).
"""

from __future__ import annotations

import base64
import copy
import math
import sys
import types
import zlib
from typing import Dict, List, Optional

import torch

from lowprec_demo.formats import get_format
from lowprec_demo.freeze.records import FreezeRecord
from lowprec_demo.monitor import forecast as watch_forecast

__all__ = ["forecast_state", "SavedWatch", "SavedSchedule"]


def _encode(x):
    """The forecast's state as JSON holds it exactly: tensors as zlib'd bytes, objects of the forecast's classes
    by their attributes (:func:`_decode` reverses it)."""
    if torch.is_tensor(x):
        t = x.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {"tensor": {"dtype": str(t.dtype)[6:], "shape": list(t.shape), "byteorder": sys.byteorder,
                           "zlib": base64.b64encode(zlib.compress(raw, 6)).decode()}}
    if isinstance(x, dict):
        return {"dict": {str(k): _encode(v) for k, v in x.items()}}
    if isinstance(x, (list, tuple)):
        return {"list": [_encode(v) for v in x]}
    if type(x).__module__ == watch_forecast.__name__:
        return {"object": type(x).__name__, "attrs": _encode(vars(x))}
    return x


def _decode(x):
    if not isinstance(x, dict):
        return x
    if "tensor" in x:
        t = x["tensor"]
        if t["byteorder"] != sys.byteorder:
            raise ValueError(f"the report's forecast state was saved on a {t['byteorder']}-endian machine")
        raw = bytearray(zlib.decompress(base64.b64decode(t["zlib"])))
        return torch.frombuffer(raw, dtype=torch.uint8).view(getattr(torch, t["dtype"])).reshape(t["shape"])
    if "dict" in x:
        return {k: _decode(v) for k, v in x["dict"].items()}
    if "list" in x:
        return [_decode(v) for v in x["list"]]
    cls = getattr(watch_forecast, x["object"], None)
    if not isinstance(cls, type):
        raise ValueError(f"the report's forecast state names {x['object']!r}, not a class of the forecast")
    obj = cls.__new__(cls)
    vars(obj).update(_decode(x["attrs"]))
    return obj


def forecast_state(watch) -> Optional[dict]:
    """What the forecast reads beyond the report's records, steps and rates: each tensor's param group, the
    :class:`~lowprec_demo.monitor.forecast.RatioHistograms`, the elements followed and the learning rates ahead;
    None where no forecast can be made (no watched step, no run length, or ``watch.no_forecast``)."""
    if watch.no_forecast or not watch.steps or not watch.total_steps:
        return None
    ahead = watch_forecast.schedule_ahead(watch)
    return {"group_of": {n: watch.group_of[n] for n in watch.tracked}, "ratios": _encode(watch.ratios),
            "followed": [int(c) for c in watch.tracker.sample.counts],
            "schedule": _encode({"steps": torch.tensor(sorted(ahead), dtype=torch.int64),
                                 "lrs": torch.tensor([ahead[s] for s in sorted(ahead)], dtype=torch.float64)})}


class SavedSchedule:
    """The learning rates ahead a report saved, ``table`` ({step: rate per param group} from the last watched step
    ``t0``), stepped as a torch scheduler is (the forecast steps a copy); a scheduler already past ``t0`` when it was
    saved (a gap after ``t0``, or ``t0`` alone in a run of ``total`` steps) stands where it stood."""

    def __init__(self, table: Dict[int, List[float]], t0: int, now: List[float], total: int) -> None:
        keys = sorted(table)
        at = t0 if not keys or len(keys) > 1 and keys[1] == t0 + 1 else keys[1] if len(keys) > 1 else max(total, t0)
        self.optimizer = types.SimpleNamespace(param_groups=[{"lr": lr} for lr in table.get(at, now)])
        self.last_epoch, self.table = at, table

    def step(self) -> None:
        self.last_epoch += 1
        for group, lr in zip(self.optimizer.param_groups, self.table.get(self.last_epoch, ())):
            group["lr"] = lr

    def __deepcopy__(self, memo):       # the table is shared, the optimizer's stand-in the copier's
        out = copy.copy(self)
        out.optimizer = copy.deepcopy(self.optimizer, memo)
        return out


class SavedWatch:
    """A saved report as the live watch's forecast reads a watch (``FreezeWatch.forecast`` runs on it)."""

    def __init__(self, data: dict) -> None:
        state = data["forecast_state"]
        try:
            self.ratios, schedule = _decode(state["ratios"]), _decode(state["schedule"])
            table = dict(zip(schedule["steps"].tolist(), schedule["lrs"].tolist()))
        except (KeyError, TypeError, ValueError, RuntimeError, zlib.error) as error:
            raise ValueError(f"the report's 'forecast_state' cannot be read ({error})") from None
        self.mode, self.formats, self.threshold, self.every = (data[k] for k in ("mode", "formats", "threshold",
                                                                                   "every"))
        self.steps, self.lrs, self.total_steps, self.sizes = data["steps"], data["lrs"], data["total_steps"], \
            data["sizes"]
        self.tracked, self.group_of, self.no_forecast = list(self.sizes), state["group_of"], None
        self.scheduler = SavedSchedule(table, self.steps[-1], self.lrs[-1], self.total_steps)
        self.tracker = types.SimpleNamespace(sample=types.SimpleNamespace(counts=state["followed"]))
        nan = (lambda v: [math.nan if x is None else x for x in v])      # (JSON holds NaN as null)
        self.records = {f: FreezeRecord.from_dict({**r, "overall": nan(r["overall"]),
                                                   "by_tensor": {n: nan(v) for n, v in r["by_tensor"].items()}})
                        for f, r in data["records"].items()}

    def record(self, fmt=None) -> FreezeRecord:
        return self.records[self.formats[0] if fmt is None else get_format(fmt).name]
