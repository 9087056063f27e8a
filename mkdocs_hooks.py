"""mkdocs hooks: the site shows the Markdown as the code host does, and no raw Sphinx role.

The pages are built as written: no include, no expansion. A results table is written into its page
by `python -m benchmarks.docs_tables --write` (between `<!-- results: ... -->` and
`<!-- /results -->`), so the code host, which renders the raw Markdown, shows it too. A page with
an include line (`--8<--`), or whose tables differ from their results files, fails the build.

mkdocstrings renders docstrings as Markdown, so `:class:`Name`` would reach the API
reference as literal text; write `Name` (or a Markdown link) instead.
"""

import os
import re
import sys

from mkdocs.exceptions import PluginError

_ROLE = re.compile(r":(class|func|meth|mod|attr|exc|obj|data):(`|<code>)")
_INCLUDE = re.compile(r'^--8<-- ', re.M)


def on_page_markdown(markdown, page, config, files):
    root = os.path.dirname(config.config_file_path)
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.docs_tables import written

    if _INCLUDE.search(markdown):
        raise PluginError(f"{page.file.src_path}: an include line (--8<--); the code host cannot "
                          "expand it: write the results in with python -m benchmarks.docs_tables --write")
    if page.file.src_path.endswith(".md") and written(markdown, root) != markdown:
        raise PluginError(f"{page.file.src_path}: its results tables differ from benchmarks/results/: "
                          "run python -m benchmarks.docs_tables --write")
    return markdown


def on_page_content(html, page, config, files):
    found = _ROLE.search(html)
    if found:
        start = max(0, found.start() - 60)
        raise PluginError(
            f"{page.file.src_path}: a raw Sphinx role ({found.group(0)}...) in the rendered page: "
            f"...{html[start:found.end() + 40]}... Write `name` instead."
        )
    return html
