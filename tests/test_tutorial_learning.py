"""The tutorial's recipe really learns: a small ResNet on real images, 4 replicas vs 1 device.

The same code path as the ResNet-50 tutorial, scaled down: a member of the same
ResNet v1.5 family (bottleneck blocks, global batch norm, zero-initialised
residual gammas, weight decay on kernels only), the same transforms (random
resized crop for training, centre crop for evaluation), the same recipe (SGD
with Nesterov momentum, linear scaling with warmup, cosine decay, label
smoothing) and ``distribute_dataset``, on scikit-learn's 8x8 digits upsampled.
Scaled down: 16x16 images, crops of 50% to 100% of the area and no flips (digits
are not mirror-symmetric), and the linear scaling rule with a reference batch of
16 (0.125 per 16 images, so 0.5 at the global batch of 64, reached over 2 of 15
epochs).
"""

import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import keras_replicator as kr
from keras_replicator.applications import imagenet
from keras_replicator.applications.resnet import Recipe

pytestmark = pytest.mark.devices(4)

IMAGE_SIZE = 16  # the digits, upsampled from 8x8 to 18x18, then cropped to 16x16
GLOBAL_BATCH = 64  # 16 per replica on 4 replicas
EPOCHS = 15
BLOCKS = (1, 1)  # two bottleneck stages: 9 batch-norm layers
TEST_EXAMPLES = 448  # 7 global batches


def digits():
    d = load_digits()
    side = IMAGE_SIZE + IMAGE_SIZE // 8
    images = tf.image.resize(d.images[..., np.newaxis] * (255.0 / 16.0), (side, side)).numpy()
    images = np.clip(np.round(images), 0, 255).astype("uint8")
    return train_test_split(
        images, d.target.astype("int64"), test_size=TEST_EXAMPLES, random_state=0, stratify=d.target
    )


def train_and_evaluate(strategy, data, recipe):
    keras.utils.set_random_seed(0)  # the same data order, augmentation and initial weights
    x_train, x_test, y_train, y_test = data
    mean, stddev = (float(x_train.mean()),), (float(x_train.std()),)

    def train_example(example, seed):
        image, label = example
        image = imagenet.preprocess_for_train(
            image, seed, image_size=IMAGE_SIZE, area_range=(0.5, 1.0), flip=False,
            mean=mean, stddev=stddev)
        return image, tf.one_hot(label, 10)

    def test_example(image, label):
        image = imagenet.preprocess_for_eval(image, image_size=IMAGE_SIZE, mean=mean, stddev=stddev)
        return image, tf.one_hot(label, 10)

    train = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    train = train.shuffle(len(x_train), seed=1, reshuffle_each_iteration=True)
    train = tf.data.Dataset.zip(train, imagenet.example_seeds(2)).map(train_example)
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).map(test_example)
    train = strategy.distribute_dataset(train, global_batch_size=recipe.global_batch_size,
                                        drop_remainder=True)
    test = strategy.distribute_dataset(test, global_batch_size=recipe.global_batch_size)

    with strategy.scope():
        model = kr.applications.resnet(
            BLOCKS, num_classes=10, input_shape=(IMAGE_SIZE, IMAGE_SIZE, 1), width=16,
            stem="small", weight_decay=recipe.weight_decay)
        recipe.compile(model, steps_per_execution=7)
    history = model.fit(train, epochs=recipe.epochs, steps_per_epoch=recipe.steps_per_epoch(),
                        callbacks=recipe.callbacks(), verbose=0)
    _, accuracy, _ = model.evaluate(test, verbose=0)
    return model, history, accuracy


def test_small_resnet_on_digits_4_replicas_matches_one_device():
    data = digits()
    recipe = Recipe(
        global_batch_size=GLOBAL_BATCH, epochs=EPOCHS, base_learning_rate=0.125,
        reference_batch_size=16, warmup_epochs=2, num_train_examples=len(data[0]))
    assert recipe.peak_learning_rate == 0.5 and recipe.weight_decay == 1e-4

    started = time.time()
    replicated, history, acc_replicated = train_and_evaluate(kr.ReplicatorStrategy(), data, recipe)
    mid = time.time()
    _, _, acc_one = train_and_evaluate(kr.ReplicatorStrategy(["/cpu:0"]), data, recipe)
    print(f"\ndigits test accuracy: 4 replicas {acc_replicated:.4f} ({mid - started:.0f} s), "
          f"1 device {acc_one:.4f} ({time.time() - mid:.0f} s)")

    assert replicated.distribute_strategy.num_replicas_in_sync == 4
    kr.testing.assert_replicas_identical(replicated)
    # The recipe's schedule ran: every update, warmup from the base rate, then cosine decay to ~0.
    updates = recipe.epochs * recipe.steps_per_epoch()
    assert int(replicated.optimizer.iterations.numpy()) == updates
    schedule = recipe.learning_rate_schedule()
    rates = [float(schedule(s)) for s in range(updates)]
    assert rates[0] == pytest.approx(0.125) and max(rates) == pytest.approx(recipe.peak_learning_rate)
    assert rates[-1] < 0.05 * recipe.peak_learning_rate
    assert float(replicated.optimizer.learning_rate) == pytest.approx(float(schedule(updates)))
    assert min(history.history["examples_per_second"]) > 0
    assert acc_replicated >= 0.95, acc_replicated
    assert acc_one >= 0.95, acc_one
    assert abs(acc_replicated - acc_one) <= 0.01, (acc_replicated, acc_one)
