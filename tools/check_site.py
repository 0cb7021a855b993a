#!/usr/bin/env python3
r"""Browser check of the built book (_build/html) in headless Chromium.

    python tools/check_site.py [--html _build/html] [--screenshots _build/screenshots]

The site is served from 127.0.0.1 (a free port, http.server in a thread) and every HTML page is
opened in headless Chromium driven by Playwright. For each page the check collects

* console errors and uncaught exceptions that are ours (the rule is below);
* failed requests to the book's own server (a 404 for a script, stylesheet, image, font...);
* broken images: an <img> served by the book whose naturalWidth is 0 once loading is over (an
  SVG without intrinsic size also reports 0, so an SVG passes when the browser can decode it);
* broken internal links: every same-site href (<a> and <link>) must name an existing file and,
  when it has a #fragment, an element with that id (or an <a name=...>) in the target page;
* launch buttons: every chapter page (a page built from a notebook) must carry a Binder and a
  Colab link that point at the repository URL and branch of _config.yml and at that chapter's
  notebook, which must exist in the repository; any other Binder or Colab link must point at the
  same repository and branch;
* code and printouts: no <pre> of the article is wider than its box (each wraps at the column's
  edge, _static/outputs.css), so no line is cut off out of sight;
* math (see "Math" below): once MathJax has finished, every math element of the page must hold
  MathJax's output, no formula may show a MathJax error, no raw LaTeX delimiter may be left in the
  page's text, and MathJax must be served by the book itself;

and writes a PNG screenshot of the page into the screenshots folder. It exits 1 with a readable
report when any page fails, 0 otherwise; report.json in the screenshots folder has the details.

Which console errors are ours
-----------------------------
The book theme and myst-nb load some scripts from CDNs: require.js (cdnjs.cloudflare.com) and the
Jupyter widgets manager (cdn.jsdelivr.net or unpkg.com) on pages with widgets, thebe (unpkg.com)
when enabled; MathJax too (cdn.jsdelivr.net) unless, as in this book, sphinx-mathjax-offline serves
it from _static/mathjax/. CI has no internet, and a check must give the same answer with and
without one, so this check blocks every request that leaves 127.0.0.1 and never judges a
third-party host. Hence:

1. Not ours (listed in the report, never a failure): a console error about a resource on another
   origin (the "Failed to load resource" error of a blocked CDN request has that resource's URL
   as its location), and an error or uncaught exception whose location or stack is a script
   served from another origin.
2. Ours (a failure): every other console error and uncaught exception. That covers errors from the
   pages' inline scripts and from the files under _static/ (our theme and extension assets), and a
   failed load of anything served by the book itself.
3. The one exception to 2 is KNOWN_CDN_CONSEQUENCES below: an error raised by our own page only
   because a blocked CDN script is absent. Each entry names the CDN script it stands for. It starts
   empty: add an entry only after seeing the error disappear when the CDN is reachable.

An <img> whose source is on another origin is blocked too, so it cannot be judged: it is listed as
"unchecked external image", not as broken. Content of ours should not depend on the network.

Math
----
Formulas must render for a reader without a network, so they are judged with every other origin
blocked. Sphinx writes a formula as an element of class "math" (inline `<span class="math">\(...\)
</span>`, display `<div class="math">\[...\]</div>`) and MathJax 3 replaces its text by an
<mjx-container>. After MathJax's first typesetting is over (MathJax.startup.promise, at most
MATHJAX_TIMEOUT_MS), the page's DOM is read back and scanned in Python (scan_math, which the tests
run on small HTML strings):

* a math element without an <mjx-container> inside is a formula that was not rendered;
* an <mjx-merror> is a formula MathJax could not parse;
* raw LaTeX in the text a reader sees, outside <pre>, <code>, <script> and the like: `\(`, `\[`,
  `$$`, an inline `$...$` (a `$` followed by a non-space, up to a `$` after a non-space that no
  digit follows, within one block of text: the dollarmath rule, so "$5 and $6" is not math), or
  half of one that a table cell cut off (`$\lfloor ...` or `... \rfloor$`);
* a <script> whose source names MathJax or KaTeX on another origin: the formulas would need the
  network (reported even if the page has no formula).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import re
import sys
import threading
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import parse_qs, unquote, urldefrag, urlsplit

REPO_ROOT = Path(__file__).resolve().parents[1]

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# (regular expression on the console text, the blocked CDN script it is a consequence of).
KNOWN_CDN_CONSEQUENCES: list[tuple[str, str]] = []

# A bare "#" is how the theme writes buttons, not a link to an anchor.
IGNORED_FRAGMENTS = {""}

# How long a page may take to typeset its formulas once it has loaded.
MATHJAX_TIMEOUT_MS = 30_000


# --------------------------------------------------------------------------------------------
# Configuration of the book: repository, branch and launch-button services from _config.yml.


@dataclass
class LaunchConfig:
    repo_url: str
    org: str
    repo: str
    branch: str
    path_to_book: str
    binderhub_url: str
    colab_url: str


def read_launch_config(config_path: Path) -> LaunchConfig:
    import yaml

    config = yaml.safe_load(config_path.read_text())
    repository = config.get("repository") or {}
    launch = config.get("launch_buttons") or {}
    repo_url = str(repository.get("url", "")).rstrip("/")
    parts = urlsplit(repo_url)
    segments = [s for s in parts.path.split("/") if s]
    if parts.netloc != "github.com" or len(segments) != 2:
        raise SystemExit(f"{config_path}: repository.url {repo_url!r} is not https://github.com/ORG/REPO")
    org, repo = segments[0], segments[1].removesuffix(".git")
    return LaunchConfig(
        repo_url=repo_url,
        org=org,
        repo=repo,
        branch=str(repository.get("branch", "main")),
        path_to_book=str(repository.get("path_to_book", "") or "").strip("/"),
        binderhub_url=str(launch.get("binderhub_url", "") or "").rstrip("/"),
        colab_url=str(launch.get("colab_url", "") or "").rstrip("/"),
    )


# --------------------------------------------------------------------------------------------
# Static facts about the built site: which pages exist, which ids each page has.


class _IdCollector(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value is not None and (name == "id" or (tag == "a" and name == "name")):
                self.ids.add(value)


@functools.cache
def ids_in(path: Path) -> frozenset:
    collector = _IdCollector()
    collector.feed(path.read_text(encoding="utf-8", errors="replace"))
    return frozenset(collector.ids)


def html_pages(html_dir: Path) -> list[Path]:
    skip = {"_static", "_sources", "_images"}
    return sorted(p for p in html_dir.rglob("*.html") if not (set(p.relative_to(html_dir).parts[:-1]) & skip))


def file_for_url_path(html_dir: Path, url_path: str) -> Path:
    relative = unquote(url_path).lstrip("/")
    target = html_dir / relative
    if relative == "" or url_path.endswith("/") or target.is_dir():
        target = target / "index.html"
    return target


# --------------------------------------------------------------------------------------------
# Math: every formula typeset, no raw LaTeX left in the text (see "Math" in the docstring).

# Elements whose text a reader does not see as prose: code, scripts, and MathJax's own output
# (whose assistive MathML repeats the formula).
MATH_SKIP_TAGS = {
    "head", "pre", "code", "kbd", "samp", "tt", "script", "style", "textarea", "noscript", "template",
    "mjx-container", "math", "svg",
}
# Elements that end a run of text, so that an inline `$` never pairs with one in another block.
MATH_BLOCK_TAGS = {
    "address", "article", "aside", "blockquote", "br", "caption", "dd", "details", "dialog", "div", "dl",
    "dt", "fieldset", "figcaption", "figure", "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6",
    "header", "hr", "li", "main", "nav", "ol", "p", "section", "summary", "table", "tbody", "td",
    "tfoot", "th", "thead", "tr", "ul", "button", "label", "option", "select",
}
VOID_TAGS = {
    "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source",
    "track", "wbr",
}
RAW_LATEX = re.compile(
    r"\\\(|\\\["  # \( \[
    r"|\$\$(?:[^$]{0,300}?\$\$)?"  # $$ ... $$
    r"|(?<![\\$])\$(?=[^\s$])[^$\n]{0,300}?(?<=[^\s\\$])\$(?![\d$])"  # $x$ (dollarmath: no digit after)
    r"|(?<![\\$])\$\\[A-Za-z]|\\[A-Za-z]+\$"  # half a formula: $\lfloor ... or ... \rfloor$
)


def raw_latex_in_text(text: str) -> list[str]:
    """The raw LaTeX delimiters in one run of text a reader sees, each with a little context."""
    found = []
    for match in RAW_LATEX.finditer(text):
        start, end = max(0, match.start() - 30), min(len(text), match.end() + 30)
        found.append(" ".join(text[start:end].split()))
    return found


@dataclass
class MathScan:
    math_elements: int = 0  # elements of class "math"
    rendered: int = 0  # of those, the ones that hold MathJax output
    unrendered: list[str] = field(default_factory=list)  # the text of each one that does not
    errors: list[str] = field(default_factory=list)  # MathJax's messages for formulas it could not parse
    raw: list[str] = field(default_factory=list)  # raw LaTeX in the visible text, with context
    scripts: list[str] = field(default_factory=list)  # sources of MathJax or KaTeX scripts


class _MathScanner(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.scan = MathScan()
        self.stack: list[tuple[str, bool, bool]] = []  # (tag, skips text, is a math element)
        self.skip_depth = 0
        self.math_open: list[dict] = []  # math elements open now: {"text": [...], "rendered": bool}
        self.runs: list[list[str]] = [[]]
        self.error_open: list[str] = []  # the messages of the <mjx-merror> elements open now
        self.error_text: list[str] = []

    def _break(self) -> None:
        if self.runs[-1]:
            self.runs.append([])

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script" and attrs.get("src") and re.search(r"mathjax|katex", attrs["src"], re.I):
            self.scan.scripts.append(attrs["src"])
        if tag in MATH_BLOCK_TAGS:
            self._break()
        if tag == "mjx-container":
            for open_math in self.math_open:
                open_math["rendered"] = True
        if tag == "mjx-merror":
            self.error_open.append(attrs.get("data-mjx-error") or "")
        if tag in VOID_TAGS:
            return
        classes = (attrs.get("class") or "").split()
        is_math = "math" in classes and tag in ("span", "div")
        skips = tag in MATH_SKIP_TAGS
        if is_math:
            self.scan.math_elements += 1
            self.math_open.append({"text": [], "rendered": False})
        if skips:
            self.skip_depth += 1
        self.stack.append((tag, skips, is_math))

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in VOID_TAGS:
            self.handle_endtag(tag)

    def handle_endtag(self, tag):
        if tag in MATH_BLOCK_TAGS:
            self._break()
        if tag == "mjx-merror" and self.error_open:
            message = self.error_open.pop()
            if not self.error_open:
                text = " ".join("".join(self.error_text).split())
                self.scan.errors.append(message or text or "(no message)")
                self.error_text = []
        if tag in VOID_TAGS or not any(t == tag for t, _, _ in self.stack):
            return  # a stray end tag
        while self.stack:
            open_tag, skips, is_math = self.stack.pop()
            if skips:
                self.skip_depth -= 1
            if is_math:
                element = self.math_open.pop()
                if element["rendered"]:
                    self.scan.rendered += 1
                else:
                    self.scan.unrendered.append(" ".join("".join(element["text"]).split())[:120])
            if open_tag == tag:
                break

    def handle_data(self, data):
        if self.error_open:
            self.error_text.append(data)
        for open_math in self.math_open:
            open_math["text"].append(data)
        if not self.skip_depth:
            self.runs[-1].append(data)

    def close(self):
        super().close()
        while self.stack:  # elements left open at the end of the document
            self.handle_endtag(self.stack[-1][0])
        for run in self.runs:
            self.scan.raw += raw_latex_in_text("".join(run))


def scan_math(html: str) -> MathScan:
    """Scan a page's HTML (as the browser holds it after typesetting) for its formulas."""
    scanner = _MathScanner()
    scanner.feed(html)
    scanner.close()
    return scanner.scan


