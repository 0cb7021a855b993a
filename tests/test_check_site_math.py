"""tools/check_site.py's math check, on small HTML strings (no browser needed).

The browser check hands the page's DOM, read back after MathJax has typeset it, to
`math_failures`; these tests feed it pages as a browser would hold them: formulas rendered by
MathJax 3 (an <mjx-container> inside the math element), formulas left as raw LaTeX (MathJax
absent, e.g. blocked on its CDN), Markdown math that never became a math element, and code that
legitimately shows LaTeX.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from repo_tools import load_tool

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check_site():
    return load_tool("check_site")


# A formula as MathJax 3 leaves it in the DOM (CommonHTML output, with its assistive MathML).
RENDERED = (
    '<span class="math notranslate nohighlight"><mjx-container class="MathJax" jax="CHTML">'
    '<mjx-math><mjx-mi class="mjx-i"><mjx-c class="mjx-c1D464 TEX-I"></mjx-c></mjx-mi></mjx-math>'
    "<mjx-assistive-mml><math><mi>w</mi></math></mjx-assistive-mml></mjx-container></span>"
)


def page(body: str, head: str = "") -> str:
    return f"<html><head><title>\\(x\\) in a title</title>{head}</head><body>{body}</body></html>"


def test_rendered_formulas_pass(check_site):
    html = page(
        f"<p>A weight {RENDERED} is stored.</p>"
        + RENDERED.replace("<span", "<div").replace("</span>", "</div>"),
        head='<script defer src="../_static/mathjax/tex-chtml.js"></script>',
    )
    assert check_site.math_failures(html, "http://127.0.0.1:8000") == []
    scan = check_site.scan_math(html)
    assert (scan.math_elements, scan.rendered) == (2, 2)


def test_formula_left_as_raw_latex_fails(check_site):
    # what a page shows when MathJax never ran: Sphinx's \( \) delimiters as text
    html = page(r'<p>Frozen when <span class="math notranslate nohighlight">\(|d| < \mathrm{ulp}(w)/2\)</span>.</p>')
    failures = check_site.math_failures(html)
    assert any("1 of 1 formulas not rendered" in f for f in failures), failures
    assert any("raw LaTeX" in f and r"\(|d| < \mathrm{ulp}(w)/2\)" in f for f in failures), failures


@pytest.mark.parametrize(
    "text",
    [
        "$2^{-126}$",  # Markdown output rendered as CommonMark: dollars never became math
        "the threshold $|w|$ here",
        "$$x = 1$$",
        r"display \[x\] math",
        r"$\lfloor \log_2",  # a table cell cut at the | inside the formula
        r"is \rfloor$ the exponent",
    ],
)
def test_raw_delimiters_in_text_fail(check_site, text):
    failures = check_site.math_failures(page(f"<table><tr><td>{text}</td></tr></table>"))
    assert len(failures) == 1 and "raw LaTeX" in failures[0], failures


@pytest.mark.parametrize(
    "body",
    [
        r"<pre>print(f'$2^{{-126}}$ and \(x\)')</pre>",
        r"<p>Write <code>$x$</code> or <code>\(x\)</code> in Markdown.</p>",
        '<div class="highlight"><pre><span>$$</span></pre></div>',
        "<p>It costs $5 and $6, or $ 8 (US$).</p>",
        r"<p>An escaped \$x\$ stays a dollar.</p>",
        "<script>const s = '$x$ \\\\(y\\\\)';</script>",
        "<p>one $</p><p>two $</p>",  # dollars in different blocks never pair
    ],
)
def test_code_and_plain_dollars_pass(check_site, body):
    assert check_site.math_failures(page(body)) == []


def test_mathjax_error_fails(check_site):
    html = page(
        '<span class="math"><mjx-container><mjx-merror data-mjx-error="Undefined control sequence \\foo">'
        "<mjx-mtext>\\foo</mjx-mtext></mjx-merror></mjx-container></span>"
    )
    assert check_site.math_failures(html) == ["MathJax could not typeset a formula: Undefined control sequence \\foo"]


def test_mathjax_from_a_cdn_fails(check_site):
    head = '<script defer src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js"></script>'
    failures = check_site.math_failures(page(f"<p>{RENDERED}</p>", head=head), "http://127.0.0.1:8000")
    assert len(failures) == 1 and "another origin" in failures[0], failures
    local = '<script defer src="http://127.0.0.1:8000/_static/mathjax/tex-chtml.js"></script>'
    assert check_site.math_failures(page(f"<p>{RENDERED}</p>", head=local), "http://127.0.0.1:8000") == []
