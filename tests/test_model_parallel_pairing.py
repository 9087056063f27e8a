"""Megatron's pairing (issue 41, item 2): a row-parallel layer reads the column-parallel parts.

The traced step of a column -> row pair has no concat or split of the activation between
them (the parts stay on their logical devices), and its loss and gradients are one
device's; a pair broken by anything between the layers falls back to the gather and
stays correct. The strategy-level equivalence (MLP and transformer, (1, 4) and (2, 2),
SGD and AdamW) is in tests/test_model_parallel_layouts.py, which also asserts the pairing ran.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_replicator.model_parallel import parallel_layers
from keras_replicator.model_parallel.sharding import ModelSharding

B, T, D, F, K = 5, 7, 8, 16, 4     # a batch size no weight dimension has: it marks activations


def layout_map(**rules) -> keras.distribution.LayoutMap:
    mesh = keras.distribution.DeviceMesh((1, K), ["batch", "model"], [f"cpu:{i}" for i in range(K)])
    result = keras.distribution.LayoutMap(mesh)
    for path, layout in rules.items():
        result[path] = layout
    return result


COLUMN_ROW = dict([(".*column/kernel", (None, "model")), (".*column/bias", ("model",)),
                   (".*row/kernel", ("model", None))])


def dense_pair(between=None, activation="relu"):
    x = keras.Input((D,))
    h = keras.layers.Dense(F, activation=activation, name="column")(x)
    if between is not None:
        h = between(h)
    return keras.Model(x, keras.layers.Dense(3, name="row")(h))


def einsum_pair():
    x = keras.Input((T, D))
    h = keras.layers.EinsumDense("btd,df->btf", (T, F), bias_axes="f", activation="gelu", name="column")(x)
    return keras.Model(x, keras.layers.EinsumDense("btf,fd->btd", (T, D), bias_axes="d", name="row")(h))


def gemma_gating():
    """KerasHub Gemma's FFN: two column-parallel projections, gelu, their product, a row one."""
    x = keras.Input((T, D))
    gate = keras.layers.EinsumDense("btd,df->btf", (T, F), name="gating_column")(x)
    up = keras.layers.EinsumDense("btd,df->btf", (T, F), name="up_column")(x)
    h = keras.activations.gelu(gate, approximate=True) * up
    return keras.Model(x, keras.layers.EinsumDense("btf,fd->btd", (T, D), name="row")(h))


CASES = {
    # name: (model, layout rules, paired)
    "dense": (dense_pair, COLUMN_ROW, True),
    "einsum": (einsum_pair, COLUMN_ROW, True),
    "norm-between": (lambda: dense_pair(keras.layers.LayerNormalization(), None), COLUMN_ROW, False),
    "activation-layer": (lambda: dense_pair(keras.layers.Activation("relu"), None), COLUMN_ROW, True),
    "softmax": (lambda: dense_pair(activation="softmax"), COLUMN_ROW, False),
    "gemma-gating": (gemma_gating, {".*_column/kernel": (None, "model"), ".*row/kernel": ("model", None)},
                     True),
}


def reachable_ops(concrete) -> list:
    """The ops the traced function runs: those its outputs depend on (TensorFlow prunes the rest)."""
    seen, stack, ops = set(), [t.op for t in concrete.outputs], []
    while stack:
        op = stack.pop()
        if op.name not in seen:
            seen.add(op.name)
            ops.append(op)
            stack += [t.op for t in op.inputs] + list(op.control_inputs)
    return ops


def activation_moves(ops) -> list[str]:
    """Concats and splits of activations (a tensor with the batch dimension B), forward or backward."""
    return sorted(op.type for op in ops if op.type in ("ConcatV2", "Split", "SplitV", "Slice", "StridedSlice")
                  and any(o.shape.rank and o.shape[0] == B for o in op.outputs))


def activation_devices(tensor) -> set[str]:
    """The devices of the ops that made `tensor` from the model's input, through activations."""
    devices, stack, seen = set(), [tensor], set()
    while stack:
        t = stack.pop()
        if t.op.type == "Placeholder" or t.op.name in seen:
            continue
        seen.add(t.op.name)
        devices.add(t.op.device)
        stack += [i for i in t.op.inputs if i.shape.rank and i.shape[0] == B]
    return devices


def step_function(model):
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        return loss, tape.gradient(loss, model.trainable_weights)

    return step


def built(make, rules=None):
    keras.utils.set_random_seed(1)
    if rules is None:
        return make()
    with ModelSharding(layout_map(**rules)).scope():
        return make()


@pytest.mark.parametrize("case", list(CASES))
def test_pair_computes_on_its_parts_and_matches_one_device(case):
    """Paired: no activation concat/split in the traced step, each row part's input on its own
    device; not paired: the gather path. Both: loss and gradients (one SGD step of rate 1) as one
    device's."""
    make, rules, paired = CASES[case]
    model, ref = built(make, rules), built(make)
    shape = (B, D) if case in ("dense", "norm-between", "activation-layer", "softmax") else (B, T, D)
    x = tf.constant(np.random.default_rng(0).normal(size=shape), tf.float32)
    step = step_function(model)
    ops = reachable_ops(step.get_concrete_function(x))
    moves = activation_moves(ops)
    if paired:
        assert moves == []
        rows = [op for op in ops if "/row" in op.name and op.type in ("MatMul", "Einsum", "BatchMatMulV2")
                and not op.name.startswith("gradient_tape") and op.device]
        assert len(rows) == K
        for op in rows:                          # the part each multiplies never left its device
            assert activation_devices(op.inputs[0]) == {op.device}, op.name
        assert sorted(tf.DeviceSpec.from_string(op.device).device_index for op in rows) == list(range(K))
    else:
        assert "ConcatV2" in moves and "Split" in moves       # gathered, then cut again
    for m, function in ((model, step), (ref, step_function(ref))):
        loss, grads = function(x)
        for variable, grad in zip(m.trainable_weights, grads):
            variable.assign_sub(grad)
        m.loss_value = float(loss)
    np.testing.assert_allclose(model.loss_value, ref.loss_value, rtol=1e-5)
    for got, want in zip(model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_pairing_off_gathers_and_stays_correct(monkeypatch):
    """`parallel_layers.PAIRING = False` (the benchmark's baseline): the pair gathers, same results."""
    model, ref = built(dense_pair, COLUMN_ROW), built(dense_pair)
    monkeypatch.setattr(parallel_layers, "PAIRING", False)
    x = tf.constant(np.random.default_rng(0).normal(size=(B, D)), tf.float32)
    step = step_function(model)
    # forward: the gather (concat) and the cut (split); backward: their gradients (a concat of
    # the split's, k slices of the concat's)
    moves = activation_moves(reachable_ops(step.get_concrete_function(x)))
    assert moves == ["ConcatV2", "ConcatV2", *["Slice"] * K, "Split"]
    (loss, _), (want, _) = step(x), step_function(ref)(x)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
