"""lowprec_demo.book.glue writes what myst-nb's {glue:text} role reads: a display bundle under
application/papermill.record/ with the key in its scrapbook metadata."""

import IPython.display
import numpy as np
import pytest
import torch

from lowprec_demo.book.glue import GLUE_PREFIX, glue


@pytest.fixture
def shown(monkeypatch):
    calls = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False, metadata=None: calls.append((obj, raw, metadata)))
    return calls


@pytest.mark.parametrize("value, text", [(61, "61"), (0.125, "0.125"), (np.float32(0.5), "0.5"),
                                         (torch.tensor(3), "3"), ("round to nearest", "round to nearest")])
def test_glue_records_the_value_as_plain_text_under_its_key(shown, value, text):
    glue("ch2_step", value)
    (bundle, raw, metadata), = shown
    assert raw and bundle == {GLUE_PREFIX + "text/plain": text}
    assert metadata["scrapbook"] == {"name": "ch2_step", "mime_prefix": GLUE_PREFIX}


def test_glue_with_display_shows_the_value_too(shown):
    glue("x", 2, display=True)
    assert shown[0][0] == {"text/plain": "2"} and shown[0][2]["scrapbook"]["mime_prefix"] == ""


@pytest.mark.parametrize("name", ["", "a b", "x`y", 3])
def test_a_name_the_role_cannot_find_is_refused(shown, name):
    with pytest.raises(ValueError, match="glue name"):
        glue(name, 1)
    assert not shown
