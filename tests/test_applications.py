"""kr.applications: the ResNet-50 of the tutorial, its input transforms and its recipe."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator.applications import imagenet
from keras_replicator.applications.resnet import Recipe, mixed_precision_policy

# --- the model ------------------------------------------------------------------


def _count(weights):
    return sum(int(np.prod(w.shape)) for w in weights)


def _batch_norms(model):
    return [layer for layer in model.layers if isinstance(layer, kr.layers.GlobalBatchNormalization)]


def _producer(tensor):
    return tensor._keras_history.operation


@pytest.fixture(scope="module")
def resnet50():
    return kr.applications.resnet50()


def test_resnet50_has_the_parameters_of_resnet50_v1_5(resnet50):
    # torchvision's resnet50 (v1.5): 25,557,032 parameters; plus the batch-norm
    # moving statistics (2 x 26,560 channels), which Keras counts as weights.
    assert _count(resnet50.trainable_weights) == 25_557_032
    assert _count(resnet50.non_trainable_weights) == 53_120
    assert resnet50.count_params() == 25_610_152
    assert tuple(resnet50.output.shape) == (None, 1000)
    assert len(_batch_norms(resnet50)) == 53
    assert not any(type(layer) is keras.layers.BatchNormalization for layer in resnet50.layers)
    convs = [layer for layer in resnet50.layers if isinstance(layer, keras.layers.Conv2D)]
    assert len(convs) == 53 and not any(c.use_bias for c in convs)
    # v1.5: the stride of a downsampling bottleneck is in its 3x3 convolution.
    for stage in (3, 4, 5):
        block = f"conv{stage}_block1"
        assert resnet50.get_layer(f"{block}_1_conv").strides == (1, 1)
        assert resnet50.get_layer(f"{block}_2_conv").strides == (2, 2)
        assert resnet50.get_layer(f"{block}_0_conv").strides == (2, 2)


def test_resnet18_basic_blocks_have_torchvision_parameter_count():
    model = kr.applications.resnet((2, 2, 2, 2), num_classes=1000, block="basic")
    assert _count(model.trainable_weights) == 11_689_512


def test_last_batch_norm_of_every_residual_block_starts_at_zero(resnet50):
    adds = [layer for layer in resnet50.layers if isinstance(layer, keras.layers.Add)]
    assert len(adds) == 16  # 3 + 4 + 6 + 3 bottleneck blocks
    zero = set()
    for add in adds:
        shortcut, residual = (_producer(t) for t in add.input)
        assert isinstance(residual, kr.layers.GlobalBatchNormalization)
        np.testing.assert_array_equal(residual.gamma.numpy(), 0.0)
        zero.add(residual.name)
        if isinstance(shortcut, kr.layers.GlobalBatchNormalization):  # a projection shortcut
            np.testing.assert_array_equal(shortcut.gamma.numpy(), 1.0)
    for bn in _batch_norms(resnet50):
        if bn.name not in zero:
            np.testing.assert_array_equal(bn.gamma.numpy(), 1.0)
    # So every block starts as the identity on its (shortcut) input.
    block_in = resnet50.get_layer("conv2_block1_out").output
    probe = keras.Model(resnet50.input, [block_in, resnet50.get_layer("conv2_block2_out").output])
    x = np.random.default_rng(0).normal(size=(1, 224, 224, 3)).astype("float32")
    before, after = probe(x, training=False)
    np.testing.assert_allclose(after, before, atol=1e-6)


def test_zero_init_can_be_turned_off():
    model = kr.applications.resnet((1, 1), num_classes=10, input_shape=(16, 16, 3), width=8,
                                   stem="small", zero_init_residual=False)
    for bn in _batch_norms(model):
        np.testing.assert_array_equal(bn.gamma.numpy(), 1.0)


def _decay_gradients(model):
    with tf.GradientTape() as tape:
        penalty = tf.add_n(model.losses)
    grads = tape.gradient(penalty, [w.value for w in model.trainable_weights])
    return dict(zip([w.path for w in model.trainable_weights], zip(model.trainable_weights, grads)))


def _assert_decay_on_kernels_only(model, weight_decay, expected_kernels):
    kernels = 0
    for path, (weight, grad) in _decay_gradients(model).items():
        if path.endswith("/kernel"):
            kernels += 1
            np.testing.assert_allclose(grad, weight_decay * weight.numpy(), rtol=1e-5, atol=1e-12)
        else:  # batch-norm gamma/beta and biases: no decay
            assert path.endswith(("/gamma", "/beta", "/bias")), path
            assert grad is None or not np.any(grad.numpy()), path
    assert kernels == expected_kernels


def test_weight_decay_on_kernels_only_not_on_batch_norm_or_bias(resnet50):
    assert len(resnet50.losses) == 54  # 53 convolution kernels + the classifier's kernel
    _assert_decay_on_kernels_only(resnet50, 1e-4, 54)


def test_weight_decay_zero_and_custom():
    small = dict(num_classes=10, input_shape=(16, 16, 3), width=8, stem="small")
    assert kr.applications.resnet((1,), weight_decay=0.0, **small).losses == []
    # The stem, the block's three convolutions and its projection shortcut, the classifier.
    _assert_decay_on_kernels_only(kr.applications.resnet((1,), weight_decay=5e-5, **small), 5e-5, 6)


def test_keras_applications_variant_is_converted_with_the_same_rules():
    model = kr.applications.resnet50(variant="keras_applications", input_shape=(64, 64, 3))
    # keras.applications.ResNet50 is v1 with convolution biases: 25,636,712 weights.
    assert model.count_params() == 25_636_712
    bns = _batch_norms(model)
    assert len(bns) == 53
    assert not any(type(layer) is keras.layers.BatchNormalization for layer in model.layers)
    zero = [bn.name for bn in bns if not np.any(bn.gamma.numpy())]
    assert len(zero) == 16 and all(name.endswith("_3_bn") for name in zero)
    _assert_decay_on_kernels_only(model, 1e-4, 54)  # conv biases are not decayed


def test_apply_weight_decay_on_any_model_survives_saving(tmp_path):
    model = keras.Sequential([
        keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(),
        keras.layers.Flatten(), keras.layers.Dense(2)])
    assert kr.applications.apply_weight_decay(model, 2e-4) is model
    _assert_decay_on_kernels_only(model, 2e-4, 2)
    path = str(tmp_path / "m.keras")
    model.save(path)
    _assert_decay_on_kernels_only(keras.models.load_model(path), 2e-4, 2)


def test_resnet_saves_and_loads(tmp_path):
    model = kr.applications.resnet((1,), num_classes=3, input_shape=(8, 8, 3), width=4, stem="small")
    path = str(tmp_path / "resnet.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    x = np.random.default_rng(1).normal(size=(2, 8, 8, 3)).astype("float32")
    np.testing.assert_allclose(loaded(x, training=False), model(x, training=False), atol=1e-6)
    assert len(_batch_norms(loaded)) == 5  # stem, 3 in the block, 1 on the shortcut


def test_mixed_precision_computes_in_bfloat16_and_classifies_in_float32():
    strategy = kr.ReplicatorStrategy()
    policy = mixed_precision_policy(strategy)
    assert policy == "mixed_bfloat16"  # CPU
    with strategy.scope():
        model = kr.applications.resnet((1,), num_classes=10, input_shape=(8, 8, 3), width=4,
                                       stem="small", dtype=policy)
        Recipe(global_batch_size=8, epochs=2, warmup_epochs=1).compile(model)
    assert model.get_layer("conv1_conv").compute_dtype == "bfloat16"
    assert model.get_layer("conv1_conv").kernel.dtype == "float32"
    assert model.get_layer("predictions").compute_dtype == "float32"
    x = np.random.default_rng(0).normal(size=(16, 8, 8, 3)).astype("float32")
    y = np.eye(10, dtype="float32")[np.arange(16) % 10]
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert model.predict(x, batch_size=8, verbose=0).dtype == np.float32
    kr.testing.assert_replicas_identical(model)


def test_mixed_float16_gets_loss_scaling_and_gpu_policy():
    model = kr.applications.resnet((1,), num_classes=10, input_shape=(8, 8, 3), width=4,
                                   stem="small", dtype="mixed_float16")
    Recipe(global_batch_size=8, epochs=2, warmup_epochs=1).compile(model)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)

    class GpuStrategy:  # what mixed_precision_policy reads
        class extended:
            worker_devices = ("/job:localhost/replica:0/task:0/device:GPU:0",)

    assert mixed_precision_policy(GpuStrategy()) == "mixed_float16"


def test_recipe_on_4_replicas_matches_one_device():
    """Weight decay, label smoothing, momentum and global batch norm: replication is invisible."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8, 8, 3)).astype("float32")
    y = np.eye(5, dtype="float32")[rng.integers(0, 5, 32)]
    recipe = Recipe(global_batch_size=16, epochs=2, warmup_epochs=1, reference_batch_size=8,
                    weight_decay=1e-2, num_train_examples=32)  # warmup 0.1 -> 0.2 over 2 updates

    def train(strategy):
        keras.utils.set_random_seed(3)
        with strategy.scope():
            model = kr.applications.resnet((1,), num_classes=5, input_shape=(8, 8, 3), width=4,
                                           stem="small", weight_decay=recipe.weight_decay)
            recipe.compile(model)
        data = strategy.distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)),
                                           global_batch_size=16)
        model.fit(data, epochs=2, callbacks=recipe.callbacks(throughput=False), verbose=0)
        return model

    replicated = train(kr.ReplicatorStrategy())
    one = train(kr.ReplicatorStrategy(["/cpu:0"]))
    kr.testing.assert_replicas_identical(replicated)
    assert kr.testing.max_weight_difference(replicated, one) <= 1e-5


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: kr.applications.resnet([], num_classes=10), "block_sizes"),
        (lambda: kr.applications.resnet((1, 0), num_classes=10), "block_sizes"),
        (lambda: kr.applications.resnet((1,), num_classes=0), "num_classes"),
        (lambda: kr.applications.resnet((1,), num_classes=10, block="wide"), "block"),
        (lambda: kr.applications.resnet((1,), num_classes=10, stem="cifar"), "stem"),
        (lambda: kr.applications.resnet((1,), num_classes=10, batch_norm="sync"), "batch_norm"),
        (lambda: kr.applications.resnet((1,), num_classes=10, weight_decay=-1e-4), "weight_decay"),
        (lambda: kr.applications.resnet((1,), num_classes=10, input_shape=(32, 32)), "input_shape"),
        (lambda: kr.applications.resnet((1,), num_classes=10, bn_momentum=1.5), "bn_momentum"),
        (lambda: kr.applications.resnet50(variant="v2"), "variant"),
        (lambda: kr.applications.resnet50(weights="imagenet"), "weights"),
        (lambda: kr.applications.resnet50(variant="keras_applications", batch_norm="keras"), "batch_norm"),
        (lambda: kr.applications.apply_weight_decay("model", 1e-4), "keras.Model"),
    ],
)
def test_model_arguments_are_checked(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


# --- the transforms ---------------------------------------------------------------

PLAIN = dict(mean=(0.0,), stddev=(1.0,))


def _image(h=64, w=64, c=3, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, c)).astype("uint8")


