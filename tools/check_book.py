"""Check the shape of the book a reader gets, from _toc.yml and the stored notebooks.

    python tools/check_book.py            # a table per page, then every failed check; exit 1 on any

What it checks (the targets of a book a newcomer finishes in an evening):

* the numbered chapters and the introduction (the toc's root and its "Chapters" part): prose words
  (whitespace-separated tokens of the markdown cells) at most 2,000 per page and 12,000 in all;
  their "Time to learn" lines add up to at most two hours;
* no ``assert`` a reader sees, on any page of the toc: every code cell with an assert is tagged
  ``remove-cell`` or ``remove-input``;
* every ``{glue:text}`` / ``{glue}`` role names a key that the same notebook's stored outputs glue
  (so the prose's numbers come from the cells), and the numbered chapters use glue;
* "What's next": the introduction and each chapter link first to the next chapter of the toc;
* no page speaks of how the project is made (issues, sessions, pull requests, commits);
* what a reader sees on every page built from a notebook (:func:`page_problems`; an appendix may
  name the stored benchmark it reports): figures shown at
  most :data:`MAX_FIGURE_PX` CSS pixels wide (the output column of a 1,280-pixel window, so that a
  figure is not shrunk and its 10-point text reads at the body's small print) from PNGs of twice
  those pixels; animations that work offline (no stylesheet from a CDN) at the same width; a slider
  box shown once, never on the static site (where it looks live but redraws nothing: the cell that
  calls ``interact(`` is tagged ``remove-output``), and beside every one a version without a kernel
  (an animation); no environment variable in the prose, in a shown output or in code that is not
  collapsed (the setup cell is tagged ``hide-input``); no environment
  variable, no ``NBVAL_`` marker in a code cell a reader sees, no path into ``benchmarks/`` in the
  prose, no progress bar stored;
* exercises (:func:`exercises`): each numbered chapter ends with two or three, a markdown cell that
  starts "**Exercise N.**" each, each followed by its answer in a collapsed cell (a code cell
  tagged ``hide-cell``, or a markdown ``dropdown``);
* the README's first screen: at most 9,000 characters in all, a Python snippet of at most ten
  lines before the first section that is not about reading, links to Colab (chapter 2) and Binder,
  the two commands, no commit hashes.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

MAX_WORDS_CHAPTER = 2000
MAX_WORDS_TOTAL = 12000
MAX_MINUTES = 120
MAX_README_CHARS = 9000
HIDDEN = {"remove-cell", "remove-input"}
GLUE_ROLE = re.compile(r"\{glue(?::text|:md|:math)?\}`((?:[^`:]+::)?[^`:]+)(?::[^`]*)?`")
GLUE_MIME = "application/papermill.record/"
MAKING = re.compile(r"\b(issues?|sessions?|pull requests?|commits? [0-9a-f]{7,40})\b", re.IGNORECASE)
HASH = re.compile(r"\b(?:commit|at|from)\s+`?[0-9a-f]{7,40}\b")
MAX_FIGURE_PX = 700
EXERCISES = (2, 3)
ENV_VAR = re.compile(r"\b(?:LOWPREC|OMP|CUDA)_[A-Z_]+\b")
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
COLLAPSED = {"hide-cell", "hide-input", "hide-output"}
TIME_TO_LEARN = re.compile(r"Time to learn\**:?\**\s*:?\s*(?:about\s+)?(\d+)\s*(minutes?|min|hours?|h)\b", re.IGNORECASE)


def toc_pages() -> tuple[list[str], list[str]]:
    """(the introduction and numbered chapters, every other page), as paths without extension."""
    toc = yaml.safe_load((REPO / "_toc.yml").read_text())
    numbered, others = [toc["root"]], []
    for part in toc.get("parts", []):
        files = [c["file"] for c in part.get("chapters", [])]
        (numbered if part.get("caption") == "Chapters" else others).extend(files)
    return numbered, others


def source(cell) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def load(page: str):
    """(kind, notebook or text) of a toc entry."""
    for ext in (".ipynb", ".md"):
        path = REPO / f"{page}{ext}"
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            return (ext, json.loads(text) if ext == ".ipynb" else text)
    raise FileNotFoundError(f"_toc.yml names {page}, which has no .ipynb or .md file")


def markdown_of(kind, doc) -> str:
    if kind == ".md":
        return doc
    return "\n\n".join(source(c) for c in doc["cells"] if c["cell_type"] == "markdown")


def glued_keys(nb) -> set:
    keys = set()
    for cell in nb["cells"]:
        for out in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            if any(k.startswith(GLUE_MIME) for k in out.get("data", {})):
                name = out.get("metadata", {}).get("scrapbook", {}).get("name")
                if name:
                    keys.add(name)
    return keys


def glue_missing(page: str, nb, roles: list) -> list:
    """The glue roles of ``page`` whose key no stored output glues: ``key`` in ``nb`` itself,
    ``path::key`` in the notebook at ``path`` (relative to the page, as myst-nb resolves it)."""
    missing, own = [], glued_keys(nb)
    for role in roles:
        if "::" in role:
            path, key = role.split("::", 1)
            other = (REPO / page).parent / path
            if not other.suffix:
                other = other.with_suffix(".ipynb")
            if not other.is_file() or key not in glued_keys(json.loads(other.read_text(encoding="utf-8"))):
                missing.append(role)
        elif role not in own:
            missing.append(role)
    return sorted(set(missing))


def _tags(cell) -> set:
    return set(cell.get("metadata", {}).get("tags", []))


def _shown_outputs(cell):
    """The outputs a reader sees of a code cell (none where the cell or its output is removed)."""
    if cell["cell_type"] != "code" or _tags(cell) & {"remove-cell", "remove-output"}:
        return []
    return cell.get("outputs", [])


def _texts(out) -> list:
    if out.get("output_type") == "stream":
        return [source({"source": out.get("text", "")})]
    data = out.get("data", {})
    return [source({"source": v}) for k, v in data.items() if k in ("text/plain", "text/html", "text/markdown")
            and not k.startswith(GLUE_MIME)]


def page_problems(page: str, nb, evidence: bool = False) -> list:
    """What a reader should not meet on a page built from ``nb``: see the module's docstring. An
    evidence page (an appendix, ``evidence=True``) may name the stored benchmark it reports."""
    problems, widgets, animations = [], [], 0
    md = markdown_of(".ipynb", nb)
    for m in ENV_VAR.finditer(md):
        problems.append(f"{page}: the prose names the environment variable {m.group(0)}")
    bench = None if evidence else re.search(r"benchmarks/\S+", md)
    if bench:
        problems.append(f"{page}: the prose names a path into benchmarks/ ({bench.group(0)})")
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        if not _tags(cell) & {"remove-cell", "remove-input", "hide-input", "hide-cell"}:
            m = ENV_VAR.search(source(cell))
            if m:
                problems.append(f"{page}: cell {i} shows a reader the environment variable {m.group(0)} in its "
                                f"code (collapse the setup: tag it hide-input)")
        if not _tags(cell) & {"remove-cell", "remove-input"} and "NBVAL_" in source(cell):
            problems.append(f"{page}: cell {i} shows a reader an NBVAL_ marker (tag the cell remove-input)")
        shown = _shown_outputs(cell)
        n_widgets = sum(WIDGET_MIME in out.get("data", {}) for out in shown)
        if re.search(r"\binteract\(", source(cell)):
            widgets.append(i)
            if not _tags(cell) & {"remove-output", "remove-cell"}:
                problems.append(f"{page}: cell {i}'s sliders would show on the static site, where they look live but "
                                f"redraw nothing without a kernel: tag the cell remove-output (the animation beside "
                                f"it is the static version; the sliders work in Binder, Colab or a local kernel)")
        if n_widgets > 1:
            problems.append(f"{page}: cell {i} shows {n_widgets} slider boxes (one is meant)")
        for out in shown:
            texts = _texts(out)
            for text in texts:
                m = ENV_VAR.search(text)
                if m:
                    problems.append(f"{page}: cell {i}'s output names the environment variable {m.group(0)}")
                if re.search(r"\d+/\d+ \[\d+:\d+<", text):
                    problems.append(f"{page}: cell {i} stores a progress bar")
            html = source({"source": out.get("data", {}).get("text/html", "")})
            if "_anim_img" in html:
                animations += 1
                if re.search(r"<link[^>]+href=\"https?://", html):
                    problems.append(f"{page}: cell {i}'s animation loads a stylesheet from the network (blank offline)")
                width = re.search(r'id="_anim_img\w+" style="[^"]*max-width: (\d+)px', html)
                if not width or int(width.group(1)) > MAX_FIGURE_PX:
                    problems.append(f"{page}: cell {i}'s animation is not held to {MAX_FIGURE_PX} px "
                                    f"({'max-width ' + width.group(1) + ' px' if width else 'no max-width'})")
            if "image/png" in out.get("data", {}):
                meta = out.get("metadata", {}).get("image/png", {})
                if "width" not in meta:
                    problems.append(f"{page}: cell {i} shows a PNG of one pixel per CSS pixel (not retina: "
                                    f"use_book_style() sets it)")
                elif int(meta["width"]) > MAX_FIGURE_PX:
                    problems.append(f"{page}: cell {i} shows a figure {meta['width']} px wide, shrunk in the "
                                    f"{MAX_FIGURE_PX}-px column (at most {MAX_FIGURE_PX / 100:g} inches at 100 dpi)")
    if widgets and not animations:
        problems.append(f"{page}: sliders (cells {widgets}) and no version without a kernel (an animation)")
    return problems


def exercises(nb) -> tuple[int, list]:
    """(how many exercises, the numbers of those without a collapsed answer right after them):
    an exercise is a markdown cell that starts "**Exercise N.**"; its answer is the next cell,
    a code cell tagged hide-cell (or hide-input) or a markdown cell with a ``dropdown``."""
    found, unanswered = 0, []
    cells = nb["cells"]
    for i, cell in enumerate(cells):
        m = re.match(r"\s*\*\*Exercise (\d+)\.?\*\*", source(cell)) if cell["cell_type"] == "markdown" else None
        if not m:
            continue
        found += 1
        nxt = cells[i + 1] if i + 1 < len(cells) else None
        collapsed = nxt is not None and (
            (nxt["cell_type"] == "code" and _tags(nxt) & COLLAPSED)
            or (nxt["cell_type"] == "markdown" and re.search(r":class:\s*dropdown|\{dropdown\}", source(nxt))))
        if not collapsed:
            unanswered.append(int(m.group(1)))
    return found, unanswered


def visible_asserts(nb) -> list[int]:
    found = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        tags = set(cell.get("metadata", {}).get("tags", []))
        if not tags & HIDDEN and re.search(r"^\s*assert\b", source(cell), re.MULTILINE):
            found.append(i)
    return found


def minutes(markdown: str):
    m = TIME_TO_LEARN.search(markdown)
    if not m:
        return None
    n, unit = int(m.group(1)), m.group(2).lower()
    return n * 60 if unit.startswith("h") else n


def whats_next_first_link(markdown: str):
    m = re.search(r"^#+\s*What's next\s*$(.*?)(?=^#\s|\Z)", markdown, re.MULTILINE | re.DOTALL)
    if not m:
        return None
    link = re.search(r"\]\(([^)#\s]+)", m.group(1)) or re.search(r"\{doc\}`(?:[^`<]*<)?([^`>]+)>?`", m.group(1))
    return link.group(1) if link else ""


def check_readme(problems: list) -> dict:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    first = text.split("\n## ", 1)[0]
    snippet = re.search(r"```python\n(.*?)```", first, re.DOTALL)
    lines = [ln for ln in snippet.group(1).splitlines() if ln.strip()] if snippet else []
    if len(text) > MAX_README_CHARS:
        problems.append(f"README.md: {len(text):,} characters (at most {MAX_README_CHARS:,})")
    if not snippet:
        problems.append("README.md: no ```python snippet before its first section")
    elif len(lines) > 10:
        problems.append(f"README.md: the first snippet has {len(lines)} lines (at most 10)")
    for what, pattern in (("a Colab link to chapter 2", r"colab\.research\.google\.com/\S*02_freeze_rule"),
                          ("a Binder link", r"mybinder\.org"),
                          ("the two commands", r"setup_and_build\.sh[\s\S]*run_tests\.sh")):
        if not re.search(pattern, text):
            problems.append(f"README.md: no {what}")
    if HASH.search(text):
        problems.append(f"README.md: names a commit ({HASH.search(text).group(0)!r})")
    return {"chars": len(text), "snippet_lines": len(lines)}


def main() -> int:
    numbered, others = toc_pages()
    problems: list[str] = []
    rows = []
    total_words = total_minutes = 0
    for i, page in enumerate(numbered + others):
        kind, doc = load(page)
        md = markdown_of(kind, doc)
        words = len(md.split())
        is_numbered = page in numbered
        row = {"page": page, "words": words, "minutes": None, "glue roles": 0, "visible asserts": 0}
        if kind == ".ipynb":
            asserts = visible_asserts(doc)
            row["visible asserts"] = len(asserts)
            if asserts:
                problems.append(f"{page}: asserts a reader sees in cells {asserts} (tag them remove-cell or remove-input)")
            roles = GLUE_ROLE.findall(md)
            for m in re.finditer(r"\{glue(?::text)?\}`([^`:]+::[^`:]+)`", md):
                problems.append(f"{page}: the glue role {m.group(0)} names another notebook without a format: myst-nb "
                                f"reads its last ':' as one; write {m.group(1)}:s (text) or :d (a count)")
            row["glue roles"] = len(roles)
            missing = glue_missing(page, doc, roles)
            if missing:
                problems.append(f"{page}: glue roles with no glued output in the stored notebook: {missing}")
        for m in MAKING.finditer(md):
            problems.append(f"{page}: speaks of how the project is made: {m.group(0)!r}")
        if kind == ".ipynb":
            problems.extend(page_problems(page, doc, evidence=not is_numbered))
        if is_numbered and kind == ".ipynb":
            if page != numbered[0]:
                n, unanswered = exercises(doc)
                if not EXERCISES[0] <= n <= EXERCISES[1]:
                    problems.append(f"{page}: {n} exercises (two or three: markdown cells that start '**Exercise N.**')")
                if unanswered:
                    problems.append(f"{page}: exercises {unanswered} have no collapsed answer in the next cell")
        if is_numbered:
            total_words += words
            row["minutes"] = minutes(md)
            if row["minutes"] is None and page != numbered[0]:
                problems.append(f"{page}: no 'Time to learn' line")
            total_minutes += row["minutes"] or 0
            if words > MAX_WORDS_CHAPTER:
                problems.append(f"{page}: {words:,} words of prose (at most {MAX_WORDS_CHAPTER:,})")
            if kind == ".ipynb" and page != numbered[0] and not row["glue roles"]:
                problems.append(f"{page}: no number in the prose is glued from a cell")
            k = numbered.index(page)
            if k + 1 < len(numbered):
                nxt = Path(numbered[k + 1]).name
                link = whats_next_first_link(md)
                if link is None:
                    problems.append(f"{page}: no \"What's next\" section")
                elif Path(link).stem != nxt:
                    problems.append(f"{page}: \"What's next\" leads first to {link!r}, not to the next chapter {nxt}")
        rows.append(row)
    if total_words > MAX_WORDS_TOTAL:
        problems.append(f"the introduction and chapters: {total_words:,} words of prose (at most {MAX_WORDS_TOTAL:,})")
    if total_minutes > MAX_MINUTES:
        problems.append(f"the introduction and chapters: 'Time to learn' adds up to {total_minutes} min (at most {MAX_MINUTES})")
    readme = check_readme(problems)

    print(f"{'page':34} {'words':>6} {'learn':>6} {'glue':>5} {'asserts seen':>12}")
    for r in rows:
        learn = "" if r["minutes"] is None else f"{r['minutes']} min"
        print(f"{r['page']:34} {r['words']:>6,} {learn:>6} {r['glue roles']:>5} {r['visible asserts']:>12}")
    print(f"{'introduction and chapters':34} {total_words:>6,} {total_minutes:>4} min")
    print(f"README.md: {readme['chars']:,} characters, first snippet {readme['snippet_lines']} lines")
    if problems:
        print(f"\n{len(problems)} problem(s):")
        for p in problems:
            print(f"  - {p}")
        return 1
    print("\nall checks pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
