"""The data axis of a layout (issue 41, item 2): FSDP / ZeRO-3 over the replicas.

A layout naming `batch` on a dimension splits the variable over the M replicas
(copy i holds slice i); every use gathers it, its gradient is reduce-scattered.
Each training test compares with the same model on one device, from the same
initial weights, trained on the same batches: weights to 1e-5 after 12 steps.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator.errors import LayoutError
from keras_replicator.model_parallel.fsdp import ReplicaShardedVariable
from keras_replicator.model_parallel.memory import bytes_per_device, training_bytes_per_device
from keras_replicator.model_parallel.sharding import ModelSharding

pytestmark = pytest.mark.devices(4)

traces = {"train_step": 0}


class Counted(keras.Sequential):
    def train_step(self, data):
        traces["train_step"] += 1                       # Python runs once per trace
        return super().train_step(data)


def mesh(data: int, model: int) -> keras.distribution.DeviceMesh:
    return keras.distribution.DeviceMesh(
        (data, model), ["batch", "model"], [f"cpu:{i}" for i in range(data * model)])


def fsdp_layout(m, both_axes: bool = False) -> keras.distribution.LayoutMap:
    layout_map = keras.distribution.LayoutMap(m)
    if both_axes:
        layout_map[".*d1/kernel"] = ("batch", "model")
        layout_map[".*d2/kernel"] = ("model", "batch")
        layout_map[".*qkv/kernel"] = ("model", "batch", None)   # Gemma's Q/K/V: heads, hidden, head_dim
    else:
        layout_map[".*d1/kernel"] = ("batch", None)
        layout_map[".*d2/kernel"] = (None, "batch")
        layout_map[".*qkv/kernel"] = (None, "batch", None)
    layout_map[".*d1/bias"] = ("batch",)
    return layout_map


def mlp():
    return Counted([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="tanh", name="d1"),
        keras.layers.Dense(8, activation="tanh", name="d2"),
        keras.layers.EinsumDense("bd,hdk->bhk", (2, 4), name="qkv"),   # a 3-D kernel (2, 8, 4)
        keras.layers.Flatten(),
        keras.layers.Dense(3, name="out"),
    ])


def compiled(model, optimizer: str):
    opt = keras.optimizers.SGD(0.05) if optimizer == "sgd" else keras.optimizers.AdamW(1e-2, weight_decay=0.1)
    model.compile(opt, "mse")
    return model


def data(n: int = 48):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def assert_weights_close(model, ref, atol=1e-5):
    got, want = model.get_weights(), ref.get_weights()
    assert [w.shape for w in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=atol, rtol=1e-5)


def split_variables(model) -> list[ReplicaShardedVariable]:
    return [v for layer in model._flatten_layers() for v in layer.__dict__.get("_kr_sharded_variables", [])]


def assert_fsdp_bytes(model, replicas: int, k: int, slots: int) -> None:
    """Shard j of a split variable: 1/M of it on logical device j of each replica (device r * k + j);
    its gradient and its slots beside it. The rest (replicated) on each replica's logical device 0."""
    split = split_variables(model)
    assert split and all(isinstance(v, ReplicaShardedVariable) for v in split)
    expected = {d: 0 for d in range(replicas * k)}
    for v in split:
        for r in range(replicas):
            for j in range(len(v.shards)):
                expected[r * k + j] += int(np.prod(v.shape)) * 4 // (len(v.shards) * replicas)
    shards = [s for v in split for s in v.shards]
    assert by_index(bytes_per_device(shards)) == expected
    rest = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights if not any(v is s for s in shards))
    total = by_index(training_bytes_per_device(model)["total"])
    for d in expected:
        replicated = (2 + slots) * rest + 12 if d % k == 0 else 0   # + iterations (int64), learning rate
        assert total[d] == (2 + slots) * expected[d] + replicated, (d, total, expected)


def by_index(per_device: dict) -> dict:
    return {tf.DeviceSpec.from_string(d).device_index: b for d, b in per_device.items()}


