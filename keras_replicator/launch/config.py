"""What to launch: the script or module every worker runs, checked before any work."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os


def _check_module_name(name: object) -> None:
    if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(f"module must be a dotted module name such as 'pkg.train', got {name!r}.")


def _check_module(name: object, pythonpath: str) -> None:
    """Refuses a module ``python -m`` would not find, without importing it (nor TensorFlow).

    Looks where a worker's ``python -m`` looks: its working directory (this one), its
    ``PYTHONPATH``, then this interpreter's ``sys.path`` and finders.
    """
    _check_module_name(name)
    parts = name.split(".")
    first = [os.getcwd(), *(p for p in pythonpath.split(os.pathsep) if p)]
    spec = importlib.machinery.PathFinder.find_spec(parts[0], first) or importlib.util.find_spec(parts[0])
    for i in range(1, len(parts)):
        if spec is None or not spec.submodule_search_locations:
            spec = None
            break
        spec = importlib.machinery.PathFinder.find_spec(
            ".".join(parts[: i + 1]), list(spec.submodule_search_locations))
    if spec is None:
        raise ModuleNotFoundError(f"No module named {name!r} for `python -m` here.")

