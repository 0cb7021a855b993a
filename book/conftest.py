"""nbval over the chapters: every output a reader sees is compared with the stored one.

Run as ``./tools/run_tests.sh book/06_nanogpt.ipynb`` (or ``python -m pytest --nbval
--nbval-current-env book/06_nanogpt.ipynb`` with ``LOWPREC_SCALE=quick OMP_NUM_THREADS=1``). nbval
executes each chapter once, cell by cell; in its full mode it compares each cell's outputs, and
this plugin makes that comparison the one of ``tools/output_compare.py``: printed text, tables and
glued values with numbers at a relative tolerance of 1e-6, timings and object ids masked, each
figure drawn again. A difference fails the cell, naming the notebook, the cell, the stored and the
computed value.

A chapter is compared only where it runs as its outputs were stored (``tools/stored_outputs.py``:
quick scale, one thread, the real Tiny Shakespeare for the chapters that read it, and a machine of
a kind on which its outputs were computed bit for bit, or any machine once they were the same on
two kinds). Elsewhere its cells still run and its checks (the hidden asserts) still hold, and the
summary says why its outputs were not compared: on the offline fallback text the text chapters
print other numbers, and on another CPU the chapters that train print other digits.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import output_compare  # noqa: E402  (tools/ is not a package)
from stored_outputs import machine_signature  # noqa: E402

try:
    from nbval.plugin import IPyNbCell
except ImportError:  # nbval is missing: nothing here to do
    IPyNbCell = None

STORED_SETTINGS = {"LOWPREC_SCALE": "quick", "OMP_NUM_THREADS": "1"}


@functools.lru_cache(maxsize=1)
def _has_real_text() -> bool:
    """Whether the chapters in this run get the real Tiny Shakespeare (else the offline fallback)."""
    from lowprec_demo.book.data import load_shakespeare

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return not load_shakespeare().fallback


def not_compared_because(notebook: dict) -> str | None:
    """Why this run cannot reproduce the notebook's stored outputs, or None when it can."""
    for name, value in STORED_SETTINGS.items():
        current = os.environ.get(name, "quick" if name == "LOWPREC_SCALE" else "")
        if current != value:
            return f"it runs with {name}={current or '(unset)'}, its outputs were stored with {name}={value}"
    stored = notebook.get("metadata", {}).get("lowprec_demo", {})
    machines = stored.get("machines", [])
    if len(set(machines)) < 2 and machine_signature() not in machines:
        return (f"its outputs were computed on another kind of machine ({machines[0] if machines else 'not recorded'}), "
                f"and its floating-point results depend on the CPU; this one is {machine_signature()}")
    if stored.get("reads_text", True) and not _has_real_text():
        return ("it reads Tiny Shakespeare, and this run has the offline fallback text "
                "(LOWPREC_DATA_DIR=../shared/data gives the real one)")
    return None


if IPyNbCell is not None:
    class StoredOutputCell(IPyNbCell):
        """nbval's cell, comparing as ``tools/output_compare.py`` does."""

        def compare_outputs(self, test, ref, skip_compare=None):
            if self.parent.__dict__.get("not_compared_because"):
                return True
            differences = output_compare.compare_outputs(ref, test, images="drawn")
            self.comparison_traceback = [
                f"{self.parent.fspath.basename}, code cell {self.cell_num} (stored as In [{self.cell.execution_count}]): "
                f"{difference}" for difference in differences]
            return not differences


def pytest_collection_modifyitems(session, config, items):
    if IPyNbCell is None:
        return
    for item in items:
        if type(item) is IPyNbCell:
            notebook = item.parent
            if "not_compared_because" not in notebook.__dict__:
                notebook.not_compared_because = (not_compared_because(notebook.nb) if not config.option.nbval_lax
                                                 else "nbval ran in lax mode (--nbval-lax)")
            item.__class__ = StoredOutputCell
            item.user_properties.append(("not_compared_because", notebook.not_compared_because))


_seconds: dict[str, float] = defaultdict(float)
_not_compared: dict[str, str] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    if path.endswith(".ipynb"):
        _seconds[path] += report.duration
        reason = dict(report.user_properties).get("not_compared_because")
        if reason:
            _not_compared[path] = reason


def pytest_terminal_summary(terminalreporter):
    if not _seconds:
        return
    write = terminalreporter.write_line
    terminalreporter.section("chapters: seconds each, outputs compared with the stored ones")
    for path, seconds in sorted(_seconds.items(), key=lambda item: -item[1]):
        reason = _not_compared.get(path)
        write(f"{seconds:7.1f} s  {path}: " + (f"executed, outputs not compared: {reason}" if reason else
                                               "every output compared"))
    compared = len(_seconds) - len(_not_compared)
    write(f"{compared} of {len(_seconds)} notebooks compared output by output "
          f"(relative tolerance {output_compare.RELATIVE_TOLERANCE:g}, timings masked)")
