"""mkdocs hooks: results sections included by name, and no raw Sphinx role in a rendered page.

A page includes one section of a results file that `make bench` writes with a line

    <!-- results: benchmarks/results/benchmarks.md "Input pipeline" -->

which becomes that file's paragraph starting with `**Input pipeline**` and everything up to the
next such bold title: a figure then has one source, the file, and the page follows every new run
(`pymdownx.snippets`' `--8<--` includes a whole file; its sections need markers the generated files
do not have). A missing file or section fails the build.

mkdocstrings renders docstrings as Markdown, so `:class:`Name`` would reach the API
reference as literal text; write `Name` (or a Markdown link) instead.
"""

import os
import re

from mkdocs.exceptions import PluginError

_ROLE = re.compile(r":(class|func|meth|mod|attr|exc|obj|data):(`|<code>)")
RESULTS = re.compile(r'^<!-- results: (\S+) "([^"]+)" -->$', re.M)
_TITLE = re.compile(r"^\*\*[A-Z`]")


def results_section(path: str, title: str, root: str = ".") -> str:
    """The section of the Markdown file ``path`` whose first line starts with ``**title**``."""
    full = os.path.join(root, path)
    if not os.path.exists(full):
        raise PluginError(f"results: {path} does not exist")
    with open(full, encoding="utf-8") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"**{title}**")), None)
    if start is None:
        raise PluginError(f'results: {path} has no section "**{title}**"')
    end = next((i for i in range(start + 1, len(lines)) if _TITLE.match(lines[i])), len(lines))
    return "\n".join(lines[start:end]).strip() + "\n"


def expand_results(markdown: str, root: str = ".") -> str:
    """``markdown`` with every results line replaced by its section."""
    return RESULTS.sub(lambda m: results_section(m.group(1), m.group(2), root), markdown)


def on_page_markdown(markdown, page, config, files):
    return expand_results(markdown, os.path.dirname(config.config_file_path))


def on_page_content(html, page, config, files):
    found = _ROLE.search(html)
    if found:
        start = max(0, found.start() - 60)
        raise PluginError(
            f"{page.file.src_path}: a raw Sphinx role ({found.group(0)}...) in the rendered page: "
            f"...{html[start:found.end() + 40]}... Write `name` instead."
        )
    return html
