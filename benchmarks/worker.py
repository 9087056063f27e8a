"""One benchmark configuration in a fresh interpreter.

Usage: ``python -m benchmarks.worker '<spec as JSON>'``. The spec's ``kind`` says
what to measure (``env``, ``memcopy``, ``allreduce``, ``train``,
``multiworker``); the other keys are that kind's parameters (see the
``run_<kind>`` functions). The worker prints exactly one line
``RESULT <json>`` on stdout, and exits non-zero on failure.

The simulated CPU device count must be set before TensorFlow starts, so the
worker configures devices first thing, and imports TensorFlow only inside the
functions that need it.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RESULT_PREFIX = "RESULT "
TURN = "TURN"  # a worker in turns mode is between two timed windows
# The runner's answers to TURN: time one more window, or take no more (the
# planned windows are done, or the run's time limit is near).
GO, STOP = "go", "stop"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Image side of the training benchmarks: ResNet-50 at 32x32 (CIFAR size) keeps
# a step on 2 CPU cores well under a second.
IMAGE_SIZE = 32
NUM_CLASSES = 10


# --- helpers ------------------------------------------------------------------


def _emit(result: dict[str, Any]) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def _take_turn() -> bool:
    """With ``turns`` (see ``runner.run_group``): says this process is between
    timed windows and waits until the runner gives it the machine again.

    Returns ``True`` to time another window, ``False`` to stop here (``STOP``):
    the process then finishes without another turn.
    """
    print(TURN, flush=True)
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("the benchmark runner went away")
    return line.strip() != STOP


def _setup_devices(devices: int | str) -> None:
    """An int: that many CPU devices (simulated), GPUs hidden; ``"gpu"``/``"gpu1"``: the GPUs."""
    if isinstance(devices, int):
        import tensorflow as tf

        if tf.config.list_physical_devices("GPU"):
            tf.config.set_visible_devices([], "GPU")
        if devices > 1:
            import keras_replicator as kr

            kr.simulate_devices(devices)


def _device_names(devices: int | str) -> list[str]:
    import tensorflow as tf

    if devices == "gpu":
        return [d.name for d in tf.config.list_logical_devices("GPU")]
    return [d.name for d in tf.config.list_logical_devices("CPU")][: int(devices)]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_seconds() -> float | None:
    """User + system CPU time of this process and its finished children (Unix only)."""
    try:
        import resource
    except ImportError:
        return None
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def _describe_cross_device_ops(strategy) -> str:
    """A short human-readable name of the strategy's cross-device reduction."""
    ops = getattr(strategy.extended, "_cross_device_ops", None)
    if ops is None:
        return "none"
    name = type(ops).__name__
    accumulate = getattr(ops, "accumulation_fn", None)
    if accumulate is not None and getattr(accumulate, "__name__", "add_n") != "add_n":
        return f"{name}(accumulation_fn={accumulate.__name__})"
    options = getattr(ops, "_options", None)
    impl = getattr(options, "implementation", None)
    if impl is not None:
        name += f"({getattr(impl, 'name', impl)})"
    return name