def math_failures(html: str, origin: str = "") -> list[str]:
    """The failures that scan_math finds in a page: an empty list when every formula rendered."""
    scan = scan_math(html)
    failures = []
    if scan.unrendered:
        failures.append(
            f"{len(scan.unrendered)} of {scan.math_elements} formulas not rendered by MathJax, e.g. "
            + "; ".join(f"'{t}'" for t in scan.unrendered[:3])
        )
    for message in scan.errors[:5]:
        failures.append(f"MathJax could not typeset a formula: {message}")
    if scan.raw:
        failures.append(
            f"raw LaTeX in the page's text ({len(scan.raw)}x), e.g. " + "; ".join(f"'{t}'" for t in scan.raw[:3])
        )
    for src in scan.scripts:
        if re.match(r"(https?:)?//", src) and not (origin and is_ours(src, origin)):
            failures.append(f"MathJax/KaTeX is loaded from another origin ({src}): formulas need the network")
    return failures


# --------------------------------------------------------------------------------------------
# Serving the site.


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


def serve(html_dir: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_QuietHandler, directory=str(html_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


# --------------------------------------------------------------------------------------------
# Checking one page.


@dataclass
class PageResult:
    page: str
    failures: list[str] = field(default_factory=list)
    external_errors: list[str] = field(default_factory=list)
    unchecked_images: list[str] = field(default_factory=list)
    screenshot: str = ""
    math_elements: int = 0  # formulas on the page (elements of class "math")
    math_rendered: int = 0  # of those, the ones MathJax rendered

    @property
    def ok(self) -> bool:
        return not self.failures


def is_ours(url: str, origin: str) -> bool:
    """True for a URL served by the book's own server (or a URL with no origin, such as inline)."""
    if not url or url.startswith(("data:", "blob:", "about:")):
        return True
    return url.startswith(origin + "/") or url == origin


def classify_console(text: str, location_url: str, origin: str) -> str:
    """'external', 'known-cdn' or 'ours' for a console error (see the module docstring)."""
    if location_url and not is_ours(location_url, origin):
        return "external"
    for pattern, _cdn in KNOWN_CDN_CONSEQUENCES:
        if re.search(pattern, text):
            return "known-cdn"
    return "ours"


def stack_is_external(stack: str, origin: str) -> bool:
    """True when the first frame of a JavaScript stack with a URL is on another origin."""
    for url in re.findall(r"(?:https?|file)://[^\s)]+", stack or ""):
        return not is_ours(url, origin)
    return False


def check_launch_links(
    result: PageResult, hrefs: list[str], page_rel: str, is_chapter: bool, config: LaunchConfig, repo_root: Path
) -> None:
    binder_host = urlsplit(config.binderhub_url).netloc
    colab_host = urlsplit(config.colab_url).netloc
    stem = page_rel[: -len(".html")]
    prefix = f"{config.path_to_book}/" if config.path_to_book else ""
    notebook = f"{prefix}{stem}.ipynb"
    binder_links = [h for h in hrefs if binder_host and urlsplit(h).netloc == binder_host]
    colab_links = [h for h in hrefs if colab_host and urlsplit(h).netloc == colab_host]

    for href in binder_links:
        parts = urlsplit(href)
        segments = [s for s in parts.path.split("/") if s]
        want = ["v2", "gh", config.org, config.repo, config.branch]
        if segments != want:
            result.failures.append(
                f"Binder link {href} does not point at {'/'.join(want)} (repository and branch of _config.yml)"
            )
            continue
        urlpath = parse_qs(parts.query).get("urlpath", [""])[0]
        if urlpath:
            path = re.sub(r"^(lab/tree|tree|lab|notebooks)/", "", urlpath)
            if not (repo_root / path).is_file():
                result.failures.append(f"Binder link {href} opens {path}, which is not in the repository")
            elif is_chapter and path != notebook:
                result.failures.append(f"Binder link {href} opens {path}, not this chapter's {notebook}")
    for href in colab_links:
        parts = urlsplit(href)
        want = f"/github/{config.org}/{config.repo}/blob/{config.branch}/"
        if not parts.path.startswith(want):
            result.failures.append(f"Colab link {href} does not start with {config.colab_url}{want}")
            continue
        path = parts.path[len(want) :]
        if not (repo_root / path).is_file():
            result.failures.append(f"Colab link {href} opens {path}, which is not in the repository")
        elif is_chapter and path != notebook:
            result.failures.append(f"Colab link {href} opens {path}, not this chapter's {notebook}")

    if is_chapter:
        if config.binderhub_url and not binder_links:
            result.failures.append(f"chapter page has no Binder launch link ({config.binderhub_url})")
        if config.colab_url and not colab_links:
            result.failures.append(f"chapter page has no Colab launch link ({config.colab_url})")
        if not (repo_root / notebook).is_file():
            result.failures.append(f"the chapter's notebook {notebook} is not in the repository")


def check_links(
    result: PageResult, links: list[dict], page_url: str, origin: str, html_dir: Path, live_ids: set
) -> None:
    seen = set()
    for link in links:
        href = link["href"]
        if not href or href in seen or not is_ours(href, origin) or href.startswith(("data:", "blob:", "about:")):
            continue
        seen.add(href)
        url, fragment = urldefrag(href)
        fragment = unquote(fragment)
        target = file_for_url_path(html_dir, urlsplit(url).path)
        if not target.is_file():
            result.failures.append(f"broken link {link['raw']!r}: {target.relative_to(html_dir)} does not exist")
            continue
        if fragment in IGNORED_FRAGMENTS:
            continue
        same_page = urldefrag(page_url)[0] == url
        ids = live_ids if same_page else ids_in(target)
        if fragment not in ids:
            result.failures.append(
                f"broken anchor {link['raw']!r}: no id {fragment!r} in {target.relative_to(html_dir)}"
            )


IMAGE_STATE_JS = """
async () => {
  const images = Array.from(document.images);
  await Promise.all(images.map(img => {
    img.loading = "eager";
    if (img.complete) return null;
    return new Promise(resolve => {
      img.addEventListener("load", resolve, {once: true});
      img.addEventListener("error", resolve, {once: true});
      setTimeout(resolve, 10000);
    });
  }));
  const out = [];
  for (const img of images) {
    let decodes = false;
    try { await img.decode(); decodes = true; } catch (e) { decodes = false; }
    out.push({src: img.currentSrc || img.src, raw: img.getAttribute("src"), width: img.naturalWidth,
              decodes: decodes});
  }
  return out;
}
"""

LINKS_JS = """
() => Array.from(document.querySelectorAll("a[href], link[href]"))
  .filter(el => !(el.tagName === "LINK" && ["preconnect", "dns-prefetch"].includes(el.rel)))
  .map(el => ({href: el.href, raw: el.getAttribute("href")}))
"""

# Waits for MathJax's first typesetting (when MathJax is there at all) and hands back the DOM.
MATH_DOM_JS = """
async (timeoutMs) => {
  const mj = window.MathJax;
  let state = "no MathJax";
  if (mj && mj.startup && mj.startup.promise) {
    state = await Promise.race([
      mj.startup.promise.then(() => "typeset", e => "failed: " + e),
      new Promise(resolve => setTimeout(() => resolve("timeout"), timeoutMs)),
    ]);
  }
  return {state: state, html: document.documentElement.outerHTML};
}
"""

IDS_JS = """
() => Array.from(document.querySelectorAll("[id], a[name]")).map(el => el.id || el.getAttribute("name"))
"""


def check_page(
    context,
    page_path: Path,
    html_dir: Path,
    origin: str,
    config: LaunchConfig,
    repo_root: Path,
    shots: Path,
    full_page: bool,
) -> PageResult:
    rel = page_path.relative_to(html_dir).as_posix()
    result = PageResult(page=rel)
    page = context.new_page()
    console: list[tuple[str, str]] = []
    page_errors: list[tuple[str, str]] = []
    bad_responses: list[str] = []
    failed_requests: list[str] = []

    page.on(
        "console",
        lambda msg: console.append((msg.text, (msg.location or {}).get("url", ""))) if msg.type == "error" else None,
    )
    page.on("pageerror", lambda exc: page_errors.append((str(exc), getattr(exc, "stack", "") or "")))
    page.on(
        "response",
        lambda r: (
            bad_responses.append(f"HTTP {r.status} for {r.url}") if r.status >= 400 and is_ours(r.url, origin) else None
        ),
    )
    page.on(
        "requestfailed",
        lambda r: failed_requests.append(f"{r.failure} for {r.url}") if is_ours(r.url, origin) else None,
    )

    url = f"{origin}/{rel}"
    try:
        page.goto(url, wait_until="load", timeout=60_000)
        images, links, live_ids = [], [], set()
        for _ in range(20):
            # late errors from deferred scripts; and a page that sends the browser on (the
            # site's index.html, by a meta refresh) is read once the page it leads to has
            # loaded and the address stays put, so that links and ids come from one document
            final_url = page.url
            page.wait_for_timeout(300)
            page.wait_for_load_state("load", timeout=60_000)
            try:
                images = page.evaluate(IMAGE_STATE_JS)
                links = page.evaluate(LINKS_JS)
                live_ids = set(page.evaluate(IDS_JS))
            except Exception as exc:  # the page went on while it was read: read the next one
                if "context was destroyed" not in str(exc) and "navigat" not in str(exc):
                    raise
                continue
            if page.url == final_url:
                break
        else:
            result.failures.append(f"the page kept moving on (last at {page.url})")
        math = page.evaluate(MATH_DOM_JS, MATHJAX_TIMEOUT_MS)  # before the screenshot: it shows the formulas
        shot = shots / (rel.replace("/", "__").removesuffix(".html") + ".png")
        page.screenshot(path=str(shot), full_page=full_page)
        result.screenshot = str(shot)
    except Exception as exc:  # a page that cannot be opened is a failure, and the run goes on
        result.failures.append(f"could not load the page: {exc}")
        page.close()
        return result

    for text, location in console:
        kind = classify_console(text, location, origin)
        if kind == "ours":
            result.failures.append(f"console error: {text}" + (f" (at {location})" if location else ""))
        else:
            result.external_errors.append(f"[{kind}] {text}" + (f" (at {location})" if location else ""))
    for text, stack in page_errors:
        if stack_is_external(stack, origin):
            result.external_errors.append(f"[external] uncaught: {text}")
        else:
            result.failures.append(f"uncaught exception: {text}\n{stack}".rstrip())
    result.failures += [f"request failed: {x}" for x in failed_requests]
    result.failures += [f"request answered with an error: {x}" for x in bad_responses]

    for img in images:
        if not is_ours(img["src"], origin):
            result.unchecked_images.append(img["src"])
        elif img["width"] == 0 and not (img["src"].endswith(".svg") and img["decodes"]):
            result.failures.append(f"broken image {img['raw']!r} (naturalWidth 0)")

    if math["state"] == "timeout":
        result.failures.append(f"MathJax did not finish typesetting within {MATHJAX_TIMEOUT_MS / 1000:g} s")
    elif math["state"].startswith("failed"):
        result.failures.append(f"MathJax {math['state']}")
    result.failures += math_failures(math["html"], origin)
    scan = scan_math(math["html"])
    result.math_elements, result.math_rendered = scan.math_elements, scan.rendered

    # Code and printouts wrap at the column's edge (_static/outputs.css): none runs off it, hidden.
    cut = page.evaluate("""() => [...document.querySelectorAll('.bd-article pre')]
        .filter(p => p.scrollWidth > p.clientWidth + 1).map(p => p.textContent.trim().split('\\n')[0].slice(0, 60))""")
    result.failures += [f"code or a printout runs off the column's edge (it starts {first!r})" for first in cut]

    check_links(result, links, final_url, origin, html_dir, live_ids)
    is_chapter = (html_dir / "_sources" / (rel.removesuffix(".html") + ".ipynb")).is_file()
    check_launch_links(result, [link["href"] for link in links], rel, is_chapter, config, repo_root)
    page.close()
    return result


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--html", type=Path, default=REPO_ROOT / "_build" / "html", help="built site (default _build/html)"
    )
    parser.add_argument("--screenshots", type=Path, default=REPO_ROOT / "_build" / "screenshots", help="where PNGs go")
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "_config.yml", help="the book's _config.yml")
    parser.add_argument("--chromium", default="/usr/bin/chromium", help="Chromium executable")
    parser.add_argument("--full-page", action="store_true", help="screenshot the whole page, not the first screen")
    parser.add_argument("--only", nargs="*", default=None, help="check only these pages (paths relative to --html)")
    args = parser.parse_args(argv)

    from playwright.sync_api import sync_playwright

    html_dir = args.html.resolve()
    if not (html_dir / "index.html").is_file():
        print(f"check_site: no built site at {html_dir} (run jupyter-book build . first)")
        return 2
    config = read_launch_config(args.config)
    repo_root = args.config.resolve().parent  # notebooks named by launch links must exist here
    pages = html_pages(html_dir)
    if args.only:
        pages = [html_dir / p for p in args.only]
    args.screenshots.mkdir(parents=True, exist_ok=True)
    for old in args.screenshots.glob("*.png"):
        old.unlink()

    server, origin = serve(html_dir)
    blocked: dict[str, int] = {}

    def route(route_request):
        request_url = route_request.request.url
        if is_ours(request_url, origin):
            route_request.continue_()
        else:
            host = urlsplit(request_url).netloc or request_url.split(":", 1)[0]
            blocked[host] = blocked.get(host, 0) + 1
            route_request.abort("blockedbyclient")

    results: list[PageResult] = []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=args.chromium, headless=True, args=CHROMIUM_FLAGS)
            context = browser.new_context(viewport={"width": 1280, "height": 900}, service_workers="block")
            context.route("**/*", route)
            for page_path in pages:
                results.append(
                    check_page(
                        context, page_path, html_dir, origin, config, repo_root, args.screenshots, args.full_page
                    )
                )
            context.close()
            browser.close()
    finally:
        server.shutdown()

    failed = [r for r in results if not r.ok]
    print(f"check_site: {len(results)} pages of {html_dir} served at {origin}, screenshots in {args.screenshots}")
    for r in results:
        print(f"  {'ok  ' if r.ok else 'FAIL'} {r.page}")
        for line in r.failures:
            print("         - " + line.replace("\n", "\n           "))
    external = sorted({e for r in results for e in r.external_errors})
    unchecked = sorted({i for r in results for i in r.unchecked_images})
    if blocked:
        print(
            "blocked requests to other origins (not judged): "
            + ", ".join(f"{h} x{n}" for h, n in sorted(blocked.items()))
        )
    if external:
        print(f"console errors about other origins (not judged): {len(external)} distinct, for example:")
        for line in external[:5]:
            print("    " + line)
    if unchecked:
        print("unchecked external images: " + ", ".join(unchecked))
    formulas = sum(r.math_elements for r in results)
    print(
        f"math: {sum(r.math_rendered for r in results)} of {formulas} formulas rendered, on "
        f"{sum(1 for r in results if r.math_elements)} pages, with every other origin blocked"
    )
    (args.screenshots / "report.json").write_text(
        json.dumps(
            {
                "origin": origin,
                "blocked_hosts": blocked,
                "pages": [r.__dict__ for r in results],
            },
            indent=1,
        )
    )
    if failed:
        print(
            f"check_site: {len(failed)} of {len(results)} pages failed; details above and in {args.screenshots / 'report.json'}"
        )
    print(f"check_site: {len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
