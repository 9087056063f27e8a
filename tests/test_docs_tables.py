"""The docs read the same on the code host as on the site (issue 49).

The code host renders a page's raw Markdown; the site renders it through mkdocs. So:

* every results table a page shows is written into the page (`benchmarks.docs_tables`), and
  equals its results file: a page whose table differs from `benchmarks/results/` fails here;
* no page holds what only the site expands: an include line (`--8<--`), a results comment
  without its table, an autoref link (`[x][keras_replicator.y]`), and mkdocs.yml has no include
  extension;
* the built site's pages show no table that the raw Markdown, rendered with the plain `tables`
  extension (as the code host renders it), lacks.
"""

import glob
import html
import os
import re
import subprocess
import sys

import pytest
import yaml

from benchmarks import docs_tables
from tests.helpers import ROOT

pytestmark = pytest.mark.devices(1)  # no TensorFlow here (the site build imports none)


def _read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def test_every_page_shows_its_results_as_they_are():
    assert docs_tables.stale() == [], "run python -m benchmarks.docs_tables --write"


def test_a_changed_table_or_a_lone_include_is_found(tmp_path):
    os.makedirs(tmp_path / "docs")
    (tmp_path / "r.md").write_text("Intro.\n\n**Speed** x\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n**Other** y\n")
    page = tmp_path / "docs" / "p.md"
    fresh = '# P\n\n<!-- results: r.md "Speed" -->\n**Speed** x\n\n| a | b |\n|---|---|\n| 1 | 2 |\n<!-- /results -->\n'
    (tmp_path / "README.md").write_text("# R\n")
    page.write_text(fresh)
    assert docs_tables.stale(str(tmp_path)) == []
    page.write_text(fresh.replace("| 1 | 2 |", "| 1 | 3 |"))
    assert docs_tables.stale(str(tmp_path)) == ["docs/p.md"]
    assert docs_tables.written(page.read_text(), str(tmp_path)) == fresh
    page.write_text('# P\n\n--8<-- "r.md"\n')
    assert docs_tables.stale(str(tmp_path)) == ["docs/p.md"]
    once = docs_tables.written(page.read_text(), str(tmp_path))
    assert once.count("<!-- results: r.md -->\nIntro.") == 1 and once.count("<!-- /results -->") == 1, once
    assert docs_tables.written(once, str(tmp_path)) == once
    with pytest.raises(docs_tables.ResultsError, match="no section"):
        docs_tables.section("r.md", "Missing", str(tmp_path))


def _pages() -> list[str]:
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


@pytest.mark.parametrize("page", _pages())
def test_no_page_holds_what_only_the_site_expands(page):
    text = _read(page)
    assert not re.search(r"^--8<--", text, re.M), f"{page}: an include line"
    prose = re.sub(r"`[^`\n]*`", "", text)  # inline code may show the forms
    assert not re.search(r"\]\[keras_replicator[.\w]*\]", prose), (
        f"{page}: an autoref link: write [text](reference/page.md#anchor)")
    bodies = [m["body"] for m in docs_tables.REGION.finditer(text)]
    assert len(bodies) == len(re.findall(r"^<!-- results: ", text, re.M)), f"{page}: a results comment without its table"
    assert all(body.strip() for body in bodies)


def test_mkdocs_has_no_include_extension():
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    names = [e if isinstance(e, str) else next(iter(e)) for e in config["markdown_extensions"]]
    assert not [n for n in names if "snippets" in n or "include" in n], names


def _tables(rendered: str) -> list[list[str]]:
    """Each <table> of an HTML page as its rows' cell texts."""
    out = []
    for table in re.findall(r"<table.*?</table>", rendered, re.S):
        rows = []
        for row in re.findall(r"<tr.*?</tr>", table, re.S):
            cells = re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row, re.S)
            rows.append(" | ".join(" ".join(html.unescape(re.sub(r"<[^>]+>", "", c)).split()) for c in cells))
        out.append(rows)
    return out


def test_the_site_shows_no_table_the_markdown_lacks(tmp_path):
    import markdown  # mkdocs's renderer: here with the code host's tables only

    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        nav = yaml.safe_load(f)["nav"]
    # The API reference pages are docstrings (`::: module`): the code host shows them in the source.
    pages = [p for p in re.findall(r"[\w/]+\.md", str(nav)) if not p.startswith("reference/")]
    checked = 0
    for page in pages:
        built = site / ("index.html" if page == "index.md" else page[:-3] + "/index.html")
        shown = _tables(built.read_text(encoding="utf-8"))
        raw = _tables(markdown.markdown(_read(os.path.join("docs", page)), extensions=["tables"]))
        missing = [t[0] for t in shown if t not in raw]
        assert not missing, f"{page}: the site shows tables the Markdown does not: {missing}"
        checked += len(shown)
    assert checked > 20  # the results tables among them
