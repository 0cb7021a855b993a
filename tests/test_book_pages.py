"""What a reader meets on a page: tools/check_book.py's page checks (figures, animations, slider boxes,
environment variables, markers, progress bars, exercises, glue from another notebook) find each
problem they look for and pass a clean page; the package's animation works offline and at the page's
width; the slider helper shows its box once."""

import base64
import json
import re
import struct

import pytest

from lowprec_demo.book import widgets
from repo_tools import load_tool


def _check_book():
    return load_tool("check_book")


def _code(source="x = 1", outputs=(), tags=()):
    return {"cell_type": "code", "metadata": {"tags": list(tags)}, "source": source, "outputs": list(outputs),
            "execution_count": 1}


def _md(source):
    return {"cell_type": "markdown", "metadata": {}, "source": source}


def _png(width=None):
    meta = {"image/png": {"width": width, "height": 100}} if width is not None else {}
    return {"output_type": "display_data", "data": {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"},
            "metadata": meta}


def _widget():
    return {"output_type": "display_data", "metadata": {},
            "data": {"application/vnd.jupyter.widget-view+json": {"model_id": "a"}, "text/plain": "VBox()"}}


def _html(text):
    return {"output_type": "display_data", "metadata": {}, "data": {"text/html": text, "text/plain": "<HTML>"}}


ANIMATION_OK = '<img id="_anim_img0a1" style="width: 100%; max-width: 700px; height: auto;">'


def test_a_clean_page_passes():
    check = _check_book()
    nb = {"cells": [_md("# A page\n\nProse."), _code(outputs=[_png(594)]),
                    _code("widgets.interact(draw, man_bits=s)", outputs=[_widget()], tags=["remove-output"]),
                    _code(outputs=[_html(ANIMATION_OK)]),
                    _code("x = 1  # NBVAL_CHECK_OUTPUT", tags=["remove-input"]),
                    _code("# LOWPREC_SCALE=full runs the full size", tags=["hide-input"])]}
    assert check.page_problems("book/x", nb) == []


@pytest.mark.parametrize("cells, expected", [
    ([_code(outputs=[_png()])], "not retina"),
    ([_code(outputs=[_png(1290)])], "1290 px wide"),
    ([_code(outputs=[_widget(), _widget()]), _code(outputs=[_html(ANIMATION_OK)])], "2 slider boxes"),
    ([_code("interact(draw)", outputs=[_widget()], tags=["remove-output"])], "no version without a kernel"),
    ([_code("widgets.interact(draw)", outputs=[_widget()]), _code(outputs=[_html(ANIMATION_OK)])], "look live"),
    ([_code(outputs=[_html('<link rel="stylesheet" href="https://cdn.example/font-awesome.css">' + ANIMATION_OK)])],
     "stylesheet from the network"),
    ([_code(outputs=[_html('<img id="_anim_img0a1">')])], "no max-width"),
    ([_code(outputs=[_html(ANIMATION_OK.replace("700px", "1200px"))])], "max-width 1200 px"),
    ([_md("Set LOWPREC_SCALE=full to run it all.")], "LOWPREC_SCALE"),
    ([_code(outputs=[{"output_type": "stream", "name": "stdout", "text": "data from LOWPREC_DATA_DIR"}])],
     "LOWPREC_DATA_DIR"),
    ([_md("See benchmarks/costs.md.")], "benchmarks/costs.md"),
    ([_code("SCALE = 'quick'  # LOWPREC_SCALE=full for the full size")], "in its code"),
    ([_code("y = 2  # NBVAL_CHECK_OUTPUT")], "NBVAL_ marker"),
    ([_code(outputs=[{"output_type": "stream", "name": "stderr", "text": "100%|##| 3/3 [01:41<00:00, 32.88s/it]"}])],
     "progress bar"),
])
def test_each_problem_is_found(cells, expected):
    problems = _check_book().page_problems("book/x", {"cells": cells})
    assert any(expected in p for p in problems), problems


def test_hidden_cells_are_not_what_a_reader_sees():
    check = _check_book()
    removed = _code(outputs=[_png(1290), {"output_type": "stream", "name": "stdout", "text": "LOWPREC_SCALE"}],
                    tags=["remove-cell"])
    assert check.page_problems("book/x", {"cells": [removed]}) == []


def test_exercises_are_counted_and_their_answers_collapsed():
    check = _check_book()
    answer = _code("print(2 ** -8)", tags=["hide-cell"])
    dropdown = _md(":::{admonition} Answer\n:class: dropdown\n2^-8\n:::")
    nb = {"cells": [_md("**Exercise 1.** Predict the gap."), answer, _md("**Exercise 2.** And this one?"), dropdown,
                    _md("**Exercise 3.** Without an answer."), _code("print(1)")]}
    assert check.exercises(nb) == (3, [3])
    assert check.exercises({"cells": [_md("No exercises here.")]}) == (0, [])


def test_glue_from_another_notebook_is_checked_in_that_notebook(tmp_path, monkeypatch):
    check = _check_book()
    monkeypatch.setattr(check, "REPO", tmp_path)
    glued = {"output_type": "display_data", "data": {"application/papermill.record/text/plain": "61"},
             "metadata": {"scrapbook": {"name": "ch6_step", "mime_prefix": "application/papermill.record/"}}}
    (tmp_path / "book").mkdir()
    (tmp_path / "book" / "06_nanogpt.ipynb").write_text(json.dumps({"cells": [_code(outputs=[glued])]}))
    roles = check.GLUE_ROLE.findall("at {glue:text}`06_nanogpt.ipynb::ch6_step` and {glue:text}`06_nanogpt::ch6_x:.2f`"
                                    " and {glue:text}`07_gpt2_fp8.ipynb::ch7_y` and {glue:text}`own:.1f`")
    assert roles == ["06_nanogpt.ipynb::ch6_step", "06_nanogpt::ch6_x", "07_gpt2_fp8.ipynb::ch7_y", "own"]
    missing = check.glue_missing("book/intro", {"cells": []}, roles)
    assert missing == ["06_nanogpt::ch6_x", "07_gpt2_fp8.ipynb::ch7_y", "own"]


def test_the_animation_works_offline_at_the_page_width():
    pytest.importorskip("IPython")
    html = widgets.animate(lambda ax, man_bits: ax.plot([0, 1], [0, man_bits]), "man_bits", [2, 3],
                           figsize=(6.0, 3.0)).data
    assert "font-awesome" not in html and not re.search(r"<link[^>]+https?://", html)
    assert 'class="fa' not in html and "\u25b6" in html            # the play button is a character
    assert re.search(r'<img id="_anim_img\w+" style="width: 100%; max-width: 600px; height: auto;">', html)
    frames = re.findall(r'frames\[\d+\] = "data:image/png;base64,([^"]+)"', html)
    assert len(frames) == 2
    png = base64.b64decode(re.sub(r"[^A-Za-z0-9+/=]", "", frames[0]))
    width = struct.unpack(">I", png[16:20])[0]                     # the PNG header's width
    assert width >= 2 * 560, width                                 # twice the pixels of 6 inches at 100 dpi
    assert _check_book().page_problems("book/x", {"cells": [_code(outputs=[_html(html)])]}) == []


def test_offline_animation_html_rejects_an_unknown_icon():
    with pytest.raises(KeyError):
        widgets.offline_animation_html('<i class="fa fa-rocket"></i>', 700)


def test_interact_shows_its_box_once(monkeypatch):
    pytest.importorskip("ipywidgets")
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda *objs, **kw: shown.extend(objs))
    result = widgets.interact(lambda ax, man_bits: ax.plot([0, man_bits]), man_bits=widgets.mantissa_slider(3))
    assert result is None and len(shown) == 1


def test_glue_from_another_notebook_needs_a_format(tmp_path, monkeypatch, capsys):
    """myst-nb 1.4 splits ``path::key`` at its last ':' when no format follows (key 'path:')."""
    check = _check_book()
    monkeypatch.setattr(check, "toc_pages", lambda: (["book/intro"], []))
    monkeypatch.setattr(check, "load", lambda page: (".ipynb", {"cells": [
        _md("at {glue:text}`06_nanogpt.ipynb::ch6_claim` and {glue:text}`06_nanogpt.ipynb::ch6_step:d`")]}))
    monkeypatch.setattr(check, "check_readme", lambda problems: {"chars": 0, "snippet_lines": 0})
    monkeypatch.setattr(check, "glue_missing", lambda page, nb, roles: [])
    assert check.main() == 1
    report = capsys.readouterr().out
    assert "06_nanogpt.ipynb::ch6_claim` names another notebook without a format" in report
    assert "ch6_step" not in report.split("problem(s):")[1]
