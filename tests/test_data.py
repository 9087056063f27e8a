"""keras_replicator.data: batch semantics, sharding, uneven batches, errors (4 replicas)."""

from __future__ import annotations

import collections
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator import data, input_pipeline
from keras_replicator._compat import tf_data
from tests.helpers import conv_model, dense_model, image_data, regression_data


@pytest.fixture(scope="module")
def strategy():
    return kr.ReplicatorStrategy()


def replica_slices(strategy, distributed):
    """Per step, the list of every replica's first component as a NumPy array."""
    steps = []
    for batch in distributed:
        first = tf.nest.flatten(batch)[0]
        steps.append([np.asarray(v) for v in strategy.experimental_local_results(first)])
    return steps


def pipeline_elements(input_fn, pipelines, replicas=4):
    """Every pipeline's elements (first component, NumPy), built with hand-made InputContexts."""
    out = []
    for k in range(pipelines):
        ctx = tf.distribute.InputContext(num_input_pipelines=pipelines, input_pipeline_id=k,
                                         num_replicas_in_sync=replicas)
        ds = input_fn(ctx)
        out.append((ds, [np.asarray(tf.nest.flatten(e)[0]) for e in ds]))
    return out


def assert_exactly_once(ids, n):
    counts = collections.Counter(int(i) for i in ids)
    assert sorted(counts) == list(range(n)), f"missing: {sorted(set(range(n)) - set(counts))[:10]}"
    assert set(counts.values()) == {1}, f"repeated: {[i for i, c in counts.items() if c > 1][:10]}"


# --- the problem this module solves ----------------------------------------------


def test_tensorflow_alone_leaves_replicas_empty(strategy):
    # The scenario the rest of the module tests against: stock splitting of 450 examples
    # in global batches of 64 over 4 replicas gives two replicas nothing in the last step.
    stock = tf.distribute.Strategy.experimental_distribute_dataset(strategy, tf.data.Dataset.range(450).batch(64))
    assert [len(v) for v in replica_slices(strategy, stock)[-1]] == [1, 1, 0, 0]


# --- batch semantics on one worker ------------------------------------------------


@pytest.mark.parametrize(
    "make, kwargs",
    [
        (lambda: tf.data.Dataset.range(450), {"global_batch_size": 64}),
        (lambda: tf.data.Dataset.range(450), {"per_replica_batch_size": 16}),
        (lambda: tf.data.Dataset.range(450).batch(64).map(lambda b: b * 1).prefetch(2), {"global_batch_size": 64}),
        (lambda: (lambda ctx: tf.data.Dataset.range(450)), {"global_batch_size": 64}),
        (lambda: (lambda ctx: tf.data.Dataset.range(450).batch(ctx.get_per_replica_batch_size(64))),
         {"global_batch_size": 64}),
    ],
    ids=["unbatched-global", "unbatched-per-replica", "batched", "input_fn", "input_fn-batched-per-replica"],
)
def test_every_example_once_in_order_and_no_replica_empty(strategy, make, kwargs):
    distributed = strategy.distribute_dataset(make(), **kwargs)
    steps = replica_slices(strategy, distributed)
    assert int(distributed.cardinality) == len(steps) == 8  # ceil(450 / 64)
    sizes = [[len(v) for v in step] for step in steps]
    assert sizes[:6] == [[16] * 4] * 6
    assert sizes[6:] == [[16, 16, 15, 15], [1, 1, 1, 1]]  # 62 + 4 instead of 64 + 2
    # Replica order within a step, steps in order: the dataset's order.
    np.testing.assert_array_equal(np.concatenate([v for step in steps for v in step]), np.arange(450))


def test_slices_of_a_batch_differ_by_at_most_one(strategy):
    # 70 examples: batches 64 + 6; the 6 are split 2, 2, 1, 1 (TensorFlow: 2, 2, 2, 0).
    sizes = [[len(v) for v in s] for s in replica_slices(
        strategy, strategy.distribute_dataset(tf.data.Dataset.range(70), global_batch_size=64))]
    assert sizes == [[16, 16, 16, 16], [2, 2, 1, 1]]


