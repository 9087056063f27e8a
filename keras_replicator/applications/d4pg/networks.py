"""D4PG's networks, as in Acme (`acme/agents/jax/d4pg/networks.py`, `LayerNormMLP`).

* the policy: an MLP (256, 256, 256) whose first layer is followed by layer norm and `tanh`
  (Acme's `LayerNormMLP`), ELU after the others, a near-zero initialised linear output and
  `tanh` scaled to the environment's action bounds (Acme's `TanhToSpec`);
* the distributional critic: the same kind of MLP (512, 512, 256) on the concatenation
  `[observation, action]`, ending in the logits of a categorical distribution over
  `num_atoms` (51) atoms evenly spaced on `[v_min, v_max]`.

`policy_forward_numpy` runs the policy from its weights with NumPy alone: the actors use it,
so they neither import TensorFlow's runtime per step nor hold a model (a weight list is what
the learner sends them).

Example:
    ```python
    import numpy as np
    from keras_replicator.applications import d4pg

    policy = d4pg.make_policy(3, low=[-2.0], high=[2.0])
    critic = d4pg.make_critic(3, 1)
    obs = np.zeros((4, 3), "float32")
    actions = np.asarray(policy(obs))          # (4, 1), within [-2, 2]
    logits = critic([obs, actions])            # (4, 51)
    ```
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import numpy as np

from keras_replicator._validation import ArgumentError, check_int, check_number

POLICY_LAYERS = (256, 256, 256)
CRITIC_LAYERS = (512, 512, 256)


@keras.saving.register_keras_serializable(package="keras_replicator")
class ScaleToBounds(keras.layers.Layer):
    """Maps `tanh` outputs in [-1, 1] affinely onto `[low, high]` (per action dimension).

    Example:
        ```python
        layer = ScaleToBounds(low=[-2.0], high=[2.0])
        layer(keras.ops.tanh(np.array([[-30.0], [0.0], [30.0]])))   # [[-2.], [0.], [2.]]
        ```
    """

    def __init__(self, low: Sequence[float], high: Sequence[float], **kwargs):
        super().__init__(**kwargs)
        self.low = [float(v) for v in np.ravel(low)]
        self.high = [float(v) for v in np.ravel(high)]
        if len(self.low) != len(self.high) or not all(
            np.isfinite(lo) and np.isfinite(hi) and lo < hi for lo, hi in zip(self.low, self.high)
        ):
            raise ArgumentError(
                f"low and high must be finite, of equal length, with low < high; got "
                f"{self.low} and {self.high}."
            )

    def call(self, x):
        low = keras.ops.convert_to_tensor(np.asarray(self.low, "float32"), dtype=x.dtype)
        high = keras.ops.convert_to_tensor(np.asarray(self.high, "float32"), dtype=x.dtype)
        return low + (x + 1.0) * 0.5 * (high - low)

    def get_config(self) -> dict:
        return {**super().get_config(), "low": self.low, "high": self.high}


def _layer_norm_mlp(x, sizes: Sequence[int], name: str, activate_final: bool = True):
    """Acme's `LayerNormMLP`: Linear, LayerNorm, tanh; then Linear + ELU for the others."""
    init = keras.initializers.VarianceScaling(1.0, "fan_in", "uniform")
    x = keras.layers.Dense(sizes[0], kernel_initializer=init, name=f"{name}_dense_0")(x)
    x = keras.layers.LayerNormalization(epsilon=1e-5, name=f"{name}_layer_norm")(x)
    x = keras.layers.Activation("tanh", name=f"{name}_tanh")(x)
    for i, size in enumerate(sizes[1:], start=1):
        last = i == len(sizes) - 1
        x = keras.layers.Dense(size, kernel_initializer=init, name=f"{name}_dense_{i}")(x)
        if not last or activate_final:
            x = keras.layers.Activation("elu", name=f"{name}_elu_{i}")(x)
    return x


