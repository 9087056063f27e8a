"""D4PG's learner on 2 replicas equals the single-device learner; actors on Ray survive a kill.

Runs in the 2-device process. The Ray tests share one Ray instance on 127.0.0.1 (see
``ray_owner``), shut down at the module's end, and check that no Ray process it started is left.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator.applications import d4pg
from keras_replicator.applications.d4pg import actors as actors_lib
from keras_replicator.applications.d4pg import environments, training
from tests.helpers import RAY_OWNER_ENV, own_ray_servers, wait_for_no_ray_servers

pytestmark = pytest.mark.devices(2)

B = 32


def _batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "observation": rng.normal(size=(n * B, 3)).astype("f4"),
        "action": rng.uniform(-2, 2, size=(n * B, 1)).astype("f4"),
        "reward": (rng.normal(size=(n * B,)) * 20).astype("f4"),
        "discount": rng.choice([0.0, 0.99**5], size=(n * B,)).astype("f4"),
        "next_observation": rng.normal(size=(n * B, 3)).astype("f4"),
    }


def _learner(strategy, **kwargs):
    with strategy.scope():
        keras.utils.set_random_seed(3)
        learner = d4pg.D4PGLearner.create(3, [-2.0], [2.0], v_min=-50.0, v_max=50.0,
                                          policy_layers=(32, 32, 32),
                                          critic_layers=(64, 64, 32), **kwargs)
        learner.compile(learning_rate=1e-3, clip_global_norm=1.0)
    return learner


def _fit(learner, data, updates):
    """`updates` more updates of `learner` on the batches of `data` (in order, from the first)."""
    strategy = learner.distribute_strategy
    dataset = strategy.distribute_dataset(tf.data.Dataset.from_tensor_slices(data),
                                          global_batch_size=B)
    learner.fit(dataset, epochs=1, steps_per_epoch=updates, verbose=0)
    return learner


def _train(strategy, data, updates, **kwargs):
    return _fit(_learner(strategy, **kwargs), data, updates)


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def _max_diff(a, b):
    """The largest weight difference of two models (or lists of their weights)."""
    a, b = (x if isinstance(x, list) else x.get_weights() for x in (a, b))
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


@pytest.mark.parametrize("targets", [{"target_update_period": 3}, {"target_update_rate": 0.05}])
def test_two_replicas_equal_one_device(targets):
    data = _batches(5)
    one = _train(kr.ReplicatorStrategy(["/cpu:0"]), data, 5, **targets)
    two = _learner(kr.ReplicatorStrategy(), **targets)
    initial_target_critic = _weights(two.target_critic)
    _fit(two, data, 5)
    assert two.distribute_strategy.num_replicas_in_sync == 2
    assert int(two.updates.numpy()) == 5
    for name in ("policy", "critic", "target_policy", "target_critic"):
        assert _max_diff(getattr(one, name), getattr(two, name)) < 1e-5, name
    kr.testing.assert_replicas_identical(two)
    # The targets moved (copied at update 3, or averaged), and differ from the online nets.
    assert _max_diff(initial_target_critic, two.target_critic) > 1e-4
    assert _max_diff(two.critic, two.target_critic) > 1e-5


def test_periodic_target_is_the_online_copy_at_the_last_period():
    data = _batches(3)
    learner = _learner(kr.ReplicatorStrategy(), target_update_period=3)
    initial_critic = _weights(learner.critic)
    # Two updates (batches 0 and 1), then the third (batch 2) in a second fit: the update count
    # lives in the learner (`updates`), so the period counts across fit calls.
    _fit(learner, {k: v[: 2 * B] for k, v in data.items()}, 2)
    assert int(learner.updates.numpy()) == 2
    assert _max_diff(learner.target_critic, initial_critic) == 0.0   # not copied yet
    assert _max_diff(learner.critic, initial_critic) > 0.0
    _fit(learner, {k: v[2 * B:] for k, v in data.items()}, 1)
    # After 3 updates with period 3 the targets are the online weights exactly.
    assert int(learner.updates.numpy()) == 3
    assert _max_diff(learner.critic, learner.target_critic) == 0.0
    assert _max_diff(learner.policy, learner.target_policy) == 0.0


@pytest.fixture(scope="module")
def ray_owner():
    """The module's mark on the Ray servers it starts; none of them is left when the module ends.

    The module's tests share one Ray instance: on main, Ray started a second time in this process
    on a loaded machine (--busy 1 beside other jobs) timed out starting its node ("The current node
    timed out during startup": Ray waits 30 s for its raylet) in 1 run of 3 and hung looking the
    node up (ended by pytest-timeout at 600 s) in another; its first start never did."""
    owner = f"{os.getpid()}-{time.monotonic_ns()}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(RAY_OWNER_ENV, owner)
        try:
            yield owner
        finally:
            actors_lib.stop_ray()
    assert not wait_for_no_ray_servers(owner), "Ray processes left after shutdown"


@pytest.fixture
def local_ray(ray_owner):
    """The module's Ray instance on 127.0.0.1, started by the first test that needs it."""
    ray = actors_lib.start_ray()
    assert own_ray_servers(ray_owner), "the owner mark does not find this module's Ray servers"
    # tests/conftest.py bounds the object store (Ray's default: 30% of the machine's memory).
    bound = int(os.environ["RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES"])
    assert ray.cluster_resources()["object_store_memory"] <= bound
    return ray


def _get(ray, ref_fn, timeout=90):
    """`ray.get(ref_fn())`, retried while a restarting actor is unavailable."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(ref_fn(), timeout=timeout)
        except ray.exceptions.RayError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


# The limits below are for a hang: at a load average of 20 (run_suite --busy 1 beside other jobs on
# 2 cores) this test ran over its 600 s default (pytest-timeout) while the restarted actor imported
# TensorFlow again.
@pytest.mark.timeout(1500)
def test_actor_restarts_after_kill_and_training_data_goes_on(local_ray):
    ray = local_ray
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    assert all(node["NodeManagerAddress"] == "127.0.0.1" for node in ray.nodes())
    policy = d4pg.make_policy(3, [-2.0], [2.0], layers=(8, 8, 8))
    pool = actors_lib.make_actors("Pendulum-v1", 2, seed=0)
    buffer = d4pg.ReplayBuffer(10_000, 3, 1, seed=0)
    limiter = d4pg.RateLimiter(samples_per_insert=8, min_size_to_sample=200)
    feeder = training.Feeder(pool, buffer, limiter, policy.get_weights, batch_size=16,
                             steps_per_call=100)
    for _ in range(20):
        feeder.next_batch()
    old_pid = _get(ray, pool[0].pid.remote)
    feeder.step(wait=False)  # actor 0 has a call in flight again
    os.kill(old_pid, signal.SIGKILL)
    steps_at_kill = feeder.env_steps
    actor0_at_kill = feeder.steps_by_actor[0]
    deadline = time.monotonic() + 600   # the new process imports TensorFlow again
    while feeder.steps_by_actor[0] < actor0_at_kill + 300 and time.monotonic() < deadline:
        feeder.next_batch()
    new_pid = _get(ray, pool[0].pid.remote)
    assert new_pid != old_pid
    # The killed actor's call in flight (if any) failed and was re-sent; its new process has
    # delivered transitions since.
    assert feeder.steps_by_actor[0] >= actor0_at_kill + 300, feeder.actor_failures
    assert feeder.env_steps >= steps_at_kill + 300
    # The restarted actor works: a direct call returns fresh transitions.
    transitions, _, steps = _get(ray, lambda: pool[0].run.remote(policy.get_weights(), 10))
    assert steps == 10 and len(transitions) >= 6
    feeder.drain()


@pytest.mark.timeout(1500)  # 216 s at a load average of 10, 600 s is pytest-timeout's default
def test_training_writes_outputs_and_resumes(tmp_path, local_ray):
    # Both runs on the module's Ray (keep_ray; see ray_owner). test_pendulum_learns checks that
    # train stops Ray at its end without keep_ray.
    kwargs = dict(actors=1, replicas=2, samples_per_insert=64.0, batch_size=32,
                  eval_every=400, eval_episodes=1, final_eval_episodes=2, min_replay_size=200,
                  steps_per_call=100,
                  policy_layers=(16, 16, 16), critic_layers=(32, 32, 16), verbose=False, keep_ray=True)
    rows = training.train("Pendulum-v1", str(tmp_path), env_steps=800, **kwargs)
    assert [int(r["env_steps"]) for r in rows] == [400, 800]
    assert rows[-1]["updates"] > 0
    for name in ("policy.keras", "returns.csv", "learning_curve.png", "checkpoint.npz",
                 training.FINAL_EVALUATION):
        assert (tmp_path / name).exists(), name
    policy = keras.saving.load_model(tmp_path / "policy.keras")
    obs = np.random.default_rng(0).normal(size=(7, 3)).astype("float32") * 10
    actions = np.asarray(policy(obs))
    assert actions.shape == (7, 1) and np.all(np.abs(actions) <= 2.0)
    # The held-out evaluation is of the saved policy, on its own starts (50_000 on).
    final = training.read_final_evaluation(str(tmp_path))
    weights = policy.get_weights()
    again = environments.evaluate(
        "Pendulum-v1", lambda o: d4pg.policy_forward_numpy(weights, o, [-2.0], [2.0]),
        episodes=2, seed=50_000)
    assert final["returns"] == again and final["reset_seeds"] == [50_000, 50_001]
    assert final["mean"] == pytest.approx(np.mean(again)) and final["worst"] == min(again)
    assert final["updates"] == rows[-1]["updates"] and final["env_steps"] == 800
    assert final["updates_per_env_step"] == pytest.approx(final["updates"] / 800)
    # Resume: the second run starts at 800 steps and adds rows up to 1200.
    rows = training.train("Pendulum-v1", str(tmp_path), env_steps=1200, **kwargs)
    assert [int(r["env_steps"]) for r in rows] == [400, 800, 1200]
    assert rows[-1]["updates"] > rows[1]["updates"]


_START_RAY = """
import json
from keras_replicator.applications.d4pg import actors
ray = actors.start_ray()  # as the notebook calls it (with num_cpus, Ray would refuse to join)
print("started", json.dumps(ray.get_runtime_context().gcs_address))
actors.stop_ray()
"""


@pytest.mark.timeout(900)
def test_start_ray_starts_its_own_instance_beside_a_recorded_cluster(local_ray):
    """`ray.init()` without an address joins the cluster that `RAY_ADDRESS` or Ray's
    `ray_current_cluster` file names (`ray.cluster_utils`, which tests/ray_train_job.py uses, and
    `ray start` write it): the D4PG notebook's kernel, in a suite run, joined a Ray Train test's
    cluster that way, whose end then destroyed the notebook's actors ("cancelled before it started
    running"). `start_ray` starts its own, here beside this module's Ray named in that file."""
    module_gcs = local_ray.get_runtime_context().gcs_address
    temp = tempfile.mkdtemp(prefix="kr", dir="/tmp")  # short: Ray's socket paths are under it
    try:
        os.makedirs(os.path.join(temp, "ray"))
        with open(os.path.join(temp, "ray", "ray_current_cluster"), "w") as f:
            f.write(module_gcs)
        owner = f"{os.getpid()}-{time.monotonic_ns()}"
        env = dict(os.environ, RAY_TMPDIR=temp, **{RAY_OWNER_ENV: owner})
        result = subprocess.run([sys.executable, "-c", _START_RAY], env=env, capture_output=True,
                                text=True, timeout=600)  # a limit for a hang: it imports TensorFlow
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        started = json.loads(result.stdout.split("started ")[-1].splitlines()[0])
        assert started != module_gcs and started.startswith("127.0.0.1:"), (started, module_gcs)
        assert not wait_for_no_ray_servers(owner)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def test_training_rejects_bad_input_before_work(tmp_path):
    with pytest.raises(ValueError, match="actors must be a positive integer"):
        training.train("Pendulum-v1", str(tmp_path), actors=0)
    with pytest.raises(ValueError, match="must exceed min_replay_size"):
        training.train("Pendulum-v1", str(tmp_path), env_steps=500)
    with pytest.raises(ValueError, match="replicas=3 but only 2 devices"):
        training.train("Pendulum-v1", str(tmp_path), replicas=3)
    with pytest.raises(ValueError, match="Discrete action space"):
        training.train("CartPole-v1", str(tmp_path))
    assert not any(tmp_path.iterdir())


# A random policy scores about -1200 on the held-out starts; a learner that does not learn fails
# this test (learning_rate=1e-12 passed to train here, measured: -1173 at a load of 21). The
# default configuration's 5-run table (docs/d4pg.md, 100 held-out episodes at 20k steps, loaded
# machine): every run between -141 and -148; the two runs without the pre-tanh penalty that
# missed the target scored -389 and -968.
PENDULUM_BAR = -300.0


@pytest.mark.timeout(1500)
def test_pendulum_learns(tmp_path, local_ray, ray_owner):
    """The default Pendulum-v1 command's configuration, 20k environment steps, judged on its
    final evaluation: `policy.keras` over 100 held-out episodes (reset seeds 50,000 on, which
    neither the learning curve's 10 episodes nor the actors use). Runs are not bit-reproducible
    (the actors are asynchronous); the bar is far from both a correct run and a broken one."""
    rows = training.train("Pendulum-v1", str(tmp_path), actors=2, replicas=2, seed=0,
                          verbose=False)
    assert rows[-1]["env_steps"] >= 20_000
    final = training.read_final_evaluation(str(tmp_path))
    assert (final["episodes"], final["reset_seeds"]) == (100, [50_000, 50_099])
    # The saved policy is the evaluated one.
    weights = keras.saving.load_model(tmp_path / "policy.keras").get_weights()
    first = environments.evaluate(
        "Pendulum-v1", lambda o: d4pg.policy_forward_numpy(weights, o, [-2.0], [2.0]),
        episodes=1, seed=50_000)
    assert first[0] == pytest.approx(final["returns"][0], abs=1e-3)
    assert final["mean"] >= PENDULUM_BAR, final
    # Without keep_ray, train stops Ray at its end: its servers end (they may take a moment on a
    # busy machine). A test after this one starts it again (local_ray).
    assert not wait_for_no_ray_servers(ray_owner)
