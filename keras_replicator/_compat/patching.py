"""The one patch mechanism of `_compat`: patch objects, grouped by lifetime, always undoable.

A `ScopedPatch` replaces one attribute (`owner.name`) and restores it exactly.
Patches are never applied one by one: a `Patches` set applies its patches
together, for one of two lifetimes, and undoes them in reverse order:

* scoped: `Patches.scope()`, a context manager, re-entrant and thread-safe (a
  counted lock): the patches are applied when the first scope is entered and
  restored when the last one exits, whichever thread enters them;
* installed: `Patches.install()` applies them until `Patches.uninstall()` (for
  entry points Keras calls outside any scope, such as `fit` and callbacks);
  both are idempotent, and `install()` is the one "already installed" marker.

Nothing is patched when a module is imported. Every patched function acts only
for keras_replicator's strategies (`ours`, `ours_async`, `multi_worker`: the one
place that reads the strategies' markers) and leaves other strategies to
TensorFlow's and Keras's own behaviour.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any


def ours(strategy: Any) -> bool:
    """Whether `strategy` is one of keras_replicator's synchronous strategies."""
    return bool(getattr(strategy, "_keras_replicator", False))


def ours_async(strategy: Any) -> bool:
    """Whether `strategy` is keras_replicator's `AsyncReplicatorStrategy`."""
    return bool(getattr(strategy, "_keras_replicator_async", False))


def multi_worker(strategy: Any) -> bool:
    """Whether `strategy` is one of keras_replicator's with more than one worker."""
    return ours(strategy) and getattr(strategy, "num_workers", 1) > 1


# The applied patches, by (id(owner), name): what `original` looks up.
_applied: dict[tuple[int, str], ScopedPatch] = {}


class ScopedPatch:
    """Replaces `owner.name` by `make(original)` while applied; restores it exactly.

    Restoring puts back what `owner.__dict__` held (or removes the attribute if
    it was inherited), so a class or module is left as it was found. While
    applied, `original` is what the patch replaced.
    """

    def __init__(self, owner: Any, name: str, make: Callable[[Any], Any]):
        self.owner, self.name, self.make = owner, name, make
        self._saved: tuple[bool, Any] | None = None
        self.original: Any = None

    @property
    def applied(self) -> bool:
        return self._saved is not None

    def apply(self) -> None:
        if self._saved is not None:
            return
        own = self.name in vars(self.owner)
        original = getattr(self.owner, self.name)
        self._saved = (own, vars(self.owner).get(self.name))
        self.original = original
        setattr(self.owner, self.name, self.make(original))
        _applied[(id(self.owner), self.name)] = self

    def restore(self) -> None:
        if self._saved is None:
            return
        own, value = self._saved
        if own:
            setattr(self.owner, self.name, value)
        else:
            delattr(self.owner, self.name)
        self._saved = None
        self.original = None
        _applied.pop((id(self.owner), self.name), None)


class Patches:
    """Patches with one lifetime: while a `scope()` is entered, or from `install()` to `uninstall()`."""

    def __init__(self, patches: Sequence[ScopedPatch]):
        self.patches = tuple(patches)
        self._lock = threading.RLock()
        self._depth = 0
        self._installed = False

    @property
    def applied(self) -> bool:
        return self._depth > 0

    def _enter(self) -> None:
        with self._lock:
            if self._depth == 0:
                done = []
                try:
                    for patch in self.patches:
                        patch.apply()
                        done.append(patch)
                except BaseException:
                    for patch in reversed(done):
                        patch.restore()
                    raise
            self._depth += 1

    def _exit(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                for patch in reversed(self.patches):
                    patch.restore()

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Applies the patches for the outermost of nested (re-entrant) scopes, in any thread."""
        self._enter()
        try:
            yield
        finally:
            self._exit()

    def install(self) -> None:
        """Applies the patches until `uninstall()` (idempotent)."""
        with self._lock:
            if not self._installed:
                self._enter()
                self._installed = True

    def uninstall(self) -> None:
        """Undoes `install()` (idempotent); patches still in a `scope()` stay until it exits."""
        with self._lock:
            if self._installed:
                self._installed = False
                self._exit()


def original(owner: Any, name: str) -> Any:
    """`owner.name` as it was before a patch replaced it (its current value if not patched)."""
    patch = _applied.get((id(owner), name))
    return getattr(owner, name) if patch is None else patch.original
