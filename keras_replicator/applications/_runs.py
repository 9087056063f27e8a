"""A run directory's files, written atomically and read back to resume: one place for both.

Every application that resumes (D4PG, SN-GAN) writes its checkpoint and its records
through `write_atomically`: the content goes to a temporary file beside the target,
then `os.replace` puts it in place (`keras_replicator.atomic_files`, with an fsync), so a reader (or a resumed run after a crash) sees
the old file or the new one, never half of one.

Example:
    ```python
    import os, tempfile
    from keras_replicator.applications import _runs

    path = os.path.join(tempfile.mkdtemp(), "metrics.json")
    _runs.write_json(path, [{"step": 100, "fid": 12.5}])
    assert _runs.read_json(path, default=[]) == [{"step": 100, "fid": 12.5}]
    ```
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keras_replicator import atomic_files

__all__ = [
    "read_csv_rows",
    "read_json",
    "read_npz",
    "write_atomically",
    "write_csv_rows",
    "write_json",
    "write_npz",
]


def write_atomically(path: str, write: Callable[[str], Any]) -> bool:
    """``write(tmp)``, then ``tmp`` replaces ``path`` in one step (`keras_replicator.atomic_files`'s).

    ``write`` returning ``False`` means it wrote nothing (a worker other than the
    chief, whose saves go elsewhere): then nothing is replaced and this returns
    ``False``; else ``True``.
    """
    return atomic_files.write_atomically(path, write)


def write_json(path: str, value: Any, **dump_kwargs: Any) -> None:
    """``value`` as JSON at ``path``, atomically."""

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(value, f, **dump_kwargs)

    write_atomically(path, write)


def read_json(path: str, default: Any = None) -> Any:
    """The JSON at ``path``, or ``default`` if there is no such file."""
    if not os.path.exists(path):
        return default
    with open(path) as f:
        return json.load(f)


def write_npz(path: str, arrays: dict) -> None:
    """``arrays`` (name -> array) as an ``.npz`` file at ``path``, atomically."""
    write_atomically(path, lambda tmp: np.savez(tmp, **arrays))


def read_npz(path: str) -> dict | None:
    """The arrays of the ``.npz`` file at ``path``, or ``None`` if there is none."""
    if not os.path.exists(path):
        return None
    with np.load(path) as saved:
        return dict(saved)


def write_csv_rows(path: str, rows: Sequence[dict], fields: Sequence[str]) -> None:
    """``rows`` (dicts with ``fields``) as a CSV file with a header, atomically."""

    def write(tmp: str) -> None:
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(fields))
            writer.writeheader()
            writer.writerows(rows)

    write_atomically(path, write)


def read_csv_rows(path: str) -> list[dict]:
    """The rows of the CSV file at ``path`` as dicts of floats (none if there is no file)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
