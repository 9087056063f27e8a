"""The job tests/test_xla.py runs on 2 local workers (not a test module): `fit` with XLA.

    python tests/xla_job.py OUT_DIR

Each worker fits tests/test_xla.py's small conv net with `jit_compile=True` under
`ReplicatorStrategy` (the cluster from TF_CONFIG) and writes its weights and losses
to ``OUT_DIR/worker{i}.npz``; the test compares them with one device's.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_replicator as kr  # noqa: E402
from tests.helpers import conv_model, image_data  # noqa: E402

EXAMPLES, BATCH, EPOCHS = 32, 16, 2

if __name__ == "__main__":
    strategy = kr.ReplicatorStrategy(startup_timeout=120)
    x, y = image_data(n=EXAMPLES, size=8, classes=4)
    with strategy.scope():
        model = conv_model()
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=True)
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    weights = {f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
    np.savez(os.path.join(sys.argv[1], f"worker{strategy.worker_index}.npz"),
             loss=np.asarray(history.history["loss"]), replicas=strategy.num_replicas_in_sync,
             jit=bool(model.jit_compile), **weights)
    print("worker", strategy.worker_index, "done", flush=True)
