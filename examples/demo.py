"""`make demo`: a small CNN on scikit-learn's 8x8 digits, on 4 simulated replicas.

Prints the per-epoch throughput and the test accuracy.
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from quiet_start import quiet_start  # noqa: E402 (examples/quiet_start.py: imports no TensorFlow)

REPLICAS = int(os.environ.get("DEMO_REPLICAS", "4"))
EPOCHS = int(os.environ.get("DEMO_EPOCHS", "20"))
with quiet_start():  # without TensorFlow's no-GPU lines (a red cuInit error on a CPU machine)
    import keras_replicator as kr

    kr.simulate_devices(REPLICAS)  # before TensorFlow starts

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402


class EpochTimer(keras.callbacks.Callback):
    def __init__(self, examples):
        super().__init__()
        self.examples = examples

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        rate = self.examples / (time.perf_counter() - self.start)
        print(f"epoch {epoch + 1:2d}  loss {logs['loss']:.4f}  accuracy {logs['accuracy']:.4f}  "
              f"{rate:8.0f} examples/s")


def main():
    digits = load_digits()
    x = (digits.images[..., np.newaxis] / 16.0).astype("float32")
    y = digits.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)

    strategy = kr.ReplicatorStrategy()
    print(f"{strategy}\n")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ])
        model.compile(
            keras.optimizers.Adam(1e-2),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=4,
        )
    global_batch = 16 * strategy.num_replicas_in_sync
    # The digits as they come: the last batch of each epoch is short (on 4 replicas, 1,347
    # digits end with 3 rows, and one replica gets a padding row that weighs nothing).
    model.fit(x_train, y_train, batch_size=global_batch, epochs=EPOCHS,
              verbose=0, callbacks=[EpochTimer(len(x_train))])
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=75, verbose=0)  # 450 = 6 x 75
    kr.testing.assert_replicas_identical(model)
    print(f"\n{strategy.num_replicas_in_sync} replicas, global batch {global_batch}: "
          f"test accuracy {accuracy:.4f} on {len(x_test)} held-out digits (replicas identical)")


if __name__ == "__main__":
    main()