def test_fewer_examples_than_replicas_keeps_them_all(strategy):
    # Only here can a replica stay empty: there are not enough examples for all.
    steps = replica_slices(strategy, strategy.distribute_dataset(tf.data.Dataset.range(3), global_batch_size=8))
    assert [len(v) for v in steps[0]] == [1, 1, 1, 0]
    assert replica_slices(strategy, strategy.distribute_dataset(tf.data.Dataset.range(0), global_batch_size=8)) == []


def test_one_example_per_replica_merges_the_short_tail(strategy):
    # global batch 4 = 1 per replica: 9 examples -> batches 4 + 5 (not 4 + 4 + 1).
    steps = replica_slices(strategy, strategy.distribute_dataset(tf.data.Dataset.range(9), global_batch_size=4))
    assert [[len(v) for v in s] for s in steps] == [[1, 1, 1, 1], [2, 1, 1, 1]]
    np.testing.assert_array_equal(np.concatenate([v for s in steps for v in s]), np.arange(9))


def test_nested_elements_keep_their_structure(strategy):
    x, y = regression_data(100)
    dataset = tf.data.Dataset.from_tensor_slices(((x,), {"y": y}))  # a 1-tuple and a dict
    distributed = strategy.distribute_dataset(dataset, global_batch_size=32)
    rows = []
    for batch in distributed:
        assert tf.nest.map_structure(lambda _: 0, batch) == (((0,), {"y": 0}))
        rows += [np.asarray(v) for v in strategy.experimental_local_results(batch[0][0])]
    np.testing.assert_array_equal(np.concatenate(rows), x)


def test_drop_remainder_gives_full_static_batches(strategy):
    distributed = strategy.distribute_dataset(tf.data.Dataset.range(450), global_batch_size=64, drop_remainder=True)
    pipeline = data.make_input_fn(tf.data.Dataset.range(450), global_batch_size=64, drop_remainder=True)(
        tf.distribute.InputContext(1, 0, 4))
    assert pipeline.element_spec.shape.as_list() == [16]  # static: what XLA and TPUs want
    steps = replica_slices(strategy, distributed)
    assert int(distributed.cardinality) == len(steps) == 7
    assert np.concatenate([v for s in steps for v in s]).tolist() == list(range(448))


def test_shuffle_is_reproducible_and_reshuffles_each_epoch():
    def epochs(seed):
        pipeline = data.make_input_fn(tf.data.Dataset.range(200), global_batch_size=40, shuffle_buffer_size=200,
                                      seed=seed)(tf.distribute.InputContext(1, 0, 4))
        return [np.concatenate([np.asarray(e) for e in pipeline]) for _ in range(2)]

    first, again, other = epochs(7), epochs(7), epochs(8)
    for epoch in first:
        assert sorted(epoch.tolist()) == list(range(200))
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    assert not np.array_equal(first[0], first[1])  # a new order every epoch
    assert not np.array_equal(first[0], other[0])


def test_prefetches_to_every_replica_device(strategy):
    distributed = strategy.distribute_dataset(tf.data.Dataset.range(64), global_batch_size=16)
    batch = next(iter(distributed))
    devices = [tf.DeviceSpec.from_string(v.device) for v in strategy.experimental_local_results(batch)]
    assert [(d.device_type, d.device_index) for d in devices] == [("CPU", i) for i in range(4)]
    pipeline = data.make_input_fn(tf.data.Dataset.range(64), global_batch_size=16)(
        tf.distribute.InputContext(1, 0, 4))
    # Autotuning is TensorFlow's default (unset: on), which ReplicatorStrategy turns off for CPU
    # replicas' iterators (the autotuning-thread stall, tests/test_iterator_stall.py).
    assert pipeline.options().autotune.enabled is None and pipeline.options().deterministic is True


