"""The results tables of the docs, written into the pages themselves from `benchmarks/results/`.

A page shows a results file, or one section of it, between two comments:

    <!-- results: benchmarks/results/benchmarks.md "Input pipeline" -->
    ...the section, as this script wrote it...
    <!-- /results -->

The section is the file's paragraph starting with `**Input pipeline**` and everything up to the
next such bold title; without a title, the whole file. The comments are invisible on the code host
and on the site, so both show the same page: the table is in the Markdown itself (no include the
code host cannot expand). After a benchmark run (`make bench` runs this last):

    python -m benchmarks.docs_tables --write     # rewrites the stale pages
    python -m benchmarks.docs_tables             # lists them; exit status 1 if any

`tests/test_docs_tables.py` fails when a page's table differs from its results file. `--write`
also turns a `--8<-- "file"` include line, or a results comment without its closing
`<!-- /results -->`, into a section written in place.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A region: the opening comment, the body this script wrote, the closing comment.
REGION = re.compile(
    r'^<!-- results: (?P<path>\S+)(?: "(?P<title>[^"]+)")? -->\n(?P<body>.*?)^<!-- /results -->$',
    re.M | re.S)
# What --write turns into a region: an include line, or an opening comment alone.
_OPENING = re.compile(r'^<!-- results: (?P<path>\S+)(?: "(?P<title>[^"]+)")? -->$', re.M)
_UNFINISHED = re.compile(r'^(?:--8<-- "(?P<path>[^"]+)"|<!-- results: (?P<opened>\S+)(?: "(?P<title>[^"]+)")? -->)$',
                         re.M)
_TITLE = re.compile(r"^\*\*[A-Z`]")


class ResultsError(ValueError):
    """A page names a results file or section that does not exist."""


def section(path: str, title: str | None = None, root: str = ROOT) -> str:
    """The results file ``path`` (relative to the repository), or its section ``**title**``."""
    full = os.path.join(root, path)
    if not os.path.exists(full):
        raise ResultsError(f"results: {path} does not exist")
    with open(full, encoding="utf-8") as f:
        text = f.read()
    if title is None:
        return text.strip() + "\n"
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"**{title}**")), None)
    if start is None:
        raise ResultsError(f'results: {path} has no section "**{title}**"')
    end = next((i for i in range(start + 1, len(lines)) if _TITLE.match(lines[i])), len(lines))
    return "\n".join(lines[start:end]).strip() + "\n"


def _region(path: str, title: str | None, root: str) -> str:
    opening = f'<!-- results: {path} "{title}" -->' if title else f"<!-- results: {path} -->"
    return f"{opening}\n{section(path, title, root)}<!-- /results -->"


def written(text: str, root: str = ROOT) -> str:
    """``text`` with every region's body rewritten from its results file (and includes and
    lone opening comments made into regions)."""
    out, last = [], 0
    for m in REGION.finditer(text):
        if _OPENING.search(m["body"]):
            raise ResultsError(f"a results comment before {m['path']}'s has no <!-- /results -->")
        out += [_unfinished(text[last:m.start()], root), _region(m["path"], m["title"], root)]
        last = m.end()
    return "".join(out + [_unfinished(text[last:], root)])


def _unfinished(text: str, root: str) -> str:
    """An include line or a lone opening comment, made into a region (in one pass)."""
    return _UNFINISHED.sub(lambda m: _region(m["path"] or m["opened"], m["title"], root), text)


def pages(root: str = ROOT) -> list[str]:
    """The pages that may show results: the README and docs/*.md (relative paths)."""
    docs = sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    return ["README.md"] + [os.path.relpath(p, root) for p in docs]


def stale(root: str = ROOT) -> list[str]:
    """The pages whose results regions differ from their results files."""
    found = []
    for page in pages(root):
        with open(os.path.join(root, page), encoding="utf-8") as f:
            text = f.read()
        if written(text, root) != text:
            found.append(page)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the stale pages")
    args = parser.parse_args(argv)
    pages_ = stale()
    for page in pages_:
        if args.write:
            with open(os.path.join(ROOT, page), encoding="utf-8") as f:
                text = written(f.read())
            with open(os.path.join(ROOT, page), "w", encoding="utf-8") as f:
                f.write(text)
        print(f"{'wrote' if args.write else 'stale'}: {page}")
    return 0 if args.write or not pages_ else 1


if __name__ == "__main__":
    sys.exit(main())
