"""Argument checks shared by every public function: one wording for one mistake.

Each check converts and returns the value, so a constructor reads
`self.steps = check_int("steps", steps, minimum=1)`. Wrong types and wrong
values both raise `ArgumentError` (a `ValueError` and a
`TypeError`); NumPy integers and booleans are accepted where Python's are.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

__all__ = ["ArgumentError", "check_bool", "check_choice", "check_int", "check_number"]


class ArgumentError(ValueError, TypeError):
    """An argument of the wrong type or value; raised before any work is done.

    Both a `ValueError` and a `TypeError`, so code that catches either works.
    Defined here, not in `errors`, so that the command line (which imports no
    TensorFlow) can use these checks; `keras_replicator.errors` re-exports it.

    Example:
        ```python
        try:
            kr.simulate_devices(0)
        except ValueError as e:        # or TypeError, or kr.errors.ArgumentError
            print(e)                   # n must be a positive integer, got 0.
        ```
    """

    # AutoGraph re-raises an error from traced code with its own type only for the
    # built-in types and for classes with Exception's constructor; this keeps ours.
    __init__ = Exception.__init__


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and (
        type(value).__name__ != "bool_"
    )


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    optional: bool = False,
) -> int | None:
    """`value` as an `int` within `[minimum, maximum]`; `None` passes if `optional`."""
    if value is None and optional:
        return None
    if not _is_int(value) or (minimum is not None and value < minimum) or (
        maximum is not None and value > maximum
    ):
        if minimum == 1 and maximum is None:
            kind = "a positive integer"
        elif minimum == 0 and maximum is None:
            kind = "a non-negative integer"
        elif minimum is not None and maximum is not None:
            kind = f"an integer in [{minimum}, {maximum}]"
        elif minimum is not None:
            kind = f"an integer >= {minimum}"
        elif maximum is not None:
            kind = f"an integer <= {maximum}"
        else:
            kind = "an integer"
        raise ArgumentError(f"{name} must be {kind}{' or None' if optional else ''}, got {value!r}.")
    return int(value)


def check_number(
    name: str,
    value: Any,
    *,
    positive: bool = False,
    non_negative: bool = False,
    optional: bool = False,
) -> float | None:
    """`value` as a finite `float` (`> 0` if `positive`, `>= 0` if `non_negative`)."""
    if value is None and optional:
        return None
    ok = (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and type(value).__name__ != "bool_"
        and math.isfinite(value)
        and (value > 0 if positive else True)
        and (value >= 0 if non_negative else True)
    )
    if not ok:
        kind = "a positive" if positive else "a non-negative" if non_negative else "a finite"
        raise ArgumentError(
            f"{name} must be {kind} number{' or None' if optional else ''}, got {value!r}."
        )
    return float(value)


def check_bool(name: str, value: Any, *, optional: bool = False) -> bool | None:
    """`value` as a `bool` (Python's or NumPy's); `None` passes if `optional`."""
    if value is None and optional:
        return None
    if not (isinstance(value, bool) or type(value).__name__ == "bool_"):
        kind = "True, False or None" if optional else "True or False"
        raise ArgumentError(f"{name} must be {kind}, got {value!r}.")
    return bool(value)


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """`value` if it is one of `choices`."""
    choices = tuple(choices)
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ArgumentError(f"{name} must be one of {listed}; got {value!r}.")
    return value
