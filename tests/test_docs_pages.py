"""The docs' shape and figures, read as files (no TensorFlow, no site build; seconds).

* Every guide (a page in the nav's guide sections) stays under 2,500 words and opens with a
  complete program: its first ```python block (or ```bash block running `python` or `keras-replicator`) starts
  within its first 300 words.
  A page's results tables (written in by `python -m benchmarks.docs_tables --write`) are data,
  not prose: they do not count.
* Every measured figure a page quotes (a decimal number with a unit: 1.42x, 55.2 s, 3.1k, 0.5%)
  is in one of the results files the page cites: those it shows (`<!-- results: file "Section" -->`
  ... `<!-- /results -->`, tests/test_docs_tables.py) and those it declares
  (`<!-- figures: file ... -->`). A figure typed by hand drifts from the run it came from; a
  written-in one cannot.
"""

import glob
import os
import re

import pytest
import yaml

pytestmark = pytest.mark.devices(1)  # no TensorFlow here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The nav sections a user reads to do a task: each page under them is a guide.
GUIDE_SECTIONS = ("Install and quickstart", "One machine", "Several machines", "Fault tolerance",
                  "Memory and model size", "Keras ecosystem")
# Pages of those sections that are references, not tasks: read where needed, not in order.
NOT_GUIDES = {
    "launcher.md": "the launcher's reference: every option, signal and restart rule",
    "troubleshooting.md": "error messages and what to do about each: read by the message",
}
MAX_WORDS = 2500
FIRST_EXAMPLE_WITHIN = 300  # words

_FENCE = re.compile(r"^```(\w*)\n.*?^```\n?", re.M | re.S)
_FIGURE = re.compile(
    r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+)\.(\d+)\s*(ms|s|x|%|k|min|minutes|hours|MB|MiB|GiB|GB/s)(?![\w/])"
)
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
_SOURCES = re.compile(r'--8<-- "([^"]+)"|<!-- results: (\S+)(?: "[^"]*")? -->|<!-- figures: ([^>]*?) -->')
_RESULTS_REGION = re.compile(r"^<!-- results: .*?^<!-- /results -->$", re.M | re.S)


def _read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def _nav_pages(entries, section=None):
    """(top-level section, page) for every Markdown page of mkdocs.yml's nav."""
    for entry in entries:
        for title, value in entry.items():
            top = section or title
            if isinstance(value, list):
                yield from _nav_pages(value, top)
            elif value.endswith(".md"):
                yield top, value


def guides() -> list[str]:
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        nav = yaml.safe_load(f)["nav"]
    return [page for section, page in _nav_pages(nav)
            if section in GUIDE_SECTIONS and page not in NOT_GUIDES]


def first_example_position(text: str) -> int | None:
    """Words before the first program: a ```python block, or a ```bash block that runs one
    (`python`, `keras-replicator`; not a `pip install`). None: the page has none."""
    for fence in _FENCE.finditer(text):
        runs = re.search(r"^(python|keras-replicator) ", fence.group(0), re.M)
        if fence.group(1) == "python" or (fence.group(1) == "bash" and runs):
            return len(text[:fence.start()].split())
    return None


def figures(text: str) -> list[str]:
    """The measured figures of a page's prose: decimal numbers with a unit, outside code blocks,
    comments and includes."""
    prose = _FENCE.sub("", text)
    prose = re.sub(r"<!--.*?-->", "", prose, flags=re.S)
    prose = re.sub(r"^--8<--.*$", "", prose, flags=re.M)
    return [m.group(0) for m in _FIGURE.finditer(prose)]


def cited_sources(text: str) -> list[str]:
    found = []
    for included, section, declared in _SOURCES.findall(text):
        found += [included or section] if (included or section) else declared.split()
    return found


def unsourced(text: str) -> list[str]:
    """The figures of ``text`` whose number is in none of the results files it cites."""
    numbers = set()
    for source in cited_sources(text):
        numbers |= {n.replace(",", "") for n in _NUMBER.findall(_read(source))}
    return [f for f in figures(text) if _NUMBER.match(f).group(0).replace(",", "") not in numbers]


def test_the_checks_see_what_they_check():
    # The rules on a page made to break them, so that the tests below can fail.
    assert first_example_position("# T\n\n```bash\npip install x\n```\n\n```bash\npython a.py\n```\n") == 7
    page = "# T\n\nIntro.\n\n```python\nprint(3.5)   # 2.5x in code is not prose\n```\n\n" \
           "Measured 1.42x and 55.2 s, 3.1k steps/s, 7,668 nodes, 12.5% and 30 s.\n"
    assert first_example_position(page) == 3
    assert first_example_position("# T\n\n```text\nout\n```\n") is None
    assert figures(page) == ["1.42x", "55.2 s", "3.1k", "12.5%"]
    assert figures("a <!-- figures: x --> 2.0x and\n--8<-- \"b 1.5x\"\n") == ["2.0x"]
    assert cited_sources('<!-- figures: a.md b.md -->\n--8<-- "c.md"\n<!-- results: d.md "S" -->') == [
        "a.md", "b.md", "c.md", "d.md"]
    memory = "<!-- figures: benchmarks/results/memory.md -->\n"
    assert unsourced(memory + "sharded: 1.42x faster, 97.6 MiB") == []
    assert unsourced(memory + "sharded: 1.43x faster") == ["1.43x"]
    assert unsourced("no source: 1.42x") == ["1.42x"]


def test_the_guides_are_the_nav_pages_of_the_guide_sections():
    pages = guides()
    assert "index.md" in pages and "fault_tolerance.md" in pages and "multi_worker.md" in pages
    assert "performance.md" not in pages and "contributing.md" not in pages
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        listed = {page for _, page in _nav_pages(yaml.safe_load(f)["nav"])}
    assert set(NOT_GUIDES) <= listed, "an exemption names a page the nav no longer has"


@pytest.mark.parametrize("page", guides())
def test_a_guide_is_short_and_opens_with_a_program(page):
    text = _read(os.path.join("docs", page))
    words = len(_RESULTS_REGION.sub("", text).split())
    assert words <= MAX_WORDS, f"{page}: {words} words (at most {MAX_WORDS})"
    position = first_example_position(text)
    assert position is not None, f"{page}: no ```python or ```bash example"
    assert position <= FIRST_EXAMPLE_WITHIN, (
        f"{page}: the first example starts after {position} words (at most {FIRST_EXAMPLE_WITHIN})")


def _pages() -> list[str]:
    return ["README.md", "Makefile"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


@pytest.mark.parametrize("page", _pages())
def test_every_figure_is_in_the_results_the_page_cites(page):
    text = _read(page)
    for source in cited_sources(text):
        assert os.path.exists(os.path.join(ROOT, source)), f"{page} cites {source}, which does not exist"
    missing = unsourced(text)
    assert not missing, (
        f"{page} quotes figures that are in none of the results it cites "
        f"({cited_sources(text) or 'none'}): {missing}. Include the result "
        "(<!-- results: file \"Section\" --> and python -m benchmarks.docs_tables --write), or cite "
        "its file in <!-- figures: ... -->.")


def test_every_results_section_a_page_shows_exists():
    from benchmarks.docs_tables import REGION, section

    for page in _pages():
        for m in REGION.finditer(_read(page)):
            if m["title"]:
                assert section(m["path"], m["title"], ROOT).startswith(f"**{m['title']}**"), (page, m[0][:80])
