"""Compare a notebook cell's outputs as a reader sees them: the stored ones against a fresh execution.

Used by nbval's full mode for every chapter (``book/conftest.py``) and by ``tools/stored_outputs.py
execute``, which re-stores a chapter only where this comparison finds a difference.

What is compared, per cell, after streams are joined (``\\r`` and ``\\b`` applied, as on the page):

- every text a reader sees: ``stdout`` and ``stderr``, ``text/plain``, ``text/html``,
  ``text/markdown``, and each glued value (``{glue:text}`` in the prose), named by its glue key;
- numbers with a decimal point or an exponent within a relative tolerance,
  :data:`RELATIVE_TOLERANCE` (1e-6: the values a seed fixes print the same digits; a value printed
  to 16 digits may move in its last one), integers (counts, steps, sizes) and everything between
  the numbers exactly;
- figures: with ``images="drawn"`` (verification) that each stored figure is drawn again, in the
  same place; with ``images="bytes"`` (storing) that its PNG is byte for byte the same.

Masked before comparing (:data:`MASKS`): wall-clock timings ("in 90 s", tqdm's "[00:03<00:00,
1.2it/s]"), object addresses (``0x7f...``), the random ids of an animation's HTML, and a commit
hash after the word "commit". tqdm's progress bars (:func:`is_progress_bar`) are left out. Widget views (``application/vnd.jupyter.widget-view+json``) carry
random model ids only and are not compared; their ``text/plain`` is.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Iterable, Mapping

RELATIVE_TOLERANCE = 1e-6

GLUE_PREFIX = "application/papermill.record/"
IMAGE_TYPES = ("image/png", "image/jpeg", "image/svg+xml")
NOT_COMPARED = ("application/vnd.jupyter.widget-view+json",)

# (what it masks, pattern, replacement), applied in order to the stored and the computed text alike.
MASKS: tuple[tuple[str, re.Pattern, str], ...] = (
    ("base64 image data (a figure: compared as drawn)", re.compile(r"data:image/\w+;base64,[A-Za-z0-9+/=\\n]+"),
     "data:image;base64,<figure>"),
    ("tqdm's progress", re.compile(r"\d+%\|[^|\n]*\|\s*\d+/\d+\s*\[[^\]\n]*\]"), "<progress>"),
    ("a timing", re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:s|ms|µs|us|min|h)(?![\w/])"), "<time>"),
    ("an object address", re.compile(r"\b0x[0-9a-fA-F]{6,}\b"), "0x<address>"),
    ("a random id (animations, widgets)", re.compile(r"[0-9a-f]{32}"), "<id>"),
    ("a commit hash", re.compile(r"\b(commit:?\s+)[0-9a-f]{7,40}\b"), r"\1<commit>"),
)

_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+(?:,\d{3})+|\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?![\w.]*[A-Za-z_])"
                     r"|(?<![\w.])[-+]?(?:nan|inf)\b")
_FRAMES = MASKS[0][1]
_CARRIAGE_RETURN = re.compile(r"^.*\r(?=[^\n])", re.MULTILINE)
_BACKSPACE = re.compile("[^\n]\x08")


def is_progress_bar(output: Mapping) -> bool:
    """Whether an output is a tqdm progress bar (a widget view whose text is the bar): what it shows depends on when
    the page was stored (0 % or 100 %), so it is neither stored nor compared."""
    data = output.get("data") or {}
    text = data.get("text/plain", "")
    text = text if isinstance(text, str) else "".join(text)
    return NOT_COMPARED[0] in data and bool(text) and MASKS[1][1].sub("", text).strip(" :\n").count("\n") == 0 \
        and MASKS[1][1].search(text) is not None


def mask(text: str) -> str:
    """``text`` with what changes from run to run (:data:`MASKS`) replaced by placeholders."""
    for _, pattern, replacement in MASKS:
        text = pattern.sub(replacement, text)
    return text


def _text(value) -> str:
    return value if isinstance(value, str) else "".join(value) if isinstance(value, list) else str(value)


def _as_page(stream_text: str) -> str:
    """A stream as a terminal or the page shows it: backspaces and carriage returns applied."""
    previous = None
    while previous != stream_text:
        previous, stream_text = stream_text, _BACKSPACE.sub("", stream_text)
    return _CARRIAGE_RETURN.sub("", stream_text)


def seen_outputs(outputs: Iterable[Mapping]) -> dict[str, list[tuple[str, str]]]:
    """A cell's outputs as ``{what: [(label, value), ...]}``: ``what`` is a stream's name, a MIME type
    or ``glue``; ``label`` names the output for a message (a glue key); values keep their order within
    each ``what`` (across kinds, the order of stdout and a display depends on when streams flush)."""
    seen: dict[str, list[tuple[str, str]]] = {}
    streams: dict[str, str] = {}
    for output in outputs:
        kind = output.get("output_type")
        if kind == "stream":
            streams[output.get("name", "stdout")] = streams.get(output.get("name", "stdout"), "") + _text(output["text"])
        elif kind in ("display_data", "execute_result"):
            glue_name = (output.get("metadata") or {}).get("scrapbook", {}).get("name")
            for mime, value in (output.get("data") or {}).items():
                if mime in NOT_COMPARED:
                    continue
                if mime.startswith(GLUE_PREFIX):
                    seen.setdefault("glue", []).append((f"glue {glue_name!r} ({mime[len(GLUE_PREFIX):]})", _text(value)))
                else:
                    seen.setdefault(mime, []).append((mime, _text(value)))
        elif kind == "error":
            seen.setdefault("error", []).append(("error", f"{output.get('ename')}: {output.get('evalue')}"))
    for name, text in streams.items():
        seen.setdefault(name, []).append((name, _as_page(text)))
    return seen


def _numbers_equal(a: str, b: str, rel: float) -> bool:
    if not any(c in a + b for c in ".eEn"):   # integers (counts, steps, sizes): exactly
        return a == b
    x, y = float(a.replace(",", "")), float(b.replace(",", ""))
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    if math.isinf(x) or math.isinf(y):
        return x == y
    return abs(x - y) <= rel * max(abs(x), abs(y))


def _line_of(text: str, position: int) -> str:
    start = text.rfind("\n", 0, position) + 1
    end = text.find("\n", position)
    line = text[start:end if end >= 0 else len(text)]
    return line if len(line) <= 160 else line[:157] + "..."


def compare_text(stored: str, computed: str, rel: float = RELATIVE_TOLERANCE) -> str | None:
    """None when the two texts agree (masked, numbers within ``rel``), else what differs first: the
    stored and the computed line, and the numbers where they are what differs."""
    stored, computed = mask(stored), mask(computed)
    if stored == computed:
        return None
    a, b = list(_NUMBER.finditer(stored)), list(_NUMBER.finditer(computed))
    if _NUMBER.sub("#", stored) != _NUMBER.sub("#", computed) or len(a) != len(b):
        old_lines, new_lines = stored.splitlines(), computed.splitlines()
        for number, (x, y) in enumerate(zip(old_lines, new_lines)):
            if _NUMBER.sub("#", x) != _NUMBER.sub("#", y):
                break
        else:
            number, x, y = min(len(old_lines), len(new_lines)), "(no more lines)", "(no more lines)"
            x = old_lines[number] if number < len(old_lines) else x
            y = new_lines[number] if number < len(new_lines) else y
        clip = lambda line: line if len(line) <= 160 else line[:157] + "..."
        return f"the text differs at line {number + 1}:\n      stored:   {clip(x)!r}\n      computed: {clip(y)!r}"
    for x, y in zip(a, b):
        if not _numbers_equal(x.group(), y.group(), rel):
            return (f"stored {x.group()}, computed {y.group()} (relative tolerance {rel:g}) in:\n"
                    f"      stored:   {_line_of(stored, x.start())!r}\n      computed: {_line_of(computed, y.start())!r}")
    return None


def _matching_subsequence(stored: list, computed: list, rel: float) -> list:
    """The computed items that match the stored ones in order (greedily); unmatched stored items are
    paired with what is left, so that the comparison below reports them."""
    chosen, rest = [], list(computed)
    for label, value in stored:
        for index, (label_b, value_b) in enumerate(rest):
            if label_b == label and (label in IMAGE_TYPES or compare_text(value, value_b, rel) is None):
                chosen.append(rest.pop(index))
                rest = rest[index:]
                break
        else:
            if rest:
                chosen.append(rest.pop(0))
    return chosen


def _image_digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:12]


def compare_outputs(stored: Iterable[Mapping], computed: Iterable[Mapping], images: str = "drawn",
                    rel: float = RELATIVE_TOLERANCE) -> list[str]:
    """What differs between a cell's stored and computed outputs, one sentence each; [] when they agree.
    ``images``: "drawn" (each stored figure drawn again) or "bytes" (the same bytes)."""
    if images not in ("drawn", "bytes"):
        raise ValueError(f"images is 'drawn' or 'bytes', not {images!r}")
    stored, computed = ([o for o in outputs if not is_progress_bar(o)] for outputs in (stored, computed))
    old, new = seen_outputs(stored), seen_outputs(computed)
    differences = []
    widget = any(NOT_COMPARED[0] in (output.get("data") or {}) for output in stored)
    for what in sorted(set(old) | set(new)):
        a, b = old.get(what, []), new.get(what, [])
        if widget:
            # nbval does not apply a widget's clear_output, so the displays captured by an
            # interactive widget arrive as extra outputs: each stored one must be among them, in order
            b = _matching_subsequence(a, b, rel)
        if len(a) != len(b):
            labels = lambda items: ", ".join(label for label, _ in items) or "none"
            differences.append(f"{what}: {len(a)} stored output(s) [{labels(a)}], {len(b)} computed [{labels(b)}]")
            continue
        for (label, x), (label_b, y) in zip(a, b):
            if label != label_b:
                differences.append(f"{what}: stored {label}, computed {label_b}")
            elif what in IMAGE_TYPES:
                if images == "bytes" and x != y:
                    differences.append(f"{label}: the figure changed (sha256 {_image_digest(x)} -> {_image_digest(y)})")
            else:
                if images == "bytes" and _FRAMES.findall(x) != _FRAMES.findall(y):
                    differences.append(f"{label}: the animation's frames changed")   # masked below
                found = compare_text(x, y, rel)
                if found:
                    differences.append(f"{label}: {found}")
    return differences
