"""Grappler run once for the replica calls of a step traced once (`grappler_once`).

The properties: the function every device calls is optimised once, offline (its
body holds Grappler's CPU rewrites, here the fused convolution), and the calls
are made with the meta optimizer off, so that no device optimises it again
(TensorFlow's own log of Grappler's items, in a fresh interpreter); the user's
Grappler settings reach that one run; a user who turned Grappler off gets no
run at all; and the step's results equal the step traced per replica.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

import keras_replicator as kr
from tests.helpers import conv_model, run_python

REPLICAS = 4


def _step(strategy):
    with strategy.scope():
        model = conv_model(seed=3)
        optimizer = keras.optimizers.Adam(1e-2)
        optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                logits = model(x)
                loss = tf.reduce_sum(
                    keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)) / 16
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(replica_step, args=(x, y))

    return model, step


def _train(strategy, steps: int = 3):
    model, step = _step(strategy)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16 * steps, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 4, 16 * steps)
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(16))
    batches = list(dataset)
    for xb, yb in batches:
        step(xb, yb)
    return model, step.get_concrete_function(*batches[0])


def _replica_calls(concrete):
    """Each call of a function not to inline (the replica step's): (its config_proto, its function's ops)."""
    graph_def = concrete.graph.as_graph_def()
    library = {f.signature.name: f for f in graph_def.library.function}
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    calls = []
    for node in nodes:
        called = library.get(node.attr["f"].func.name) if node.op.endswith("PartitionedCall") else None
        if called is not None and "_noinline" in called.attr:
            config = config_pb2.ConfigProto.FromString(node.attr["config_proto"].s)
            calls.append((config, {n.op for n in called.node_def}, called.signature.name))
    return calls


@pytest.fixture
def grappler_options():
    """Sets TensorFlow's Grappler options for one test; restores each to its effect by default."""
    defaults = {"remapping": True, "disable_meta_optimizer": False}
    set_here = []

    def set_options(options: dict):
        set_here.extend(options)
        tf.config.optimizer.set_experimental_options(options)

    yield set_options
    tf.config.optimizer.set_experimental_options({name: defaults[name] for name in set_here})


@pytest.mark.core
def test_the_replica_function_is_optimised_once_and_its_calls_not_again():
    model, concrete = _train(kr.ReplicatorStrategy())
    calls = _replica_calls(concrete)
    assert len(calls) == REPLICAS
    assert len({name for _, _, name in calls}) == 1  # one function, called on every device
    for config, body_ops, _ in calls:
        assert config.graph_options.rewrite_options.disable_meta_optimizer
        assert "_FusedConv2D" in body_ops  # Grappler's CPU remapper ran on it, once
    reference, _ = _train(kr.ReplicatorStrategy(trace_once=False))
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    kr.testing.assert_replicas_identical(model)


def test_the_users_grappler_options_reach_the_one_run(grappler_options):
    grappler_options({"remapping": False})
    _, concrete = _train(kr.ReplicatorStrategy(), steps=1)
    calls = _replica_calls(concrete)
    assert len(calls) == REPLICAS
    for config, body_ops, _ in calls:
        assert config.graph_options.rewrite_options.disable_meta_optimizer
        assert "_FusedConv2D" not in body_ops and "Conv2D" in body_ops


def test_with_grappler_turned_off_by_the_user_nothing_is_optimised(grappler_options):
    grappler_options({"disable_meta_optimizer": True})
    model, concrete = _train(kr.ReplicatorStrategy(), steps=2)
    for config, body_ops, _ in _replica_calls(concrete):
        assert config.graph_options.rewrite_options.disable_meta_optimizer
        assert "_FusedConv2D" not in body_ops
    kr.testing.assert_replicas_identical(model)


_ITEM = re.compile(r"Starting optimization for grappler item: (\S+)")
_PASS = re.compile(r"meta_optimizer\.cc:\d+\] ([\w-]+)(?:\{.*\})?: Graph size after")


def _passes_by_item(log: str) -> dict[str, list[str]]:
    """Grappler's passes in TensorFlow's log, by the item (function) they ran on."""
    passes: dict[str, list[str]] = {}
    item = None
    for line in log.splitlines():
        found = _ITEM.search(line)
        if found:
            item = found.group(1)
            passes.setdefault(item, [])
        elif item is not None and (found := _PASS.search(line)):
            passes[item].append(found.group(1))
    return passes