def test_train_transform_shape_dtype_range_and_determinism():
    image = _image(80, 60)
    seed = tf.constant([1, 2], tf.int64)
    out = imagenet.preprocess_for_train(image, seed, image_size=32)
    assert out.shape == (32, 32, 3) and out.dtype == tf.float32
    low = (0 - np.array(imagenet.MEAN_RGB)) / np.array(imagenet.STDDEV_RGB)
    high = (255 - np.array(imagenet.MEAN_RGB)) / np.array(imagenet.STDDEV_RGB)
    assert np.all(out.numpy() >= low - 1e-4) and np.all(out.numpy() <= high + 1e-4)
    np.testing.assert_array_equal(out, imagenet.preprocess_for_train(image, seed, image_size=32))
    other = imagenet.preprocess_for_train(image, tf.constant([1, 3], tf.int64), image_size=32)
    assert np.abs(other.numpy() - out.numpy()).max() > 0.1
    half = imagenet.preprocess_for_train(image, seed, image_size=32, dtype=tf.bfloat16)
    assert half.dtype == tf.bfloat16


def test_train_crop_is_a_window_of_the_requested_area():
    image = _image(64, 64)
    for s in range(5):
        out = imagenet.preprocess_for_train(
            image, tf.constant([s, 7], tf.int64), image_size=32, area_range=(0.25, 0.25),
            aspect_ratio_range=(1.0, 1.0), flip=False, **PLAIN).numpy()
        # A 32x32 window resized to 32x32 is the window itself.
        matches = [(t, left) for t in range(33) for left in range(33)
                   if np.array_equal(out, image[t:t + 32, left:left + 32].astype("float32"))]
        assert len(matches) == 1


