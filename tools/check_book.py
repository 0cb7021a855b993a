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
GLUE_ROLE = re.compile(r"\{glue(?::text|:md|:math)?\}`([^`:]+)(?::[^`]*)?`")
GLUE_MIME = "application/papermill.record/"
MAKING = re.compile(r"\b(issues?|sessions?|pull requests?|commits? [0-9a-f]{7,40})\b", re.IGNORECASE)
HASH = re.compile(r"\b(?:commit|at|from)\s+`?[0-9a-f]{7,40}\b")
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
            row["glue roles"] = len(roles)
            missing = sorted(set(roles) - glued_keys(doc))
            if missing:
                problems.append(f"{page}: glue roles with no glued output in the stored notebook: {missing}")
        for m in MAKING.finditer(md):
            problems.append(f"{page}: speaks of how the project is made: {m.group(0)!r}")
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
