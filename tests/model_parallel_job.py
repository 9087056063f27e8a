"""The two-stage model of tests/test_model_parallel_devices.py, and its 2-worker job (not a test module).

Usage (every worker runs the same command, as ``keras-replicator launch`` does)::

    python tests/model_parallel_job.py OUT_DIR

Each worker (2 devices: one replica of 2 logical devices) trains the two-stage
model, then again with the optimizer state sharded over the job's 2 replicas,
and writes the weights and where their copies and slots live to
``OUT_DIR/{mirrored,sharded}{i}.json`` / ``.npz``; the test compares the
workers with each other and with the same training on one device.
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_replicator as kr  # noqa: E402

X = np.random.default_rng(0).normal(size=(96, 6)).astype("float32")
Y = np.random.default_rng(1).normal(size=(96, 3)).astype("float32")
BATCH = 16

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
}


@keras.saving.register_keras_serializable(package="keras_replicator_tests")
class TwoStage(keras.Model):
    """Stage 1 on logical device 0, stage 2 on logical device 1 (`kr.logical_device`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stage1 = keras.layers.Dense(16, activation="tanh")
        self.stage2 = keras.layers.Dense(3)
        self.seen = []  # where stage 2 ran, one entry per trace of a replica

    def call(self, x):
        with kr.logical_device(0):
            h = self.stage1(x)
        with kr.logical_device(1):
            y = self.stage2(h)
        self.seen.append(y.device)
        return y


def two_stage(strategy=None) -> TwoStage:
    """The model, its stages' variables on logical devices 0 and 1 of `strategy` (if given)."""
    keras.utils.set_random_seed(5)
    model = TwoStage()
    if strategy is None:
        model.stage1.build((None, 6))
        model.stage2.build((None, 16))
    else:
        with strategy.logical_device_for_variables(0):
            model.stage1.build((None, 6))
        with strategy.logical_device_for_variables(1):
            model.stage2.build((None, 16))
    model.build((None, 6))
    return model


def fit(strategy, optimizer, steps_per_execution: int = 1, epochs: int = 2) -> TwoStage:
    """The model trained on X, Y (under `strategy`'s scope, or on one device if None);
    `optimizer`: a name in OPTIMIZERS or a function that makes one."""
    make = OPTIMIZERS[optimizer] if isinstance(optimizer, str) else optimizer
    if strategy is None:
        model = two_stage()
        model.compile(make(), "mse")
    else:
        with strategy.scope():
            model = two_stage(strategy)
            model.compile(make(), "mse", steps_per_execution=steps_per_execution)
    model.fit(X, Y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model


def _devices(variable) -> list[str]:
    variable = getattr(variable, "value", variable)
    return [c.device for c in getattr(variable, "values", [variable])]


def main(out_dir: str) -> None:
    # Before any tensor: the strategy joins the cluster that TF_CONFIG describes.
    strategy = kr.ReplicatorStrategy(devices_per_replica=2, startup_timeout=120)
    # The same cluster again, the optimizer state sharded over the job's 2 replicas.
    sharded = kr.ReplicatorStrategy(devices_per_replica=2, shard_optimizer_state=True)
    for name, each in (("mirrored", strategy), ("sharded", sharded)):
        model = fit(each, "adamw", steps_per_execution=2)
        # AdamW's moments of stage 2's kernel (of shape (0,) where the other worker owns them).
        key = model.stage2.kernel.path.replace("/", "_")
        slots = [v for v in model.optimizer.variables if key in v.path]
        report = {
            "worker_index": each.worker_index,
            "num_replicas": each.num_replicas_in_sync,
            "mesh": list(each.mesh.devices),
            "stage1": _devices(model.stage1.kernel),
            "stage2": _devices(model.stage2.kernel),
            "slots": {v.path: [tuple(v.shape), *_devices(v)] for v in slots},
        }
        path = os.path.join(out_dir, f"{name}{each.worker_index}")
        np.savez(path + ".npz", *[np.asarray(w) for w in model.get_weights()])
        with open(path + ".json", "w") as f:
            json.dump(report, f)
        print("wrote", path, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
