"""One run of the peers section (``benchmarks.peers``) in a fresh process: one stack, one workload.

``python -m benchmarks.peers_worker SPEC_JSON`` prints one ``PEERS_RESULT {...}`` line.

Imports only the standard library at module level: the Keras-on-JAX runs use this module
from their own venv (``.venvs/jax``: JAX, Keras and NumPy, no TensorFlow, no keras_replicator).
The stack's environment (``KERAS_BACKEND``; for JAX ``XLA_FLAGS=--xla_force_host_platform_
device_count=n``) is set by the parent before this process starts.

Stacks: ``ours`` (``kr.simulate_devices(n)`` + ``ReplicatorStrategy()``, or for ``lm_mp``
``set_distribution(ModelParallel(...))``), ``stock`` (``MirroredStrategy`` on n logical CPUs,
keras_replicator not imported) and ``jax`` (Keras on JAX: ``DataParallel`` or ``ModelParallel``
over ``list_devices()[:n]``). Workloads: ``cnn`` (6 convolutions, 32x32x3, 10 classes, Adam),
``lm`` (a 2-block transformer LM, AdamW) and ``lm_mp`` (the LM with the attention and FFN
kernels split over a (1, n) mesh: the same ``LayoutMap`` for ours and JAX).
"""

from __future__ import annotations

import json
import os
import sys
import time

SIZES = {
    "full": {"cnn": dict(batch=128, steps=8, size=32, filters=32),
             "lm": dict(batch=32, steps=8, d=256, heads=4, ffn=1024, seq=64, vocab=2048, blocks=2)},
    "tiny": {"cnn": dict(batch=16, steps=2, size=8, filters=4),
             "lm": dict(batch=8, steps=2, d=16, heads=2, ffn=32, seq=8, vocab=64, blocks=1)},
}


def cnn(keras, size: int, filters: int, **_):
    """Six 3x3 convolutions (two strided), global pooling, 10 classes."""
    inputs = keras.Input((size, size, 3))
    h = inputs
    for i, (f, stride) in enumerate(((1, 1), (1, 1), (2, 2), (2, 1), (4, 2), (4, 1))):
        h = keras.layers.Conv2D(filters * f, 3, strides=stride, padding="same", activation="relu",
                                name=f"conv{i}")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(h))


def lm(keras, d: int, heads: int, ffn: int, seq: int, vocab: int, blocks: int, **_):
    """A GPT-style LM of Keras layers: causal attention, pre-norm, ``blocks`` blocks."""
    ids = keras.Input((seq,), dtype="int32")
    positions = keras.ops.zeros_like(ids) + keras.ops.arange(seq, dtype="int32")
    x = keras.layers.Embedding(vocab, d, name="token")(ids)
    x = x + keras.layers.Embedding(seq, d, name="position")(positions)
    for i in range(blocks):
        h = keras.layers.LayerNormalization(name=f"block{i}_norm1")(x)
        x = x + keras.layers.MultiHeadAttention(heads, d // heads, name=f"block{i}_mha")(
            h, h, use_causal_mask=True)
        h = keras.layers.LayerNormalization(name=f"block{i}_norm2")(x)
        h = keras.layers.Dense(ffn, activation="gelu", name=f"block{i}_ffn_in")(h)
        x = x + keras.layers.Dense(d, name=f"block{i}_ffn_out")(h)
    x = keras.layers.LayerNormalization(name="final_norm")(x)
    return keras.Model(ids, keras.layers.Dense(vocab, name="logits")(x))


def compiled(keras, kind: str, sizes: dict):
    """The workload's model (``cnn`` or ``lm``), compiled as every stack runs it: Adam for the
    CNN, AdamW for the LM, sparse categorical cross-entropy on logits."""
    model = (cnn if kind == "cnn" else lm)(keras, **sizes)
    optimizer = (keras.optimizers.Adam(1e-3) if kind == "cnn"
                 else keras.optimizers.AdamW(1e-3, weight_decay=0.01))
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def layout_map(keras, devices: int):
    """The attention and FFN kernels over the model axis of a (1, ``devices``) mesh."""
    mesh = keras.distribution.DeviceMesh((1, devices), ("batch", "model"),
                                         keras.distribution.list_devices()[:devices])
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*mha/(query|key|value)/kernel"] = (None, "model", None)
    layouts[".*mha/attention_output/kernel"] = ("model", None, None)
    layouts[".*ffn_in/kernel"] = (None, "model")
    layouts[".*ffn_out/kernel"] = ("model", None)
    return layouts