def test_train_flip_happens_about_half_the_time_and_can_be_off():
    image = _image(32, 32)
    whole = dict(image_size=32, area_range=(1.0, 1.0), aspect_ratio_range=(1.0, 1.0), **PLAIN)
    flips = 0
    for s in range(40):
        out = imagenet.preprocess_for_train(image, tf.constant([s, 0], tf.int64), **whole).numpy()
        if np.array_equal(out, image[:, ::-1].astype("float32")):
            flips += 1
        else:
            np.testing.assert_array_equal(out, image.astype("float32"))
        no_flip = imagenet.preprocess_for_train(image, tf.constant([s, 0], tf.int64), flip=False, **whole)
        np.testing.assert_array_equal(no_flip, image.astype("float32"))
    assert 8 <= flips <= 32


def test_jpeg_bytes_and_decoded_images_get_the_same_transform():
    encoded = tf.io.encode_jpeg(_image(50, 70), quality=95)
    decoded = tf.io.decode_jpeg(encoded, channels=3)
    seed = tf.constant([4, 5], tf.int64)
    np.testing.assert_allclose(imagenet.preprocess_for_train(encoded, seed, image_size=24),
                               imagenet.preprocess_for_train(decoded, seed, image_size=24), atol=1e-5)
    np.testing.assert_allclose(imagenet.preprocess_for_eval(encoded, image_size=24),
                               imagenet.preprocess_for_eval(decoded, image_size=24), atol=1e-5)


