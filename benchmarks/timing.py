"""How the benchmark times and weighs a piece of work: medians over interleaved rounds, and the
most memory one call holds at once.

Every round runs every case once, so a machine whose load changes during a measurement slows all
of them alike; a ratio of two cases taken within one round is steadier than a ratio of two
separate measurements.

Example:
    ``median_times({"copy": lambda: x.clone(), "round trip": lambda: x.bfloat16().float()}, "cpu", 7)``
    -> ``{"copy": 0.031, "round trip": 0.058}`` (seconds)
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

__all__ = ["median_times", "peak_extra_bytes"]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_times(cases: Dict[str, Callable[[], object]], device: str, repeats: int, warmup: int = 1,
                 min_seconds: float = 0.0, per_round: Optional[dict] = None) -> Dict[str, float]:
    """Median seconds of each case over ``repeats`` rounds. Every round runs every case, starting
    one case later each round, so that neither a changing machine load nor the position in the
    round (caches warmed by the case before) favours one case. A case faster than
    ``min_seconds`` runs several times in a row within a round (as many as the slowest case of
    the warmup needs to last that long, ``ceil(min_seconds / slowest)``, the same for every
    case), and its time is the mean of those runs: short steps are timed over a span long enough
    for the clock and the scheduler. ``per_round``, if given, receives every case's time in
    every round (a list per case, in round order).

    Example: ``median_times({"a": f, "b": g}, "cpu", repeats=3)`` -> ``{"a": 0.002, "b": 0.003}``."""
    slowest = 0.0
    for _ in range(warmup):
        for fn in cases.values():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            slowest = max(slowest, time.perf_counter() - start)
    inner = max(1, math.ceil(min_seconds / slowest)) if min_seconds > 0 and slowest > 0 else 1
    names = list(cases)
    times: Dict[str, List[float]] = {name: [] for name in cases}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = cases[name]
            _sync(device)
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            _sync(device)
            times[name].append((time.perf_counter() - start) / inner)
    if per_round is not None:
        per_round.update(times)
    return {name: statistics.median(ts) for name, ts in times.items()}


@contextlib.contextmanager
def _quiet_kineto():
    """Keep the profiler's library (kineto) from writing two lines to stderr every time it starts
    and stops (``USDT: ... SyncActivityProfilerHandler.cpp:52] profiler_start``). Kineto reads
    ``KINETO_LOG_LEVEL`` when a profile starts; 6 lies above its highest level (USDT, 5), so
    nothing is logged, its own errors included (a failed profile still raises, and the caller
    then reports no memory). A level the user set is left alone."""
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


def peak_extra_bytes(fn: Callable[[], object], device: str) -> Optional[int]:
    """The most memory ``fn`` holds at once beyond what was allocated before it: on a GPU the
    CUDA allocator's peak; on the CPU the running sum of the allocations and frees torch's
    profiler records (every tensor torch allocates, compiled code included), kept quiet. None if
    neither works.

    Example: ``peak_extra_bytes(lambda: torch.ones(1000) * 2, "cpu")`` -> ``8008`` (the ones and
    the product, 4000 bytes each, held at once)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        del out
        return torch.cuda.max_memory_allocated() - before
    try:
        from torch.profiler import ProfilerActivity, profile
        with _quiet_kineto(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn()
            del out
        running = peak = 0
        for event in sorted(prof.events(), key=lambda e: e.time_range.start):
            running += event.self_cpu_memory_usage
            peak = max(peak, running)
        return peak
    except Exception:
        return None
