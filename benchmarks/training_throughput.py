"""Training throughput: ``model.fit`` examples/s over timed windows after a warm-up."""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.devices import (
    build_in_scope,
    describe_cross_device_ops,
    device_names,
    make_strategy,
    setup_devices,
)
from benchmarks.models import build_model, build_sngan
from benchmarks.synthetic_data import sngan_dataset, synthetic_dataset
from benchmarks.window_clock import WindowClock


def run_train(spec: dict[str, Any]) -> dict[str, Any]:
    """``model.fit`` throughput in examples/s over timed windows after warm-up.

    Spec: ``model`` (``sngan``: the small SN-GAN, each step one generator update
    on ``global_batch`` examples, see ``models.build_sngan``; else ``build_model``'s),
    ``strategy`` (``one`` | ``stock`` | ``ours`` | ``reference``: one device running
    ``reference_replicas`` steps at ``global_batch / reference_replicas`` per step of
    the others, in one call), ``devices``,
    ``global_batch``, ``steps_per_execution``, ``batch_norm``, ``warmup_steps``,
    ``windows``, ``window_steps`` (steps counts are multiples of
    ``steps_per_execution``), ``epoch_per_window`` (each window its own ``fit``
    call: a new epoch and iterator), and ``turns``: if true, the process prints
    ``TURN`` after its warm-up and after each window and waits for a line on
    stdin before the next, so that the runner can alternate the timed windows
    of several processes (``processes.run_group``).
    """
    # The replica-work reference of K replicas: one device, no strategy, K steps at B / K
    # per step of the others (one call of `steps_per_execution=K`: the work of K replicas,
    # with none of replication's costs; see benchmarks/replica_work.py).
    reference = int(spec.get("reference_replicas", 1)) if spec["strategy"] == "reference" else 1
    setup_devices(1 if reference > 1 else spec["devices"])
    import keras

    spe = int(spec.get("steps_per_execution", 1))
    batch = int(spec["global_batch"])
    strategy = None
    if spec["strategy"] not in ("one", "reference"):
        strategy = make_strategy(spec["strategy"], device_names(spec["devices"]),
                                 spec.get("cross_device_ops"))

    def build_and_compile():
        if spec["model"] == "sngan":
            return build_sngan(steps_per_execution=spe * reference)
        model = build_model(spec["model"], spec.get("batch_norm", "keras"))
        model.compile(
            keras.optimizers.SGD(0.01, momentum=0.9),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=spe * reference,
            jit_compile=bool(spec.get("jit_compile", False)),
        )
        return model

    t0 = time.perf_counter()
    model = build_in_scope(strategy, build_and_compile)
    build_seconds = time.perf_counter() - t0

    clock = WindowClock(max(1, spec["warmup_steps"] // spe), max(1, spec["window_steps"] // spe),
                        spec["windows"], bool(spec.get("turns")))

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            clock.tick()
            if clock.stopped:
                self.model.stop_training = True

    t0 = time.perf_counter()
    dataset = (sngan_dataset if spec["model"] == "sngan" else synthetic_dataset)(batch // reference)
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
        "cross_device_ops": "none" if strategy is None else describe_cross_device_ops(strategy),
        "parameters": int(model.count_params()),
        "build_seconds": build_seconds,
        "first_execution_seconds": clock.times[0] - t0 if clock.times else None,
        "fit_seconds": fit_seconds,
        "window_intervals": clock.window_intervals(),
    }
