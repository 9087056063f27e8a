"""D4PG (tutorial 3): the C51 projection and N-step returns against NumPy references, the
rate limiter, the networks, environments and clear errors for bad inputs."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_replicator.applications import d4pg
from keras_replicator.applications.d4pg import environments


def projection_reference(atoms, probs, rewards, discounts):
    """The C51 projection of Bellemare et al. (2017), Algorithm 1, with loops."""
    v_min, v_max, n = atoms[0], atoms[-1], len(atoms)
    dz = (v_max - v_min) / (n - 1)
    out = np.zeros_like(probs, dtype=np.float64)
    for b in range(probs.shape[0]):
        for j in range(n):
            tz = min(max(rewards[b] + discounts[b] * atoms[j], v_min), v_max)
            pos = (tz - v_min) / dz
            lo, hi = int(np.floor(pos)), int(np.ceil(pos))
            if lo == hi:
                out[b, lo] += probs[b, j]
            else:
                out[b, lo] += probs[b, j] * (hi - pos)
                out[b, hi] += probs[b, j] * (pos - lo)
    return out


def test_projection_matches_numpy_reference():
    rng = np.random.default_rng(0)
    atoms = d4pg.make_atoms(-10.0, 10.0, 51)
    probs = rng.dirichlet(np.ones(51), size=64).astype(np.float32)
    # Rewards inside and far outside the support; discounts 0 (terminal), gamma^n and 1.
    rewards = rng.uniform(-30, 30, size=64).astype(np.float32)
    rewards[:4] = [25.0, -25.0, 0.4, 10.0]
    discounts = rng.choice([0.0, 0.99**5, 0.99, 1.0], size=64).astype(np.float32)
    discounts[:4] = [0.99, 0.99, 0.0, 1.0]
    got = d4pg.categorical_projection(atoms, probs, rewards, discounts).numpy()
    want = projection_reference(atoms, probs, rewards, discounts)
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)
    # All mass beyond the support lands on the end atoms; a terminal transition puts all mass
    # on the reward's neighbours (0.4 between atoms 0.0 and 0.4: exactly on atom 0.4).
    assert got[0, -1] == pytest.approx(np.sum(probs[0][atoms * 0.99 + 25 >= 10]), abs=1e-5)
    assert got[1, 0] == pytest.approx(np.sum(probs[1][atoms * 0.99 - 25 <= -10]), abs=1e-5)
    np.testing.assert_allclose(got[2], np.eye(51)[26], atol=1e-6)
    assert got[3, -1] == pytest.approx(np.sum(probs[3][atoms >= 0]), abs=1e-5)


def test_projection_of_identity_target_is_identity():
    atoms = d4pg.make_atoms(-150, 150, 51)
    probs = np.random.default_rng(1).dirichlet(np.ones(51), size=3).astype(np.float32)
    got = d4pg.categorical_projection(atoms, probs, np.zeros(3), np.ones(3)).numpy()
    np.testing.assert_allclose(got, probs, atol=1e-6)


def test_dpg_loss_gradient_is_clipped_dqda():
    a = tf.Variable([[0.5, -0.2]])
    with tf.GradientTape() as tape:
        loss = d4pg.dpg_loss(a, tf.constant([[3.0, -0.5]]), clipping=1.0)
    np.testing.assert_allclose(tape.gradient(loss, a).numpy(), [[-1.0, 0.5]], atol=1e-6)


def test_pre_tanh_penalty_pulls_a_saturated_policy_back():
    """A policy whose tanh is saturated (pre-tanh output 50, as a Pendulum run's was) gets no DPG
    gradient; the penalty's is exactly 2 * penalty * u / batch on the output bias, toward 0."""
    rng = np.random.default_rng(0)
    n = 8
    data = {"observation": rng.normal(size=(n, 3)).astype("f4"),
            "action": rng.uniform(-2, 2, size=(n, 1)).astype("f4"),
            "reward": rng.normal(size=n).astype("f4"), "discount": np.full(n, 0.95, "f4"),
            "next_observation": rng.normal(size=(n, 3)).astype("f4")}
    bias_grads, losses = {}, {}
    for penalty in (None, 1e-3):
        keras.utils.set_random_seed(0)                   # the same networks both times
        learner = d4pg.D4PGLearner.create(3, [-2.0], [2.0], policy_layers=(8, 8),
                                          critic_layers=(8, 8), pre_tanh_penalty=penalty)
        output = learner.policy.get_layer("policy_output")
        output.kernel.assign(np.zeros(output.kernel.shape, "f4"))
        output.bias.assign([50.0])                      # u = 50 for every observation
        _, policy_loss, _, policy_grads = learner.compute_losses(
            {k: tf.constant(v) for k, v in data.items()})
        index = [id(v) for v in learner.policy.trainable_variables].index(id(output.bias))
        bias_grads[penalty] = float(policy_grads[index].numpy()[0])
        losses[penalty] = float(policy_loss)
    assert bias_grads[None] == 0.0
    assert bias_grads[1e-3] == pytest.approx(2 * 1e-3 * 50.0, rel=1e-5)   # mean over the batch
    assert losses[1e-3] - losses[None] == pytest.approx(1e-3 * 50.0**2, rel=1e-5)
    with pytest.raises(ValueError, match="pre_tanh_penalty needs a policy of make_policy"):
        inp = keras.Input((3,))
        other = keras.Model(inp, keras.layers.Dense(1)(inp))
        d4pg.D4PGLearner(other, d4pg.make_critic(3, 1, (8, 8)), d4pg.make_atoms(),
                         pre_tanh_penalty=1e-3)


def n_step_reference(rewards, dones, truncs, n, gamma):
    """Transition t: (t, sum of rewards to min(t+n, end of episode), discount, next index)."""
    out, start = [], 0
    T = len(rewards)
    ends = [i for i in range(T) if dones[i] or truncs[i]]
    for t in range(T):
        end = next((e for e in ends if e >= t), None)
        last = min(t + n - 1, end if end is not None else T)
        if end is None and t + n - 1 >= T:
            continue  # not complete yet
        if last >= T:
            continue
        m = last - t + 1
        reward = sum(gamma**k * rewards[t + k] for k in range(m))
        discount = 0.0 if (end == last and dones[last]) else gamma**m
        out.append((t, reward, discount, last + 1))
    del start
    return out


def test_n_step_accumulation_with_episode_ends():
    rng = np.random.default_rng(0)
    T, n, gamma = 40, 5, 0.9
    rewards = rng.normal(size=T)
    dones = np.zeros(T, bool)
    truncs = np.zeros(T, bool)
    dones[7] = True      # terminal after 8 steps: bootstrap discount 0
    truncs[20] = True    # time limit: bootstrap gamma^m from s_{t+m}
    dones[22] = True     # a 2-step episode, shorter than n
    acc = d4pg.NStepAccumulator(n, gamma)
    got = []
    for t in range(T):
        for o, _, r, d, nxt in acc.add([t], [t], rewards[t], [t + 1], dones[t], truncs[t]):
            got.append((int(o[0]), r, d, int(nxt[0])))
    want = n_step_reference(rewards, dones, truncs, n, gamma)
    assert [g[0] for g in got] == [w[0] for w in want]
    for g, w in zip(got, want):
        assert g[1] == pytest.approx(w[1], abs=1e-6)
        assert g[2] == pytest.approx(w[2], abs=1e-7)
        assert g[3] == w[3]
    # Spot checks: step 5 ends at the terminal step 7 (3 rewards, discount 0); step 16 is cut
    # by the time limit at 20 (5 rewards, 16..20: a full window, discount gamma^5).
    by_t = {g[0]: g for g in got}
    assert by_t[5][2] == 0.0 and by_t[5][3] == 8
    assert by_t[5][1] == pytest.approx(rewards[5] + gamma * rewards[6] + gamma**2 * rewards[7])
    assert by_t[18][2] == pytest.approx(gamma**3) and by_t[18][3] == 21
    assert len(got) == T - (n - 1)  # the last n-1 steps wait for more


def test_replay_and_rate_limiter():
    buf = d4pg.ReplayBuffer(10, obs_dim=2, action_dim=1, seed=0)
    items = [([i, i], [i], float(i), 0.9, [i + 1, i + 1]) for i in range(15)]
    buf.insert(d4pg.replay.stack_transitions(items, 2, 1))
    assert buf.size == 10 and buf.inserted == 15
    batch = buf.sample(100)
    assert set(batch.reward.astype(int)) <= set(range(5, 15))      # the 5 oldest are gone
    np.testing.assert_array_equal(batch.observation[:, 0], batch.reward)
    restored = d4pg.ReplayBuffer(10, 2, 1)
    restored.load_state(buf.state())
    assert restored.size == 10 and restored.inserted == 15

    lim = d4pg.RateLimiter(samples_per_insert=4, min_size_to_sample=10, error_buffer=8)
    assert not lim.can_sample(1) and lim.can_insert(10)
    lim.record_insert(10)
    assert lim.can_sample(8) and not lim.can_sample(9)       # 0 * 4 + 8 of tolerance
    lim.record_insert(2)                                       # 8 samples owed, +8 tolerance
    assert lim.can_sample(16) and not lim.can_sample(17)
    assert lim.can_insert(0) and not lim.can_insert(1)         # 8 owed + 4 > 8: wait
    lim.record_sample(16)
    assert lim.can_insert(4) and not lim.can_insert(5)


def test_policy_numpy_forward_and_bounds():
    policy = d4pg.make_policy(3, [-2.0, 0.0], [2.0, 1.0], layers=(16, 8, 8))
    rng = np.random.default_rng(0)
    for w in policy.weights:  # large weights so that the tanh saturates
        w.assign(rng.normal(size=w.shape).astype("float32") * 0.5)
    policy.weights[-2].assign(policy.weights[-2].numpy() * 50)  # a saturated output tanh
    obs = rng.normal(size=(50, 3)).astype("float32") * 20
    keras_out = policy(obs).numpy()
    np.testing.assert_allclose(
        d4pg.policy_forward_numpy(policy.get_weights(), obs, [-2, 0], [2, 1]), keras_out,
        atol=1e-5,
    )
    assert keras_out[:, 0].min() >= -2 and keras_out[:, 0].max() <= 2
    assert keras_out[:, 1].min() >= 0 and keras_out[:, 1].max() <= 1
    assert keras_out[:, 0].max() > 1.9 and keras_out[:, 0].min() < -1.9


def test_networks_shapes():
    critic = d4pg.make_critic(5, 2)
    assert critic([np.zeros((4, 5)), np.zeros((4, 2))]).shape == (4, 51)
    sizes = [w.shape for w in critic.weights if len(w.shape) == 2]
    assert sizes == [(7, 512), (512, 512), (512, 256), (256, 51)]
    policy = d4pg.make_policy(5, [-1, -1], [1, 1])
    assert [w.shape for w in policy.weights if len(w.shape) == 2] == [
        (5, 256), (256, 256), (256, 256), (256, 2)]
    assert any("layer_norm" in layer.name for layer in policy.layers)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: d4pg.make_atoms(1.0, -1.0), "v_min must be below v_max"),
        (lambda: d4pg.make_atoms(num_atoms=1), "num_atoms must be an integer >= 2"),
        (lambda: d4pg.NStepAccumulator(n=0), "n must be a positive integer"),
        (lambda: d4pg.NStepAccumulator(discount=1.5), "discount must be in"),
        (lambda: d4pg.RateLimiter(samples_per_insert=0), "samples_per_insert must be a positive"),
        (lambda: d4pg.ReplayBuffer(0, 3, 1), "capacity must be a positive integer"),
        (lambda: d4pg.make_policy(3, [1.0], [-1.0]), "low < high"),
        (lambda: d4pg.D4PGLearner.create(3, [-1.0], [1.0], target_update_period=0),
         "target_update_period must be a positive integer"),
        (lambda: environments.make_env("NoSuchEnv-v9"), "Unknown environment id 'NoSuchEnv-v9'"),
        (lambda: environments.make_env("dm_control/cartpole-nosuchtask-v0"),
         "Unknown environment id"),
        (lambda: environments.make_env("CartPole-v1"), "Discrete action space; D4PG needs"),
    ],
)
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_environments():
    spec = environments.env_spec("Pendulum-v1")
    assert (spec.obs_dim, spec.low, spec.high, spec.reward_scale) == (3, (-2.0,), (2.0,), 0.1)
    spec = environments.env_spec("dm_control/cartpole-swingup-v0")
    assert (spec.obs_dim, spec.low, spec.high) == (5, (-1.0,), (1.0,))
    env = environments.make_env("dm_control/cartpole-swingup-v0", seed=0)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (5,)
    env.close()
    # A random policy on Pendulum scores about -1200 (the learning check's baseline).
    rng = np.random.default_rng(0)
    returns = environments.evaluate("Pendulum-v1", lambda o: rng.uniform(-2, 2, 1), episodes=5)
    assert -1600 < np.mean(returns) < -900