def test_no_device_runs_grappler_on_the_replica_function():
    # TensorFlow's log of Grappler's items: before, one item per device for the
    # replica function (`replica_step`, or each stage's `stage_fn`).
    code = """
        import keras, numpy as np
        from tests.helpers import conv_model
        with kr.ReplicatorStrategy().scope():
            model = conv_model(seed=3)
            model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rng = np.random.default_rng(0)
        model.fit(rng.normal(size=(32, 8, 8, 3)).astype("float32"), rng.integers(0, 4, 32), batch_size=16, verbose=0)
        print("FIT_DONE")
    """
    done = run_python(code, devices=REPLICAS, timeout=240,
                      env={"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "meta_optimizer=1"})
    assert "FIT_DONE" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
    items = _ITEM.findall(done.stderr)
    assert "graph_to_optimize" in items, items  # the one offline run
    # without the passes that cannot change an NHWC graph without control flow on CPUs
    once = _passes_by_item(done.stderr)["graph_to_optimize"]
    assert "remapper" in once and not {"layout", "tfg_optimizer"} & set(once), once
    per_device = [name for name in items if "replica_step" in name or "stage_fn" in name or "optimized_step" in name]
    assert per_device == [], items
    # Keras's train function, which holds the calls: the three passes that shrink it, one round
    # (`replica_call_options.outer_call_config`); before, every default pass, twice.
    outer = {k: v for k, v in _passes_by_item(done.stderr).items() if k.startswith("__inference_multi_step_on_iterator")}
    assert outer, items
    for passes in outer.values():
        assert passes == ["model_pruner", "common_subgraph_elimination", "dependency_optimizer"], passes


def test_the_one_run_keeps_the_layout_and_tfg_passes_where_they_can_change_the_graph():
    from tensorflow.core.protobuf import rewriter_config_pb2

    from keras_replicator._compat import grappler_once

    def lean(fn, *specs):
        graph_def = tf.function(fn).get_concrete_function(*specs).graph.as_graph_def()
        rewrite = grappler_once.without_idle_passes(config_pb2.ConfigProto(), graph_def).graph_options.rewrite_options
        return rewrite.layout_optimizer == rewriter_config_pb2.RewriterConfig.OFF, rewrite.disable_tfg_optimizer

    image = tf.TensorSpec([2, 8, 8, 3], tf.float32)
    kernel = tf.zeros([3, 3, 3, 4])
    assert lean(lambda x: tf.nn.conv2d(x, kernel, 1, "SAME"), image) == (True, True)
    assert lean(lambda x: tf.nn.conv2d(x, kernel, 1, "SAME", data_format="NCHW"), tf.TensorSpec([2, 3, 8, 8]))[0] is False
    assert lean(lambda x: tf.cond(tf.reduce_sum(x) > 0, lambda: x * 2, lambda: x), image)[1] is False
    set_by_user = config_pb2.ConfigProto()
    set_by_user.graph_options.rewrite_options.layout_optimizer = rewriter_config_pb2.RewriterConfig.ON
    graph_def = tf.function(lambda x: x * 2).get_concrete_function(image).graph.as_graph_def()
    assert grappler_once.without_idle_passes(set_by_user, graph_def).graph_options.rewrite_options.layout_optimizer \
        == rewriter_config_pb2.RewriterConfig.ON


def test_the_outer_call_keeps_grappler_where_it_does_not_apply(grappler_options):
    from keras_replicator._compat import replica_call_options

    lean = replica_call_options.outer_call_config(kr.ReplicatorStrategy())
    assert list(lean.graph_options.rewrite_options.optimizers) == [
        "pruning", "common_subgraph_elimination", "dependency"]
    for strategy in (kr.ReplicatorStrategy(trace_once=False), kr.ReplicatorStrategy(devices=["/cpu:0"]),
                     tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])):
        assert replica_call_options.outer_call_config(strategy) is None
    grappler_options({"disable_meta_optimizer": True})
    assert replica_call_options.outer_call_config(kr.ReplicatorStrategy()) is None


def test_the_outer_call_settings_reach_the_eager_call_and_not_the_calls_it_traces():
    from tensorflow.python.eager import context

    from keras_replicator._compat import replica_call_options

    lean = replica_call_options.outer_call_config(kr.ReplicatorStrategy())
    thread = context.context().function_call_options.as_attrs()["config_proto"]

    def eager_config(traced_once: list[bool]) -> bytes:
        """The config of Keras's eager call of a function whose traces went as `traced_once` says."""
        inner = tf.function(lambda x: x + 1, experimental_attributes={"_noinline": True})  # stays a call
        outer = tf.function(lambda x: inner(x) * 2)
        seen = []

        def keras_function(x):
            for once in traced_once:  # what replica_trace records while the step is traced
                replica_call_options.outer_call_traced(once)
            seen.append(context.context().function_call_options.as_attrs()["config_proto"])
            return outer(x)

        assert float(replica_call_options._with_outer_call_config(keras_function, lean)(tf.constant(1.0))) == 4.0
        graph_def = outer.get_concrete_function(tf.TensorSpec([], tf.float32)).graph.as_graph_def()
        # the call traced into the function's graph: the thread's own settings, always
        assert [n.attr["config_proto"].s for n in graph_def.node if n.op.endswith("PartitionedCall")] == [thread]
        return seen[0]

    assert eager_config([True]) == lean.SerializeToString(deterministic=True)
    # A step traced per replica is the function's graph: every pass, as without us.
    assert eager_config([False]) == thread
    assert eager_config([True, False]) == thread
    assert eager_config([]) == thread
    assert context.context().function_call_options.as_attrs()["config_proto"] == thread  # restored
