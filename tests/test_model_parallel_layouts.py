"""Keras's LayoutMap over the model axis (issue 41, item 2): shards, the parallel rules, saving.

Every training test compares with the same model on one device, built from the same
seed (a sharded variable starts as the slices of the one-device initial value),
trained on the same batches: weights to 1e-5 after several steps.
"""

import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._compat import keras_layouts
from keras_replicator.model_parallel import parallel_layers
from keras_replicator.model_parallel.memory import training_bytes_per_device
from keras_replicator.model_parallel.sharded_variable import ShardedVariable
from keras_replicator.model_parallel.sharding import ModelSharding

V, T, D, HEADS = 32, 6, 16, 4


def mesh(data: int, model: int) -> keras.distribution.DeviceMesh:
    return keras.distribution.DeviceMesh(
        (data, model), ["batch", "model"], [f"cpu:{i}" for i in range(data * model)])


def mlp_layout(m) -> keras.distribution.LayoutMap:
    layout_map = keras.distribution.LayoutMap(m)
    layout_map[".*column/kernel"] = (None, "model")
    layout_map[".*column/bias"] = ("model",)
    layout_map[".*row/kernel"] = ("model", None)
    return layout_map


def mlp():
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu", name="column"),
        keras.layers.Dense(3, name="row"),
    ])


def transformer_layout(m) -> keras.distribution.LayoutMap:
    layout_map = keras.distribution.LayoutMap(m)
    layout_map[".*token/embeddings"] = ("model", None)       # by vocabulary
    layout_map[".*position/embeddings"] = (None, "model")    # by features
    layout_map[".*mha/(query|key|value)/kernel"] = (None, "model", None)
    layout_map[".*mha/(query|key|value)/bias"] = ("model", None)
    layout_map[".*mha/attention_output/kernel"] = ("model", None, None)
    layout_map[".*ffn_in/kernel"] = (None, "model")
    layout_map[".*ffn_out/kernel"] = ("model", None)
    layout_map[".*logits/kernel"] = (None, "model")
    return layout_map


