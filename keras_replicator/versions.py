"""The one place that decides which TensorFlow and Keras keras_replicator supports.

`import keras_replicator`, a strategy's creation, `keras-replicator info` and the
tests all read this module (it imports neither TensorFlow nor Keras: versions
are read from the installed distributions' metadata).

* **Supported** (`SUPPORTED`): TensorFlow 2.16-2.21 with Keras 3.8-3.15, every
  minor of each axis in the matrix (`PAIRS`: the pairs the core subset of the
  suite runs on, `make test-versions`).
* **Below a floor**: `import keras_replicator` raises `UnsupportedVersionError`,
  naming the installed versions, the range, why the floor is where it is
  (`FLOOR_REASONS`) and the `pip install` that fixes it.
* **Above the tested ceiling** (a newer Keras or TensorFlow): it imports, and
  making a strategy warns (`UntestedVersionWarning`), naming the `_compat`
  modules checked on older versions only; each patch's guard
  (`keras_replicator._compat.patching`) still checks what it patches and refuses
  where that changed. Setting `KERAS_REPLICATOR_UNTESTED_OK=1` silences the
  warning (for users who test a new release themselves).

Example:
    ```python
    from keras_replicator import versions

    support = versions.check()
    print(support.status)      # "supported" on a tested pair
    print(versions.describe())  # e.g. "TensorFlow 2.16-2.21 with Keras 3.8-3.15"
    ```
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
import warnings

__all__ = [
    "FLOOR_REASONS",
    "IncompatiblePatchError",
    "OPT_OUT",
    "CI_PAIRS",
    "PAIRS",
    "SUPPORTED",
    "Support",
    "UnsupportedVersionError",
    "UntestedVersionWarning",
    "check",
    "describe",
    "installed",
]

# The range, inclusive, by minor: (lowest, highest tested).
SUPPORTED: dict[str, tuple[str, str]] = {
    "tensorflow": ("2.16", "2.21"),
    "keras": ("3.8", "3.15"),
}

# Why each floor is where it is (shown by the refusal).
FLOOR_REASONS: dict[str, str] = {
    "keras": (
        "Keras below 3.8 sums the replicas' gradients without dividing by their number under "
        "any tf.distribute strategy (stock MirroredStrategy included; measured on Keras 3.5, 3.6 "
        "and 3.7 with TensorFlow 2.16: one SGD step on 4 replicas moves the weights 4.0x as far "
        "as on one device; Keras 3.8 fixed it), so any strategy trains wrong there"
    ),
    "tensorflow": (
        "TensorFlow below 2.16 brings Keras 2 (tf.keras), and keras_replicator is for Keras 3 "
        "on TensorFlow; TensorFlow 2.16 is the oldest tested"
    ),
}

# Setting this environment variable to 1 silences the warning above the tested ceiling.
OPT_OUT = "KERAS_REPLICATOR_UNTESTED_OK"

# The matrix the core subset of the suite (`pytest -m core`) runs on, `make test-versions`,
# (tensorflow, keras): the oldest pair, the newest Keras on each TensorFlow, and the newest
# TensorFlow pip installs with each Keras (TensorFlow 2.20 requires keras>=3.10, 2.21
# keras>=3.12, in their metadata; 2.16-2.19 take any Keras of the range). `.ci/run` runs the
# full suite on the newest pair and the core subset on 2.16.2 + 3.8.0 and 2.19.1 + 3.10.0
# (TensorFlow's last release with TPU support, with its Keras).
PAIRS: tuple[tuple[str, str], ...] = (
    ("2.16.2", "3.8.0"),
    ("2.16.2", "3.15.1"),
    ("2.17.1", "3.15.1"),
    ("2.18.1", "3.15.1"),
    ("2.19.1", "3.8.0"),
    ("2.19.1", "3.9.2"),
    ("2.19.1", "3.10.0"),
    ("2.19.1", "3.15.1"),
    ("2.20.0", "3.10.0"),
    ("2.20.0", "3.11.3"),
    ("2.20.0", "3.15.1"),
    ("2.21.0", "3.12.4"),
    ("2.21.0", "3.13.2"),
    ("2.21.0", "3.14.1"),
    ("2.21.0", "3.15.1"),
)
CI_PAIRS: tuple[tuple[str, str], ...] = (("2.16.2", "3.8.0"), ("2.19.1", "3.10.0"))

# Distribution names that install each package's modules.
_DISTRIBUTIONS = {
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-macos", "tensorflow-intel",
                   "tf-nightly"),
    "keras": ("keras", "keras-nightly"),
}


class UnsupportedVersionError(ImportError):
    """The installed TensorFlow or Keras is below keras_replicator's supported range."""