def test_eval_transform_is_the_central_crop_of_the_shorter_side():
    image = _image(256, 320)
    out = imagenet.preprocess_for_eval(image, image_size=224, **PLAIN).numpy()
    # 0.875 x 256 = 224: the central 224x224, no resizing needed.
    np.testing.assert_array_equal(out, image[16:240, 48:272].astype("float32"))
    normalised = imagenet.preprocess_for_eval(image, image_size=224).numpy()
    expected = (image[16:240, 48:272] - np.array(imagenet.MEAN_RGB)) / np.array(imagenet.STDDEV_RGB)
    np.testing.assert_allclose(normalised, expected, atol=1e-4)
    small = imagenet.preprocess_for_eval(_image(30, 40, 1), image_size=16, crop_fraction=1.0, **PLAIN)
    assert small.shape == (16, 16, 1)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: imagenet.preprocess_for_train(_image(), [0, 0], image_size=0), "image_size"),
        (lambda: imagenet.preprocess_for_train(_image(), [0, 0], area_range=(0.0, 1.0)), "area_range"),
        (lambda: imagenet.preprocess_for_train(_image(), [0, 0], area_range=(0.5, 1.5)), "area_range"),
        (lambda: imagenet.preprocess_for_train(_image(), [0, 0], aspect_ratio_range=2), "aspect_ratio"),
        (lambda: imagenet.preprocess_for_train(np.zeros((2, 8, 8, 3), "uint8"), [0, 0]), "one example"),
        (lambda: imagenet.preprocess_for_eval(_image(), crop_fraction=1.5), "crop_fraction"),
        (lambda: imagenet.preprocess_for_eval(_image(), mean=(1.0, 2.0)), "mean"),
        (lambda: imagenet.input_fn("train", num_classes=1), "num_classes"),
        (lambda: imagenet.input_fn("", image_size=32), "split"),
        (lambda: imagenet.input_fn("train", shuffle_buffer=0), "shuffle_buffer"),
    ],
)
def test_transform_arguments_are_checked(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- the ImageNet pipeline, on TFDS's mock imagenet2012 ------------------------------


def test_imagenet_input_fn_through_distribute_dataset_with_mock_data():
    tfds = pytest.importorskip("tensorflow_datasets")
    strategy = kr.ReplicatorStrategy()
    with tfds.testing.mock_data(num_examples=20):
        train = strategy.distribute_dataset(imagenet.input_fn("train", image_size=32),
                                            global_batch_size=8)
        val = strategy.distribute_dataset(imagenet.input_fn("validation", image_size=32),
                                          global_batch_size=8)
    images, labels = next(iter(train))
    for image, label in zip(strategy.experimental_local_results(images),
                            strategy.experimental_local_results(labels)):
        assert image.shape == (2, 32, 32, 3) and image.dtype == tf.float32
        assert label.shape == (2, 1000)
        np.testing.assert_array_equal(tf.reduce_sum(label, axis=1), 1.0)
    # Training repeats; evaluation sees every example exactly once.
    assert sum(1 for _ in zip(range(5), train)) == 5
    seen = 0
    for _, labels in val:
        seen += sum(int(v.shape[0]) for v in strategy.experimental_local_results(labels))
    assert seen == 20


# --- the recipe ----------------------------------------------------------------------


def test_recipe_follows_the_linear_scaling_rule_and_decays():
    recipe = Recipe(global_batch_size=1024)
    assert recipe.peak_learning_rate == pytest.approx(0.4)
    assert recipe.weight_decay == 1e-4 and recipe.epochs == 90 and recipe.label_smoothing == 0.1
    steps = recipe.steps_per_epoch()
    assert steps == 1_281_167 // 1024
    schedule = recipe.learning_rate_schedule()
    assert isinstance(schedule, kr.schedules.LinearScalingWarmup)
    assert schedule.warmup_steps == 5 * steps and schedule.decay_steps == 85 * steps

    def rate(step):
        return float(schedule(step))

    assert rate(0) == pytest.approx(0.1)  # warmup starts at the base rate
    assert rate(int(2.5 * steps)) == pytest.approx(0.25, rel=1e-3)
    assert rate(5 * steps) == pytest.approx(0.4)  # end of the warmup
    middle = 5 * steps + (85 * steps) // 2
    assert rate(middle) == pytest.approx(0.2, rel=1e-3)  # cosine half-way
    assert rate(90 * steps - 1) < 1e-5
    rates = [rate(s) for s in range(5 * steps, 90 * steps, steps)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))
    # Another number of steps per epoch (another data set size) stretches the same shape.
    short = recipe.learning_rate_schedule(steps_per_epoch=10)
    assert short.warmup_steps == 50 and float(short(25)) == pytest.approx(0.25)

    step = Recipe(global_batch_size=256, schedule="step").learning_rate_schedule()
    s = Recipe(global_batch_size=256).steps_per_epoch()
    assert [float(step(e * s)) for e in (10, 30, 60, 85)] == pytest.approx([0.1, 0.01, 0.001, 0.0001])
    assert Recipe(global_batch_size=32_768).weight_decay == 5e-5
    assert Recipe(global_batch_size=32_768, weight_decay=1e-4).weight_decay == 1e-4


