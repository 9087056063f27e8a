"""`keras.RematScope` and `keras.remat` on TensorFlow (`_compat.keras_remat`), 4 devices.

Each run is compared with the same run without rematerialisation on one device:
the losses and the weights after several steps, with TensorFlow's default Grappler
settings. The recomputation itself is counted: a layer that counts its executions
runs twice per step under remat (forward, then again in the gradient), once
without; its Keras state is updated once. The order of each variable's reads and
updates in the step's graph after Grappler is checked directly.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.grappler import tf_optimizer  # Grappler as the runtime runs it

import keras_replicator as kr
from keras_replicator._compat import keras_api_patches
from keras_replicator.model_parallel import fsdp

X = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
Y = np.random.default_rng(1).normal(size=(64, 1)).astype("float32")
KERAS_21207 = "custom_gradient decorator currently supports keywords arguments only when eager"


class Counted(keras.layers.Layer):
    """A Dense-like layer that counts how often its call runs (in a TensorFlow variable, which
    Keras does not track, so per execution) and its calls (in a Keras weight, its state)."""

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], 16), initializer="glorot_uniform")
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False)
        self.executions = tf.Variable(0.0, trainable=False)

    def call(self, x):
        self.executions.assign_add(1.0)
        self.calls.assign_add(1.0)
        return tf.nn.relu(x @ self.kernel)


def mlp_layers():
    return [keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(16, activation="tanh", name="remat_middle"), keras.layers.Dense(1)]


def train(*, remat=None, strategy=None, layers=mlp_layers, epochs=2, run_eagerly=False):
    """A 3-layer MLP's fit; `remat` is a RematScope's keywords, the scope around the layers only."""
    keras.utils.set_random_seed(1)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        with keras.RematScope(**remat) if remat else contextlib.nullcontext():
            made = layers()
        model = keras.Sequential([keras.Input((8,)), *made])
        model.compile(keras.optimizers.SGD(0.1), "mse", run_eagerly=run_eagerly)
    history = model.fit(X, Y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history["loss"]


def assert_same_run(run, reference, atol=1e-6):
    (model, losses), (ref_model, ref_losses) = run, reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for weight, ref in zip(model.get_weights(), ref_model.get_weights(), strict=True):
        np.testing.assert_allclose(weight, ref, atol=atol)


@pytest.fixture(scope="module")
def reference():
    return train()


def test_keras_remat_fails_in_graph_mode_without_the_patch():
    """The Keras bug the patch mends (keras#21207): if this fails, Keras fixed it; re-check the patch."""
    keras_api_patches().uninstall()
    try:
        with pytest.raises(ValueError, match=KERAS_21207):
            train(remat={"mode": "full"}, epochs=1)
    finally:
        keras_api_patches().install()


@pytest.mark.parametrize("remat", [
    {"mode": "full"},
    {"mode": "activations"},
    {"mode": "larger_than", "output_size_threshold": 8},
    {"mode": "list_of_layers", "layer_names": ["remat_middle"]},
], ids=lambda r: r["mode"])
def test_remat_scope_trains_as_without_it_on_one_device(remat, reference):
    assert_same_run(train(remat=remat), reference)


def test_remat_scope_eagerly(reference):
    assert_same_run(train(remat={"mode": "full"}, run_eagerly=True), reference)


@pytest.mark.core
@pytest.mark.skipif(not hasattr(keras, "RematScope"), reason="keras.RematScope is from Keras 3.9")
@pytest.mark.parametrize("trace_once", [True, False], ids=["traced_once", "per_replica"])
def test_remat_scope_under_the_strategy_trains_as_one_device(trace_once, reference):
    strategy = kr.ReplicatorStrategy(trace_once=trace_once)
    assert_same_run(train(remat={"mode": "full"}, strategy=strategy), reference)


def test_attention_under_remat_gets_its_keyword_tensors_gradients():
    """`MultiHeadAttention(query, value=..., key=...)`: tensors passed by keyword, differentiated."""
    sequences = np.random.default_rng(2).normal(size=(32, 6, 8)).astype("float32")
    targets = np.random.default_rng(3).normal(size=(32, 6, 8)).astype("float32")
    weights = []
    for remat in (None, {"mode": "full"}):
        keras.utils.set_random_seed(4)
        with keras.RematScope(**remat) if remat else contextlib.nullcontext():
            project = keras.layers.Dense(8)
            attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
        inputs = keras.Input((6, 8))
        context = project(inputs)
        model = keras.Model(inputs, attention(inputs, value=context, key=context))
        model.compile(keras.optimizers.SGD(0.1), "mse")
        model.fit(sequences, targets, batch_size=8, epochs=1, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    # `project` learns only through `value=` and `key=`: a lost keyword gradient would leave it
    # where it started under remat, and moved without.
    for weight, ref in zip(weights[1], weights[0], strict=True):
        np.testing.assert_allclose(weight, ref, atol=1e-6)


class DenseDropout(keras.layers.Layer):
    """Dense then Dropout(0.5) in one layer: its recomputation must draw the forward's mask."""

    def build(self, shape):
        self.dense = keras.layers.Dense(16, activation="relu")
        self.dropout = keras.layers.Dropout(0.5, seed=3)

    def call(self, x, training=None):
        return self.dropout(self.dense(x), training=training)


@pytest.mark.parametrize("devices", [1, 4])
def test_dropout_inside_remat_draws_the_forwards_masks(devices):
    runs = []
    for remat in (None, {"mode": "full"}):
        strategy = kr.ReplicatorStrategy() if devices > 1 else None
        runs.append(train(remat=remat, strategy=strategy,
                          layers=lambda: [DenseDropout(), keras.layers.Dense(1)]))
    assert_same_run(runs[1], runs[0])


LAYOUTS = {
    "tensor_parallel_2x2": ((2, 2), {".*column/kernel": (None, "model"), ".*column/bias": ("model",),
                                     ".*row/kernel": ("model", None)}),
    "fsdp_4": ((4, 1), {".*column/kernel": ("batch", None), ".*row/kernel": ("batch", None)}),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_remat_under_layouts_trains_as_without_it(layout):
    """Sharded and FSDP-split weights: the layer's state read once is each replica's shard."""
    shape, rules = LAYOUTS[layout]
    runs = []
    for remat in (None, {"mode": "full"}):
        mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], [f"cpu:{i}" for i in range(4)])
        layout_map = keras.distribution.LayoutMap(mesh)
        for rule, axes in rules.items():
            layout_map[rule] = axes
        runs.append(train(remat=remat, strategy=kr.ReplicatorStrategy(layout_map=layout_map),
                          layers=lambda: [keras.layers.Dense(16, activation="relu", name="column"),
                                          keras.layers.Dense(1, name="row")]))
    split = [w.path for w in runs[1][0].weights if "_shard" in w.path or fsdp.replica_slices(w)]
    assert len(split) >= 2, split  # the layout did shard the kernels
    assert_same_run(runs[1], runs[0])


def test_remat_under_the_strategy_is_traced_once_not_per_replica():
    """The recomputation is part of the replica step: traced once with it, 4 times per replica."""
    traced = []

    class Traced(Counted):
        def call(self, x):
            traced.append(self.name)  # Python: runs when the step is traced, not when it runs
            return super().call(x)

    for trace_once in (True, False):
        train(remat={"mode": "full"}, strategy=kr.ReplicatorStrategy(trace_once=trace_once),
              layers=lambda trace_once=trace_once: [Traced(name=f"traced_{trace_once}"),
                                                    keras.layers.Dense(1)], epochs=1)
    traces = {trace_once: traced.count(f"traced_{trace_once}") for trace_once in (True, False)}
    # Per replica, the 3 other replicas trace the forward and the recomputation again.
    assert traces[False] >= traces[True] + 3 * 2


def test_remat_recomputes_the_forward_in_the_gradient_and_updates_state_once():
    executions, calls = {}, {}
    for remat in (None, {"mode": "full"}):
        model, _ = train(remat=remat, layers=lambda: [Counted(), keras.layers.Dense(1)], epochs=1)
        executions[bool(remat)] = float(model.layers[0].executions.numpy())
        calls[bool(remat)] = float(model.layers[0].calls.numpy())
    steps = len(X) // 16
    assert executions == {False: steps, True: 2 * steps}
    assert calls == {False: steps, True: steps}  # the recomputation's assignment is dropped


def test_batch_normalization_under_remat_updates_its_moving_statistics_once():
    """Training-mode BatchNormalization: recomputed, its moving mean and variance must still
    move once per step (a second update would leave them elsewhere than without remat)."""
    def layers():
        return [keras.layers.Dense(16), keras.layers.BatchNormalization(momentum=0.5), keras.layers.Dense(1)]

    runs = [train(remat=remat, layers=layers) for remat in (None, {"mode": "full"})]
    assert_same_run(runs[1], runs[0])
    assert not np.allclose(runs[0][0].layers[1].moving_mean.numpy(), 0.0)  # they moved


def test_mixed_precision_under_remat_trains_as_without_it():
    """float16 compute, float32 weights: the recomputation (run by the tape, after the layer's
    call returned) computes in float16 as the forward did (it failed on a float32 tanh)."""
    def layers():
        return [keras.layers.Dense(16, activation="relu", dtype="mixed_float16"),
                keras.layers.Dense(16, activation="tanh", dtype="mixed_float16"), keras.layers.Dense(1)]

    runs = [train(remat=remat, layers=layers) for remat in (None, {"mode": "full"})]
    assert runs[1][0].layers[0].compute_dtype == "float16"
    assert_same_run(runs[1], runs[0])


def unordered_reads_and_updates(model) -> list[str]:
    """Each read of a variable that TensorFlow's default Grappler leaves unordered with an
    update of it, in the graph of one training step (with `variable` read before or after the
    update depending on scheduling: a race)."""
    step = tf.function(lambda x, y: model.train_step((x, y)))
    function = step.get_concrete_function(tf.TensorSpec((16, 8)), tf.TensorSpec((16, 1)))
    graph = function.graph
    meta = tf.compat.v1.train.export_meta_graph(graph_def=graph.as_graph_def(), graph=graph)
    # What the runtime keeps: the outputs, and the stateful ops (the function's control outputs).
    meta.collection_def["train_op"].node_list.value.extend(
        [t.name for t in function.outputs] + [op.name for op in graph.control_outputs])
    nodes = tf_optimizer.OptimizeGraph(config_pb2.ConfigProto(), meta).node
    inputs = {n.name: [i.lstrip("^").split(":")[0] for i in n.input] for n in nodes}

    def ancestors(name):
        seen, stack = set(), [name]
        while stack:
            for parent in inputs[stack.pop()]:
                if parent not in seen:
                    seen.add(parent)
                    stack.append(parent)
        return seen

    reads = [n.name for n in nodes if n.op == "ReadVariableOp"]
    updates = [n.name for n in nodes if n.op in ("AssignSubVariableOp", "AssignVariableOp",
                                                  "AssignAddVariableOp")]
    assert updates, "no variable update found: the check would pass vacuously"
    return [f"{read} / {update}" for update in updates for read in reads
            if inputs[read][0] == inputs[update][0]  # the same variable's handle
            and read not in ancestors(update) and update not in ancestors(read)]


@pytest.mark.parametrize("remat", [None, {"mode": "full"}, {"mode": "larger_than", "output_size_threshold": 8}],
                         ids=lambda r: r["mode"] if r else "no_remat")
def test_every_read_of_a_variable_is_ordered_with_its_update_after_grappler(remat):
    """The race that made remat runs differ (up to 2.8e-3 in 8 of 267 seeded runs): with
    `tf.recompute_grad` reading the kernels again in the gradient, Grappler's dependency
    optimizer dropped the control edge that ordered the last Dense kernel's read (for its input's
    gradient) before the kernel's update, so the update could come first."""
    model, _ = train(remat=remat, epochs=1)
    assert unordered_reads_and_updates(model) == []


def test_keras_remat_passes_gradients_to_keyword_tensors():
    """`keras.remat(f)(x, scale=s, mask=m)`: `s` gets its gradient, `m` (bool) is passed as is."""
    x = tf.constant(np.linspace(-1, 1, 12, dtype="float32").reshape(3, 4))
    scale = tf.constant(np.float32(1.5))
    mask = tf.constant([True, False, True])

    def f(x, *, scale, mask):
        return tf.where(mask[:, None], tf.sin(x * scale), tf.zeros_like(x))

    @tf.function
    def gradients(fn):
        with tf.GradientTape() as tape:
            tape.watch([x, scale])
            loss = tf.reduce_sum(fn(x, scale=scale, mask=mask) ** 2)
        return tape.gradient(loss, [x, scale])

    expected = gradients(f)
    got = gradients(keras.remat(f))
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-6)
    assert float(tf.abs(got[1])) > 0


def test_remat_scope_under_keras_data_parallel_trains_as_one_device(reference):
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        run = train(remat={"mode": "full"})
        assert run[0].distribute_strategy.num_replicas_in_sync == 4
    finally:
        keras.distribution.set_distribution(None)
    assert_same_run(run, reference)
