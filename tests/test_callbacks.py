"""kr.callbacks: throughput numbers, the consistency check, resuming elsewhere."""

import glob
import json
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from tests.helpers import dense_model, regression_data, run_markdown_example, run_python


def strategy_for(replicas):
    return kr.ReplicatorStrategy([f"/cpu:{i}" for i in range(replicas)])


def compiled(strategy, make_optimizer, **compile_kwargs):
    with strategy.scope():
        model = dense_model()
        model.compile(make_optimizer(), "mse", **compile_kwargs)
    return model


# --- Throughput ---------------------------------------------------------------------------


def tensorboard_scalars(log_dir, tag):
    values = []
    for path in sorted(glob.glob(f"{log_dir}/train/events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    values.append(float(tf.make_ndarray(value.tensor)))
    return values


def test_throughput_numbers_in_history_and_tensorboard(tmp_path):
    # 72 examples, batch 16: 4 full steps and a short one of 8 per epoch. The first step of
    # fit() is left out (tracing), so epoch 0 measures 56 examples in 4 steps, epoch 1 all 72 in 5.
    x, y = regression_data(72)
    model = compiled(strategy_for(4), lambda: keras.optimizers.SGD(0.01))
    throughput = kr.callbacks.Throughput(single_replica_rate=500.0)
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                        callbacks=[throughput, keras.callbacks.TensorBoard(str(tmp_path))])
    h = history.history
    for key in ("examples_per_second", "examples_per_second_per_replica", "step_time",
                "scaling_efficiency"):
        assert len(h[key]) == 2 and all(v > 0 and np.isfinite(v) for v in h[key]), (key, h[key])
    rate, per_replica, step = (np.array(h[k]) for k in
                               ("examples_per_second", "examples_per_second_per_replica", "step_time"))
    np.testing.assert_allclose(per_replica * 4, rate, rtol=1e-9)
    np.testing.assert_allclose(np.array(h["scaling_efficiency"]), per_replica / 500.0, rtol=1e-9)
    np.testing.assert_allclose(rate * step, [56 / 4, 72 / 5], rtol=1e-6)  # examples per step
    np.testing.assert_allclose(tensorboard_scalars(tmp_path, "epoch_examples_per_second"), rate, rtol=1e-6)


def test_throughput_with_a_given_global_batch_and_bad_arguments():
    with pytest.raises(ValueError, match="single_replica_rate must be a positive number"):
        kr.callbacks.Throughput(single_replica_rate=-1.0)
    with pytest.raises(ValueError, match="global_batch_size must be a positive integer or None"):
        kr.callbacks.Throughput(global_batch_size=0)
    x, y = regression_data(64)
    model = compiled(strategy_for(2), lambda: keras.optimizers.SGD(0.01))
    throughput = kr.callbacks.Throughput(global_batch_size=16)
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[throughput])
    h = history.history
    assert h["examples_per_second"][0] * h["step_time"][0] == pytest.approx(16)
    assert "scaling_efficiency" not in h


# --- ReplicaConsistencyCheck ----------------------------------------------------------------


class Perturb(keras.callbacks.Callback):
    """At global step ``at``, moves replica ``replica``'s copy of ``variable``."""

    def __init__(self, variable, replica, at):
        super().__init__()
        self.variable, self.replica, self.at = variable, replica, at

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.at:
            copy = self.variable.value.values[self.replica]
            copy.assign(copy + 1e-3)


def test_consistency_check_passes_clean_training_and_catches_a_perturbed_copy():
    x, y = regression_data(64)
    model = compiled(strategy_for(4), lambda: kr.CrossReplicaOptimizer(
        keras.optimizers.Adam(0.01), accumulation_steps=2))  # accumulators differ per replica
    check = kr.callbacks.ReplicaConsistencyCheck(every_n_steps=3)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[check])
    assert check.checks_done == 3  # after steps 3 and 6, and at the end (step 8)

    bias = model.layers[1].bias
    with pytest.raises(kr.callbacks.ReplicaDivergenceError,
                       match=re.escape(f"after step 3: variable '{bias.path}' differs between "
                                       "replica 0 and replica 2 (max abs difference 0.001")):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[Perturb(bias, 2, 1), check])

    # Repair the model, then break an optimizer slot: found only when optimizer variables are checked.
    with model.distribute_strategy.scope():
        bias.assign(kr.testing.replica_values(bias)[0])
    check.check()
    slot = model.optimizer.inner_optimizer.variables[3]
    copy = slot.value.values[1]
    copy.assign(copy + 1.0)
    weights_only = kr.callbacks.ReplicaConsistencyCheck(include_optimizer=False)
    weights_only.set_model(model)
    weights_only.check()
    with pytest.raises(kr.callbacks.ReplicaDivergenceError,
                       match=re.escape(f"variable '{slot.path}' differs between replica 0 and replica 1")):
        everything = kr.callbacks.ReplicaConsistencyCheck()
        everything.set_model(model)
        everything.check()


