"""Numbers for the prose: :func:`glue` records a value a page quotes with the ``{glue:text}`name``` role, as
``myst_nb.glue`` does but without myst-nb (a reader's kernel needs only IPython), e.g. ``glue("ch2_steps", 61)``."""

from __future__ import annotations

from typing import Any

__all__ = ["glue", "GLUE_PREFIX"]

GLUE_PREFIX = "application/papermill.record/"


def glue(name: str, value: Any, display: bool = False) -> None:
    """Record ``value`` under ``name`` for ``{glue:text}`name``` (and ``{glue}`name```). Numpy and
    torch scalars are stored as Python numbers, so ``{glue:text}`name:.3f``` applies; strings as
    they are (no quotes on the page). ``display=True`` also shows the value. A name other than
    letters, digits, ``_``, ``-`` and ``.`` (which the role could not find) raises ValueError."""
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
