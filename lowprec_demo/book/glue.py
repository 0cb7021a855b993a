"""Numbers for the book's prose: :func:`glue` records a value that a page's text quotes with
myst-nb's ``{glue:text}`name``` role, so the text is made from the cell's output and cannot
drift from it.

It writes the same output as ``myst_nb.glue`` (an ``application/papermill.record`` display
bundle), without importing myst-nb: a reader's kernel on Colab or Binder needs only IPython.

Example (in a chapter, with ``{glue:text}`ch2_steps`` in a markdown cell)::

    from lowprec_demo.book.glue import glue
    glue("ch2_steps", 61)
"""

from __future__ import annotations

from typing import Any

__all__ = ["glue", "GLUE_PREFIX"]

GLUE_PREFIX = "application/papermill.record/"


def glue(name: str, value: Any, display: bool = False) -> None:
    """Record ``value`` under ``name`` for ``{glue:text}`name``` (and ``{glue}`name```) in the
    page's markdown. Numpy and torch scalars are stored as Python numbers, so a format spec such
    as ``{glue:text}`name:.3f``` applies; strings are stored as they are (no quotes on the page).
    ``display=True`` also shows the value in the cell's output.

    Raises ``ValueError`` for a name that is not an identifier-like key (letters, digits, ``_``,
    ``-``, ``.``), which the role could not find."""
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_-." for c in name):
        raise ValueError(f"a glue name is letters, digits, '_', '-' or '.'; got {name!r}")
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    from IPython.core.formatters import format_display_data
    from IPython.display import display as ipy_display

    if isinstance(value, str):
        bundle, metadata = {"text/plain": value}, {}
    else:
        bundle, metadata = format_display_data(value)
    prefix = "" if display else GLUE_PREFIX
    metadata = dict(metadata, scrapbook={"name": name, "mime_prefix": prefix})
    ipy_display({prefix + k: v for k, v in bundle.items()}, raw=True, metadata=metadata)