def test_held_out_evaluation_seeds_are_disjoint_from_the_curve_and_the_actors():
    from keras_replicator.applications.d4pg import actors, builder
    from keras_replicator.applications.d4pg.config import D4PGConfig

    assert actors.actor_seeds(3, 2) == [1003, 2003]
    config = builder.check_arguments(D4PGConfig("Pendulum-v1", "/tmp/unused"))
    assert (config.final_eval_seed, config.final_eval_episodes) == (50_000, 100)
    for fields in (dict(final_eval_seed=environments.CURVE_EVAL_SEED + 5),   # the curve's
                   dict(final_eval_seed=9_995, final_eval_episodes=10),     # overlaps it
                   dict(final_eval_seed=1_950, final_eval_episodes=100)):   # actor 2's 2000
        with pytest.raises(ValueError, match="disjoint from the curve's"):
            builder.check_arguments(D4PGConfig("Pendulum-v1", "/tmp/unused", **fields))


def test_missing_extra_error_names_the_extra(monkeypatch):
    import builtins

    from keras_replicator.applications.d4pg import _deps

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("ray"):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.delitem(__import__("sys").modules, "ray", raising=False)
    with pytest.raises(ImportError, match=r'pip install "\.\[rl\]"'):
        _deps.require("ray")


def test_command_rejects_bad_input(capsys):
    from keras_replicator.applications.d4pg.__main__ import main

    with pytest.raises(SystemExit):
        main(["--out", "/tmp/unused", "--actors", "0"])
    assert "--actors must be a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", "/tmp/unused", "--env-steps", "-5"])
    assert "--env-steps must be a positive integer" in capsys.readouterr().err
    assert main(["--out", "/tmp/unused", "--env", "CartPole-v1"]) == 2
    assert "Discrete action space" in capsys.readouterr().err
    assert main(["--out", "/tmp/unused", "--env", "Nope-v0"]) == 2
    assert "Unknown environment id" in capsys.readouterr().err
