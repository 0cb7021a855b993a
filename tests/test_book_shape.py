"""The book a reader gets: tools/check_book.py's targets (prose, time to learn, no visible assert,
glued numbers, the order of "What's next", the README's first screen), and the README's numbers
against the chapters' stored outputs (tools/readme_table.py)."""

import subprocess
import sys
from pathlib import Path

from repo_tools import load_tool

REPO = Path(__file__).resolve().parents[1]


_tool = load_tool


def test_the_book_meets_its_reader_targets():
    run = subprocess.run([sys.executable, str(REPO / "tools" / "check_book.py")], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_readmes_numbers_are_the_books_stored_outputs():
    readme_table = _tool("readme_table")
    values = readme_table.values()
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for name in readme_table.BLOCKS:
        assert f"<!-- {name}: begin -->" in readme and f"<!-- {name}: end -->" in readme, name
    assert readme_table.filled(readme, values) == readme, (
        "README.md's numbers differ from the chapters' glued values: python tools/readme_table.py --write\n"
        + "\n\n".join(make(values) for make in readme_table.BLOCKS.values()))
    for name in ("fp32", "nearest", "stochastic", "master"):
        assert f"ch9_gap_{name}" in values and f"ch9_bytes_{name}" in values, sorted(values)
    for name in ("bf16", "lp_stochastic", "lp_preflight", "lp_plan"):
        assert f"ch9_ft_closed_{name}" in values and f"ch9_ft_time_{name}" in values, sorted(values)
    claim = readme_table.nanogpt_claim(values)          # the nanoGPT claim: the wall's step within the seeds' spread,
    assert "within the spread over seeds" in claim and "seed 0" in claim   # and how far the chapter's seed misses
    assert claim in readme and "at the predicted step" not in readme


def test_check_book_finds_what_it_looks_for(tmp_path):
    check = _tool("check_book")
    hidden = {"cell_type": "code", "metadata": {"tags": ["remove-cell"]}, "source": "assert 1 == 1", "outputs": []}
    shown = {"cell_type": "code", "metadata": {}, "source": "x = 1\nassert x", "outputs": []}
    assert check.visible_asserts({"cells": [hidden, shown]}) == [1]
    assert check.minutes("- **Time to learn**: 15 minutes") == 15
    assert check.minutes("**Time to learn**: 1 hour") == 60
    md = "# T\n\n## What's next\n\n[Chapter 3](03_regression.ipynb), then [the appendix](appendix_x.ipynb)\n"
    assert check.whats_next_first_link(md) == "03_regression.ipynb"
    glue_out = {"output_type": "display_data", "data": {"application/papermill.record/text/plain": "61"},
                "metadata": {"scrapbook": {"name": "ch2_step", "mime_prefix": "application/papermill.record/"}}}
    assert check.glued_keys({"cells": [{"cell_type": "code", "outputs": [glue_out]}]}) == {"ch2_step"}
    assert check.GLUE_ROLE.findall("at step {glue:text}`ch2_step` and {glue:text}`ch2_x:.3f`") == ["ch2_step", "ch2_x"]