class _WindowClock:
    """The clock of a timed run: ``warmup_ticks`` ticks, then ``windows`` windows
    of ``ticks_per_window`` ticks (a tick is a step, or ``steps_per_execution`` steps).

    Call :meth:`tick` at the end of every tick. With ``turns`` (see
    ``runner.run_group``) it prints ``TURN`` at the end of the warm-up and of
    every window and waits for the runner before going on, and each window is
    timed from the moment it resumed. Once the runner has said ``STOP``,
    :attr:`stopped` is true: the caller takes no more ticks.
    """

    def __init__(self, warmup_ticks: int, ticks_per_window: int, windows: int, turns: bool):
        self.warmup_ticks, self.ticks_per_window = warmup_ticks, ticks_per_window
        self.total_ticks = warmup_ticks + windows * ticks_per_window
        self.turns = turns
        self.times: list[float] = []  # the clock at the end of each tick
        self.starts: dict[int, float] = {}  # the start of the window after tick i
        self.wall: list[float] = []  # with turns: wall-clock ends and starts of pauses
        self.stopped = False

    def tick(self) -> None:
        now = time.perf_counter()
        self.times.append(now)
        tick = len(self.times) - 1
        after_warmup = tick - self.warmup_ticks + 1
        if after_warmup >= 0 and after_warmup % self.ticks_per_window == 0:
            if self.turns:
                self.wall.append(time.time())
                self.stopped = not _take_turn()
                now = time.perf_counter()
                self.wall.append(time.time())
            self.starts[tick] = now

    def samples(self, units_per_tick: float) -> list[float]:
        """Units per second in each timed window."""
        k = self.ticks_per_window
        return [units_per_tick * k / (self.times[end] - self.starts[end - k])
                for end in range(self.warmup_ticks - 1 + k, len(self.times), k)]

    def window_intervals(self) -> list[list[float]]:
        """With turns: [start, end] of each timed window, wall clock (comparable across processes)."""
        return [[self.wall[i], self.wall[i + 1]] for i in range(1, len(self.wall) - 1, 2)]


# --- env ----------------------------------------------------------------------