def train(strategy, optimizer: str, epochs: int = 2):
    keras.utils.set_random_seed(1)
    ref = compiled(mlp(), optimizer)
    initial = ref.get_weights()
    with strategy.scope():
        model = mlp()
        model.set_weights(initial)                       # the same initial weights
        compiled(model, optimizer)
    assert_weights_close(model, ref, atol=0)             # get_weights gathers the slices back
    x, y = data()
    traces["train_step"] = 0
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    traced = traces["train_step"]
    ref.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    return model, ref, traced, initial


@pytest.mark.parametrize("optimizer,trace_once", [
    pytest.param("sgd", True, id="sgd-traced-once"),
    pytest.param("adamw", True, id="adamw-traced-once"),
    pytest.param("adamw", False, id="adamw-traced-per-replica")])
def test_fsdp_over_four_replicas_trains_as_one_device(optimizer, trace_once):
    """(4, 1) mesh, every kernel but the last split over the replicas: fit = one device's fit;
    weights, gradients and slots of the split variables at 1/4 per device."""
    strategy = kr.ReplicatorStrategy(layout_map=fsdp_layout(mesh(4, 1)), trace_once=trace_once)
    model, ref, traced, initial = train(strategy, optimizer)
    assert traced == (1 if trace_once else 4)
    kernel = model.get_layer("d1").kernel
    assert isinstance(kernel, ReplicaShardedVariable) and kernel.shape == (8, 16)
    copies = model.get_layer("d1").trainable_weights[0].value.values
    assert [tuple(c.shape) for c in copies] == [(2, 16)] * 4
    moved = max(np.abs(a - b).max() for a, b in zip(model.get_weights(), initial))
    assert moved > 1e-2
    assert_weights_close(model, ref)
    assert_fsdp_bytes(model, 4, 1, slots=0 if optimizer == "sgd" else 2)
    shapes = []                                         # a gathered use has its whole static shape

    def replica_fn():
        shapes.append(tuple(model.get_layer("d2").kernel.value.shape))
        return tf.reduce_sum(model.get_layer("d2").kernel.value)

    tf.function(lambda: strategy.run(replica_fn))()
    assert shapes and set(shapes) == {(16, 8)}


def test_a_layout_naming_both_axes_on_a_2x2_mesh():
    """("batch", "model"), ("model", "batch"), Gemma's ("model", "batch", None): shard (i, j) on
    logical device j of replica i; AdamW's fit as one device's."""
    strategy = kr.ReplicatorStrategy(layout_map=fsdp_layout(mesh(2, 2), both_axes=True))
    assert (strategy.num_replicas_in_sync, strategy.devices_per_replica) == (2, 2)
    model, ref, _, _ = train(strategy, "adamw")
    qkv = model.get_layer("qkv").kernel
    assert (qkv.shape, qkv.axis, qkv.data_axis) == ((2, 8, 4), 0, 1)
    for j, shard in enumerate(qkv.shards):
        for i, copy in enumerate(shard.value.values):
            assert tf.DeviceSpec.from_string(copy.device).device_index == i * 2 + j
            np.testing.assert_array_equal(copy.numpy(), qkv.numpy()[j:j + 1, i * 4:(i + 1) * 4])
    assert_weights_close(model, ref)
    assert_fsdp_bytes(model, 2, 2, slots=2)


def test_save_on_the_mesh_load_on_one_device_and_back(tmp_path):
    """save_weights and model.save from FSDP over 4 write whole tensors; load_weights splits them."""
    strategy = kr.ReplicatorStrategy(layout_map=fsdp_layout(mesh(4, 1)))
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = compiled(mlp(), "sgd")
    weights, whole = str(tmp_path / "m.weights.h5"), str(tmp_path / "m.keras")
    model.save_weights(weights)
    model.save(whole)
    ref = compiled(mlp(), "sgd")
    assert not all(np.array_equal(a, b) for a, b in zip(ref.get_weights(), model.get_weights()))
    ref.load_weights(weights)
    assert_weights_close(model, ref, atol=0)
    assert_weights_close(model, keras.saving.load_model(whole, custom_objects={"Counted": Counted}), atol=0)
    ref.set_weights([w * 0.9 + 0.01 for w in ref.get_weights()])
    ref.save_weights(weights)
    model.load_weights(weights)
    assert_weights_close(model, ref, atol=0)
    x = data()[0]
    np.testing.assert_allclose(model.predict(x, verbose=0), ref.predict(x, verbose=0), atol=1e-5)


