"""The D4PG learner: a `keras.Model` whose `train_step` updates the critic, the policy and
their target networks, trained by `model.fit` under `ReplicatorStrategy`.

Per replica, `train_step` receives its slice of the global batch of N-step transitions. Both
losses are sums over the slice divided by the global batch size, so the all-reduced (summed)
gradients equal the single-device gradients of the mean loss; the optimizers
(`CrossReplicaOptimizer`s around Adam, with clipping of the all-reduced gradient's global
norm) then apply the same update on every replica. The target networks are updated in the
cross-replica context (`merge_call`, then `strategy.extended.update` per variable) from the
online weights, which are identical on every replica, so the targets are too: a periodic copy
every `target_update_period` updates (Acme), or Polyak averaging with `target_update_rate`.

As Acme's learner, both gradients are taken at the current weights before either update.

Example:
    ```python
    import numpy as np
    import tensorflow as tf
    import keras_replicator as kr
    from keras_replicator.applications import d4pg

    strategy = kr.ReplicatorStrategy()
    with strategy.scope():
        learner = d4pg.D4PGLearner.create(obs_dim=3, low=[-2.0], high=[2.0])
        learner.compile()
    n = 64                                    # replay samples, as the feeder sends them
    batches = tf.data.Dataset.from_tensor_slices({
        "observation": np.zeros((n, 3), "float32"), "action": np.zeros((n, 1), "float32"),
        "reward": np.ones(n, "float32"), "discount": np.full(n, 0.99, "float32"),
        "next_observation": np.zeros((n, 3), "float32")}).repeat()
    learner.fit(strategy.distribute_dataset(batches, global_batch_size=32), steps_per_epoch=2,
                verbose=0, shuffle=False)    # the replay's sampling is the shuffle
    ```
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from keras_replicator import xla
from keras_replicator._validation import ArgumentError, check_int, check_number
from keras_replicator.applications.d4pg import losses, networks
from keras_replicator.optimizers import CrossReplicaOptimizer


class D4PGLearner(keras.Model):
    """Policy, distributional critic and their targets, trained together by `fit`.

    Args:
        policy: the online policy (`make_policy`).
        critic: the online critic (`make_critic`).
        atoms: the critic's support (`make_atoms`).
        target_update_period: copy the online weights to the targets every this many updates
            (used when `target_update_rate` is None).
        target_update_rate: Polyak averaging `target += rate * (online - target)` every update,
            instead of the periodic copy.
        dqda_clipping: clip of dQ/da in the policy loss (Acme: 1.0; None: no clip).
        pre_tanh_penalty: adds ``pre_tanh_penalty * mean(sum(u**2))`` to the policy loss, ``u``
            the policy's output before its `tanh` (layer ``policy_output`` of `make_policy`).
            Without it a policy can saturate its `tanh` (``|u|`` of 100 and more, measured on
            Pendulum at learning rate 1e-3), where the DPG gradient is exactly 0 and the policy
            stays at full torque; the penalty's gradient brings it back and is negligible where
            the `tanh` is not saturated. None or 0: no penalty (Acme).

    Example:
        ```python
        learner = D4PGLearner.create(obs_dim=3, low=[-2.0], high=[2.0])
        learner.compile()
        ```
    """

    # Under jit_compile its train_step compiles its own per-replica parts (replica_jit).
    _keras_replicator_jit_aware = True

    def __init__(
        self,
        policy: keras.Model,
        critic: keras.Model,
        atoms: Sequence[float],
        *,
        target_update_period: int = 100,
        target_update_rate: float | None = None,
        dqda_clipping: float | None = 1.0,
        pre_tanh_penalty: float | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.pre_tanh_penalty = check_number("pre_tanh_penalty", pre_tanh_penalty,
                                             non_negative=True, optional=True) or None
        self.target_update_period = check_int("target_update_period", target_update_period,
                                              minimum=1)
        self.target_update_rate = check_number("target_update_rate", target_update_rate,
                                               positive=True, optional=True)
        if self.target_update_rate is not None and self.target_update_rate > 1:
            raise ArgumentError(f"target_update_rate must be in (0, 1], got {target_update_rate}.")
        self.dqda_clipping = check_number("dqda_clipping", dqda_clipping, positive=True,
                                          optional=True)
        self.atoms = np.asarray(atoms, np.float32)
        self.policy = policy
        self.critic = critic
        self.target_policy = keras.models.clone_model(policy)
        self.target_critic = keras.models.clone_model(critic)
        self.target_policy.set_weights(policy.get_weights())
        self.target_critic.set_weights(critic.get_weights())
        self._policy_and_pre_tanh = None
        if self.pre_tanh_penalty is not None:
            try:
                pre_tanh = policy.get_layer("policy_output").output
            except ValueError as e:
                raise ArgumentError("pre_tanh_penalty needs a policy of make_policy (a layer named "
                                    "'policy_output' before its tanh).") from e
            # The same layers (weights shared): the actions and the pre-tanh outputs in one pass.
            self._policy_and_pre_tanh = keras.Model(policy.inputs, [policy.outputs[0], pre_tanh])
        self._jit_losses = None  # compute_losses compiled per replica, made on first use
        self.updates = self.add_weight(
            shape=(), dtype="int64", initializer="zeros", trainable=False, name="updates",
            aggregation="only_first_replica",
        )

    @classmethod
    def create(
        cls,
        obs_dim: int,
        low: Sequence[float],
        high: Sequence[float],
        *,
        v_min: float = -150.0,
        v_max: float = 150.0,
        num_atoms: int = 51,
        policy_layers: Sequence[int] = networks.POLICY_LAYERS,
        critic_layers: Sequence[int] = networks.CRITIC_LAYERS,
        **kwargs,
    ) -> D4PGLearner:
        """Builds the networks of Acme's D4PG for an environment and wraps them in a learner.

        Example:
            ```python
            learner = D4PGLearner.create(obs_dim=5, low=[-1.0], high=[1.0])
            ```
        """
        atoms = networks.make_atoms(v_min, v_max, num_atoms)
        policy = networks.make_policy(obs_dim, low, high, policy_layers)
        critic = networks.make_critic(obs_dim, len(np.ravel(low)), critic_layers, num_atoms)
        return cls(policy, critic, atoms, **kwargs)

    def compile(
        self,
        policy_optimizer: keras.optimizers.Optimizer | None = None,
        critic_optimizer: keras.optimizers.Optimizer | None = None,
        *,
        learning_rate: float = 1e-4,
        clip_global_norm: float | None = 40.0,
        **kwargs,
    ) -> None:
        """Sets the two optimizers (default: Adam `learning_rate`, all-reduced gradients
        clipped to a global norm of `clip_global_norm`), then `keras.Model.compile`.

        Example:
            ```python
            learner = D4PGLearner.create(obs_dim=3, low=[-2.0], high=[2.0])
            learner.compile(learning_rate=1e-4, clip_global_norm=40.0)
            ```
        """
        learning_rate = check_number("learning_rate", learning_rate, positive=True)
        clip_global_norm = check_number("clip_global_norm", clip_global_norm, positive=True,
                                        optional=True)

        def default():
            return CrossReplicaOptimizer(keras.optimizers.Adam(learning_rate),
                                         clip_global_norm=clip_global_norm)

        self.policy_optimizer = policy_optimizer or default()
        self.critic_optimizer = critic_optimizer or default()
        super().compile(**kwargs)

    def call(self, observations, training=False):
        return self.policy(observations, training=training)

    def build(self, input_shape=None):  # the networks are functional models, built already
        self.built = True

    def _global_batch(self, local_batch):
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        return tf.cast(local_batch * replicas, tf.float32)

    def compute_losses(self, data):
        """Both gradients at the current weights: (critic loss, policy loss, grads, grads).

        `data` is a dict of `Transitions` fields (`Transitions._asdict()`), Keras's `x`.
        """
        obs, action, reward, discount, next_obs = (
            data[k] for k in ("observation", "action", "reward", "discount", "next_observation")
        )
        atoms = tf.constant(self.atoms)
        global_batch = self._global_batch(tf.shape(obs)[0])
        with tf.GradientTape() as tape:
            logits = self.critic([obs, action], training=True)
            next_action = self.target_policy(next_obs, training=False)
            target_logits = self.target_critic([next_obs, next_action], training=False)
            target = losses.categorical_projection(
                atoms, tf.nn.softmax(target_logits), reward, discount
            )
            critic_loss = tf.reduce_sum(losses.categorical_cross_entropy(target, logits))
            critic_loss = critic_loss / global_batch
        critic_grads = tape.gradient(critic_loss, self.critic.trainable_variables)
        with tf.GradientTape() as tape:
            if self._policy_and_pre_tanh is None:
                dpg_action = self.policy(obs, training=True)
            else:
                dpg_action, pre_tanh = self._policy_and_pre_tanh(obs, training=True)
            with tf.GradientTape() as inner:
                inner.watch(dpg_action)
                q = losses.critic_mean(self.critic([obs, dpg_action], training=False), atoms)
            dqda = inner.gradient(q, dpg_action)
            policy_loss = tf.reduce_sum(losses.dpg_loss(dpg_action, dqda, self.dqda_clipping))
            if self._policy_and_pre_tanh is not None:
                policy_loss += self.pre_tanh_penalty * tf.reduce_sum(tf.square(pre_tanh))
            policy_loss = policy_loss / global_batch
        policy_grads = tape.gradient(policy_loss, self.policy.trainable_variables)
        return critic_loss, policy_loss, critic_grads, policy_grads

    def _losses_and_gradients(self, data):
        """`compute_losses`, compiled with XLA per replica under `jit_compile`."""
        if not self.jit_compile:
            return self.compute_losses(data)
        if self._jit_losses is None:
            self._jit_losses = xla.replica_jit(self.compute_losses)
        return self._jit_losses(data)

    def train_step(self, data):
        # Under jit_compile the losses and gradients are compiled per replica; the applies
        # (all-reduces) and the target update (merge_call) stay outside XLA.
        critic_loss, policy_loss, critic_grads, policy_grads = self._losses_and_gradients(data)
        self.critic_optimizer.apply(critic_grads, self.critic.trainable_variables)
        self.policy_optimizer.apply(policy_grads, self.policy.trainable_variables)
        self.updates.assign_add(1)
        ctx = tf.distribute.get_replica_context()
        if ctx is not None and tf.distribute.has_strategy():
            ctx.merge_call(self._update_targets)
        else:
            self._update_targets(tf.distribute.get_strategy())
        # Losses are per-replica shares of the global mean: their sum is the global loss.
        ctx = tf.distribute.get_replica_context()
        if ctx is not None and tf.distribute.has_strategy():
            critic_loss, policy_loss = ctx.all_reduce("sum", [critic_loss, policy_loss])
        return {"critic_loss": critic_loss, "policy_loss": policy_loss}

    def _update_targets(self, strategy):
        """Runs once in the cross-replica context; every replica's targets get the same value."""
        pairs = list(zip(self.target_policy.weights, self.policy.weights)) + list(
            zip(self.target_critic.weights, self.critic.weights)
        )
        if self.target_update_rate is not None:
            rate = tf.constant(self.target_update_rate, tf.float32)

            def update(target, online):
                return target.assign(target + rate * (online - target))
        else:
            copy = tf.equal(self.updates % self.target_update_period, 0)

            def update(target, online):
                return target.assign(tf.where(copy, online, target))

        for target, online in pairs:
            # `.value` is the backing `tf.Variable` (a `MirroredVariable` under a strategy), as
            # Keras's own optimizer passes to `extended.update`.
            strategy.extended.update(target.value, update, args=(online.value,), group=False)

    def test_step(self, data):
        critic_loss, policy_loss, _, _ = self._losses_and_gradients(data)
        return {"critic_loss": critic_loss, "policy_loss": policy_loss}

    # --- state for resuming ---------------------------------------------------------------

    def state(self) -> dict:
        """Every weight, target and optimizer variable as NumPy arrays (for `np.savez`)."""
        out = {}
        groups = self._state_groups()
        for name, variables in groups.items():
            for i, v in enumerate(variables):
                out[f"{name}/{i}"] = np.asarray(v.numpy())
        return out

    def load_state(self, state) -> None:
        """Restores `state()`; the optimizers are built first if they are not."""
        for opt, net in ((self.critic_optimizer, self.critic), (self.policy_optimizer,
                                                                 self.policy)):
            if not opt.built:
                opt.build(net.trainable_variables)
        for name, variables in self._state_groups().items():
            for i, v in enumerate(variables):
                key = f"{name}/{i}"
                if key not in state:
                    raise ValueError(f"saved learner state has no {key!r}.")
                v.assign(state[key])

    def _state_groups(self) -> dict:
        return {
            "policy": self.policy.weights,
            "critic": self.critic.weights,
            "target_policy": self.target_policy.weights,
            "target_critic": self.target_critic.weights,
            "policy_optimizer": self.policy_optimizer.variables,
            "critic_optimizer": self.critic_optimizer.variables,
            "updates": [self.updates],
        }