def data(workload: str, sizes: dict):
    """The same arrays for every stack: ``steps`` batches of synthetic data (NumPy, seeded)."""
    import numpy as np

    rng = np.random.default_rng(0)
    n = sizes["batch"] * sizes["steps"]
    if workload == "cnn":
        return (rng.random((n, sizes["size"], sizes["size"], 3), dtype=np.float32),
                rng.integers(0, 10, n).astype(np.int32))
    tokens = rng.integers(0, sizes["vocab"], (n, sizes["seq"] + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def _scope(spec: dict, keras):
    """The distribution context of the stack: a strategy's scope, or Keras's distribution set."""
    import contextlib

    stack, n, workload = spec["stack"], spec["devices"], spec["workload"]
    if stack == "jax":
        if workload == "lm_mp":
            keras.distribution.set_distribution(keras.distribution.ModelParallel(
                layout_map=layout_map(keras, n), batch_dim_name="batch"))
        else:
            keras.distribution.set_distribution(keras.distribution.DataParallel(
                devices=keras.distribution.list_devices()[:n]))
        return contextlib.nullcontext()
    import tensorflow as tf

    if stack == "stock":
        return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)]).scope()
    import keras_replicator as kr

    if workload == "lm_mp":
        keras.distribution.set_distribution(keras.distribution.ModelParallel(
            layout_map=layout_map(keras, n), batch_dim_name="batch"))
        return contextlib.nullcontext()
    return kr.ReplicatorStrategy().scope()


def _devices(spec: dict) -> None:
    """n simulated CPU devices for the TensorFlow stacks (JAX's come from XLA_FLAGS)."""
    n = spec["devices"]
    if spec["stack"] == "ours":
        import keras_replicator as kr

        kr.simulate_devices(n)
    elif spec["stack"] == "stock":
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)


def run(spec: dict) -> dict:
    """Builds, compiles and fits the workload; the first step's time and the timed epochs'."""
    _devices(spec)
    import keras
    import numpy as np

    workload = spec["workload"]
    kind = "cnn" if workload == "cnn" else "lm"
    sizes = SIZES[spec["size"]][kind]
    keras.utils.set_random_seed(0)
    with _scope(spec, keras):
        model = compiled(keras, kind, sizes)
    x, y = data(workload, sizes)
    marks: dict[str, list[float]] = {"epochs": []}

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            marks.setdefault("first_step", [time.perf_counter()])

        def on_epoch_end(self, epoch, logs=None):
            marks["epochs"].append(time.perf_counter())
            marks["loss"] = [float(logs["loss"])]

    epochs = spec["warmup_epochs"] + spec["epochs"]
    start = time.perf_counter()
    model.fit(x, y, batch_size=sizes["batch"], epochs=epochs, shuffle=False, verbose=0,
              callbacks=[Clock()])
    timed = marks["epochs"][spec["warmup_epochs"] - 1:]
    examples = spec["epochs"] * sizes["steps"] * sizes["batch"]
    weights = np.concatenate([np.ravel(w).astype(np.float64) for w in model.get_weights()])
    if spec.get("weights_path"):
        np.save(spec["weights_path"], weights)
    return {"first_step_s": marks["first_step"][0] - start,
            "steady_examples_per_s": examples / (timed[-1] - timed[0]),
            "epoch_s": [b - a for a, b in zip(timed, timed[1:])],
            "loss": marks["loss"][0], "weights_checksum": float(weights.sum()),
            "parameters": int(weights.size), "keras": keras.__version__,
            "backend": keras.backend.backend(), **_onednn(spec)}


def _onednn(spec: dict) -> dict:
    """Whether TensorFlow's oneDNN CPU kernels ran, for ours (stock does not import keras_replicator,
    whose ``_compat`` holds the check; it inherits the same ``TF_ENABLE_ONEDNN_OPTS``)."""
    if spec["stack"] != "ours":
        return {}
    from keras_replicator._compat import onednn

    return {"onednn": onednn.enabled()}


def main(argv: list[str] | None = None) -> int:
    spec = json.loads((argv if argv is not None else sys.argv[1:])[0])
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    result = run(spec)
    print("PEERS_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
