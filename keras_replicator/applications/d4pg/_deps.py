"""The optional dependencies of the D4PG tutorial (the `rl` extra), imported on demand."""

from __future__ import annotations

import importlib
import warnings

INSTALL_HINT = 'pip install ".[rl]" from the root of your keras_replicator clone'


def require(module: str):
    """Imports `module` or raises an `ImportError` saying which extra installs it."""
    try:
        if module.startswith("shimmy") or module.startswith("dm_control"):
            with warnings.catch_warnings():  # glfw warns that there is no display
                warnings.simplefilter("ignore")
                return importlib.import_module(module)
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"The D4PG tutorial needs {module!r}, which is not installed ({e}). "
            f"Install the reinforcement-learning extra: {INSTALL_HINT}"
        ) from e