def test_recipe_schedule_drives_the_optimizer_in_fit():
    # 32 examples at a global batch of 8: 4 updates per epoch, warmup over the first epoch.
    recipe = Recipe(global_batch_size=8, epochs=3, warmup_epochs=1, reference_batch_size=4,
                    base_learning_rate=0.05, num_train_examples=32)
    with kr.ReplicatorStrategy().scope():
        model = kr.applications.resnet((1,), num_classes=5, input_shape=(8, 8, 3), width=4,
                                       stem="small")
        recipe.compile(model, steps_per_execution=2)
    schedule = recipe.learning_rate_schedule()

    class Probe(keras.callbacks.Callback):
        rates = []

        def on_train_batch_begin(self, batch, logs=None):
            self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8, 8, 3)).astype("float32")
    y = np.eye(5, dtype="float32")[rng.integers(0, 5, 32)]
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[Probe()])
    assert int(model.optimizer.iterations.numpy()) == 8
    # Keras calls back once per execution of 2 steps: the rates of steps 0, 2, 4, 6.
    np.testing.assert_allclose(Probe.rates, [float(schedule(s)) for s in (0, 2, 4, 6)], rtol=1e-6)
    assert Probe.rates[:3] == pytest.approx([0.05, 0.075, 0.1])  # warmup to 0.05 * 8 / 4


