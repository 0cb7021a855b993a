"""Stored full-scale results: JSON files under ``book/results/``, loaded when present.

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

import os
from pathlib import Path
from typing import Dict, Optional

from .training import TrainResult

__all__ = ["results_dir", "load_result", "stored_results", "describe"]


def results_dir() -> Optional[Path]:
    """The folder of stored results (see the module docstring), or None when there is none.

    Example: ``results_dir()`` -> ``PosixPath('results')`` inside ``book/``."""
    candidates = []
    if os.environ.get("LOWPREC_RESULTS_DIR"):
        candidates.append(Path(os.environ["LOWPREC_RESULTS_DIR"]).expanduser())
    candidates += [Path("results"), Path("book") / "results",
                   Path(__file__).resolve().parent.parent / "book" / "results"]
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
