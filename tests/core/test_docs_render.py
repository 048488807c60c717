"""The docs site as a reader sees it: built once (mkdocs), then its HTML read, and, where chromium is installed, its pages
laid out at 1280 px by a headless browser.

What it guards: reST markup (``:func:``, ``:class:``, double backticks) shown literally, an empty Type column in the API
reference, and pages wider than the window or code and tables cut off at its edge (docs/stylesheets/extra.css,
scripts/docs_griffe.py). The strict build itself is scripts/test.sh's.
"""

import glob
import html
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WIDTH = 1280
#: Pages laid out in the browser: the home page, a guide page, the API reference and the benchmark pages.
PAGES = ("index.html", "guide/distribute/index.html", "reference/api/index.html", "benchmarks/index.html",
         "benchmarks-data-parallel/index.html", "benchmarks-startup/index.html", "benchmarks-hosts/index.html",
         "benchmarks-model-parallel/index.html", "benchmarks-appendix/index.html")
#: The benchmarks overview is read first: its notice, its chart and its summary, not a long scroll (it was 22,900 px
#: with every section's method on it; the sections have pages of their own).
OVERVIEW_MAX_PX = 6000
#: Public calls whose parameters and return value the API reference must give types for.
TYPED = ("distkeras.distribute", "distkeras.describe", "distkeras.global_batch_size", "distkeras.use_cpu_devices",
         "distkeras.shard", "distkeras.shard_bounds", "distkeras.Cluster", "distkeras.callbacks.BackupAndRestore",
         "distkeras.environments.find", "distkeras.environments.Found")
#: A reST role (its target may have become inline code, so the role name alone counts), or a reST literal.
REST = re.compile(r":(?:func|class|mod|meth|exc|data|attr|obj):(?=[\s`])|(?<!`)``(?!`)")

#: Run in the page once it is laid out: the page's width and what runs past the text column without a scroll bar.
MEASURE = """<script>
window.addEventListener("load", function () { setTimeout(function () {
  var article = document.querySelector("article") || document.body;
  var right = article.getBoundingClientRect().right + 20, bad = [];
  article.querySelectorAll("pre > code").forEach(function (code) {
    if (code.scrollWidth > code.clientWidth + 1) bad.push("code cut off: " + code.textContent.trim().slice(0, 60));
  });
  article.querySelectorAll("table, pre, img").forEach(function (el) {
    if (el.getBoundingClientRect().right <= right) return;
    for (var p = el.parentElement; p && p !== article; p = p.parentElement) {
      var overflow = getComputedStyle(p).overflowX;
      if (overflow !== "visible" && p.getBoundingClientRect().right <= right) return;  // it scrolls inside p
    }
    bad.push(el.tagName.toLowerCase() + " past the text column: " + el.textContent.trim().slice(0, 60));
  });
  document.body.setAttribute("data-render", JSON.stringify({width: document.documentElement.scrollWidth,
                                                           height: document.documentElement.scrollHeight, bad: bad}));
}, 300); });
</script>"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs", reason="the docs build needs mkdocs (pip install -e .[dev])")
    pytest.importorskip("mkdocstrings")
    out = str(tmp_path_factory.mktemp("site"))
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--quiet", "--site-dir", out], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, "mkdocs build failed:\n" + done.stdout + done.stderr
    return out


def text_outside_code_blocks(page):
    """The page's visible text, inline code included (a Type cell's annotation is inline code), code blocks left out
    (where backticks may be meant)."""
    body = re.sub(r"<(script|style|pre)\b.*?</\1>", " ", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", body))


def test_no_rest_markup_is_shown_literally(site):
    shown = {}
    for path in sorted(glob.glob(os.path.join(site, "**", "*.html"), recursive=True)):
        with open(path, encoding="utf-8") as handle:
            text = text_outside_code_blocks(handle.read())
        found = [text[max(m.start() - 30, 0):m.end() + 30].strip() for m in REST.finditer(text)]
        if found:
            shown[os.path.relpath(path, site)] = found[:3]
    assert not shown, "reST markup rendered as text (scripts/docs_griffe.py converts it):\n{}".format(
        json.dumps(shown, indent=1))


def doc_tables(page):
    """``{object id: [table html, ...]}``: the tables under each documented object's heading of the API page."""
    tables = {}
    parts = re.split(r'<h[2-4] id="(distkeras[\w.]*)"', page)
    for name, chunk in zip(parts[1::2], parts[2::2]):
        tables[name] = re.findall(r"<table>.*?</table>", chunk, flags=re.S)
    return tables


