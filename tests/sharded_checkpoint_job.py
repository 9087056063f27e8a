"""Checkpoints across meshes on 8 simulated devices (not a test module: run by
tests/test_model_parallel_checkpoints.py in a fresh interpreter).

Usage::

    python tests/sharded_checkpoint_job.py OUT_DIR

A tiny model (a vocabulary-split Embedding, a column-parallel then a row-parallel
Dense) with AdamW trains one epoch (3 steps) on a (2, 4) mesh and is saved five
ways: `model.save`, `save_weights`, `ModelCheckpoint`, `BackupAndRestore` and
`tf.train.Checkpoint`. Each is loaded on (4, 2), (1, 8), 8 plain replicas and one
device (and a one-device save on (2, 4)), trained one more epoch, and compared
with the same model trained 2 epochs on one device, uninterrupted: weights and
AdamW's state (iterations, m, v). Writes OUT_DIR/results.json: the largest
difference per path, and the wrong-shape loads' errors.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import keras_replicator as kr  # noqa: E402

kr.simulate_devices(8)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_replicator.model_parallel import whole_state  # noqa: E402

V, T, D, H, BATCH, STEPS = 16, 4, 8, 16, 16, 3
X = np.random.default_rng(0).integers(0, V, (BATCH * STEPS, T))
Y = np.random.default_rng(1).normal(size=(BATCH * STEPS, 3)).astype("float32")
MESHES = {"4x2": (4, 2), "1x8": (1, 8), "replicas8": None, "one_device": "one"}
WAYS = ("tf_checkpoint", "model_save", "save_weights", "model_checkpoint", "backup")


def model(hidden: int = H) -> keras.Model:
    keras.utils.set_random_seed(7)
    ids = keras.Input((T,), dtype="int32")
    x = keras.layers.Embedding(V, D, name="token")(ids)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(hidden, activation="tanh", name="column")(x)
    return keras.Model(ids, keras.layers.Dense(3, name="row")(x))


def layout_map(data: int, k: int) -> keras.distribution.LayoutMap:
    mesh = keras.distribution.DeviceMesh((data, k), ["batch", "model"], [f"cpu:{i}" for i in range(8)])
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*token/embeddings"] = ("model", None)
    layouts[".*column/kernel"] = (None, "model")
    layouts[".*column/bias"] = ("model",)
    layouts[".*row/kernel"] = ("model", None)
    return layouts


def strategy_for(where):
    if where == "one":
        return None
    if where is None:
        return kr.ReplicatorStrategy()
    return kr.ReplicatorStrategy(layout_map=layout_map(*where))


def compiled(strategy, hidden: int = H) -> keras.Model:
    def make():
        m = model(hidden)
        m.compile(keras.optimizers.AdamW(0.02, weight_decay=0.05), "mse")
        return m

    if strategy is None:
        return make()
    with strategy.scope():
        return make()


def fit(m, epochs: int = 1, initial_epoch: int = 0, callbacks=()) -> None:
    m.fit(X, Y, batch_size=BATCH, epochs=epochs, initial_epoch=initial_epoch, shuffle=False, verbose=0,
          callbacks=list(callbacks))


def optimizer_state(m) -> list[np.ndarray]:
    """iterations, learning rate, then each slot whole (a sharded model's grouped)."""
    return [np.asarray(v.numpy()) for v in whole_state.whole_views(m.optimizer.variables, {})]


def difference(m, ref) -> float:
    got, want = m.get_weights() + optimizer_state(m), ref.get_weights() + optimizer_state(ref)
    assert [g.shape for g in got] == [w.shape for w in want], ([g.shape for g in got], [w.shape for w in want])
    return max(float(np.max(np.abs(g.astype("float64") - w.astype("float64")))) for g, w in zip(got, want))


def save_all(m, out: str, callbacks_fit) -> None:
    """The five ways (ModelCheckpoint and BackupAndRestore through `callbacks_fit`'s epoch)."""
    callbacks_fit([keras.callbacks.ModelCheckpoint(os.path.join(out, "mc.weights.h5"), save_weights_only=True),
                   keras.callbacks.BackupAndRestore(os.path.join(out, "backup"), delete_checkpoint=False)])
    m.save(os.path.join(out, "model.keras"))
    m.save_weights(os.path.join(out, "w.weights.h5"))
    tf.train.Checkpoint(model=m, optimizer=m.optimizer).write(os.path.join(out, "tf", "ckpt"))


def continue_from(way: str, out: str, strategy, m):
    """`m` (or a model loaded from the file) restored from `way`'s save, then one more epoch."""
    if way == "tf_checkpoint":  # restore-on-create: the optimizer is built by fit
        tf.train.Checkpoint(model=m, optimizer=m.optimizer).restore(os.path.join(out, "tf", "ckpt"))
    elif way == "model_save" and m is None:
        if strategy is None:
            m = keras.saving.load_model(os.path.join(out, "model.keras"))
        else:
            with strategy.scope():
                m = keras.saving.load_model(os.path.join(out, "model.keras"))
    elif way == "model_save":
        m.load_weights(os.path.join(out, "model.keras"))
    elif way in ("save_weights", "model_checkpoint"):
        m.load_weights(os.path.join(out, "w.weights.h5" if way == "save_weights" else "mc.weights.h5"))
    if way == "backup":
        backup = os.path.join(out, "backup_copy")
        shutil.rmtree(backup, ignore_errors=True)
        shutil.copytree(os.path.join(out, "backup"), backup)
        fit(m, epochs=2, callbacks=[keras.callbacks.BackupAndRestore(backup)])  # restores epoch 1
    else:
        fit(m, epochs=2, initial_epoch=1)
    return m


def digest(folder: str) -> str:
    h = hashlib.sha256()
    for base, _, files in sorted(os.walk(folder)):
        for name in sorted(files):
            with open(os.path.join(base, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()


def same_format(a: str, b: str) -> dict:
    """Whether two folders' files hold the same names and shapes (a mesh's and one device's)."""
    import h5py

    def h5(path):
        found = {}
        with h5py.File(path, "r") as f:
            f.visititems(lambda name, item: found.__setitem__(name, item.shape)
                         if isinstance(item, h5py.Dataset) else None)
        return found

    tf_a, tf_b = (sorted(tf.train.list_variables(os.path.join(d, "tf", "ckpt"))) for d in (a, b))
    return {"tf_checkpoint": tf_a == tf_b and len(tf_a) > 10,
            "weights_h5": h5(os.path.join(a, "w.weights.h5")) == h5(os.path.join(b, "w.weights.h5"))}


def wrong_shape_errors(out: str) -> dict:
    """A model whose column layer is wider (24) than the saved one (16) on (4, 2)."""
    errors, before = {}, digest(out)
    strategy = strategy_for((4, 2))
    for way, load in (("save_weights", lambda m: m.load_weights(os.path.join(out, "w.weights.h5"))),
                      ("tf_checkpoint", lambda m: tf.train.Checkpoint(model=m, optimizer=m.optimizer).restore(
                          os.path.join(out, "tf", "ckpt")))):
        m = compiled(strategy, hidden=24)
        kernel = m.get_layer("column").kernel.numpy()
        try:
            load(m)
            errors[way] = None
        except Exception as e:  # noqa: BLE001 - the message is the result
            errors[way] = f"{type(e).__name__}: {e}"
        errors[way + "_kernel_untouched"] = bool(np.array_equal(kernel, m.get_layer("column").kernel.numpy()))
    errors["files_untouched"] = digest(out) == before
    return errors


def main(out: str) -> None:
    results, started = {}, time.monotonic()
    reference = compiled(None)
    fit(reference, epochs=2)  # the uninterrupted run

    source = compiled(strategy_for((2, 4)))
    save_all(source, os.path.join(out, "from_2x4"), lambda cb: fit(source, callbacks=cb))
    half = compiled(None)
    save_all(half, os.path.join(out, "from_one"), lambda cb: fit(half, callbacks=cb))
    results["2x4_after_one_epoch"] = difference(source, half)
    results["same_format"] = same_format(os.path.join(out, "from_2x4"), os.path.join(out, "from_one"))

    for name, where in MESHES.items():
        strategy = strategy_for(where)
        m = compiled(strategy) if where != "one" else None
        # One device: load_model first (the others load into that model); a mesh: a fresh
        # model first, restored from tf.train.Checkpoint before its optimizer exists; on (4, 2),
        # the .keras file through load_model in the strategy's scope too (a new model).
        for way in (WAYS if m is not None else ("model_save", *(w for w in WAYS if w != "model_save"))):
            fresh = way == "model_save" and name == "4x2"
            m = continue_from(way, os.path.join(out, "from_2x4"), strategy, None if fresh else m)
            results[f"2x4->{name}:{way}"] = difference(m, reference)
            print(f"2x4->{name}:{way}", results[f"2x4->{name}:{way}"], flush=True)
        print(f"{name} done at {time.monotonic() - started:.1f} s", flush=True)
    # The reverse: one device's files onto (2, 4), into the model that wrote the others.
    for way in WAYS:
        source = continue_from(way, os.path.join(out, "from_one"), None, source)
        results[f"one_device->2x4:{way}"] = difference(source, reference)
    untrained = compiled(None)
    untrained.optimizer.build(untrained.trainable_variables)
    results["untrained"] = difference(untrained, reference)  # what a load that did nothing would give
    results["wrong_shape"] = wrong_shape_errors(os.path.join(out, "from_2x4"))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", os.path.join(out, "results.json"), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
