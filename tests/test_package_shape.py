"""The package's shape meets its targets (tools/check_package.py): the library (all but ``book/``) at
most 6,000 lines (5,000 before the practitioner's loop), no module over 400, none of the book's names at the top, at most 12 entries at the
top, no benchmark code inside, a light ``import lowprec_demo``, at most 25 names in ``__all__``, no
attribute shadowing a submodule, one compile/eager dialect."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import check_package  # noqa: E402


def test_every_target_is_met():
    rows = check_package.verdicts(check_package.measure())
    missed = [f"{what}: {value} (target {target})" for what, value, target, ok in rows if not ok]
    assert not missed, missed


def test_the_checks_can_fail():
    """Each verdict turns on its measurement: a package past every target fails every check."""
    worse = {"lines": 20000, "book_names": ["run_experiment"], "largest_modules": [("lowprec_demo/x.py", 900)], "module_lines": 900,
             "top_entries": 40, "benchmark_in_package": ["lowprec_demo/bench.py"], "loaded": ["lowprec_demo.book.x"] * 30,
             "all": ["x"] * 40, "has_torch": True, "shadowed": ["lowprec_demo.watch"], "dialect": ["a", "b"]}
    assert not any(ok for *_, ok in check_package.verdicts(worse))


def test_the_command_prints_its_table():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "check_package.py")], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert "| lines in the library (all but book/) |" in out.stdout and "lines per layer:" in out.stdout
    assert out.returncode == (0 if "| NO |" not in out.stdout else 1)
