"""tools/stored_outputs.py: the check that the chapters' stored outputs are current fails on each
way they can be stale, and passes on a notebook whose fingerprint matches."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("stored_outputs", REPO / "tools" / "stored_outputs.py")
stored_outputs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stored_outputs)


def notebook(*cells, fingerprint=True, package="p" * 64):
    nb = {"cells": list(cells), "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    if fingerprint:
        nb["metadata"]["lowprec_demo"] = {"fingerprint": stored_outputs.fingerprint(nb, package)}
    return nb


def code(source, count, outputs=()):
    return {"cell_type": "code", "source": source, "execution_count": count, "metadata": {}, "outputs": list(outputs)}


def stream(text):
    return {"output_type": "stream", "name": "stdout", "text": text}


def write(tmp_path, nb):
    path = tmp_path / "chapter.ipynb"
    path.write_text(json.dumps(nb))
    return path


def test_current_notebook_passes(tmp_path):
    nb = notebook(code("print(1)", 1, [stream("1\n")]), code("x = 2", 2), {"cell_type": "markdown", "source": "# t"})
    assert stored_outputs.problems(write(tmp_path, nb), "p" * 64) == []


@pytest.mark.parametrize("change, expected", [
    ("package", "the package (lowprec_demo/) changed"),
    ("code", "its code cells changed"),
    ("unfingerprinted", "no fingerprint"),
    ("unexecuted", "not executed once each, in order"),
    ("out_of_order", "not executed once each, in order"),
    ("error", "stored an error"),
    ("absolute_path", "shows an absolute path"),
])
def test_each_kind_of_stale_output_is_found(tmp_path, change, expected):
    cells = [code("print(1)", 1, [stream("1\n")]), code("x = 2", 2)]
    nb = notebook(*cells, fingerprint=change != "unfingerprinted")
    package = "q" * 64 if change == "package" else "p" * 64
    if change == "code":
        nb["cells"][1]["source"] = "x = 3"
    elif change == "unexecuted":
        nb["cells"][1]["execution_count"] = None
    elif change == "out_of_order":
        nb["cells"][0]["execution_count"], nb["cells"][1]["execution_count"] = 2, 1
    elif change == "error":
        nb["cells"][1]["outputs"] = [{"output_type": "error", "ename": "AssertionError", "evalue": "", "traceback": []}]
    elif change == "absolute_path":
        nb["cells"][0]["outputs"] = [stream("data: tinyshakespeare.txt (/home/reader/shared/data/tinyshakespeare.txt)\n")]
    found = stored_outputs.problems(write(tmp_path, nb), package)
    assert any(expected in f for f in found), found


def test_relative_paths_and_urls_are_not_absolute_paths(tmp_path):
    text = "tinyshakespeare.txt from LOWPREC_DATA_DIR, see book/results/ and https://example.org/home/x and a/b/tmp/c"
    nb = notebook(code("print()", 1, [stream(text)]))
    assert stored_outputs.problems(write(tmp_path, nb), "p" * 64) == []


def test_code_digest_ignores_markdown_and_outputs():
    a = notebook(code("x = 1", 1, [stream("1")]), {"cell_type": "markdown", "source": "a"}, fingerprint=False)
    b = notebook(code("x = 1", 5), {"cell_type": "markdown", "source": "b"}, fingerprint=False)
    assert stored_outputs.code_digest(a) == stored_outputs.code_digest(b)
    b["cells"][0]["source"] = "x = 2"
    assert stored_outputs.code_digest(a) != stored_outputs.code_digest(b)