def run_env(spec: dict[str, Any]) -> dict[str, Any]:
    """Versions, devices and the features this checkout has (layers, multi-worker)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_replicator as kr

    try:
        from keras_replicator import layers as kr_layers

        has_global_bn = hasattr(kr_layers, "GlobalBatchNormalization")
    except ImportError:
        has_global_bn = False
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": np.__version__,
        "keras_replicator": kr.__version__,
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "physical_devices": [
            f"{d.device_type}:{d.name.split(':')[-1]}" for d in tf.config.list_physical_devices()
        ],
        "gpus": len(tf.config.list_physical_devices("GPU")),
        "global_batch_norm_available": has_global_bn,
    }


# --- memory copy --------------------------------------------------------------


def run_memcopy(spec: dict[str, Any]) -> dict[str, Any]:
    """NumPy ``copyto`` bandwidth (bytes copied / time) for each size, in GB/s."""
    import numpy as np

    out = {}
    for mb in spec["sizes_mb"]:
        n = int(mb * 2**20) // 4
        src = np.random.default_rng(0).random(n, dtype=np.float32)
        dst = np.empty_like(src)
        reps = max(3, int(256 / mb))
        np.copyto(dst, src)
        samples = []
        for _ in range(spec["windows"]):
            t = time.perf_counter()
            for _ in range(reps):
                np.copyto(dst, src)
            samples.append(src.nbytes * reps / (time.perf_counter() - t) / 1e9)
        out[str(mb)] = {"gbps": statistics.median(samples), "samples": samples}
    return {"sizes": out}


# --- all-reduce ---------------------------------------------------------------


def _make_strategy(name: str, devices: list[str], cross_device_ops: str | None = None):
    """``stock`` / ``stock_default``: MirroredStrategy's default; ``stock_rtod``: with
    ReductionToOneDevice; ``ours``: ReplicatorStrategy, with its own choice of
    all-reduce unless ``cross_device_ops`` names one (``ring``, ``rtod``,
    ``hierarchical``, ``unpacked``: for investigations, not part of the plan)."""
    import tensorflow as tf

    import keras_replicator as kr

    if name in ("stock", "stock_default"):
        return tf.distribute.MirroredStrategy(devices)
    if name == "stock_rtod":
        return tf.distribute.MirroredStrategy(
            devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
        )
    if name == "ours":
        if cross_device_ops == "ring":
            return kr.ReplicatorStrategy(devices, communication="ring")
        ops = {
            None: None,
            "rtod": tf.distribute.ReductionToOneDevice(),
            "hierarchical": tf.distribute.HierarchicalCopyAllReduce(num_packs=1),
            # ours' default without packing: one reduction per tensor.
            "unpacked": tf.distribute.ReductionToOneDevice(
                accumulation_fn=kr.cross_device_ops.default_cross_device_ops(devices).accumulation_fn),
        }[cross_device_ops]
        return kr.ReplicatorStrategy(devices, cross_device_ops=ops)
    raise ValueError(f"unknown strategy {name!r}")


# Each call to an all-reduce step reduces at least this many megabytes, as separate
# all-reduces of distinct tensors (so neither packing nor common-subexpression
# elimination can merge them). Like nccl-tests' back-to-back operations, this
# spreads the fixed cost of calling a function on K devices (about 0.15-0.25 ms
# on this 2-core VM, more than a 1 MB sum) over several all-reduces, so the
# figure is the all-reduce's bandwidth. Sizes it amortizes are also timed one
# all-reduce per call ("one_per_call").
MB_PER_CALL = 8


def all_reduces_per_call(mb: float) -> int:
    """How many all-reduces of ``mb`` megabytes one timed call makes."""
    return max(1, round(MB_PER_CALL / mb))


def run_allreduce(spec: dict[str, Any]) -> dict[str, Any]:
    """Algorithm bandwidth (tensor bytes / time per all-reduce) of in-replica sums
    of float32 tensors of each size, across the replicas.

    A timed call reduces ``all_reduces_per_call(mb)`` distinct tensors, each by its
    own all-reduce; sizes where that is more than one are also timed one
    all-reduce per call. Every step is warmed up first; then each window times
    every step once. With ``turns`` (``runner.run_group``) the process waits for
    its turn before each window, so the implementations of a group are timed one
    window at a time.
    """
    _setup_devices(spec["devices"])
    import tensorflow as tf

    import keras_replicator as kr

    devices = _device_names(spec["devices"])
    strategy = _make_strategy(spec["impl"], devices, spec.get("cross_device_ops"))
    turns = bool(spec.get("turns"))

    def sync(result):
        for r in strategy.experimental_local_results(result):
            r.numpy()

    def make_step(tensors):
        @tf.function
        def step():
            def replica_fn():
                # One all-reduce per tensor; the sums' first elements are returned
                # (returning whole tensors would time their hand-over to Python).
                firsts = [kr.all_reduce(v.read_value(), "sum")[:1] for v in tensors]
                return tf.math.add_n(firsts) if len(firsts) > 1 else firsts[0]

            return strategy.run(replica_fn)

        for _ in range(3):
            sync(step())
        return step

    # (series, size) -> (megabytes, elements, all-reduces per call, step)
    steps: dict[tuple[str, str], tuple[float, int, int, Any]] = {}
    for mb in spec["sizes_mb"]:
        n = int(mb * 2**20) // 4
        per_call = all_reduces_per_call(mb)
        with strategy.scope():
            tensors = [tf.Variable(tf.random.normal([n]), trainable=False)
                       for _ in range(per_call)]
        steps[("sizes", str(mb))] = (mb, n, per_call, make_step(tensors))
        if per_call > 1:
            steps[("one_per_call", str(mb))] = (mb, n, 1, make_step(tensors[:1]))
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in steps}
    wall = []
    for _ in range(spec["windows"]):
        if turns and not _take_turn():
            break
        start = time.time()
        for key, (mb, n, per_call, step) in steps.items():
            calls = max(3, int(spec.get("calls_mb", 128) / (mb * per_call)))
            t = time.perf_counter()
            for _ in range(calls):
                result = step()
            sync(result)
            samples[key].append(n * 4 * per_call * calls / (time.perf_counter() - t) / 1e9)
        wall.append([start, time.time()])
    else:
        if turns:
            _take_turn()  # the runner's end of the group
    out: dict[str, Any] = {"sizes": {}, "one_per_call": {}}
    for (series, mb), x in samples.items():
        out[series][mb] = {"gbps": statistics.median(x), "samples": x}
    return {**out, "all_reduces_per_call": {mb: per_call for (series, mb), (_, _, per_call, _)
                                            in steps.items() if series == "sizes"},
            "cross_device_ops": _describe_cross_device_ops(strategy),
            "replicas": len(devices), "window_intervals": wall}


# --- training throughput ------------------------------------------------------


def _batch_norm(kind: str):
    import keras

    if kind == "global":
        from keras_replicator.layers import GlobalBatchNormalization

        return GlobalBatchNormalization()
    if kind == "keras_sync":
        return keras.layers.BatchNormalization(synchronized=True)
    return keras.layers.BatchNormalization()


def _resnet50():
    import keras

    return keras.applications.ResNet50(weights=None, input_shape=(IMAGE_SIZE, IMAGE_SIZE, 3),
                                       classes=NUM_CLASSES, classifier_activation=None)


def _resnet50_batch_norm_layers(batch_norm: str):
    """ResNet-50's 53 batch-norm layers at their input shapes, with little else.

    For each input shape of ResNet-50's batch-norm layers (16x16x64 to
    1x1x2048 at 32x32 images), the image is average-pooled to its size and a
    1x1 convolution makes its channels (so that every layer's input has a
    gradient, as in ResNet-50); then as many ``batch_norm`` layers as ResNet-50
    has at that shape follow each other. Most of a step is in the batch-norm
    layers, so their step time shows, which the whole ResNet-50 (where they
    are about a tenth of a step) cannot resolve.
    """
    import collections

    import keras

    counts = collections.Counter(
        tuple(layer.input.shape[1:]) for layer in _resnet50().layers
        if isinstance(layer, keras.layers.BatchNormalization))
    inputs = keras.Input((IMAGE_SIZE, IMAGE_SIZE, 3))
    features = []
    for (height, _, channels), count in counts.items():
        h = keras.layers.AveragePooling2D(IMAGE_SIZE // height)(inputs)
        h = keras.layers.Conv2D(channels, 1, use_bias=False)(h)
        for _ in range(count):
            h = _batch_norm(batch_norm)(h)
        features.append(keras.layers.GlobalAveragePooling2D()(h))
    outputs = keras.layers.Dense(NUM_CLASSES)(keras.layers.Concatenate()(features))
    return keras.Model(inputs, outputs)


def build_model(name: str, batch_norm: str = "keras"):
    """``cnn``: a 4-conv CNN; ``cnn_bn``: the same with batch norm after each conv;
    ``resnet50``: ``keras.applications.ResNet50`` at 32x32 with ``batch_norm``
    (``keras``: its own plain BN; ``keras_sync``: ``synchronized=True``;
    ``global``: converted to ``GlobalBatchNormalization``); ``resnet50_bn``:
    ResNet-50's batch-norm layers alone (:func:`_resnet50_batch_norm_layers`)."""
    import keras

    keras.utils.set_random_seed(0)
    shape = (IMAGE_SIZE, IMAGE_SIZE, 3)
    if name == "resnet50_bn":
        return _resnet50_batch_norm_layers(batch_norm)
    if name == "resnet50":
        model = _resnet50()
        if batch_norm == "global":
            from keras_replicator.layers import convert_to_global_batch_norm

            return convert_to_global_batch_norm(model)
        if batch_norm == "keras_sync":
            def synchronized(layer):
                config = layer.get_config()
                if isinstance(layer, keras.layers.BatchNormalization):
                    config["synchronized"] = True
                return type(layer).from_config(config)

            return keras.models.clone_model(model, clone_function=synchronized)
        return model
    if name not in ("cnn", "cnn_bn"):
        raise ValueError(f"unknown model {name!r}")
    inputs = keras.Input(shape)
    h = inputs
    for filters, stride in ((32, 1), (32, 2), (64, 1), (64, 2)):
        h = keras.layers.Conv2D(filters, 3, strides=stride, padding="same",
                                use_bias=name == "cnn")(h)
        if name == "cnn_bn":
            h = _batch_norm(batch_norm)(h)
        h = keras.layers.ReLU()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(128, activation="relu")(h)
    outputs = keras.layers.Dense(NUM_CLASSES)(h)
    return keras.Model(inputs, outputs)