def test_one_host_iterator_gives_every_replica_the_same_slices(strategy):
    """Over CPU replicas one host iterator feeds all replicas (no per-device pipelines); the
    slices, their devices, a short last batch (TensorFlow's partial-batch path) and a step
    traced for one kind of iterator are those of TensorFlow's per-device iterator."""
    from keras_replicator._compat import host_iterator

    source = tf.data.Dataset.range(450).map(lambda i: tf.cast(i, tf.float32))
    host = strategy.distribute_dataset(source, global_batch_size=64)
    per_device = strategy.distribute_dataset(source, global_batch_size=64,
                                             options=tf.distribute.InputOptions())
    assert host_iterator.reads_through_host(host)
    assert not host_iterator.reads_through_host(per_device)
    expected = replica_slices(strategy, per_device)
    assert [len(v) for v in expected[-2]] == [16, 16, 15, 15] and len(expected) == 8  # 62 + 4
    for got, want in zip(replica_slices(strategy, host), expected, strict=True):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)

    @tf.function
    def replica_sums(iterator):  # one function for both kinds: no trace reused across them
        sums = strategy.run(tf.reduce_sum, args=(next(iterator),))
        return strategy.experimental_local_results(sums)

    for distributed in (per_device, host, per_device):
        np.testing.assert_array_equal(replica_sums(iter(distributed)),
                                      [np.sum(v) for v in expected[0]])


# --- sharding across input pipelines (hand-made InputContexts: 2 workers x 2 replicas) ---