def test_what_fsdp_cannot_do_is_an_error_before_any_step():
    """A dimension M does not divide; an unnamed variable; the data axis without a strategy's replicas."""
    odd = keras.distribution.LayoutMap(mesh(4, 1))
    odd[".*odd/kernel"] = (None, "batch")                      # (8, 6): 6 over 4 replicas
    strategy = kr.ReplicatorStrategy(layout_map=odd)
    with strategy.scope(), pytest.raises(LayoutError, match=r"'odd/kernel'.*does not divide 6"):
        keras.layers.Dense(6, name="odd").build((None, 8))
    unnamed = keras.distribution.LayoutMap(mesh(4, 1))
    # Keras names an unnamed weight "variable", "variable_1", ... (one count per process)
    unnamed[r".*custom/variable(_\d+)?"] = ("batch",)

    class Custom(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(8,))              # no name: its path is known too late

    with kr.ReplicatorStrategy(layout_map=unnamed).scope(), \
            pytest.raises(LayoutError, match=r"unnamed variable 'custom/variable(_\d+)?'"):
        Custom(name="custom").build((None, 8))
    with ModelSharding(fsdp_layout(mesh(4, 1))).scope(), \
            pytest.raises(LayoutError, match=r"d1/kernel.*needs the replicas of a ReplicatorStrategy"):
        mlp()


def test_guide_example():
    # docs/layouts.md's FSDP block, in a fresh interpreter with its own 4 devices.
    from tests.helpers import python_blocks, run_markdown_example

    assert '("batch", None)' in python_blocks("docs/layouts.md")[1]
    lines = run_markdown_example("docs/layouts.md", 1).stdout.strip().splitlines()
    assert lines[-2] == "(16, 64) [(4, 64), (4, 64), (4, 64), (4, 64)]"
    assert lines[-1] == "[(16, 64), (64,), (64, 8), (8,)]"


def test_optimizer_state_saved_whole_and_training_continues_on_one_device(tmp_path):
    """AdamW's slots of split variables go to the file whole: model.save on the mesh, load_model on
    one device (and a tf.train.Checkpoint restored into a one-device model before its optimizer
    exists), one more epoch there ends at the uninterrupted run's weights and AdamW's state."""
    strategy = kr.ReplicatorStrategy(layout_map=fsdp_layout(mesh(4, 1)))
    model, ref, _, _ = train(strategy, "adamw", epochs=1)
    path, checkpoint = str(tmp_path / "m.keras"), str(tmp_path / "tf" / "ckpt")
    model.save(path)
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(checkpoint)
    loaded = keras.saving.load_model(path, custom_objects={"Counted": Counted})
    got, want = loaded.optimizer.variables, ref.optimizer.variables
    assert [tuple(v.shape) for v in got] == [tuple(v.shape) for v in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), atol=1e-5, rtol=1e-5)
    restored = compiled(mlp(), "adamw")
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(checkpoint)
    x, y = data()
    for m in (loaded, restored, ref):
        m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for m in (loaded, restored):
        assert_weights_close(m, ref)
        for g, w in zip(m.optimizer.variables, ref.optimizer.variables):
            np.testing.assert_allclose(g.numpy(), w.numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strategy_kwargs,optimizer,match", [
    pytest.param(dict(shard_optimizer_state=True), lambda: keras.optimizers.SGD(0.1), "shard_optimizer_state",
                 id="zero-1"),
    pytest.param({}, lambda: kr.optimizers.CrossReplicaOptimizer(keras.optimizers.SGD(0.1)),
                 "CrossReplicaOptimizer", id="cross-replica-optimizer"),
    pytest.param({}, lambda: keras.optimizers.SGD(0.1, global_clipnorm=1.0), "global_clipnorm", id="clipnorm"),
])
def test_optimizers_that_cannot_update_slices_are_refused_at_compile(strategy_kwargs, optimizer, match):
    strategy = kr.ReplicatorStrategy(layout_map=fsdp_layout(mesh(4, 1)), **strategy_kwargs)
    with strategy.scope():
        model = mlp()
        with pytest.raises(LayoutError, match=match):
            model.compile(optimizer(), "mse")
