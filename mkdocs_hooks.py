"""mkdocs hooks: the strict build fails on a raw Sphinx role in a rendered page.

mkdocstrings renders docstrings as Markdown, so `:class:`Name`` would reach the API
reference as literal text; write `Name` (or a Markdown link) instead.
"""

import re

from mkdocs.exceptions import PluginError

_ROLE = re.compile(r":(class|func|meth|mod|attr|exc|obj|data):(`|<code>)")


def on_page_content(html, page, config, files):
    found = _ROLE.search(html)
    if found:
        start = max(0, found.start() - 60)
        raise PluginError(
            f"{page.file.src_path}: a raw Sphinx role ({found.group(0)}...) in the rendered page: "
            f"...{html[start:found.end() + 40]}... Write `name` instead."
        )
    return html