@pytest.fixture(scope="module")
def record_files(tmp_path_factory):
    """5 TFRecord files holding ids 0..449 (90 each)."""
    folder = tmp_path_factory.mktemp("records")
    files = []
    for f in range(5):
        path = str(folder / f"part-{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(90):
                writer.write(str(f * 90 + i).encode())
        files.append(path)
    return files


def read_ids(files, cycle_length=2):
    ds = tf.data.Dataset.from_tensor_slices(files).interleave(tf.data.TFRecordDataset, cycle_length=cycle_length)
    return ds.map(lambda r: tf.strings.to_number(r, tf.int64))


def _sources(files):
    return {
        "tensors": (lambda: tf.data.Dataset.range(450), "data"),
        "batched-tensors": (lambda: tf.data.Dataset.range(450).batch(64), "data"),
        "5-files": (lambda: read_ids(files), "file"),
        "TFRecordDataset": (lambda: tf.data.TFRecordDataset(files).map(
            lambda r: tf.strings.to_number(r, tf.int64)), "file"),
        "batched-5-files": (lambda: read_ids(files).batch(64), "file"),
        "1-file": (lambda: read_ids(files[:1]).concatenate(tf.data.Dataset.range(90, 450)), "data"),
        "input_fn": (lambda: (lambda ctx: tf.data.Dataset.range(450).shard(ctx.num_input_pipelines,
                                                                            ctx.input_pipeline_id)), "off"),
    }


@pytest.mark.parametrize("name", ["tensors", "batched-tensors", "5-files", "TFRecordDataset",
                                  "batched-5-files", "1-file", "input_fn"])
def test_two_pipelines_together_see_every_example_once(record_files, name):
    make, policy = _sources(record_files)[name]
    input_fn = data.make_input_fn(make(), global_batch_size=64)
    pipelines = pipeline_elements(input_fn, 2)
    assert input_fn.plan(tf.distribute.InputContext(2, 0, 4)).sharding == policy
    assert_exactly_once(np.concatenate([e for _, elements in pipelines for e in elements]), 450)
    for ds, elements in pipelines:
        assert len(elements) % 2 == 0 and all(len(e) > 0 for e in elements)  # 2 replicas, none empty
        if int(ds.cardinality()) >= 0:
            assert int(ds.cardinality()) == len(elements)
    if policy == "data":  # same number of steps on every worker: no worker waits for the other
        assert len(pipelines[0][1]) == len(pipelines[1][1]) == 16


def test_data_sharding_uses_tensorflows_slice_layout():
    # Slice j of each global batch goes to pipeline j % 2 as its replica j // 2, as TensorFlow's
    # data sharding does (Keras's multi-worker predict undoes exactly this order).
    (_, p0), (_, p1) = pipeline_elements(data.make_input_fn(tf.data.Dataset.range(64), global_batch_size=64), 2)
    assert [e.tolist() for e in p0] == [list(range(0, 16)), list(range(32, 48))]
    assert [e.tolist() for e in p1] == [list(range(16, 32)), list(range(48, 64))]


def test_file_sharding_reads_only_own_files(record_files):
    input_fn = data.make_input_fn(read_ids(record_files), global_batch_size=64, shard_policy="file")
    (_, p0), (_, p1) = pipeline_elements(input_fn, 2)
    files_of = lambda elements: sorted({int(i) // 90 for e in elements for i in e})  # noqa: E731
    assert files_of(p0) == [0, 2, 4] and files_of(p1) == [1, 3]


def test_off_policy_gives_every_pipeline_everything():
    input_fn = data.make_input_fn(tf.data.Dataset.range(450), global_batch_size=64, shard_policy="off")
    for _, elements in pipeline_elements(input_fn, 2):
        assert_exactly_once(np.concatenate(elements), 450)


def test_pipeline_seeds_differ_per_pipeline_and_agree_for_data_sharding():
    contexts = [tf.distribute.InputContext(2, k, 4) for k in range(2)]
    seeds = [data.pipeline_seed(5, c) for c in contexts]
    assert seeds[0] != seeds[1] and seeds == [data.pipeline_seed(5, c) for c in contexts]

    def orders(policy):
        input_fn = data.make_input_fn(tf.data.Dataset.range(256), global_batch_size=64, shard_policy=policy,
                                      shuffle_buffer_size=256, seed=5)
        return [np.concatenate(elements) for _, elements in pipeline_elements(input_fn, 2)]

    off = orders("off")  # both read everything, each with its own seed
    assert sorted(off[0].tolist()) == sorted(off[1].tolist()) == list(range(256))
    assert not np.array_equal(off[0], off[1])
    assert_exactly_once(np.concatenate(orders("data")), 256)  # same seed: slices fit together


def test_tfds_input_context_sharding(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")

    class TinyIds(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({"id": tf.int64}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            for i in range(450):
                yield i, {"id": i}

    builder = TinyIds(data_dir=str(tmp_path))
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(num_shards=4))

    def input_fn(ctx):  # the TF-Replicator pattern: TFDS shards by file with the context
        ds = builder.as_dataset(split="train", read_config=tfds.ReadConfig(input_context=ctx))
        return ds.map(lambda e: e["id"])

    pipelines = pipeline_elements(data.make_input_fn(input_fn, global_batch_size=64), 2)
    assert_exactly_once(np.concatenate([e for _, els in pipelines for e in els]), 450)
    # The whole dataset given directly: 4 files >= 2 pipelines, so "auto" shards by file. Each
    # worker builds its own dataset object. (Sharding one TFDS dataset object twice in one process
    # gave the first shard both times with TF 2.21 / TFDS 4.9: a single-process artefact.)
    ids = []
    for k in range(2):
        whole = data.make_input_fn(builder.as_dataset(split="train").map(lambda e: e["id"]), global_batch_size=64)
        ids += [i for e in whole(tf.distribute.InputContext(2, k, 4)) for i in np.asarray(e)]
        assert whole.plan(tf.distribute.InputContext(2, k, 4)).sharding == "file"
    assert_exactly_once(ids, 450)


# --- Keras: evaluate and predict equal one device ------------------------------------


def _compiled(strategy, build, loss, metrics):
    if strategy is None:
        model = build()
    else:
        with strategy.scope():
            model = build()
    model.compile(keras.optimizers.SGD(0.1), loss, metrics=metrics)
    return model


@pytest.mark.parametrize("kind", ["conv", "dense"])
def test_evaluate_and_predict_match_one_device_with_a_short_last_batch(strategy, kind):
    # 130 = 64 + 64 + 2: the last batch has fewer examples than there are replicas.
    if kind == "conv":
        x, y = image_data(130, size=6, channels=1)
        build = lambda: conv_model(size=6, channels=1)  # noqa: E731
        loss, metrics = keras.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"]
    else:
        x, y = regression_data(130)
        build, loss, metrics = dense_model, "mse", ["mae"]
    replicated = _compiled(strategy, build, loss, metrics)
    reference = _compiled(None, build, loss, metrics)
    expected = reference.evaluate(x, y, batch_size=64, verbose=0)
    # NumPy (Keras batches it), and an unbatched dataset through distribute_dataset.
    np.testing.assert_allclose(replicated.evaluate(x, y, batch_size=64, verbose=0), expected, rtol=1e-5)
    evaluation = strategy.distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)), global_batch_size=64)
    np.testing.assert_allclose(replicated.evaluate(evaluation, verbose=0), expected, rtol=1e-5)
    predictions = replicated.predict(x, batch_size=64, verbose=0)
    assert predictions.shape[0] == 130
    np.testing.assert_allclose(predictions, reference.predict(x, batch_size=64, verbose=0), rtol=1e-5, atol=1e-6)
    if kind == "dense":
        inputs_only = strategy.distribute_dataset(tf.data.Dataset.from_tensor_slices(x), global_batch_size=64)
        np.testing.assert_allclose(replicated.predict(inputs_only, verbose=0), predictions, rtol=1e-6, atol=1e-7)


def test_fit_on_a_distributed_dataset_matches_one_device(strategy):
    # 128 = 2 global batches of 64: equal slices, so the same maths as one device.
    x, y = image_data(128, size=6, channels=1)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    replicated = _compiled(strategy, lambda: conv_model(size=6, channels=1), loss, None)
    reference = _compiled(None, lambda: conv_model(size=6, channels=1), loss, None)
    train = strategy.distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)), per_replica_batch_size=16)
    replicated.fit(train, epochs=2, verbose=0)
    reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    assert kr.testing.max_weight_difference(replicated, reference) <= 1e-5


