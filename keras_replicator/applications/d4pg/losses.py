"""D4PG's losses: the categorical (C51) projection of the Bellman target and the DPG loss.

The distributional critic predicts a categorical distribution over fixed atoms `z`. The
N-step Bellman target of a transition is the distribution of `r + d * Z(s', pi'(s'))`, where
`r` is the discounted sum of the N rewards and `d` is `discount ** N` (0 after a terminal
step). Its atoms `r + d * z` fall between (or outside) the fixed ones, so the target is
projected back onto `z` (Bellemare et al., 2017): each shifted atom, clipped to
`[v_min, v_max]`, gives its probability to its two neighbours in proportion to closeness.
For evenly spaced atoms this is rlax's `categorical_l2_project`:
`p_i = sum_j q_j * clip(1 - |clip(r + d z_j) - z_i| / dz, 0, 1)`.

The policy follows the deterministic policy gradient through the critic's mean,
`Q(s, a) = sum_i softmax(logits)_i z_i`, as Acme's `rlax.dpg_loss` with `dqda_clipping=1`:
the loss `0.5 * |stop_gradient(a + clip(dQ/da, -1, 1)) - a|^2` has gradient `-clip(dQ/da)`
with respect to the action.

Example:
    ```python
    import tensorflow as tf
    from keras_replicator.applications import d4pg

    atoms = tf.constant(d4pg.make_atoms(-10.0, 10.0, 51))
    probs = tf.fill((2, 51), 1 / 51)
    target = d4pg.categorical_projection(atoms, probs, rewards=[1.0, 0.0], discounts=[0.99, 0.0])
    ```
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

TensorLike = Any  # a tf.Tensor, NumPy array or nested list of floats


def categorical_projection(
    atoms: TensorLike, probabilities: TensorLike, rewards: TensorLike, discounts: TensorLike
) -> tf.Tensor:
    """Projects the distribution of `rewards + discounts * atoms` onto `atoms`.

    Args:
        atoms: the support, `(num_atoms,)`, evenly spaced and increasing.
        probabilities: `(batch, num_atoms)` probabilities of the next state's distribution.
        rewards: `(batch,)` N-step discounted rewards.
        discounts: `(batch,)` bootstrap discounts (`gamma ** N`, 0 after a terminal step).

    Returns:
        `(batch, num_atoms)` probabilities on `atoms` (each row sums to 1).

    Example:
        ```python
        atoms = tf.linspace(-10.0, 10.0, 51)
        target_logits = tf.zeros((2, 51))
        r, d = [1.0, 0.0], [0.99, 0.0]          # rewards; discounts (0 at an episode's end)
        target = categorical_projection(atoms, tf.nn.softmax(target_logits), r, d)   # rows sum to 1
        ```
    """
    atoms = tf.convert_to_tensor(atoms, tf.float32)
    probabilities = tf.convert_to_tensor(probabilities, tf.float32)
    rewards = tf.reshape(tf.convert_to_tensor(rewards, tf.float32), (-1, 1))
    discounts = tf.reshape(tf.convert_to_tensor(discounts, tf.float32), (-1, 1))
    v_min, v_max = atoms[0], atoms[-1]
    delta = atoms[1] - atoms[0]
    shifted = tf.clip_by_value(rewards + discounts * atoms[None, :], v_min, v_max)  # (b, n)
    # weight[b, i, j]: how much of shifted atom j goes to support atom i.
    distance = tf.abs(shifted[:, None, :] - atoms[None, :, None])
    weight = tf.clip_by_value(1.0 - distance / delta, 0.0, 1.0)
    return tf.reduce_sum(weight * probabilities[:, None, :], axis=-1)


def critic_mean(logits, atoms) -> tf.Tensor:
    """The critic's expected value `sum_i softmax(logits)_i * atoms_i`, shape `(batch,)`.

    Example:
        ```python
        atoms = tf.linspace(-10.0, 10.0, 51)
        q = critic_mean(tf.zeros((2, 51)), atoms)   # [0., 0.]: uniform on a symmetric support
        ```
    """
    return tf.reduce_sum(tf.nn.softmax(logits, axis=-1) * atoms, axis=-1)


def categorical_cross_entropy(target_probabilities, logits) -> tf.Tensor:
    """Per-example cross-entropy of `logits` to a (constant) target distribution, `(batch,)`.

    Example:
        ```python
        target = tf.fill((2, 51), 1 / 51)
        loss = categorical_cross_entropy(target, tf.zeros((2, 51)))   # log(51) = 3.93 each
        ```
    """
    target = tf.stop_gradient(target_probabilities)
    return tf.nn.softmax_cross_entropy_with_logits(labels=target, logits=logits)


def dpg_loss(actions, dqda, clipping: float | None = 1.0) -> tf.Tensor:
    """Per-example deterministic policy gradient loss (rlax's `dpg_loss`), `(batch,)`.

    Example:
        ```python
        actions, dq_da = tf.constant([[0.5], [-1.0]]), tf.constant([[2.0], [0.1]])
        loss = dpg_loss(actions, dq_da, clipping=1.0)   # [0.5, 0.005]: dq/da clipped to 1
        ```
    """
    dqda = tf.stop_gradient(dqda)
    if clipping is not None:
        dqda = tf.clip_by_value(dqda, -clipping, clipping)
    target = tf.stop_gradient(actions + dqda)
    return 0.5 * tf.reduce_sum(tf.square(target - actions), axis=-1)
