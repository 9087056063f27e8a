"""A replica that spans several devices (`ReplicatorStrategy(devices_per_replica=2)`), on 4 devices.

A two-stage model placed by hand (stage 1's variables and ops on logical device 0,
stage 2's on logical device 1) trains on 2 replicas x 2 devices to the weights
of the same model trained on one device; where each variable's copies, its
optimizer slots and each replica's ops live is read back; then 2 workers, each
one replica of 2 devices (`tests/model_parallel_job.py`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from tests.model_parallel_job import BATCH, OPTIMIZERS, X, Y, fit, two_stage


def copies(variable) -> list[str]:
    return [c.device for c in variable.value.values]


def mesh_devices(strategy, logical: int) -> list[str]:
    return list(strategy.mesh.logical_devices(logical))


@pytest.fixture(scope="module")
def strategy():
    return kr.ReplicatorStrategy(devices_per_replica=2)


def test_the_strategy_has_two_replicas_of_two_devices(strategy):
    assert strategy.num_replicas_in_sync == 2
    assert strategy.devices_per_replica == 2
    names = [tf.DeviceSpec.from_string(d).device_index for d in strategy.mesh.devices]
    assert names == [0, 1, 2, 3]
    # TensorFlow's replicas are the replicas' logical devices 0: inputs arrive there.
    assert [tf.DeviceSpec.from_string(d).device_index for d in strategy.devices] == [0, 2]


@pytest.mark.parametrize("optimizer,steps_per_execution", [("sgd", 3), ("adamw", 1)])
def test_fit_matches_one_device(strategy, optimizer, steps_per_execution):
    reference = fit(None, optimizer)
    model = fit(strategy, optimizer, steps_per_execution)
    kr.testing.assert_replicas_identical(model)
    assert kr.testing.max_weight_difference(model, reference) <= 1e-5
    assert int(model.optimizer.iterations.numpy()) == 12
    # Each variable's copies: one per replica, on that replica's logical device.
    assert copies(model.stage1.kernel) == mesh_devices(strategy, 0)
    assert copies(model.stage2.kernel) == mesh_devices(strategy, 1)
    assert copies(model.stage2.bias) == mesh_devices(strategy, 1)
    # The optimizer's slots follow their variable.
    stage2 = [v for v in model.optimizer.variables if v.shape == model.stage2.kernel.shape]
    assert stage2 and all(copies(v) == mesh_devices(strategy, 1) for v in stage2)
    stage1 = [v for v in model.optimizer.variables if v.shape == model.stage1.kernel.shape]
    assert stage1 and all(copies(v) == mesh_devices(strategy, 0) for v in stage1)
    # Stage 2 ran on each replica's logical device 1 (the replicas' traces).
    assert set(mesh_devices(strategy, 1)) <= set(model.seen)


def test_cross_replica_optimizer_evaluate_and_predict_match_one_device(strategy):
    reference = fit(None, lambda: keras.optimizers.SGD(0.05, momentum=0.9, global_clipnorm=0.05))
    model = fit(strategy, lambda: kr.CrossReplicaOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), clip_global_norm=0.05))
    kr.testing.assert_replicas_identical(model)
    assert kr.testing.max_weight_difference(model, reference) <= 1e-5
    unclipped = fit(None, "sgd")
    assert kr.testing.max_weight_difference(unclipped, reference) > 1e-3  # the clipping acted
    np.testing.assert_allclose(model.evaluate(X, Y, batch_size=BATCH, verbose=0),
                               reference.evaluate(X, Y, batch_size=BATCH, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(model.predict(X, batch_size=BATCH, verbose=0),
                               reference.predict(X, batch_size=BATCH, verbose=0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("communication", ["auto", "ring"])
def test_custom_loop_places_ops_gradients_and_all_reduces_per_replica(strategy, communication):
    if communication != "auto":  # a collective all-reduce: one group per logical device
        strategy = kr.ReplicatorStrategy(devices_per_replica=2, communication=communication)
    with strategy.scope():
        model = two_stage(strategy)
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
    reference = two_stage()
    reference_optimizer = keras.optimizers.SGD(0.1)
    where = []

    @tf.function
    def step(x, y):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum((model(x) - y) ** 2) / (BATCH * 3)
            grads = tape.gradient(loss, model.trainable_variables)
            where.append([g.device for g in grads])
            optimizer.apply(grads, model.trainable_variables)
            return loss

        return strategy.reduce("SUM", strategy.run(replica_step, args=(x, y)), axis=None)

    data = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH))
    for x, y in data:
        step(x, y)
    for i in range(0, len(X), BATCH):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((reference(X[i:i + BATCH]) - Y[i:i + BATCH]) ** 2)
        reference_optimizer.apply(tape.gradient(loss, reference.trainable_variables),
                                  reference.trainable_variables)
    kr.testing.assert_replicas_identical(model)
    assert kr.testing.max_weight_difference(model, reference) <= 1e-5
    # Each replica's gradients were computed where their variables live: the
    # backward pass of stage 2 on its logical device 1.
    kernels = [g[2] for g in where[:2]]
    assert kernels == mesh_devices(strategy, 1)
    assert [g[0] for g in where[:2]] == mesh_devices(strategy, 0)
    if communication == "ring":
        # Stage 2's gradients are all-reduced among its copies, on logical device 1.
        graph = step.get_concrete_function(x, y).graph
        collectives = {op.device for op in graph.get_operations() if op.type == "CollectiveReduceV2"}
        assert collectives == set(strategy.mesh.devices)


def test_shard_optimizer_state_matches_one_device():
    sharded = kr.ReplicatorStrategy(devices_per_replica=2, shard_optimizer_state=True)
    reference = fit(None, "adamw")
    model = fit(sharded, "adamw")
    kr.testing.assert_replicas_identical(model)
    assert kr.testing.max_weight_difference(model, reference) <= 1e-5
    # Each slot is whole on one replica, on the logical device of its variable.
    for variable, logical in [(model.stage1.kernel, 0), (model.stage2.kernel, 1)]:
        slots = [v for v in model.optimizer.variables if v.shape == variable.shape]
        assert len(slots) == 2  # AdamW's two moments
        for slot in slots:
            device = slot.value.device
            assert device in mesh_devices(sharded, logical), (slot.path, device)


def test_bad_arguments():
    with pytest.raises(kr.errors.ArgumentError, match="devices_per_replica=3 must divide"):
        kr.ReplicatorStrategy(devices_per_replica=3)
    with pytest.raises(kr.errors.ArgumentError, match="devices_per_replica"):
        kr.ReplicatorStrategy(devices_per_replica=0)
    strategy = kr.ReplicatorStrategy(["/cpu:0", "/cpu:1"], devices_per_replica=2)
    with pytest.raises(kr.errors.ArgumentError, match="logical_device"):
        strategy.logical_device_for_variables(2)
    with pytest.raises(RuntimeError, match="inside `with strategy.scope"):
        with strategy.logical_device_for_variables(1):
            pass

    @tf.function
    def step():
        def replica_step():
            with kr.logical_device(2):
                return tf.constant(1.0)

        return strategy.run(replica_step)

    with pytest.raises(kr.errors.ArgumentError, match="logical_device must be"):
        step()


def test_guide_example_runs_as_shown():
    # docs/model_parallel.md's first block, in a fresh interpreter with its own 4 devices.
    from tests.helpers import run_markdown_example

    result = run_markdown_example("docs/model_parallel.md", 0)
    lines = result.stdout.strip().splitlines()
    assert lines[-2:] == ["2", "['CPU:1', 'CPU:3']"], result.stdout


def test_two_workers_each_one_replica_of_two_devices(tmp_path):
    from keras_replicator import launch as launcher
    from tests.helpers import ROOT, launch_env

    out = io.StringIO()
    code = launcher.launch(os.path.join(ROOT, "tests", "model_parallel_job.py"), [str(tmp_path)],
                           workers=2, devices_per_worker=2, env=launch_env(), timeout=400, output=out)
    assert code == 0, out.getvalue()[-8000:]
    reference = fit(None, "adamw").get_weights()
    for name in ("mirrored", "sharded"):
        reports, weights = [], []
        for i in range(2):
            with open(tmp_path / f"{name}{i}.json") as f:
                reports.append(json.load(f))
            with np.load(tmp_path / f"{name}{i}.npz") as arrays:
                weights.append([arrays[f"arr_{j}"] for j in range(len(arrays.files))])
        held = []
        for i, report in enumerate(reports):
            task = f"/job:worker/replica:0/task:{i}/device:CPU:"
            assert report["num_replicas"] == 2 and report["mesh"] == [task + "0", task + "1"]
            assert report["stage1"] == [task + "0"] and report["stage2"] == [task + "1"]
            assert report["slots"], report
            for shape, *devices in report["slots"].values():
                # Each slot of stage 2's kernel: whole on this worker's logical device 1
                # (mirrored, or owned here), or an empty placeholder (owned by the other worker).
                held.append(tuple(shape) != (0,))
                assert devices == [task + "1"] or not held[-1], (name, report["slots"])
        if name == "sharded":  # AdamW's 2 moments of stage 2's kernel, each whole once in the job
            assert sum(held) == 2 and len(held) == 4, reports
        else:
            assert all(held) and len(held) == 4
        for a, b, want in zip(weights[0], weights[1], reference):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(a, want, atol=1e-5, rtol=0)


def resumed(strategy, path) -> keras.Model:
    """The two-stage model and AdamW loaded from `path` under `strategy` (None: one device), one more epoch."""
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = two_stage(strategy)
        model.compile(OPTIMIZERS["adamw"](), "mse")
        model.optimizer.build(model.trainable_variables)
    model.load_weights(path)
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model


def test_checkpoint_from_a_mesh_continues_on_another_mesh_and_on_one_device(strategy, tmp_path):
    uninterrupted = fit(None, "adamw", epochs=2)
    path = str(tmp_path / "half.weights.h5")
    fit(strategy, "adamw", epochs=1).save_weights(path)  # 2 replicas x 2 devices
    on_one_device = resumed(None, path)
    assert kr.testing.max_weight_difference(on_one_device, uninterrupted) <= 1e-5
    one_replica_of_four = kr.ReplicatorStrategy(devices_per_replica=4)
    on_another_mesh = resumed(one_replica_of_four, path)
    assert copies(on_another_mesh.stage2.kernel) == mesh_devices(one_replica_of_four, 1)
    assert kr.testing.max_weight_difference(on_another_mesh, uninterrupted) <= 1e-5
    # And back: from one device onto 2 x 2.
    path = str(tmp_path / "one.weights.h5")
    fit(None, "adamw", epochs=1).save_weights(path)
    assert kr.testing.max_weight_difference(resumed(strategy, path), uninterrupted) <= 1e-5


def test_saved_model_from_a_mesh_loads_and_trains_on_one_device(strategy, tmp_path):
    uninterrupted = fit(None, "adamw", epochs=2)
    path = str(tmp_path / "half.keras")
    fit(strategy, "adamw", epochs=1).save(path)  # 2 replicas x 2 devices, with AdamW's state
    loaded = keras.models.load_model(path)
    loaded.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert kr.testing.max_weight_difference(loaded, uninterrupted) <= 1e-5


class _StopAfterEpoch(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            raise RuntimeError("interrupted")


def test_backup_from_a_mesh_resumes_on_one_device(strategy, tmp_path):
    uninterrupted = fit(None, "adamw", epochs=2)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with strategy.scope():
        model = two_stage(strategy)
        model.compile(OPTIMIZERS["adamw"](), "mse")
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[backup, _StopAfterEpoch()])
    restarted = two_stage()
    restarted.compile(OPTIMIZERS["adamw"](), "mse")
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    history = restarted.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                            callbacks=[backup])
    assert len(history.history["loss"]) == 1  # the second epoch only
    assert kr.testing.max_weight_difference(restarted, uninterrupted) <= 1e-5