def cells(row, tag):
    return [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<{0}\b[^>]*>(.*?)</{0}>".format(tag), row, re.S)]


def test_the_api_reference_gives_every_type(site):
    with open(os.path.join(site, "reference", "api", "index.html"), encoding="utf-8") as handle:
        tables = doc_tables(handle.read())
    empty, typed = [], set()
    for name, found in tables.items():
        for table in found:
            rows = re.findall(r"<tr\b[^>]*>(.*?)</tr>", table, re.S)
            header = cells(rows[0], "th")
            if "Type" not in header:
                continue
            column = header.index("Type")
            for row in rows[1:]:
                row_cells = cells(row, "td")
                typed.add(name)
                if not row_cells[column]:
                    empty.append("{}: {}".format(name, " | ".join(row_cells)[:100]))
    assert not empty, "API reference rows with an empty Type cell (annotate the signature):\n" + "\n".join(empty)
    assert set(TYPED) <= typed, "no typed table for: {}".format(sorted(set(TYPED) - typed))


def test_describe_returns_a_typed_dict_described_in_prose(site):
    with open(os.path.join(site, "reference", "api", "index.html"), encoding="utf-8") as handle:
        returns = [t for t in doc_tables(handle.read())["distkeras.describe"] if "<th>Type</th>" in t]
    row = cells(re.findall(r"<tr\b[^>]*>(.*?)</tr>", returns[-1], re.S)[1], "td")
    assert row[0] == "Dict[str, object]" and row[1].startswith("A dict with backend;"), row


def load_extension():
    pytest.importorskip("griffe")
    spec = importlib.util.spec_from_file_location("docs_griffe", os.path.join(ROOT, "scripts", "docs_griffe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_extension_rewrites_rest_and_keeps_examples():
    ext = load_extension()
    doc = ("Calls :func:`distribute`, raises :class:`~distkeras.errors.VerifyError` (:mod:`distkeras.verify`).\n\n"
           "Returns:\n    A dict with ``backend``; ``devices`` (strings: each device).\n\n"
           "Examples:\n    >>> f(``x``)\n")
    assert ext.rewrite(doc).split("\n") == [
        "Calls `distribute()`, raises `VerifyError` (`distkeras.verify`).", "",
        "Returns:", "    : A dict with `backend`; `devices` (strings: each device).", "",
        "Examples:", "    >>> f(``x``)", ""]
    assert ext.rewrite("Returns:\n    Tuple[int, int]: (start, end).") == "Returns:\n    Tuple[int, int]: (start, end)."
    fields = {"rank": "int", "coordinator": "Optional[str]"}
    assert ext.rewrite("Attributes:\n    rank: the rank.\n    coordinator: ``host:port``.", fields) == (
        "Attributes:\n    rank (int): the rank.\n    coordinator (Optional[str]): `host:port`.")


def browser():
    return next((found for found in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if found), None)


def lay_out(chromium, site, page, profile):
    """``page`` of ``site`` laid out at WIDTH px by headless chromium: ``{"width", "height", "bad"}``."""
    path = os.path.join(site, page)
    with open(path, encoding="utf-8") as handle:
        laid_out = handle.read().replace("</body>", MEASURE + "</body>")
    measured = path.replace(".html", ".measure.html")  # beside it: its links and styles resolve alike
    with open(measured, "w", encoding="utf-8") as handle:
        handle.write(laid_out)
    done = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--user-data-dir=" + profile,
         "--window-size={},2000".format(WIDTH), "--virtual-time-budget=5000", "--dump-dom", "file://" + measured],
        capture_output=True, text=True, timeout=60)
    found = re.search(r'data-render="([^"]*)"', done.stdout)
    assert found, "chromium laid out no {} (exit {}): {}".format(page, done.returncode, done.stderr[-500:])
    return json.loads(html.unescape(found.group(1)))


def test_pages_fit_a_1280_pixel_window(site, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    chromium = browser()
    if chromium is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium): page widths at 1280 px not checked")
    with ThreadPoolExecutor(3) as pool:  # each chromium mostly starts up: three at once take the time of about one
        renders = dict(zip(PAGES, pool.map(lambda p: lay_out(chromium, site, p, str(tmp_path / p.replace("/", "_"))),
                                           PAGES)))
    failures = ["{}: {} px wide; {}".format(page, r["width"], r["bad"]) for page, r in renders.items()
                if r["width"] > WIDTH or r["bad"]]
    assert not failures, "at {} px:\n".format(WIDTH) + "\n".join(failures)
    assert renders["benchmarks/index.html"]["height"] <= OVERVIEW_MAX_PX, renders["benchmarks/index.html"]


def test_the_benchmarks_page_opens_with_its_notice_and_chart(site):
    with open(os.path.join(site, "benchmarks", "index.html"), encoding="utf-8") as handle:
        page = handle.read()
    article = page[page.index("<article"):]
    notice, chart, table = article.find("Measured on CPU"), article.find("headline.png"), article.find("<table")
    assert 0 <= notice < chart, "the page must open with the CPU-only notice, then the headline chart"
    assert table == -1 or chart < table
