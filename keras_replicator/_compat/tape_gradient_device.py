"""Gradients computed where their forward op ran, in a replica that spans several devices.

`tf.GradientTape` builds an op's gradient in the device scope current when
`gradient()` is called: `backprop._gradient_function`, which the C++ tape calls
back (registered by `pywrap_tfe.TFE_Py_RegisterGradientFunction`), gets no
device. In a replica of `ReplicatorStrategy(devices_per_replica=k)` that scope
is the replica's logical device 0, so the backward pass of a stage placed on
logical device 1 with `kr.logical_device(1)` would run on device 0 and its
activations would be copied there (measured: every gradient MatMul of a
two-stage model on CPU:0). `tf.gradients` colocates gradients with their ops;
the tape does not.

`PATCHES` (installed by `keras_replicator._compat.install()`), checked on
TensorFlow 2.21:

* `execute.record_gradient` (what generated op wrappers call to record an op
  on the tape, with the name scope the tape hands back to the gradient
  function): while a graph is built under a keras_replicator strategy with
  ``devices_per_replica > 1``, the recorded name scope is a `str` that also
  carries the device the op was made under;
* `backprop._gradient_function`, re-registered with the tape: a gradient whose
  name scope carries a device is built on that device.

Elsewhere both are TensorFlow's functions, unchanged.
"""

from __future__ import annotations

import functools

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import backprop, execute
from tensorflow.python.framework import ops

from keras_replicator._compat.patching import ScopedPatch, ours


class _PlacedScope(str):
    """A forward op's name scope, with the device it was made under."""

    device: str


def _model_parallel() -> bool:
    strategy = tf.distribute.get_strategy()
    return ours(strategy) and getattr(strategy.extended, "devices_per_replica", 1) > 1


def _recording(original):
    @functools.wraps(original)
    def record_gradient(op_name, inputs, attrs, outputs):
        if not outputs or isinstance(outputs[0], ops.EagerTensor) or not _model_parallel():
            return original(op_name, inputs, attrs, outputs)
        placed = getattr(outputs[0], "device", "")
        if not placed:
            return original(op_name, inputs, attrs, outputs)
        scope = _PlacedScope(ops.get_name_scope())
        scope.device = placed
        pywrap_tfe.TFE_Py_RecordGradient(op_name, inputs, attrs, outputs, scope)

    return record_gradient


def _placed(original):
    @functools.wraps(original)
    def _gradient_function(op_name, attr_tuple, num_inputs, inputs, outputs, out_grads,
                           skip_input_indices, forward_pass_name_scope):
        device = getattr(forward_pass_name_scope, "device", None)
        if device is None:
            return original(op_name, attr_tuple, num_inputs, inputs, outputs, out_grads,
                            skip_input_indices, forward_pass_name_scope)
        with ops.device(device):
            return original(op_name, attr_tuple, num_inputs, inputs, outputs, out_grads,
                            skip_input_indices, str(forward_pass_name_scope))

    return _gradient_function


class _RegisteredGradientFunction(ScopedPatch):
    """The module attribute patched, and whatever it holds registered with the C++ tape."""

    def apply(self) -> None:
        super().apply()
        pywrap_tfe.TFE_Py_RegisterGradientFunction(backprop._gradient_function)

    def restore(self) -> None:
        super().restore()
        pywrap_tfe.TFE_Py_RegisterGradientFunction(backprop._gradient_function)


# Installed by keras_replicator._compat.install(), undone by uninstall().
PATCHES = (
    ScopedPatch(execute, "record_gradient", _recording),
    _RegisteredGradientFunction(backprop, "_gradient_function", _placed),
)