def transformer():
    ids = keras.Input((T,), dtype="int32")
    x = keras.layers.Embedding(V, D, name="token")(ids)
    positions = keras.ops.zeros_like(ids) + keras.ops.arange(T, dtype="int32")   # symbolic: in the model
    x = x + keras.layers.Embedding(T, D, name="position")(positions)
    a = keras.layers.MultiHeadAttention(HEADS, D // HEADS, name="mha")(x, x, use_causal_mask=True)
    x = keras.layers.LayerNormalization(name="norm")(x + a)
    f = keras.layers.Dense(32, activation="gelu", name="ffn_in")(x)
    x = x + keras.layers.Dense(D, name="ffn_out")(f)
    return keras.Model(ids, keras.layers.Dense(V, name="logits")(x))


def data(kind: str, n: int = 24, seed: int = 0):
    rng = np.random.default_rng(seed)
    if kind == "mlp":
        return rng.normal(size=(n, 8)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")
    return rng.integers(0, V, (n, T)), rng.integers(0, V, (n, T))


def compiled(model, kind: str, optimizer: str):
    opt = keras.optimizers.SGD(0.05) if optimizer == "sgd" else keras.optimizers.AdamW(1e-2)
    loss = "mse" if kind == "mlp" else keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(opt, loss, steps_per_execution=3)
    return model


def reference(kind: str):
    keras.utils.set_random_seed(1)
    return (mlp if kind == "mlp" else transformer)()


def by_index(per_device: dict) -> dict:
    return {tf.DeviceSpec.from_string(d).device_index: b for d, b in per_device.items()}


def assert_bytes_per_device(model, replicas: int, k: int, slots: int) -> None:
    """Replica r's device j (index r * k + j) holds shard j of each sharded weight, of its
    gradient and of its slots; logical device 0 of each replica holds the whole variables."""
    sharded = sum(np.prod(v.shape) * 4 for v in model.weights if "_shard" in v.path)
    whole = sum(np.prod(v.shape) * 4 for v in model.weights) - sharded
    trainable_whole = sum(np.prod(v.shape) * 4 for v in model.trainable_weights) - sharded
    parts = {name: by_index(part) for name, part in training_bytes_per_device(model).items()}
    assert sharded > 0
    share = sharded // k
    devices = [(r * k + j, j) for r in range(replicas) for j in range(k)]
    assert parts["weights"] == {d: share + (whole if j == 0 else 0) for d, j in devices}
    assert parts["gradients"] == {d: share + (trainable_whole if j == 0 else 0) for d, j in devices}
    for d, j in devices:
        slot_bytes = slots * (share + (trainable_whole if j == 0 else 0))
        counters = 12 if j == 0 else 0                       # iterations (int64), learning rate
        assert parts["optimizer"].get(d, 0) == slot_bytes + counters, (d, parts["optimizer"])


def assert_weights_close(model, ref, atol=1e-5):
    assert_weights_equal_to(model, ref.get_weights(), atol)


def assert_weights_equal_to(model, want: list, atol=1e-5):
    got = model.get_weights()
    assert [w.shape for w in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=atol, rtol=1e-5)


_one_device: dict = {}


def one_device(kind: str, optimizer: str) -> tuple[list, list]:
    """The one-device model's initial and trained weights (6 steps on ``data(kind)``), trained
    once per kind and optimizer for the module: both meshes compare with the same run."""
    if (kind, optimizer) not in _one_device:
        ref = compiled(reference(kind), kind, optimizer)
        initial = ref.get_weights()
        # Slots built before fit, not in its first trace (Keras then traces the step twice): the
        # same zeros, so the same training, for less tracing.
        ref.optimizer.build(ref.trainable_variables)
        x, y = data(kind)
        ref.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        _one_device[kind, optimizer] = initial, ref.get_weights()
    return _one_device[kind, optimizer]


def spy_pairs(monkeypatch) -> list:
    """Each row-parallel layer's input taken as its column-parallel layer's parts (no gather)."""
    pairs = []
    column_parts = parallel_layers.column_parts

    def spy(*args):
        parts = column_parts(*args)
        if parts is not None:
            pairs.append(len(parts))
        return parts

    monkeypatch.setattr(parallel_layers, "column_parts", spy)
    return pairs


def spy_attention_by_heads(monkeypatch) -> list:
    calls = []
    by_heads = keras_layouts._attention_by_heads
    monkeypatch.setattr(keras_layouts, "_attention_by_heads", lambda *a: calls.append(1) or by_heads(*a))
    return calls


@pytest.mark.parametrize("shape,kind,optimizer", [
    pytest.param((1, 4), "mlp", "sgd", id="1x4-mlp-sgd"),
    pytest.param((1, 4), "mlp", "adamw", id="1x4-mlp-adamw"),
    pytest.param((2, 2), "mlp", "sgd", id="2x2-mlp-sgd"),
    pytest.param((2, 2), "mlp", "adamw", id="2x2-mlp-adamw", marks=pytest.mark.core),
    pytest.param((1, 4), "transformer", "sgd", id="1x4-transformer-sgd"),
    pytest.param((1, 4), "transformer", "adamw", id="1x4-transformer-adamw"),
    pytest.param((2, 2), "transformer", "sgd", id="2x2-transformer-sgd"),
    pytest.param((2, 2), "transformer", "adamw", id="2x2-transformer-adamw")])
def test_layout_map_strategy_trains_as_one_device(shape, kind, optimizer, monkeypatch):
    """ReplicatorStrategy(layout_map=...): M x k from the mesh, steps_per_execution=3, weights as
    one device's after 6 steps (the FFN's column -> row pair on its parts, Megatron's pairing);
    bytes per device from where each shard lives."""
    calls = spy_attention_by_heads(monkeypatch)
    pairs = spy_pairs(monkeypatch)
    strategy = kr.ReplicatorStrategy(layout_map=(mlp_layout if kind == "mlp" else transformer_layout)(mesh(*shape)))
    assert (strategy.num_replicas_in_sync, strategy.devices_per_replica) == shape
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = compiled((mlp if kind == "mlp" else transformer)(), kind, optimizer)
    initial, trained = one_device(kind, optimizer)
    assert_weights_equal_to(model, initial, atol=0)     # the same initial values
    x, y = data(kind)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert_weights_equal_to(model, trained)
    assert calls or kind == "mlp"                       # attention ran by heads
    assert pairs and set(pairs) == {shape[1]}           # the pair ran on its k parts
    assert_bytes_per_device(model, *shape, slots=0 if optimizer == "sgd" else 2)


def test_layouts_with_shard_optimizer_state(tmp_path):
    """(2, 2) with ZeRO-1: each shard's slots on one replica only, weights as one device's;
    `save_weights` writes AdamW's state whole: one device loads it equal to its own."""
    strategy = kr.ReplicatorStrategy(layout_map=mlp_layout(mesh(2, 2)), shard_optimizer_state=True)
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = compiled(mlp(), "mlp", "adamw")
    ref = compiled(reference("mlp"), "mlp", "adamw")
    x, y = data("mlp")
    for m in (model, ref):
        m.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model, ref)
    slots = 2 * sum(np.prod(v.shape) * 4 for v in model.trainable_weights)   # AdamW's m and v, once
    counters = 12 * 2                                                        # per replica
    assert sum(training_bytes_per_device(model)["optimizer"].values()) == slots + counters
    model.save_weights(str(tmp_path / "m.weights.h5"))
    one = compiled(reference("mlp"), "mlp", "adamw")
    one.optimizer.build(one.trainable_variables)
    one.load_weights(str(tmp_path / "m.weights.h5"))
    assert_weights_close(one, ref)
    got, want = one.optimizer.variables, ref.optimizer.variables
    assert [tuple(v.shape) for v in got] == [tuple(v.shape) for v in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), atol=1e-5, rtol=1e-5)