def make_policy(
    obs_dim: int,
    low: Sequence[float],
    high: Sequence[float],
    layers: Sequence[int] = POLICY_LAYERS,
) -> keras.Model:
    """The deterministic policy: observations `(n, obs_dim)` to actions within `[low, high]`.

    Args:
        obs_dim: size of the (flat) observation.
        low: lower action bound per action dimension.
        high: upper action bound per action dimension.
        layers: hidden sizes; the first is followed by layer norm and `tanh`.

    Returns:
        A functional `keras.Model` (saved and loaded with `keras.saving` once
        `keras_replicator` is imported).

    Example:
        ```python
        policy = make_policy(3, low=[-2.0], high=[2.0])
        ```
    """
    obs_dim = check_int("obs_dim", obs_dim, minimum=1)
    layers = [check_int("layer size", s, minimum=1) for s in layers]
    if not layers:
        raise ArgumentError("layers must name at least one hidden layer.")
    action_dim = len(np.ravel(low))
    obs = keras.Input((obs_dim,), name="observation")
    x = _layer_norm_mlp(obs, layers, "policy")
    # Acme's NearZeroInitializedLinear: variance scaling 1e-4, so the first actions are ~0.
    x = keras.layers.Dense(
        action_dim,
        kernel_initializer=keras.initializers.VarianceScaling(1e-4, "fan_in", "truncated_normal"),
        name="policy_output",
    )(x)
    x = keras.layers.Activation("tanh", name="policy_output_tanh")(x)
    actions = ScaleToBounds(low, high, name="action_bounds")(x)
    return keras.Model(obs, actions, name="policy")


def make_critic(
    obs_dim: int,
    action_dim: int,
    layers: Sequence[int] = CRITIC_LAYERS,
    num_atoms: int = 51,
) -> keras.Model:
    """The distributional critic: `[observations, actions]` to logits over `num_atoms` atoms.

    Example:
        ```python
        critic = make_critic(3, 1)
        obs, actions = np.zeros((4, 3), "float32"), np.ones((4, 1), "float32")
        logits = critic([obs, actions])      # (4, 51)
        ```
    """
    obs_dim = check_int("obs_dim", obs_dim, minimum=1)
    action_dim = check_int("action_dim", action_dim, minimum=1)
    num_atoms = check_int("num_atoms", num_atoms, minimum=2)
    layers = [check_int("layer size", s, minimum=1) for s in layers]
    obs = keras.Input((obs_dim,), name="observation")
    act = keras.Input((action_dim,), name="action")
    x = keras.layers.Concatenate(name="critic_concat")([obs, act])
    logits = _layer_norm_mlp(x, [*layers, num_atoms], "critic", activate_final=False)
    return keras.Model([obs, act], logits, name="critic")


def make_atoms(v_min: float = -150.0, v_max: float = 150.0, num_atoms: int = 51) -> np.ndarray:
    """The critic's support: `num_atoms` values evenly spaced on `[v_min, v_max]` (float32).

    Example:
        ```python
        make_atoms(-150.0, 150.0, 51)[:3]     # [-150., -144., -138.]
        ```
    """
    v_min = check_number("v_min", v_min)
    v_max = check_number("v_max", v_max)
    num_atoms = check_int("num_atoms", num_atoms, minimum=2)
    if not v_min < v_max:
        raise ArgumentError(f"v_min must be below v_max, got {v_min} and {v_max}.")
    return np.linspace(v_min, v_max, num_atoms, dtype=np.float32)


def policy_forward_numpy(
    weights: Sequence[np.ndarray],
    obs: np.ndarray,
    low: Sequence[float] | np.ndarray,
    high: Sequence[float] | np.ndarray,
) -> np.ndarray:
    """The policy of `make_policy` evaluated from `policy.get_weights()` with NumPy.

    Args:
        weights: `policy.get_weights()` (kernel, bias, gamma, beta, then kernel/bias pairs).
        obs: observations `(n, obs_dim)` or one observation `(obs_dim,)`.
        low: lower action bounds.
        high: upper action bounds.

    Returns:
        Actions of the same leading shape, float32.

    Example:
        ```python
        policy = make_policy(3, low=[-2.0], high=[2.0])
        obs = np.ones((4, 3), "float32")
        a = policy_forward_numpy(policy.get_weights(), obs, [-2.0], [2.0])   # == policy(obs), no TensorFlow
        ```
    """
    x = np.asarray(obs, np.float32)
    single = x.ndim == 1
    x = np.atleast_2d(x)
    w = list(weights)
    x = x @ w[0] + w[1]
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    x = np.tanh((x - mean) / np.sqrt(var + 1e-5) * w[2] + w[3])
    rest = w[4:]
    for i in range(0, len(rest) - 2, 2):
        x = x @ rest[i] + rest[i + 1]
        x = np.where(x > 0, x, np.expm1(np.minimum(x, 0)))
    x = np.tanh(x @ rest[-2] + rest[-1])
    low = np.asarray(low, np.float32)
    high = np.asarray(high, np.float32)
    a = (low + (x + 1.0) * 0.5 * (high - low)).astype(np.float32)
    return a[0] if single else a
