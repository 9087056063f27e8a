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

Every patch checks what it patches before it patches it (`Guard`s, run by
`apply`, each once per object checked): a copied source's fingerprint, a call
contract (the function still calls what the patch relies on), or a behavioural
self-check. A guard that fails raises `IncompatiblePatchError` naming the
patch, the symbol and the installed versions, and nothing is patched. A patch
marked `optional` patches an attribute some supported versions lack (feature
detection): where it is absent, there is nothing to patch.

Nothing is patched when a module is imported. Every patched function acts only
for keras_replicator's strategies (`ours`, `ours_async`, `multi_worker`: the one
place that reads the strategies' markers) and leaves other strategies to
TensorFlow's and Keras's own behaviour.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import textwrap
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from keras_replicator.versions import IncompatiblePatchError, installed, minor


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


def fingerprint(obj: Any) -> str:
    """A short hash of `obj`'s source, blind to comments, blank lines and indentation depth."""
    source = textwrap.dedent(inspect.getsource(inspect.unwrap(obj)))
    lines = [line.rstrip() for line in source.splitlines()]
    kept = [line for line in lines if line.strip() and not line.strip().startswith("#")]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def code_names(function: Any) -> set[str]:
    """The names `function`'s code reads (its nested functions' too) and its string constants."""
    return _code_names(inspect.unwrap(function).__code__)


def _code_names(code: Any) -> set[str]:
    """The names a code object (and the functions it defines) reads, and its string constants."""
    names = set(code.co_names)
    consts = list(code.co_consts)
    while consts:
        const = consts.pop()
        if inspect.iscode(const):
            names |= _code_names(const)
        elif isinstance(const, str):
            names.add(const)
        elif isinstance(const, (tuple, frozenset)):  # a tuple of names, a call's keywords
            consts.extend(const)
    return names


def _versions_line() -> str:
    return ", ".join(f"{p} {v}" for p, v in installed().items())


class Guard:
    """One thing a patch relies on, checked before the patch applies.

    `symbol` names it (`"keras TensorFlowTrainer.train_step"`), `get()` returns
    it, `test(obj)` returns None where it holds, else what differs. Checked once
    per object `get()` returns (a replaced symbol is checked again).
    """

    def __init__(self, symbol: str, get: Callable[[], Any], test: Callable[[Any], str | None]):
        self.symbol, self.get, self.test = symbol, get, test
        self._passed: list[Any] = []  # the objects that passed (kept alive: ids stay unique)

    def verify(self, patch: str) -> None:
        """Raises `IncompatiblePatchError` unless what `symbol` names is what `patch` was written for."""
        obj = self.get()
        if any(obj is seen or (isinstance(obj, str) and obj == seen) for seen in self._passed):
            return
        problem = self.test(obj)
        if problem is not None:
            raise IncompatiblePatchError(
                f"{patch} relies on {self.symbol}, which is not what it was written for on the "
                f"installed {_versions_line()}: {problem}. Nothing was patched: applying it could "
                "train wrong without an error. Use a supported pair (keras_replicator.versions) "
                "or report the versions."
            )
        self._passed.append(obj)


def same_source(symbol: str, get: Callable[[], Any], known: dict[str, str],
                package: str = "keras") -> Guard:
    """A guard: `get()`'s source is one we copied or checked (`known`: fingerprint per minor)."""

    def test(obj: Any) -> str | None:
        try:
            found = fingerprint(obj)
        except (OSError, TypeError):
            return "its source cannot be read, so it cannot be compared with the one copied"
        if found in known.values():
            return None
        checked = ", ".join(f"{package} {v}: {h}" for v, h in sorted(known.items(), key=lambda kv: minor(kv[0])))
        return (f"its source fingerprint is {found}, none of those checked ({checked}): the patch "
                "copies or depends on that code line by line")

    return Guard(symbol, get, test)


def calls(symbol: str, get: Callable[[], Any], *callees: str) -> Guard:
    """A guard: the function `get()` returns still calls (names, or holds as a string) each of `callees`."""

    def test(obj: Any) -> str | None:
        code = getattr(inspect.unwrap(obj), "__code__", None)
        if code is None:
            return f"it is not a Python function ({type(obj).__name__})"
        missing = [c for c in callees if c not in _code_names(code)]
        return None if not missing else f"it no longer calls {', '.join(missing)}"

    return Guard(symbol, get, test)


def behaves(symbol: str, probe: Callable[[], str | None], key: Callable[[], Any] = lambda: None) -> Guard:
    """A guard: `probe()` (a behavioural self-check) returns None, else what it found instead.

    Run once per `key()` (default: once per process).
    """
    return Guard(symbol, key, lambda _: probe())


class ScopedPatch:
    """Replaces `owner.name` by `make(original)` while applied; restores it exactly.

    Restoring puts back what `owner.__dict__` held (or removes the attribute if
    it was inherited), so a class or module is left as it was found. While
    applied, `original` is what the patch replaced. `guards` are verified before
    every apply that patches; `optional`: where `owner` has no `name` (a supported
    version without it), applying does nothing.
    """

    def __init__(self, owner: Any, name: str, make: Callable[[Any], Any], *,
                 guards: Sequence[Guard] = (), optional: bool = False):
        self.owner, self.name, self.make = owner, name, make
        self.guards, self.optional = tuple(guards), optional
        self._saved: tuple[bool, Any] | None = None
        self.original: Any = None

    @property
    def label(self) -> str:
        """The patch in words: `keras_replicator._compat.keras_xla's patch of TensorFlowTrainer._make_function`."""
        module = getattr(self.make, "__module__", None) or "keras_replicator._compat"
        owner = getattr(self.owner, "__name__", type(self.owner).__name__)
        return f"{module}'s patch of {owner}.{self.name}"

    @property
    def applied(self) -> bool:
        return self._saved is not None

    def check(self) -> bool:
        """Verifies the guards (raises `IncompatiblePatchError`); False: optional and absent."""
        if not hasattr(self.owner, self.name):
            if self.optional:
                return False
            raise IncompatiblePatchError(
                f"{self.label}: {self.name} is missing on the installed {_versions_line()}. "
                "Nothing was patched. Use a supported pair (keras_replicator.versions).")
        for guard in self.guards:
            guard.verify(self.label)
        return True

    def apply(self) -> None:
        if self._saved is not None:
            return
        if not self.check():
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
                for patch in self.patches:  # every guard before any patch: all or nothing
                    patch.check()
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