# The small SN-GAN of the digits command (`CONFIGS["small16"]` with the digits' one
# channel): on 4 replicas it learns digits (docs/sngan_large_batch.md), and its steps are short enough
# for windows of a few steps. Each `fit` step is one generator update: `SNGAN_N_DIS`
# discriminator updates, each on a global batch of `global_batch` real and as many
# fake images, then one generator update on `global_batch` fakes.
SNGAN_IMAGE_SIZE, SNGAN_N_DIS = 16, 1


def _sngan(learning_rate: float = 2e-4, steps_per_execution: int = 1):
    """The small SN-GAN (``sngan.SNGAN``), compiled with its two Adam optimizers."""
    import dataclasses

    import keras

    from keras_replicator.applications import sngan

    keras.utils.set_random_seed(0)
    config = dataclasses.replace(sngan.CONFIGS["small16"], channels=1)
    assert config.image_size == SNGAN_IMAGE_SIZE
    gan = sngan.SNGAN(sngan.generator(config, NUM_CLASSES), sngan.discriminator(config, NUM_CLASSES),
                      num_classes=NUM_CLASSES, n_dis=SNGAN_N_DIS, ema_decay=None)
    gan.compile(d_optimizer=sngan.default_optimizer(learning_rate),
                g_optimizer=sngan.default_optimizer(learning_rate),
                steps_per_execution=steps_per_execution)
    return gan