def test_divergence_error_is_the_one_in_errors():
    from keras_replicator.errors import ReplicaDivergenceError

    assert kr.callbacks.ReplicaDivergenceError is ReplicaDivergenceError
    assert issubclass(ReplicaDivergenceError, RuntimeError)


def test_the_warmup_callback_points_to_the_schedule():
    with pytest.raises(AttributeError, match=r"LearningRateWarmup was removed: .*schedules\.LinearScalingWarmup"):
        kr.callbacks.LearningRateWarmup  # noqa: B018


def test_consistency_check_bad_arguments():
    with pytest.raises(ValueError, match="every_n_steps must be a positive integer, got 0"):
        kr.callbacks.ReplicaConsistencyCheck(every_n_steps=0)
    with pytest.raises(ValueError, match="include_optimizer must be True or False, got 'yes'"):
        kr.callbacks.ReplicaConsistencyCheck(include_optimizer="yes")
    with pytest.raises(ValueError, match="check_at_end must be True or False, got 1"):
        kr.callbacks.ReplicaConsistencyCheck(check_at_end=1)
    with pytest.raises(ValueError, match="has no model: call set_model"):
        kr.callbacks.ReplicaConsistencyCheck().check()


def test_callback_configs_round_trip():
    for callback in (
        kr.callbacks.Throughput(single_replica_rate=123.0, global_batch_size=64),
        kr.callbacks.ReplicaConsistencyCheck(7, include_optimizer=False, check_at_end=False),
    ):
        again = type(callback).from_config(callback.get_config())
        assert again.get_config() == callback.get_config()


# --- resuming on another number of replicas ----------------------------------------------------

RESUME_SCRIPT = """
import json
import keras, numpy as np
import keras_replicator as kr
from tests.helpers import dense_model, regression_data

x, y = regression_data(48)   # 3 micro-batches of 16 per epoch; updates every 2
def make(strategy):
    with strategy.scope():
        model = dense_model()
        schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.7)
        opt = kr.CrossReplicaOptimizer(keras.optimizers.SGD(schedule, momentum=0.9),
                                       accumulation_steps=2)
        model.compile(opt, "mse")
    return model

class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("interrupted")

def state(model):
    opt = model.optimizer
    return {"weights": [w.tolist() for w in model.get_weights()],
            "iterations": int(opt.iterations.numpy()), "micro_steps": int(opt.micro_steps.numpy()),
            "lr": float(keras.ops.convert_to_numpy(opt.learning_rate))}

strategy = kr.ReplicatorStrategy()
model = make(strategy)
backup = keras.callbacks.BackupAndRestore(BACKUP_DIR)
fit = dict(batch_size=16, epochs=4, shuffle=False, verbose=0)
if PHASE == "interrupt":
    try:
        model.fit(x, y, callbacks=[backup, Interrupt()], **fit)
    except RuntimeError as e:
        print("INTERRUPTED", e)
else:
    history = model.fit(x, y, callbacks=[backup], **fit)
    kr.testing.assert_replicas_identical(model)
    reference = make(strategy)
    reference.fit(x, y, **fit)
    print("RESULT", json.dumps({"resumed": state(model), "reference": state(reference),
                                "epochs_run": len(history.history["loss"])}))
"""


@pytest.mark.core
def test_resume_on_fewer_replicas_with_backup_and_restore(tmp_path):
    backup = str(tmp_path / "backup")
    def script(phase):
        return f"BACKUP_DIR, PHASE = {backup!r}, {phase!r}\n" + RESUME_SCRIPT

    first = run_python(script("interrupt"), devices=4)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "INTERRUPTED" in first.stdout
    second = run_python(script("resume"), devices=2)
    assert second.returncode == 0, second.stderr[-3000:]
    result = json.loads(second.stdout.split("RESULT", 1)[1])
    resumed, reference = result["resumed"], result["reference"]
    assert result["epochs_run"] == 3  # epoch 0 ran on 4 replicas, epochs 1-3 here on 2
    # 12 micro-batches, 6 updates; the one pending at the interruption was restored.
    assert resumed["micro_steps"] == reference["micro_steps"] == 12
    assert resumed["iterations"] == reference["iterations"] == 6
    assert resumed["lr"] == pytest.approx(reference["lr"], rel=1e-6)
    worst = max(np.max(np.abs(np.array(a) - np.array(b)))
                for a, b in zip(resumed["weights"], reference["weights"]))
    assert worst <= 1e-5


# --- the guide --------------------------------------------------------------------------------


@pytest.mark.parametrize("index,expected", [
    (0, "updates: 20\n[0.01, 0.025, 0.04, 0.04, 0.004, 0.004]"),
    (1, "scaling_efficiency:"),
    (2, "differs between replica 0 and replica 3"),
])
def test_docs_page_examples_run(index, expected):
    result = run_markdown_example("docs/callbacks.md", index)
    assert expected in result.stdout