def test_one_replica_over_four_devices_without_a_strategy():
    """ModelSharding.scope(): an MLP on 4 devices of one process, AdamW (slots beside their shards)."""
    sharding = ModelSharding(mlp_layout(mesh(1, 4)))
    keras.utils.set_random_seed(1)
    with sharding.scope():
        model = mlp()
    sharding.check_all_rules_matched("the test")
    ref = reference("mlp")
    assert_weights_close(model, ref, atol=0)            # the same initial values
    x, y = data("mlp")
    for m in (model, ref):
        compiled(m, "mlp", "adamw").fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model, ref)
    assert_bytes_per_device(model, 1, 4, slots=2)


def test_any_other_use_gathers_the_whole_tensor():
    """User code reading a sharded weight (no rule) sees the whole tensor; gradients reach every shard."""
    layout_map = keras.distribution.LayoutMap(mesh(1, 4))
    layout_map["custom/w"] = (None, "model")

    class Custom(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1], 8), name="w")

        def call(self, x):
            return keras.ops.tanh(x @ self.w) * 2.0

    sharding = ModelSharding(layout_map)
    with sharding.scope():
        layer = Custom(name="custom")
        layer.build((None, 3))
    assert isinstance(layer.w, ShardedVariable) and len(layer.trainable_weights) == 4
    whole = keras.Variable(layer.w.numpy())
    x = tf.constant(np.random.default_rng(0).normal(size=(5, 3)), tf.float32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(x) ** 2)
    grads = tape.gradient(loss, layer.trainable_weights)
    with tf.GradientTape() as tape:
        want = tf.reduce_sum((tf.tanh(x @ whole.value) * 2.0) ** 2)
    want_grad = tape.gradient(want, whole.value)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(np.concatenate(grads, axis=1), want_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.core
def test_save_on_2x2_load_on_one_device_and_back(tmp_path):
    """`save_weights` and `model.save` from (2, 2) write whole tensors: one device loads them."""
    strategy = kr.ReplicatorStrategy(layout_map=transformer_layout(mesh(2, 2)))
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = transformer()
    weights, whole = str(tmp_path / "m.weights.h5"), str(tmp_path / "m.keras")
    model.save_weights(weights)
    model.save(whole)
    ref = reference("transformer")
    assert not all(np.array_equal(a, b) for a, b in zip(ref.get_weights(), model.get_weights()))
    ref.load_weights(weights)
    assert_weights_close(model, ref, atol=0)
    assert_weights_close(model, keras.saving.load_model(whole), atol=0)
    ref.set_weights([w * 0.9 + 0.01 for w in ref.get_weights()])
    ref.save_weights(weights)
    model.load_weights(weights)
    assert_weights_close(model, ref, atol=0)
    np.testing.assert_allclose(model.predict(data("transformer")[0], verbose=0),
                               ref.predict(data("transformer")[0], verbose=0), atol=1e-5)


def test_a_rule_matching_no_variable_warns_once_and_training_goes_on():
    """Keras's semantics: the rule lays nothing out; one LayoutWarning names it and the variables
    no rule matched (at compile, the model built), and fit trains as one device."""
    layout_map = mlp_layout(mesh(2, 2))
    layout_map[".*renamed/kernel"] = (None, "model")
    strategy = kr.ReplicatorStrategy(layout_map=layout_map)
    with strategy.scope():
        model = mlp()
        with pytest.warns(kr.errors.LayoutWarning) as caught:
            compiled(model, "mlp", "sgd")
    ref = compiled(reference("mlp"), "mlp", "sgd")
    model.set_weights(ref.get_weights())
    x, y = data("mlp")
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        for m in (model, ref):
            m.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert len(caught) == 1 and not [w for w in later if issubclass(w.category, kr.errors.LayoutWarning)]
    message = str(caught[0].message)
    assert re.search(r"\['\.\*renamed/kernel'\] match no variable.*checked at compile", message), message
    assert re.search(r"no rule matched \(replicated whole\): \['sequential(_\d+)?/row/bias'\]", message), message
    assert_weights_close(model, ref)


class Unbuilt(keras.Model):                             # built by Keras from the first batch
    def __init__(self):
        super().__init__()
        self.column, self.row = keras.layers.Dense(16, name="column"), keras.layers.Dense(3, name="row")

    def call(self, x):
        return self.row(self.column(x))


def test_strict_layouts_raises_at_compile_or_at_the_first_fit():
    layout_map = mlp_layout(mesh(2, 2))
    layout_map[".*renamed/kernel"] = (None, "model")
    strategy = kr.ReplicatorStrategy(layout_map=layout_map, strict_layouts=True)
    with strategy.scope():
        model = mlp()                                   # built: the check is at compile
        with pytest.raises(kr.errors.LayoutError, match=r"\['\.\*renamed/kernel'\] match no variable.*compile"):
            model.compile("sgd", "mse")
    strategy = kr.ReplicatorStrategy(layout_map=layout_map, strict_layouts=True)
    with strategy.scope():
        model = Unbuilt()
        model.compile("sgd", "mse")
    with pytest.raises(kr.errors.LayoutError, match="match no variable.*the first fit"):
        model.fit(*data("mlp"), batch_size=4, verbose=0)
    with pytest.raises(kr.errors.ArgumentError, match="differs from the layout_map mesh's model axis"):
        kr.ReplicatorStrategy(layout_map=layout_map, devices_per_replica=4)
    with pytest.raises(kr.errors.ArgumentError, match="strict_layouts must be True or False"):
        kr.ReplicatorStrategy(layout_map=layout_map, strict_layouts="yes")
    with pytest.raises(kr.errors.ArgumentError, match="give a layout_map too"):
        kr.ReplicatorStrategy(strict_layouts=True)


def test_strict_layouts_through_set_distribution():
    """ModelParallel: a LayoutWarning by default; strategy_for(..., strict_layouts=True) first: the error."""
    layout_map = mlp_layout(mesh(2, 2))
    layout_map[".*renamed/kernel"] = (None, "model")
    lenient = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    try:
        keras.distribution.set_distribution(lenient)
        model = Unbuilt()
        model.compile("sgd", "mse")
        with pytest.warns(kr.errors.LayoutWarning, match=r"renamed/kernel'\] match no variable.*the first fit"):
            model.fit(*data("mlp"), batch_size=4, verbose=0)
        strict_map = mlp_layout(mesh(2, 2))
        strict_map[".*renamed/kernel"] = (None, "model")
        strict = keras.distribution.ModelParallel(layout_map=strict_map, batch_dim_name="batch")
        strategy = kr.keras_distribution.strategy_for(strict, strict_layouts=True)
        with pytest.raises(kr.errors.ArgumentError, match="was made with strict_layouts=True"):
            kr.keras_distribution.strategy_for(strict, strict_layouts=False)
        with pytest.raises(kr.errors.ArgumentError, match="a DataParallel has none"):
            kr.keras_distribution.strategy_for(keras.distribution.DataParallel(), strict_layouts=True)
        keras.distribution.set_distribution(strict)
        model = Unbuilt()
        assert model.distribute_strategy is strategy
        model.compile("sgd", "mse")
        with pytest.raises(kr.errors.LayoutError, match=r"renamed/kernel'\] match no variable.*the first fit"):
            model.fit(*data("mlp"), batch_size=4, verbose=0)
    finally:
        keras.distribution.set_distribution(None)


def layout_error(layout_map, build, match):
    sharding = ModelSharding(layout_map)
    with pytest.raises(kr.errors.LayoutError, match=match):
        with sharding.scope():
            build()
        sharding.check_all_rules_matched("the test")


def test_bad_layouts_raise_naming_the_variable_and_the_rule():
    m = mesh(1, 4)
    two = keras.distribution.LayoutMap(m)
    two[".*column/kernel"] = (None, "model")
    two[".*/kernel"] = ("model", None)
    layout_error(two, mlp, r"'sequential(_\d+)?/column/kernel' matches 2 LayoutMap rules")
    odd = keras.distribution.LayoutMap(m)
    odd[".*row/kernel"] = (None, "model")                     # (16, 3): 3 over 4 devices
    layout_error(odd, mlp, r"rule '\.\*row/kernel' .* splits dimension 1 .* does not divide 3")
    renamed = mlp_layout(m)
    renamed[".*renamed_layer/kernel"] = (None, "model")
    layout_error(renamed, mlp, r"\['\.\*renamed_layer/kernel'\] match no variable.*checked at the test")
    rank = keras.distribution.LayoutMap(m)
    rank[".*column/bias"] = (None, "model")
    layout_error(rank, mlp, r"has 2 dimensions, but the variable .*column/bias")
    axis = keras.distribution.LayoutMap(m)
    with pytest.raises(ValueError, match="Invalid axis names"):    # Keras checks at insertion
        axis[".*column/kernel"] = (None, "tensor")
    with pytest.raises(kr.errors.LayoutError, match=r"axes are \['data', 'model'\]"):
        ModelSharding(keras.distribution.LayoutMap(keras.distribution.DeviceMesh(
            (1, 4), ["data", "model"], [f"cpu:{i}" for i in range(4)])))
    constrained = keras.distribution.LayoutMap(m)
    constrained[".*c/kernel"] = (None, "model")
    layout_error(constrained, lambda: keras.layers.Dense(
        4, kernel_constraint="max_norm", name="c").build((None, 4)), "has a constraint")


def test_guide_example():
    # docs/layouts.md's LayoutMap block, in a fresh interpreter with its own 4 devices.
    from tests.helpers import python_blocks, run_markdown_example

    assert "kr.ReplicatorStrategy(layout_map=layout_map)" in python_blocks("docs/layouts.md")[0]
    lines = run_markdown_example("docs/layouts.md", 0).stdout.strip().splitlines()
    assert lines[-3].endswith("'sequential/up/bias_shard1']")
    assert lines[-2] == "(16, 64) [(16, 64), (64,)]"
    assert lines[-1] == "[2304, 2304, 2308, 2308]"