def test_keras_fit_of_numpy_datasets_and_infinite_datasets(strategy, monkeypatch):
    built = []
    original = input_pipeline.build
    monkeypatch.setattr(input_pipeline, "build", lambda plan: built.append(plan.policy) or original(plan))
    x, y = regression_data(100)
    with strategy.scope():
        model = dense_model()
        model.compile("sgd", "mse")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=1, verbose=0)
    assert built == ["data", "off"]  # Keras marks NumPy input DATA; one worker shards nothing
    forever = strategy.distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).repeat(), global_batch_size=32)
    assert int(forever.cardinality) == tf.data.INFINITE_CARDINALITY
    before = int(model.optimizer.iterations.numpy())
    model.fit(forever, epochs=2, steps_per_epoch=3, verbose=0)
    assert int(model.optimizer.iterations.numpy()) - before == 6


# --- errors, all raised before any step --------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"global_batch_size": 30}, ValueError, r"global_batch_size=30 is not divisible by the 4 replicas.*28 or 32"),
        ({}, ValueError, "exactly one of global_batch_size and per_replica_batch_size"),
        ({"global_batch_size": 64, "per_replica_batch_size": 16}, ValueError, "exactly one of"),
        ({"global_batch_size": 0}, ValueError, "global_batch_size must be a positive integer"),
        ({"per_replica_batch_size": 2.5}, ValueError, "per_replica_batch_size must be a positive integer"),
        ({"global_batch_size": 64, "shard_policy": "files"}, ValueError, r"shard_policy must be one of 'auto', 'file', 'data', 'off'; got 'files'"),
        ({"global_batch_size": 64, "drop_remainder": "yes"}, TypeError, "drop_remainder must be True, False or None"),
        ({"global_batch_size": 64, "seed": 1.5}, TypeError, "seed must be an integer"),
        ({"global_batch_size": 64, "options": "fast"}, TypeError, "options must be a tf.distribute.InputOptions"),
        ({"global_batch_size": 64, "shard_policy": "file"}, ValueError,
         r"shard_policy='file' needs at least one file per input pipeline \(1\), but the dataset does not read files"),
    ],
)
def test_bad_arguments(strategy, kwargs, error, message):
    with pytest.raises(error, match=message):
        strategy.distribute_dataset(tf.data.Dataset.range(100), **kwargs)


