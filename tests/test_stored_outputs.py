"""tools/stored_outputs.py and tools/output_compare.py: a stored output that differs from a fresh
execution is found and named; what changes from run to run (timings, ids) is not; the fingerprint
ignores docstrings, comments and layout; and nbval's full mode with book/conftest.py fails a chapter
whose stored number was changed by hand, naming the cell."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from repo_tools import load_tool

REPO = Path(__file__).resolve().parents[1]


_load = load_tool


output_compare = _load("output_compare")
stored_outputs = _load("stored_outputs")


def notebook(*cells, fingerprint=True):
    nb = {"cells": list(cells), "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    if fingerprint:
        nb["metadata"]["lowprec_demo"] = {"fingerprint": stored_outputs.fingerprint(nb, ["lowprec_demo.formats"])}
    return nb


def code(source, count, outputs=()):
    return {"cell_type": "code", "source": source, "execution_count": count, "metadata": {}, "outputs": list(outputs)}


def stream(text, name="stdout"):
    return {"output_type": "stream", "name": name, "text": text}


def glued(name, value):
    return {"output_type": "display_data", "data": {f"{output_compare.GLUE_PREFIX}text/plain": value},
            "metadata": {"scrapbook": {"name": name, "mime_prefix": output_compare.GLUE_PREFIX}}}


def figure(png, text="<Figure size 700x300 with 1 Axes>"):
    return {"output_type": "display_data", "data": {"image/png": png, "text/plain": text}, "metadata": {}}


def write(tmp_path, nb):
    path = tmp_path / "chapter.ipynb"
    path.write_text(json.dumps(nb))
    return path


# ---------------------------------------------------------------------------------------------
# check: what is wrong whatever the code

def test_a_well_formed_notebook_passes(tmp_path):
    nb = notebook(code("print(1)", 1, [stream("1\n")]), code("x = 2", 2), {"cell_type": "markdown", "source": "# t"})
    assert stored_outputs.problems(write(tmp_path, nb)) == []


@pytest.mark.parametrize("change, expected", [
    ("unfingerprinted", "no fingerprint"),
    ("unexecuted", "not executed once each, in order"),
    ("out_of_order", "not executed once each, in order"),
    ("error", "stored an error"),
    ("absolute_path", "shows an absolute path"),
])
def test_each_kind_of_unusable_output_is_found(tmp_path, change, expected):
    nb = notebook(code("print(1)", 1, [stream("1\n")]), code("x = 2", 2), fingerprint=change != "unfingerprinted")
    if change == "unexecuted":
        nb["cells"][1]["execution_count"] = None
    elif change == "out_of_order":
        nb["cells"][0]["execution_count"], nb["cells"][1]["execution_count"] = 2, 1
    elif change == "error":
        nb["cells"][1]["outputs"] = [{"output_type": "error", "ename": "AssertionError", "evalue": "", "traceback": []}]
    elif change == "absolute_path":
        nb["cells"][0]["outputs"] = [stream("data: tinyshakespeare.txt (/home/reader/shared/data/tinyshakespeare.txt)\n")]
    found = stored_outputs.problems(write(tmp_path, nb))
    assert any(expected in f for f in found), found


def test_relative_paths_and_urls_are_not_absolute_paths(tmp_path):
    text = "tinyshakespeare.txt from LOWPREC_DATA_DIR, see book/results/ and https://example.org/home/x and a/b/tmp/c"
    nb = notebook(code("print()", 1, [stream(text)]))
    assert stored_outputs.problems(write(tmp_path, nb)) == []


# ---------------------------------------------------------------------------------------------
# the fingerprint: code, not docstrings, comments or layout

def test_code_form_ignores_docstrings_comments_and_layout_but_not_code():
    before = 'def f(x):\n    """Twice x."""\n    return 2 * x  # doubled\n'
    after = 'def f(x):\n    """Twice x, a longer docstring\n    on two lines."""\n\n    # why: nothing\n    return 2*x\n'
    assert stored_outputs.code_form(before) == stored_outputs.code_form(after)
    assert stored_outputs.code_form(before) != stored_outputs.code_form(before.replace("2 * x", "3 * x"))
    message = 'def f(x):\n    """Twice x."""\n    raise ValueError("x must be a number")\n'
    assert stored_outputs.code_form(message) != stored_outputs.code_form(message.replace("a number", "finite"))


def test_a_cells_magics_and_comments_do_not_change_its_digest_but_its_code_does():
    a = notebook(code("%matplotlib inline\nx = 1  # one", 1, [stream("1")]), {"cell_type": "markdown", "source": "a"},
                 fingerprint=False)
    b = notebook(code("%matplotlib inline\n# set x\nx = 1", 5), {"cell_type": "markdown", "source": "b"},
                 fingerprint=False)
    assert stored_outputs.code_digest(a) == stored_outputs.code_digest(b)
    b["cells"][0]["source"] = "%matplotlib inline\nx = 2"
    assert stored_outputs.code_digest(a) != stored_outputs.code_digest(b)


def test_what_changed_names_the_code_cells_and_the_module():
    nb = notebook(code("x = 1", 1))
    assert stored_outputs.what_changed(nb) == []
    nb["cells"][0]["source"] = "x = 1  # a comment changes nothing"
    assert stored_outputs.what_changed(nb) == []
    nb["cells"][0]["source"] = "x = 2"
    assert stored_outputs.what_changed(nb) == ["its code cells"]
    nb = notebook(code("x = 1", 1))
    nb["metadata"]["lowprec_demo"]["fingerprint"]["modules"]["lowprec_demo.formats"] = "0" * 16
    assert stored_outputs.what_changed(nb) == ["the package's code it runs (lowprec_demo.formats)"]
    assert "no fingerprint" in stored_outputs.what_changed(notebook(code("x = 1", 1), fingerprint=False))[0]


def test_every_module_of_the_package_has_a_digest_and_a_gone_one_is_gone():
    assert len(stored_outputs.module_digest("lowprec_demo.rounding.freeze_rule")) == 16
    assert stored_outputs.module_digest("lowprec_demo.no_such_module") == "gone"


# ---------------------------------------------------------------------------------------------
# the comparison

def test_a_changed_number_is_found_with_both_values_and_its_line():
    found = output_compare.compare_outputs([stream("freeze step 61\nloss 0.531\n")],
                                           [stream("freeze step 61\nloss 0.532\n")])
    assert len(found) == 1 and "stored 0.531, computed 0.532" in found[0] and "'loss 0.531'" in found[0]


def test_numbers_agree_within_the_relative_tolerance_and_not_beyond():
    x = 0.720521946273065
    assert output_compare.compare_text(repr(x), repr(x * (1 + 1e-9))) is None
    assert output_compare.compare_text(repr(x), repr(x * (1 + 1e-5))) is not None
    assert output_compare.compare_text("73", "74") is not None
    assert output_compare.compare_text("nan inf -inf", "nan inf -inf") is None
    assert output_compare.compare_text("1,115,394 characters", "1,115,395 characters") is not None


def test_the_text_between_numbers_is_compared_exactly():
    found = output_compare.compare_text("a\nfrozen at step 12\nz", "a\nmoving at step 12\nz")
    assert "line 2" in found and "'frozen at step 12'" in found and "'moving at step 12'" in found
    assert output_compare.compare_text("fp8_e4m3", "fp8_e5m2") is not None


@pytest.mark.parametrize("stored, computed", [
    ("9 training runs in 90 s\n", "9 training runs in 97 s\n"),
    ("seeds: 100%|##########| 3/3 [01:41<00:00, 32.88s/it]", "seeds: 100%|##########| 3/3 [01:12<00:00, 24.01s/it]"),
    ("<Model at 0x7f12ab34cd10>", "<Model at 0x7fe0aa11bb20>"),
    ('<img id="_anim_img599d1062a2da4e07b73538e42f0c09eb">', '<img id="_anim_img7c927e17db8b47e4881f6a4c5bfc5ed9">'),
    ("provenance: commit 2e81258, torch 2.13.0", "provenance: commit 1ad6bb8, torch 2.13.0"),
])
def test_what_changes_from_run_to_run_is_masked(stored, computed):
    assert output_compare.compare_text(stored, computed) is None


def test_a_glued_value_is_named_by_its_key():
    found = output_compare.compare_outputs([glued("ch5_bf16_observed", "73")], [glued("ch5_bf16_observed", "74")])
    assert len(found) == 1 and "glue 'ch5_bf16_observed'" in found[0] and "stored 73, computed 74" in found[0]


def test_a_figure_must_be_drawn_and_with_bytes_must_be_the_same():
    assert output_compare.compare_outputs([figure("iVBOR1")], [figure("iVBOR2")]) == []   # drawn again
    assert "the figure changed" in output_compare.compare_outputs([figure("iVBOR1")], [figure("iVBOR2")],
                                                                  images="bytes")[0]
    missing = output_compare.compare_outputs([figure("iVBOR1")], [stream("no figure\n")])
    assert any("image/png: 1 stored output(s)" in m for m in missing), missing
    with pytest.raises(ValueError, match="'drawn' or 'bytes'"):
        output_compare.compare_outputs([], [], images="pixels")


def test_streams_are_compared_as_the_page_shows_them():
    assert output_compare.compare_outputs([stream("step 3/3\n")], [stream("step 1/3\rstep 2/3\r"), stream("step 3/3\n")]) == []
    assert output_compare.compare_outputs([stream("a\n")], [stream("a\n"), stream("warning\n", "stderr")]) != []


def test_a_widget_may_show_more_than_was_stored_but_not_other_things():
    widget = {"output_type": "display_data", "metadata": {},
              "data": {"application/vnd.jupyter.widget-view+json": {"model_id": "a"}, "text/plain": "interactive(...)"}}
    moved = dict(widget, data={"application/vnd.jupyter.widget-view+json": {"model_id": "b"},
                               "text/plain": "interactive(...)"})
    assert output_compare.compare_outputs([widget], [moved, figure("x"), figure("y")]) == []
    other = dict(moved, data={"text/plain": "something else"})
    assert output_compare.compare_outputs([widget], [other]) != []


def test_a_progress_bar_is_neither_compared_nor_a_slider():
    def bar(text, model="a"):
        return {"output_type": "display_data", "metadata": {},
                "data": {"application/vnd.jupyter.widget-view+json": {"model_id": model}, "text/plain": text}}
    started, done = bar("seeds:   0%|          | 0/3 [00:00<?, ?it/s]"), bar("seeds: 100%|#| 3/3 [01:41<00:00, 32.88s/it]")
    slider = bar("interactive(children=(IntSlider(value=7),))")
    assert output_compare.is_progress_bar(started) and output_compare.is_progress_bar(done)
    assert not output_compare.is_progress_bar(slider) and not output_compare.is_progress_bar(stream("0/3 [00:00]\n"))
    assert output_compare.compare_outputs([started, stream("a\n")], [stream("a\n")]) == []
    assert output_compare.compare_outputs([stream("a\n")], [done, stream("a\n")]) == []
    assert output_compare.compare_outputs([slider, stream("a\n")], [stream("a\n")]) != []


def test_notebook_differences_name_the_code_cell():
    a = notebook(code("print(1)", 1, [stream("1\n")]), code("print(2)", 2, [stream("2\n")]))
    b = json.loads(json.dumps(a))
    assert stored_outputs.notebook_differences(a, b) == []
    b["cells"][1]["outputs"] = [stream("3\n")]
    assert stored_outputs.notebook_differences(a, b) == ["code cell 1: stdout: stored 2, computed 3 (relative tolerance "
                                                         "1e-06) in:\n      stored:   '2'\n      computed: '3'"]


def test_the_machine_signature_names_the_cpu_and_torch():
    signature = stored_outputs.machine_signature()
    assert "family" in signature and "torch" in signature and signature == stored_outputs.machine_signature()


# ---------------------------------------------------------------------------------------------
# end to end: nbval's full mode with book/conftest.py

def _nbval(tmp_path, stored_text):
    """Run nbval's full mode over a two-cell chapter whose first output is stored as ``stored_text``."""
    for relative in ("book/conftest.py", "tools/output_compare.py", "tools/stored_outputs.py"):
        (tmp_path / relative).parent.mkdir(exist_ok=True)
        shutil.copy(REPO / relative, tmp_path / relative)
    nb = notebook(code("print(0.25 * 2)", 1, [stream(stored_text)]),
                  code("from lowprec_demo.book.glue import glue\nglue('t_half', 0.5)", 2,
                       [glued("t_half", "0.5")]))
    nb["metadata"]["lowprec_demo"].update(machines=[stored_outputs.machine_signature()], reads_text=False)
    nb["metadata"]["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    (tmp_path / "book" / "chapter.ipynb").write_text(json.dumps(nb))
    env = dict(os.environ, LOWPREC_SCALE="quick", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", "-p",
                           "no:xdist", "--nbval", "--nbval-current-env", "book/chapter.ipynb"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_stored_number_changed_by_hand_fails_its_cell_and_the_unchanged_chapter_passes(tmp_path):
    passed = _nbval(tmp_path, "0.5\n")
    assert passed.returncode == 0, passed.stdout[-3000:]
    assert "1 of 1 notebooks compared output by output" in passed.stdout
    failed = _nbval(tmp_path, "0.6\n")
    assert failed.returncode == 1, failed.stdout[-3000:]
    assert "chapter.ipynb, code cell 0 (stored as In [1]): stdout: stored 0.6, computed 0.5" in failed.stdout
