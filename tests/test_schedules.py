"""kr.schedules: rates against the formulas, config, resuming mid-warmup, replicas, accumulation."""

import math
import re

import keras
import numpy as np
import pytest

import keras_replicator as kr
import keras_replicator.schedules  # noqa: F401  (kr.schedules)
from tests.helpers import dense_model, regression_data

LinearScalingWarmup = kr.schedules.LinearScalingWarmup


def reference_rate(step, base, batch, reference=256, warmup=0, decay=None, decay_steps=None,
                   alpha=0.0, boundaries=(), factor=0.1):
    """Goyal et al.'s rule, written out in Python floats."""
    peak = base * batch / reference
    start = min(base, peak)
    if step < warmup:
        return start + (peak - start) * step / warmup
    if decay == "cosine":
        t = min(step - warmup, decay_steps) / decay_steps
        return peak * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * t)) + alpha)
    if decay == "step":
        return peak * factor ** sum(step >= b for b in boundaries)
    return peak


CASES = [
    dict(base=0.1, batch=1024, warmup=50),                                            # constant
    dict(base=0.1, batch=1024, warmup=50, decay="cosine", decay_steps=400),
    dict(base=0.1, batch=1024, warmup=50, decay="cosine", decay_steps=400, alpha=0.1),
    dict(base=0.2, batch=512, reference=128, warmup=30, decay="step", boundaries=(100, 250),
         factor=0.5),
    dict(base=0.1, batch=64, warmup=50, decay="cosine", decay_steps=400),       # below the reference
    dict(base=0.1, batch=2048, warmup=0, decay="step", boundaries=(10,)),       # no warmup
]


@pytest.mark.parametrize("case", CASES)
def test_rates_follow_the_reference_formula(case):
    kwargs = dict(case)
    base, batch = kwargs.pop("base"), kwargs.pop("batch")
    schedule = LinearScalingWarmup(
        base, batch, **{("reference_batch_size" if k == "reference" else
                         "warmup_steps" if k == "warmup" else k): v for k, v in kwargs.items()})
    steps = list(range(0, 60)) + list(range(60, 600, 7))
    got = [float(schedule(s)) for s in steps]
    expected = [reference_rate(s, base, batch, **kwargs) for s in steps]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    assert schedule.peak_learning_rate == pytest.approx(base * batch / case.get("reference", 256))


def test_warmup_only_raises_the_rate():
    # A global batch below the reference: the scaled rate from the first update, no ramp down.
    schedule = LinearScalingWarmup(0.1, 64, warmup_steps=100)
    assert [float(schedule(s)) for s in (0, 50, 99, 100, 10_000)] == pytest.approx([0.025] * 5)
    up = LinearScalingWarmup(0.1, 1024, warmup_steps=4)
    assert [float(up(s)) for s in range(6)] == pytest.approx([0.1, 0.175, 0.25, 0.325, 0.4, 0.4])


def test_config_round_trips_through_keras_serialization():
    schedule = LinearScalingWarmup(0.1, 512, reference_batch_size=128, warmup_steps=7,
                                   decay="step", boundaries=[10, 20], factor=0.5, name="lr")
    again = LinearScalingWarmup.from_config(schedule.get_config())
    assert again.get_config() == schedule.get_config()
    serialized = keras.saving.serialize_keras_object(schedule)
    assert serialized["registered_name"] == "keras_replicator>LinearScalingWarmup"
    restored = keras.optimizers.schedules.deserialize(serialized)
    assert isinstance(restored, LinearScalingWarmup)
    assert [float(restored(s)) for s in range(25)] == [float(schedule(s)) for s in range(25)]
    optimizer = keras.optimizers.SGD(schedule, momentum=0.9)
    rebuilt = keras.optimizers.SGD.from_config(optimizer.get_config())
    assert rebuilt.get_config()["learning_rate"] == optimizer.get_config()["learning_rate"]


# --- in training -------------------------------------------------------------------------


def strategy_for(replicas):
    return kr.ReplicatorStrategy([f"/cpu:{i}" for i in range(replicas)])