def test_recipe_optimizer_loss_metrics_and_callbacks(tmp_path):
    recipe = Recipe(global_batch_size=512)
    opt = recipe.optimizer()
    assert isinstance(opt, keras.optimizers.SGD) and opt.nesterov and opt.momentum == 0.9
    loss = recipe.loss()
    # Label smoothing 0.1: the target of the true class is 0.9 + 0.1/K.
    logits = np.log(np.array([[0.9 + 0.1 / 4] + [0.1 / 4] * 3], "float32"))
    smoothed = float(loss(np.eye(4, dtype="float32")[:1], logits))
    entropy = -(0.925 * math.log(0.925) + 3 * 0.025 * math.log(0.025))
    assert smoothed == pytest.approx(entropy, rel=1e-4)
    assert [m.name for m in recipe.metrics()] == ["accuracy", "top5_accuracy"]
    callbacks = recipe.callbacks(backup_dir=str(tmp_path / "backup"),
                                 checkpoint_path=str(tmp_path / "w{epoch}.weights.h5"))
    kinds = [type(c) for c in callbacks]
    assert kinds == [keras.callbacks.BackupAndRestore, kr.callbacks.Throughput,
                     keras.callbacks.ModelCheckpoint]
    assert callbacks[1].global_batch_size == 512
    lr = opt.get_config()["learning_rate"]  # the schedule, saved with the optimizer
    assert lr["registered_name"] == "keras_replicator>LinearScalingWarmup"
    assert lr["config"]["global_batch_size"] == 512


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(global_batch_size=0), "global_batch_size"),
        (dict(global_batch_size=256, epochs=5, warmup_epochs=5), "warmup_epochs"),
        (dict(global_batch_size=256, schedule="linear"), "schedule"),
        (dict(global_batch_size=256, label_smoothing=1.0), "label_smoothing"),
        (dict(global_batch_size=256, weight_decay=-1.0), "weight_decay"),
        (dict(global_batch_size=256, base_learning_rate=0.0), "base_learning_rate"),
        (dict(global_batch_size=256.0), "global_batch_size must be a positive integer"),
        (dict(global_batch_size=256, nesterov="yes"), "nesterov must be True or False"),
        (dict(global_batch_size=256, schedule="step", step_boundaries=(60, 30)), "step_boundaries"),
        (dict(global_batch_size=256, schedule="step", step_boundaries=(3,)), "step_boundaries"),
    ],
)
def test_recipe_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Recipe(**kwargs)


def test_moved_recipe_names_still_resolve_with_a_warning():
    with pytest.warns(DeprecationWarning, match="imagenet.Recipe moved to .*resnet.Recipe"):
        assert imagenet.Recipe is Recipe
    with pytest.warns(DeprecationWarning, match="mixed_precision_policy moved"):
        assert imagenet.mixed_precision_policy is mixed_precision_policy
    with pytest.raises(AttributeError, match="LearningRateDecay was removed: .*LinearScalingWarmup"):
        imagenet.LearningRateDecay  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        imagenet.nothing  # noqa: B018
