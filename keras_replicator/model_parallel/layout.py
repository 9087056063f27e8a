"""Which variables a `keras.distribution.LayoutMap` shards, and how: Keras's rule, checked.

Keras's `LayoutMap[path]` (keras/src/distribution/distribution_lib.py) returns the
layout of the exact key, else of the one key whose regex `re.fullmatch`es the
variable's path; a path matching two keys raises, a path matching none is
replicated. `LayoutRules` applies the same rule, and adds the checks Keras leaves
to the out-of-memory that follows (keras-hub#2806, keras-hub#1613): every error
names the variable and the rule, and comes before any step.

* a rule naming an axis the mesh does not have: when the rules are made;
* a variable matching two rules, a layout whose rank is not the variable's, a
  sharded dimension its axis does not divide: when the variable is created;
* a rule that matched no variable: checked where every variable exists (the
  strategy checks at `compile` when the model is built, else when `fit`,
  `evaluate` or `predict` first run). Keras ignores such a rule; so does the
  strategy, with a `LayoutWarning` naming the rules and the variables no rule
  matched (`unmatched_message`), unless `strict_layouts=True` makes it a
  `LayoutError` (`check_all_rules_matched()`, which `ModelSharding.scope()`'s
  users call themselves).

The mesh's axes are a data axis (`batch`) and a model axis (`model`), the names
Keras's `ModelParallel` and KerasHub's `get_layout_map` use. A layout naming the
model axis on a dimension stores the variable as k shards over it; the data axis
is checked (divisibility) and the variable stays whole over the replicas.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import keras

from keras_replicator._validation import ArgumentError
from keras_replicator.errors import LayoutError

__all__ = ["DATA_AXIS", "MODEL_AXIS", "LayoutRules", "VariableLayout"]

DATA_AXIS = "batch"
MODEL_AXIS = "model"


@dataclass(frozen=True)
class VariableLayout:
    """One variable's resolved layout.

    Attributes:
        path: the variable's Keras path (`"dense/kernel"`).
        shape: its full shape.
        axes: the mesh axis of each dimension (`None`: not split).
        rule: the `LayoutMap` key that matched.
        model_dim: the dimension split over the model axis, or `None`.
        num_shards: k, the size of the model axis (1 when `model_dim` is `None`).
    """

    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    rule: str
    model_dim: int | None
    num_shards: int

    @property
    def sharded(self) -> bool:
        """Whether the variable is stored as more than one shard."""
        return self.model_dim is not None and self.num_shards > 1


class LayoutRules:
    """A `LayoutMap`'s rules, matched as Keras matches them, with clear errors.

    Args:
        layout_map: a `keras.distribution.LayoutMap` whose `DeviceMesh` has the
            axes `model_axis` and (optionally) `data_axis`.
        model_axis: the name of the axis that splits a replica's variables.
        data_axis: the name of the axis over the replicas.

    Example:
        ```python
        import keras
        from keras_replicator.model_parallel.layout import LayoutRules

        mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], ["cpu:0", "cpu:1"])
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map["dense/kernel"] = (None, "model")
        rules = LayoutRules(layout_map)
        rules.model_size                                   # 2
        rules.resolve("dense/kernel", (8, 4)).model_dim     # 1: split on the output dimension
        rules.resolve("dense/bias", (4,))                   # None: no rule, replicated
        rules.check_all_rules_matched("example")            # every rule matched a variable
        ```
    """

    def __init__(self, layout_map: keras.distribution.LayoutMap, *, model_axis: str = MODEL_AXIS, data_axis: str = DATA_AXIS):
        if not isinstance(layout_map, keras.distribution.LayoutMap):
            raise ArgumentError(
                f"layout_map must be a keras.distribution.LayoutMap, got {type(layout_map).__name__}."
            )
        mesh = layout_map.device_mesh
        if mesh is None:
            raise ArgumentError("layout_map has no DeviceMesh: make it with LayoutMap(device_mesh).")
        names = tuple(mesh.axis_names)
        unknown = [n for n in names if n not in (model_axis, data_axis)]
        if unknown or model_axis not in names:
            raise LayoutError(
                f"the DeviceMesh's axes are {list(names)}; keras_replicator needs a model axis "
                f"{model_axis!r} and optionally a data axis {data_axis!r} (the names Keras's "
                "ModelParallel and KerasHub's get_layout_map use)."
            )
        self.layout_map = layout_map
        self.model_axis, self.data_axis = model_axis, data_axis
        self.axis_sizes = dict(zip(names, mesh.shape))
        self._axes = {rule: self._checked_axes(rule, layout_map[rule]) for rule in layout_map}
        self._matched: dict[str, list[str]] = {rule: [] for rule in self._axes}
        self._unmatched_paths: list[str] = []  # the variables no rule matched (replicated)

    def _checked_axes(self, rule: str, layout) -> tuple[str | None, ...]:
        axes = tuple(layout.axes)
        named = [a for a in axes if a is not None]
        for axis in named:
            if axis not in self.axis_sizes:
                raise LayoutError(
                    f"LayoutMap rule {rule!r} -> {axes} names the axis {axis!r}, which the "
                    f"DeviceMesh does not have (its axes: {list(self.axis_sizes)})."
                )
        if len(set(named)) != len(named):
            raise LayoutError(f"LayoutMap rule {rule!r} -> {axes} names an axis twice.")
        return axes

    @property
    def model_size(self) -> int:
        """k: the model axis's size (shards per sharded variable)."""
        return self.axis_sizes[self.model_axis]

    @property
    def data_size(self) -> int:
        """M: the data axis's size (replicas), 1 without a data axis."""
        return self.axis_sizes.get(self.data_axis, 1)

    def mesh_devices(self) -> list[str]:
        """The mesh's devices replica by replica (TensorFlow's names): replica r's j-th is [r * k + j]."""
        mesh = self.layout_map.device_mesh
        grid = mesh.devices
        if list(mesh.axis_names)[0] == self.model_axis and grid.ndim == 2:
            grid = grid.T
        return [_tf_device(d) for d in grid.reshape(-1)]

    def rule_for(self, path: str) -> str | None:
        """The rule matching `path` by Keras's rule (exact key, else one `re.fullmatch`)."""
        if path in self._axes:
            return path
        matching = [rule for rule in self._axes if re.fullmatch(rule, path)]
        if len(matching) > 1:
            raise LayoutError(
                f"the variable {path!r} matches {len(matching)} LayoutMap rules: {matching}. "
                "Keras needs at most one: make the rules' regexes exclusive."
            )
        return matching[0] if matching else None

    def resolve(self, path: str, shape: Sequence[int]) -> VariableLayout | None:
        """The layout of the variable `path` of shape `shape`; `None` when no rule matches."""
        rule = self.rule_for(path)
        if rule is None:
            self._unmatched_paths.append(path)
            return None
        shape = tuple(int(d) for d in shape)
        axes = self._axes[rule]
        if len(axes) != len(shape):
            raise LayoutError(
                f"LayoutMap rule {rule!r} -> {axes} has {len(axes)} dimensions, but the variable "
                f"{path!r} it matches has shape {shape} ({len(shape)} dimensions)."
            )
        for dim, (axis, size) in enumerate(zip(axes, shape)):
            if axis is not None and size % self.axis_sizes[axis]:
                raise LayoutError(
                    f"LayoutMap rule {rule!r} -> {axes} splits dimension {dim} of the variable "
                    f"{path!r} (shape {shape}) over the mesh axis {axis!r} of size "
                    f"{self.axis_sizes[axis]}, which does not divide {size}."
                )
        self._matched[rule].append(path)
        model_dim = axes.index(self.model_axis) if self.model_axis in axes else None
        return VariableLayout(path, shape, axes, rule, model_dim, self.model_size if model_dim is not None else 1)

    def unmatched_rules(self) -> list[str]:
        """The rules that no resolved variable matched yet."""
        return [rule for rule, paths in self._matched.items() if not paths]

    def unmatched_variables(self) -> list[str]:
        """The paths of the variables no rule matched (kept whole on every device), in order."""
        return list(dict.fromkeys(self._unmatched_paths))

    def unmatched_message(self, where: str, limit: int = 20) -> str | None:
        """What the unmatched rules are and which variables no rule matched; `None` if every rule matched.

        Args:
            where: when the check runs, for the message (`"compile"`, `"the first fit"`).
            limit: at most this many unmatched variables are named (then their count).
        """
        unmatched = self.unmatched_rules()
        if not unmatched:
            return None
        variables = self.unmatched_variables()
        named = ", ".join(repr(p) for p in variables[:limit])
        if len(variables) > limit:
            named += f", ... ({len(variables)} in all)"
        return (
            f"LayoutMap rules {unmatched} match no variable of the model (checked at {where}, "
            "when every variable exists): they lay nothing out, as in Keras. A renamed layer would "
            "leave its weights whole on every device (keras-hub#2806). Variables no rule matched "
            f"(replicated whole): [{named}]."
        )

    def check_all_rules_matched(self, where: str) -> None:
        """Raises `LayoutError` if a rule matched no variable (call once every variable exists).

        Args:
            where: when the check runs, for the message (`"compile"`, `"the first fit"`).
        """
        message = self.unmatched_message(where)
        if message is not None:
            raise LayoutError(message)


def _tf_device(name) -> str:
    """Keras's device name (`"cpu:0"`) as TensorFlow's (`"/device:CPU:0"`)."""
    name = str(name)
    if name.startswith("/"):
        return name
    kind, _, index = name.rpartition(":")
    return f"/device:{kind.upper()}:{index}"