class RateProbe(keras.callbacks.Callback):
    """The learning rate each step starts with (the schedule at the optimizer's iterations)."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


def schedule_16():
    # Global batch 16, reference 4: peak 0.04, reached over 6 updates; x0.5 at update 7.
    return LinearScalingWarmup(0.01, 16, reference_batch_size=4, warmup_steps=6, decay="step",
                               boundaries=[7], factor=0.5)


EXPECTED_16 = [reference_rate(s, 0.01, 16, reference=4, warmup=6, decay="step", boundaries=(7,),
                              factor=0.5) for s in range(8)]


def compiled(strategy, optimizer_fn):
    with strategy.scope():
        model = dense_model()
        model.compile(optimizer_fn(), "mse")
    return model


def test_same_rates_and_weights_on_1_and_4_replicas():
    x, y = regression_data(128)
    trained = []
    for replicas in (1, 4):
        model = compiled(strategy_for(replicas),
                         lambda: keras.optimizers.SGD(schedule_16(), momentum=0.9))
        probe = RateProbe()
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[probe])
        np.testing.assert_allclose(probe.rates, EXPECTED_16, rtol=1e-6)
        assert int(model.optimizer.iterations.numpy()) == 8
        trained.append(model)
    assert kr.testing.max_weight_difference(*trained) <= 1e-5


def test_a_model_saved_mid_warmup_resumes_the_same_rates(tmp_path):
    # Saved after 3 of 6 warmup updates on 4 replicas, reloaded on 2 replicas: the schedule
    # continues from the saved iteration count, and the weights end as in one run.
    x, y = regression_data(128)
    make = lambda: keras.optimizers.SGD(schedule_16(), momentum=0.9)  # noqa: E731
    whole = compiled(strategy_for(4), make)
    probe = RateProbe()
    whole.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[probe])

    first = compiled(strategy_for(4), make)
    before = RateProbe()
    first.fit(x[:48], y[:48], batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[before])
    path = str(tmp_path / "mid_warmup.keras")
    first.save(path)
    with strategy_for(2).scope():
        resumed = keras.saving.load_model(path)
    assert int(resumed.optimizer.iterations.numpy()) == 3
    saved_schedule = resumed.optimizer.get_config()["learning_rate"]
    assert saved_schedule["registered_name"] == "keras_replicator>LinearScalingWarmup"
    after = RateProbe()
    resumed.fit(x[48:], y[48:], batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[after])
    np.testing.assert_allclose(before.rates + after.rates, probe.rates, rtol=1e-6)
    np.testing.assert_allclose(probe.rates, EXPECTED_16, rtol=1e-6)
    assert kr.testing.max_weight_difference(resumed, whole) <= 1e-5


def test_with_gradient_accumulation_steps_are_updates_and_the_batch_is_k_micro_batches():
    # accumulation_steps=2 at a global batch of 8 is one update of 16 examples: the same schedule
    # (global_batch_size=16, lengths in updates) gives the same rates per update, and the same
    # weights, as updates of 16 without accumulation.
    x, y = regression_data(128)
    plain = compiled(strategy_for(4), lambda: kr.CrossReplicaOptimizer(
        keras.optimizers.SGD(schedule_16(), momentum=0.9)))
    plain_rates = RateProbe()
    plain.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[plain_rates])

    accumulated = compiled(strategy_for(4), lambda: kr.CrossReplicaOptimizer(
        keras.optimizers.SGD(schedule_16(), momentum=0.9), accumulation_steps=2))
    micro_rates = RateProbe()
    accumulated.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[micro_rates])

    assert int(accumulated.optimizer.iterations.numpy()) == 8  # 16 micro-batches, 8 updates
    np.testing.assert_allclose(micro_rates.rates[::2], plain_rates.rates, rtol=1e-6)
    np.testing.assert_allclose(micro_rates.rates[1::2], plain_rates.rates, rtol=1e-6)
    np.testing.assert_allclose(plain_rates.rates, EXPECTED_16, rtol=1e-6)
    assert kr.testing.max_weight_difference(accumulated, plain) <= 1e-5


# --- arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((0, 256), {}, "base_learning_rate must be a positive number, got 0"),
        ((0.1, 0), {}, "global_batch_size must be a positive integer, got 0"),
        ((0.1, 256.0), {}, "global_batch_size must be a positive integer, got 256.0"),
        ((0.1, 256), {"reference_batch_size": True}, "reference_batch_size must be a positive integer"),
        ((0.1, 256), {"warmup_steps": -1}, "warmup_steps must be a non-negative integer, got -1"),
        ((0.1, 256), {"decay": "linear"}, "decay must be one of None, 'cosine', 'step'; got 'linear'"),
        ((0.1, 256), {"decay": "cosine"}, "decay_steps is required with decay='cosine'"),
        ((0.1, 256), {"decay_steps": 10}, "decay_steps is required with decay='cosine' and only used"),
        ((0.1, 256), {"decay": "cosine", "decay_steps": 0}, "decay_steps must be a positive integer"),
        ((0.1, 256), {"decay": "cosine", "decay_steps": 9, "alpha": 2.0}, "alpha must be in [0, 1]"),
        ((0.1, 256), {"decay": "step"}, "decay='step' needs boundaries"),
        ((0.1, 256), {"decay": "step", "boundaries": [5, 5]}, "boundaries must be increasing"),
        ((0.1, 256), {"decay": "step", "boundaries": [3], "warmup_steps": 5},
         "boundaries[0] must be an integer >= 5, got 3"),
        ((0.1, 256), {"decay": "step", "boundaries": 10}, "boundaries must be a sequence"),
        ((0.1, 256), {"boundaries": [10]}, "boundaries are only used with decay='step'"),
        ((0.1, 256), {"decay": "step", "boundaries": [10], "factor": 1.5}, "factor must be in (0, 1]"),
    ],
)
def test_bad_arguments(args, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LinearScalingWarmup(*args, **kwargs)