def test_batched_dataset_with_another_batch_size(strategy):
    with pytest.raises(ValueError, match=r"already batched by 32, but the global batch size is 64 \(16 per replica"):
        strategy.distribute_dataset(tf.data.Dataset.range(100).batch(32), global_batch_size=64)
    with pytest.raises(ValueError, match=r"input_fn returned a dataset batched by 64.*per replica: 16"):
        strategy.distribute_dataset(lambda ctx: tf.data.Dataset.range(100).batch(64), global_batch_size=64)
    with pytest.raises(ValueError, match="shuffle_buffer_size shuffles examples before batching"):
        strategy.distribute_dataset(tf.data.Dataset.range(100).batch(64), global_batch_size=64,
                                    shuffle_buffer_size=10)


def test_bad_inputs(strategy):
    with pytest.raises(TypeError, match=r"tf.data.Dataset or a function input_fn\(input_context\)"):
        strategy.distribute_dataset(np.arange(10), global_batch_size=8)
    with pytest.raises(TypeError, match="input_fn must return a tf.data.Dataset, it returned list"):
        strategy.distribute_dataset(lambda ctx: [1, 2], global_batch_size=8)
    with pytest.raises(ValueError, match="batched=False"):
        strategy.distribute_dataset(tf.data.Dataset.range(10), global_batch_size=8, batched=True)


def test_file_policy_with_fewer_files_than_pipelines(record_files):
    input_fn = data.make_input_fn(read_ids(record_files[:1]), global_batch_size=64, shard_policy="file")
    with pytest.raises(ValueError, match=r"needs at least one file per input pipeline \(2\).*reads only 1 file"):
        input_fn(tf.distribute.InputContext(2, 0, 4))
    unknown = data.make_input_fn(read_ids(record_files).scan(0, lambda s, x: (s, x)), global_batch_size=64,
                                 shard_policy="file")
    with pytest.raises(ValueError, match="could not find the files"):
        unknown(tf.distribute.InputContext(2, 0, 4))


def test_data_sharding_with_a_shuffle_needs_a_seed():
    input_fn = data.make_input_fn(tf.data.Dataset.range(100), global_batch_size=64, shuffle_buffer_size=10)
    with pytest.raises(ValueError, match="all must shuffle identically: give seed="):
        input_fn(tf.distribute.InputContext(2, 0, 4))


def test_infinite_dataset_without_steps_fails_before_any_step(strategy):
    x, y = regression_data(64)
    with strategy.scope():
        model = dense_model()
        model.compile("sgd", "mse")
    forever = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
    with pytest.raises(ValueError, match=r"infinite \(it repeats forever\).*steps_per_epoch=N"):
        model.fit(strategy.distribute_dataset(forever, global_batch_size=32), epochs=1, verbose=0)
    with pytest.raises(ValueError, match=r"infinite.*steps_per_epoch=N"):
        model.fit(forever.batch(32), epochs=1, verbose=0)
    with pytest.raises(ValueError, match=r"infinite.*steps=N"):
        model.evaluate(forever.batch(32), verbose=0)
    with pytest.raises(ValueError, match=r"validation_data is an infinite dataset.*validation_steps=N"):
        model.fit(x, y, batch_size=32, validation_data=forever.batch(32), verbose=0)
    assert not model.optimizer.built or int(model.optimizer.iterations.numpy()) == 0


def test_file_counting_sees_common_readers(record_files):
    assert tf_data.count_source_files(read_ids(record_files).shuffle(10).batch(4).prefetch(1)) == 5
    assert tf_data.count_source_files(tf.data.TFRecordDataset(record_files[:3])) == 3
    assert tf_data.count_source_files(tf.data.Dataset.list_files(
        os.path.join(os.path.dirname(record_files[0]), "*.tfrecord")).interleave(tf.data.TFRecordDataset)) == 5
    assert tf_data.count_source_files(tf.data.Dataset.range(10).map(lambda i: i + 1)) == 0
    assert tf_data.find_batch(tf.data.Dataset.range(10).batch(4, drop_remainder=True).prefetch(1)) == (4, True)
    assert tf_data.find_batch(tf.data.Dataset.range(10).batch(4).unbatch()) is None
