"""TensorFlow's own INFO lines from the engines keras_replicator drives, kept from users.

Adds a `logging.Filter` to TensorFlow's Python logger (`tf.get_logger()`, public) that
drops INFO and DEBUG records emitted from TensorFlow's distribution modules
(`tensorflow/python/distribute/`: "Using MirroredStrategy with devices ...",
"Reduce to ... then broadcast to ...", "Collective all_reduce tensors: ...",
"Check health not enabled.", the parameter-server strategy's connection lines).
What is private here is where TensorFlow logs those lines from: the path of its
modules (checked on TF 2.16-2.21).

Why: in Jupyter, TensorFlow sets its logger to INFO (`tf_logging.get_logger`: an
interactive session logs INFO to stdout), so a notebook running
`kr.ReplicatorStrategy()` showed "Using MirroredStrategy ..." (a reader concluded
they ran the stock strategy) and one "Reduce to ..." line per traced all-reduce.
Our strategies announce themselves in one line of their own instead
(`keras_replicator._announce`).

The lines stay available: the filter lets everything through once the user lowers
TensorFlow's logger level below what it was when the filter was installed
(`tf.get_logger().setLevel("DEBUG")` in a notebook, `setLevel("INFO")` in a
script), and warnings and errors always pass. Installed once (idempotent) by the
strategies' constructors, before TensorFlow's engine logs; `uninstall()` removes it.
"""

from __future__ import annotations

import logging
import os

import tensorflow as tf

_ENGINE_PATH = os.sep.join(("tensorflow", "python", "distribute")) + os.sep


class EngineInfoFilter(logging.Filter):
    """Drops TensorFlow's distribution INFO records unless the user raised the verbosity."""

    def __init__(self, logger: logging.Logger):
        super().__init__()
        self._logger = logger
        self.baseline = logger.level or logging.WARNING

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        if self._logger.level and self._logger.level < self.baseline:
            return True  # the user asked for more than TensorFlow's default
        return _ENGINE_PATH not in (record.pathname or "")


def _installed(logger: logging.Logger) -> EngineInfoFilter | None:
    return next((f for f in logger.filters if isinstance(f, EngineInfoFilter)), None)


def install() -> None:
    """Adds the filter to TensorFlow's logger (once)."""
    logger = tf.get_logger()
    if _installed(logger) is None:
        logger.addFilter(EngineInfoFilter(logger))


def uninstall() -> None:
    """Removes the filter; TensorFlow's logger is as it was."""
    logger = tf.get_logger()
    found = _installed(logger)
    if found is not None:
        logger.removeFilter(found)
