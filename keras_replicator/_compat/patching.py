"""Patches that are undone: one attribute replaced while a scope is entered."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any


class ScopedPatch:
    """Replaces `owner.name` by `make(original)` while applied; restores it exactly.

    Restoring puts back what `owner.__dict__` held (or removes the attribute if
    it was inherited), so a class is left as it was found.
    """

    def __init__(self, owner: Any, name: str, make: Callable[[Any], Any]):
        self.owner, self.name, self.make = owner, name, make
        self._saved: tuple[bool, Any] | None = None

    @property
    def applied(self) -> bool:
        return self._saved is not None

    def apply(self) -> None:
        if self._saved is not None:
            return
        own = self.name in vars(self.owner)
        original = getattr(self.owner, self.name)
        self._saved = (own, vars(self.owner).get(self.name))
        setattr(self.owner, self.name, self.make(original))

    def restore(self) -> None:
        if self._saved is None:
            return
        own, value = self._saved
        if own:
            setattr(self.owner, self.name, value)
        else:
            delattr(self.owner, self.name)
        self._saved = None


_lock = threading.Lock()
_depth = 0


@contextlib.contextmanager
def applied(patches: Sequence[ScopedPatch]) -> Iterator[None]:
    """Applies `patches` for the outermost of nested (re-entrant) scopes."""
    global _depth
    with _lock:
        if _depth == 0:
            for patch in patches:
                patch.apply()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for patch in reversed(patches):
                    patch.restore()