class IncompatiblePatchError(RuntimeError):
    """A patch found what it patches changed: Keras or TensorFlow is not what it was written for.

    Raised before the patch is applied (`keras_replicator._compat.patching`), naming the
    patch, the symbol it checked and the installed versions.
    """


class UntestedVersionWarning(UserWarning):
    """The installed TensorFlow or Keras is newer than any keras_replicator was tested with."""


def minor(version: str) -> tuple[int, int]:
    """`"3.10.0"` -> `(3, 10)`; pre-releases and local tags count as their minor (`"3.16.0.dev1"`)."""
    match = re.match(r"(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return int(match.group(1)), int(match.group(2) or 0)


def installed() -> dict[str, str | None]:
    """The installed version of each package in `SUPPORTED` (None if not installed)."""
    found: dict[str, str | None] = {}
    for package, names in _DISTRIBUTIONS.items():
        found[package] = None
        for name in names:
            try:
                found[package] = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def describe() -> str:
    """The supported range in words: "TensorFlow 2.16-2.21 with Keras 3.8-3.15"."""
    tf_low, tf_high = SUPPORTED["tensorflow"]
    k_low, k_high = SUPPORTED["keras"]
    return f"TensorFlow {tf_low}-{tf_high} with Keras {k_low}-{k_high}"


def _pip_command() -> str:
    tf_low, tf_high = SUPPORTED["tensorflow"]
    k_low, k_high = SUPPORTED["keras"]
    tf_next = f"{minor(tf_high)[0]}.{minor(tf_high)[1] + 1}"
    k_next = f"{minor(k_high)[0]}.{minor(k_high)[1] + 1}"
    return f'python -m pip install "tensorflow>={tf_low},<{tf_next}" "keras>={k_low},<{k_next}"'


@dataclasses.dataclass(frozen=True)
class Support:
    """What `check` decided: `status` is "supported", "untested" (above a ceiling) or "unsupported"."""

    status: str
    versions: dict[str, str | None]
    message: str
    above: tuple[str, ...] = ()  # the packages newer than the tested ceiling


def _installed_line(versions: dict[str, str | None]) -> str:
    return ", ".join(f"{p} {v or 'not installed'}" for p, v in versions.items())


def check(versions: dict[str, str | None] | None = None) -> Support:
    """Where `versions` (default: the installed ones) stand against `SUPPORTED`."""
    versions = installed() if versions is None else dict(versions)
    below, above = [], []
    for package, (low, high) in SUPPORTED.items():
        version = versions.get(package)
        if version is None or minor(version) < minor(low):
            below.append(package)
        elif minor(version) > minor(high):
            above.append(package)
    head = f"keras_replicator supports {describe()}; installed: {_installed_line(versions)}."
    if below:
        reasons = []
        for package in below:
            if versions.get(package) is None:
                reasons.append(f"{package} is not installed")
            else:
                reasons.append(f"{package} {versions[package]} is below {SUPPORTED[package][0]}: "
                               f"{FLOOR_REASONS[package]}")
        message = f"{head} {'. '.join(reasons)}. Fix: {_pip_command()}"
        return Support("unsupported", versions, message)
    if above:
        newer = ", ".join(f"{p} {versions[p]}" for p in above)
        message = (f"{head} {newer} is newer than any tested; each patch still checks what it "
                   f"patches and refuses where that changed. Set {OPT_OUT}=1 to silence this.")
        return Support("untested", versions, message, tuple(above))
    return Support("supported", versions, f"{head} This pair is supported.")


def refuse_unsupported() -> None:
    """Raises `UnsupportedVersionError` below a floor (`import keras_replicator` calls it)."""
    support = check()
    if support.status == "unsupported":
        raise UnsupportedVersionError(support.message)


def untested_modules(support: Support, checked: dict[str, tuple[str, str, str]]) -> list[str]:
    """The modules of `checked` (`_compat.CHECKED`) checked only on versions older than installed."""
    names = []
    for module, (package, _, high) in checked.items():
        version = support.versions.get(package)
        if package in support.above and version is not None and minor(version) > minor(high):
            names.append(module)
    return names


def warn_if_untested(checked: dict[str, tuple[str, str, str]]) -> None:
    """Warns (`UntestedVersionWarning`) above a tested ceiling, unless `OPT_OUT` is set to 1.

    A strategy calls it when made, with `_compat.CHECKED` (each private-API module's range).
    """
    if os.environ.get(OPT_OUT, "") == "1":
        return
    support = check()
    if support.status != "untested":
        return
    modules = ", ".join(untested_modules(support, checked)) or "none"
    warnings.warn(f"{support.message} Modules checked on older versions only: {modules}.",
                  UntestedVersionWarning, stacklevel=3)