def _sngan_dataset(global_batch: int):
    """Synthetic images in [-1, 1] with int labels, batched ``n_dis x global_batch`` as
    ``sngan.digits_dataset`` batches the digits (one batch per generator update)."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    n = 4 * SNGAN_N_DIS * global_batch
    x = rng.uniform(-1.0, 1.0, size=(n, SNGAN_IMAGE_SIZE, SNGAN_IMAGE_SIZE, 1)).astype("float32")
    y = rng.integers(0, NUM_CLASSES, size=(n,)).astype("int32")
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .repeat()
        .batch(SNGAN_N_DIS * global_batch, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )


def _synthetic_dataset(global_batch: int):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    n = 4 * global_batch
    x = rng.normal(size=(n, IMAGE_SIZE, IMAGE_SIZE, 3)).astype("float32")
    y = rng.integers(0, NUM_CLASSES, size=(n,)).astype("int32")
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .repeat()
        .batch(global_batch, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )


def run_train(spec: dict[str, Any]) -> dict[str, Any]:
    """``model.fit`` throughput in examples/s over timed windows after warm-up.

    Spec: ``model`` (``sngan``: the small SN-GAN, each step one generator update
    on ``global_batch`` examples, see ``_sngan``; else ``build_model``'s), ``strategy`` (``one`` | ``stock`` | ``ours``
    | ``reference``: one device running ``reference_replicas`` steps at ``global_batch /
    reference_replicas`` per step of the others, in one call), ``devices``,
    ``global_batch``, ``steps_per_execution``, ``batch_norm``, ``warmup_steps``,
    ``windows``, ``window_steps`` (steps counts are multiples of
    ``steps_per_execution``), ``epoch_per_window`` (each window its own ``fit``
    call: a new epoch and iterator), and ``turns``: if true, the process prints
    ``TURN`` after its warm-up and after each window and waits for a line on
    stdin before the next, so that the runner can alternate the timed windows
    of several processes (``runner.run_group``).
    """
    # The replica-work reference of K replicas: one device, no strategy, K steps at B / K
    # per step of the others (one call of `steps_per_execution=K`: the work of K replicas,
    # with none of replication's costs; see benchmarks/replica_work.py).
    reference = int(spec.get("reference_replicas", 1)) if spec["strategy"] == "reference" else 1
    _setup_devices(1 if reference > 1 else spec["devices"])
    import keras

    spe = int(spec.get("steps_per_execution", 1))
    batch = int(spec["global_batch"])
    strategy = None
    if spec["strategy"] not in ("one", "reference"):
        strategy = _make_strategy(spec["strategy"], _device_names(spec["devices"]),
                                  spec.get("cross_device_ops"))

    def build_and_compile():
        if spec["model"] == "sngan":
            return _sngan(steps_per_execution=spe * reference)
        model = build_model(spec["model"], spec.get("batch_norm", "keras"))
        model.compile(
            keras.optimizers.SGD(0.01, momentum=0.9),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=spe * reference,
            jit_compile=bool(spec.get("jit_compile", False)),
        )
        return model

    t0 = time.perf_counter()
    if strategy is None:
        model = build_and_compile()
    else:
        with strategy.scope():
            model = build_and_compile()
    build_seconds = time.perf_counter() - t0

    clock = _WindowClock(max(1, spec["warmup_steps"] // spe), max(1, spec["window_steps"] // spe),
                         spec["windows"], bool(spec.get("turns")))

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            clock.tick()
            if clock.stopped:
                self.model.stop_training = True

    t0 = time.perf_counter()
    dataset = (_sngan_dataset if spec["model"] == "sngan" else _synthetic_dataset)(batch // reference)
    if spec.get("epoch_per_window"):
        # Each timed window is one `fit` call (an epoch), as users train: Keras then makes a new
        # iterator over the distributed dataset and drops the last one, and that time (the
        # stall at every epoch, which TensorFlow's defaults pay there) falls in the window.
        ticks = [clock.warmup_ticks] + [clock.ticks_per_window] * spec["windows"]
        for n in ticks:
            model.fit(dataset, epochs=1, steps_per_epoch=n * spe * reference, callbacks=[Clock()],
                      verbose=0)
            if clock.stopped:
                break
    else:
        model.fit(dataset, epochs=1, steps_per_epoch=clock.total_ticks * spe * reference,
                  callbacks=[Clock()], verbose=0)
    fit_seconds = time.perf_counter() - t0
    samples = clock.samples(batch * spe)
    throughput = statistics.median(samples)
    return {
        "examples_per_second": throughput,
        "step_ms": 1000.0 * batch / throughput,
        "samples": samples,
        "replicas": 1 if strategy is None else strategy.num_replicas_in_sync,
        "reference_replicas": reference,
        "cross_device_ops": "none" if strategy is None else _describe_cross_device_ops(strategy),
        "parameters": int(model.count_params()),
        "build_seconds": build_seconds,
        "first_execution_seconds": clock.times[0] - t0 if clock.times else None,
        "fit_seconds": fit_seconds,
        "window_intervals": clock.window_intervals(),
    }


# --- multi-worker -------------------------------------------------------------


def run_multiworker(spec: dict[str, Any]) -> dict[str, Any]:
    """2 local worker processes (one CPU device each) training the small CNN in a
    ``strategy.run`` loop; examples/s of the global batch, measured on the chief.

    Launches ``mw_task`` workers with ``TF_CONFIG``. ``ours`` is reported as not
    available when ``ReplicatorStrategy`` ignores ``TF_CONFIG`` (one replica).
    With ``turns``, this process relays the runner's turns to both workers, which
    pause together at the same step.
    """
    import tempfile

    from keras_replicator.launch import free_ports

    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    turns = bool(spec.get("turns"))
    procs, logs = [], []
    for index in range(2):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        # stderr to a file: a full pipe would block a worker that the relay waits for.
        logs.append(tempfile.TemporaryFile(mode="w+"))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "benchmarks.worker", json.dumps(dict(spec, kind="mw_task"))],
            cwd=ROOT, env=env, stdin=subprocess.PIPE if turns else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=logs[-1], text=True, bufsize=1,
        ))
    outputs: list[list[str]] = [[] for _ in procs]

    def until_all_turn() -> None:
        for p, out in zip(procs, outputs):
            for line in p.stdout:
                if line.rstrip("\n") == TURN:
                    break
                out.append(line)

    def tell_all(line: str) -> None:
        for p in procs:
            if p.poll() is None:
                p.stdin.write(line + "\n")
                p.stdin.flush()

    timer = None
    try:
        timer = threading.Timer(spec.get("timeout", 300), lambda: [p.kill() for p in procs])
        timer.start()
        if turns:
            until_all_turn()  # both warmed up
            for _ in range(spec["windows"]):
                if not _take_turn():
                    break
                tell_all(GO)
                until_all_turn()
            else:
                _take_turn()  # the runner's end of the group
            tell_all(STOP)  # both stop after the same step
        for p, out in zip(procs, outputs):
            out.extend(p.stdout)
            p.wait()
    finally:
        timer.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for p, out, log in zip(procs, outputs, logs):
        log.seek(0)
        err = log.read()
        lines = [ln for ln in out if ln.startswith(RESULT_PREFIX)]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"multi-worker task failed (exit {p.returncode}):\n{err[-3000:]}")
        results.append(json.loads(lines[-1][len(RESULT_PREFIX):]))
    return results[0]


def run_mw_task(spec: dict[str, Any]) -> dict[str, Any]:
    """One worker of :func:`run_multiworker` (reads ``TF_CONFIG``)."""
    _setup_devices(1)
    import keras
    import tensorflow as tf

    if spec["strategy"] == "stock":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        import keras_replicator as kr

        strategy = kr.ReplicatorStrategy()
        if strategy.num_replicas_in_sync < 2:
            return {"available": False,
                    "reason": "ReplicatorStrategy does not read TF_CONFIG in this version"}
    batch = int(spec["global_batch"])
    with strategy.scope():
        model = build_model(spec.get("model", "cnn"))
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    dataset = strategy.experimental_distribute_dataset(_synthetic_dataset(batch))

    @tf.function
    def train_step(batch_xy):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True)) / batch
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            return loss

        per_replica = strategy.run(replica_step, args=batch_xy)
        return strategy.reduce("SUM", per_replica, axis=None)

    iterator = iter(dataset)
    clock = _WindowClock(spec["warmup_steps"], spec["window_steps"], spec["windows"],
                         bool(spec.get("turns")))
    for _ in range(clock.total_ticks):
        float(train_step(next(iterator)))
        clock.tick()
        if clock.stopped:
            break
    samples = clock.samples(batch)
    throughput = statistics.median(samples)
    return {
        "available": True,
        "examples_per_second": throughput,
        "step_ms": 1000.0 * batch / throughput,
        "samples": samples,
        "replicas": strategy.num_replicas_in_sync,
        "cross_device_ops": _describe_cross_device_ops(strategy),
        "window_intervals": clock.window_intervals(),
    }


def run_input_pipeline(spec: dict[str, Any]) -> dict[str, Any]:
    """``benchmarks/input_pipeline.py``'s own measurements (``run(quick) -> dict``)."""
    from benchmarks import input_pipeline

    return dict(input_pipeline.run(bool(spec.get("quick", False))))


KINDS = {
    "env": run_env,
    "memcopy": run_memcopy,
    "allreduce": run_allreduce,
    "train": run_train,
    "multiworker": run_multiworker,
    "mw_task": run_mw_task,
    "input_pipeline": run_input_pipeline,
}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m benchmarks.worker '<spec json>'", file=sys.stderr)
        return 2
    spec = json.loads(argv[0])
    t0 = time.perf_counter()
    result = KINDS[spec["kind"]](spec)
    result["wall_seconds"] = time.perf_counter() - t0
    result["cpu_seconds"] = _cpu_seconds()
    _emit(result)
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    # The result is out: skip the interpreter's teardown, which after a long
    # TensorFlow run took up to 38 s (ResNet-50's batch-norm layers, 200 steps
    # on 4 replicas; 2 s after 24 steps), and in a group delays the next one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
