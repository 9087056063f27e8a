"""The SN-GAN training step as one `keras.Model`: `compile` two optimizers, `fit`.

One `train_step` is one generator update and `n_dis` discriminator updates, as in
pfnet-research/sngan_projection's updater, so `fit`'s steps count generator
updates. Each step consumes a batch of `n_dis * global_batch_size` real examples
(`data.py` batches this way): discriminator update `i` uses the examples at
positions `i, i + n_dis, i + 2 n_dis, ...` of the replica's slice. Because
`ReplicatorStrategy` gives each replica a contiguous slice whose size is a
multiple of `n_dis`, update `i` sees the same global set of examples whatever
the number of replicas, so N replicas compute what one device computes.

Latents and fake labels are drawn for the whole global batch from a stateless
generator keyed by `(seed, step, update)`, and each replica takes its rows: again
the same numbers on any number of replicas.

Losses are the hinge losses of the paper,
`L_D = E[relu(1 - D(x, y))] + E[relu(1 + D(G(z, y'), y'))]`, `L_G = -E[D(G(z, y'), y')]`,
with means over the global batch (each replica's sum divided by the global batch
size; the strategy sums the gradients across replicas).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras import ops

from keras_replicator import collectives, xla
from keras_replicator._validation import ArgumentError, check_int, check_number

__all__ = ["SNGAN", "default_optimizer", "hinge_d_loss", "hinge_g_loss"]


def default_optimizer(learning_rate: float = 2e-4) -> keras.optimizers.Adam:
    """Adam(2e-4, beta_1=0, beta_2=0.9): the SN-GAN optimizer for both networks.

    Example:
        ```python
        from keras_replicator.applications.sngan import default_optimizer

        opt = default_optimizer()   # Adam(2e-4, beta_1=0.0, beta_2=0.9); one for each network:
        # gan.compile(d_optimizer=default_optimizer(), g_optimizer=default_optimizer())
        ```
    """
    return keras.optimizers.Adam(learning_rate, beta_1=0.0, beta_2=0.9)


def hinge_d_loss(real_logits, fake_logits):
    """Per-example discriminator hinge loss `relu(1 - real) + relu(1 + fake)`.

    Example:
        ```python
        import numpy as np
        from keras import ops
        from keras_replicator.applications.sngan import hinge_d_loss

        d_real, d_fake = np.array([2.0, 0.5]), np.array([-2.0, 0.5])   # discriminator logits
        loss = ops.mean(hinge_d_loss(d_real, d_fake))   # 1.0: (0 + 0 + 0.5 + 1.5) / 2
        ```
    """
    return ops.relu(1.0 - real_logits) + ops.relu(1.0 + fake_logits)


def hinge_g_loss(fake_logits):
    """Per-example generator hinge loss `-fake`.

    Example:
        ```python
        import numpy as np
        from keras import ops
        from keras_replicator.applications.sngan import hinge_g_loss

        d_fake = np.array([2.0, -1.0])             # the discriminator's logits on generated images
        loss = ops.mean(hinge_g_loss(d_fake))      # -0.5
        ```
    """
    return -fake_logits


class SNGAN(keras.Model):
    """A class-conditional GAN trained with hinge loss and `n_dis` critic updates.

    Build it (and `compile` it) under the strategy's `scope()`; `fit` it on a
    dataset of `(images, labels)` batches of `n_dis * global_batch_size` examples
    (see `data.py`). Calling the model, `gan([z, labels])`, samples from the
    generator in inference mode (the EMA weights if `ema_decay` is set).

    Example:
        ```python
        import dataclasses
        import keras_replicator as kr
        from keras_replicator.applications import sngan

        strategy = kr.ReplicatorStrategy()
        config = dataclasses.replace(sngan.CONFIGS["small16"], channels=1)   # digits: grey, 16x16
        with strategy.scope():
            gan = sngan.SNGAN(sngan.generator(config, 10), sngan.discriminator(config, 10),
                              num_classes=10, n_dis=5, ema_decay=0.999)
            gan.compile(d_optimizer=sngan.default_optimizer(),
                        g_optimizer=sngan.default_optimizer())
        train = sngan.digits_dataset(global_batch_size=16, n_dis=5, image_size=16,
                                     num_replicas=strategy.num_replicas_in_sync)
        gan.fit(train, steps_per_epoch=2, verbose=0)   # 2 steps: 10 discriminator, 2 generator updates
        ```

    Args:
        generator: `[z, labels] -> images` (e.g. `sngan.generator`).
        discriminator: `[images, labels] -> logits` (e.g. `sngan.discriminator`).
        num_classes: the number of classes of the fake labels.
        n_dis: discriminator updates per generator update (5 in SN-GAN).
        ema_decay: if set, keep an exponential moving average of the generator's
            trainable weights with this decay (BigGAN uses 0.9999), updated after
            each generator update, identical on every replica; `sampler()` and
            `call` use it. As in `tf.train.ExponentialMovingAverage` with
            `num_updates`, the decay after the `t`-th update is
            `min(ema_decay, (1 + t) / (10 + t))`, so that short runs average
            recent weights rather than the initial ones.
        seed: seed of the latents and fake labels.
        **kwargs: `keras.Model` arguments (`name`).
    """

    # Under jit_compile its train_step compiles its own per-replica parts (replica_jit).
    _keras_replicator_jit_aware = True

    def __init__(
        self,
        generator: keras.Model,
        discriminator: keras.Model,
        num_classes: int,
        n_dis: int = 5,
        ema_decay: float | None = None,
        seed: int = 0,
        **kwargs: Any,
    ):
        for label, net in (("generator", generator), ("discriminator", discriminator)):
            if not isinstance(net, keras.Model) or len(net.inputs or []) != 2:
                raise ArgumentError(
                    f"{label} must be a built keras.Model with two inputs ([z, labels] or "
                    f"[images, labels]), got {net!r}."
                )
        num_classes = check_int("num_classes", num_classes, minimum=1)
        n_dis = check_int("n_dis", n_dis, minimum=1)
        if ema_decay is not None:
            ema_decay = check_number("ema_decay", ema_decay, non_negative=True)
            if ema_decay >= 1.0:
                raise ArgumentError(f"ema_decay must be in [0, 1), got {ema_decay!r}.")
        seed = check_int("seed", seed, minimum=0)
        super().__init__(**kwargs)
        self.generator = generator
        self.discriminator = discriminator
        self.num_classes = num_classes
        self.n_dis = n_dis
        self.ema_decay = ema_decay
        self.seed = seed
        self.z_dim = int(generator.inputs[0].shape[-1])
        self.ema_weights = []
        if ema_decay is not None:
            # Identical on every replica: each computes the same update from
            # mirrored weights and the variable keeps replica 0's value.
            self.ema_weights = [
                self.add_weight(
                    shape=w.shape, dtype=w.dtype, trainable=False,
                    aggregation="only_first_replica", name=f"ema_{i}",
                    initializer=(lambda v: lambda shape, dtype=None: ops.convert_to_tensor(v))(w),
                )
                for i, w in enumerate(generator.trainable_weights)
            ]
        self._jit_discriminator_gradients = None
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.built = True

    # --- compile -----------------------------------------------------------------------

    def compile(
        self,
        d_optimizer: keras.optimizers.Optimizer | None = None,
        g_optimizer: keras.optimizers.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        """Sets the two optimizers (default: `default_optimizer()` for each).

        The optimizers' variables are built here, under the caller's scope (a
        step that creates them lazily does not run under stock `MirroredStrategy`).
        `kwargs` go to `keras.Model.compile` (`steps_per_execution`, `jit_compile`).

        Example:
            ```python
            import dataclasses
            import keras_replicator as kr
            from keras_replicator.applications import sngan

            strategy = kr.ReplicatorStrategy()
            config = dataclasses.replace(sngan.CONFIGS["small16"], channels=1)
            with strategy.scope():
                gan = sngan.SNGAN(sngan.generator(config, 10), sngan.discriminator(config, 10),
                                  num_classes=10)
                gan.compile(d_optimizer=kr.optimizers.CrossReplicaOptimizer(
                    sngan.default_optimizer()), g_optimizer=sngan.default_optimizer())
            ```
        """
        for label, opt in (("d_optimizer", d_optimizer), ("g_optimizer", g_optimizer)):
            if opt is not None and not isinstance(opt, keras.optimizers.Optimizer):
                raise ArgumentError(f"{label} must be a keras.optimizers.Optimizer, got {opt!r}.")
        if d_optimizer is not None and d_optimizer is g_optimizer:
            raise ArgumentError("d_optimizer and g_optimizer must be two different optimizers.")
        for key in ("optimizer", "loss", "metrics"):
            if key in kwargs:
                raise ArgumentError(
                    f"SNGAN.compile takes d_optimizer and g_optimizer; it has no {key!r} argument."
                )
        super().compile(**kwargs)
        self.d_optimizer = d_optimizer or default_optimizer()
        self.g_optimizer = g_optimizer or default_optimizer()
        self.d_optimizer.build(self.discriminator.trainable_variables)
        self.g_optimizer.build(self.generator.trainable_variables)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    # --- sampling ------------------------------------------------------------------------

    def call(self, inputs, training=False):
        """`[z, labels] -> images` from the generator in inference mode (EMA weights if any)."""
        if not self.ema_weights:
            return self.generator(inputs, training=False)
        live = self.generator.trainable_weights
        with keras.StatelessScope(state_mapping=list(zip(live, self.ema_weights))):
            return self.generator(inputs, training=False)

    def sampler(self) -> keras.Model:
        """The generator to sample and evaluate with: a copy holding the EMA weights.

        Without EMA this is the generator itself. The copy is a new model built
        in the current scope (its batch-norm moving statistics are the live
        generator's).

        Example:
            ```python
            import dataclasses
            import keras
            import keras_replicator as kr
            from keras_replicator.applications import sngan

            strategy = kr.ReplicatorStrategy()
            config = dataclasses.replace(sngan.CONFIGS["small16"], channels=1)
            with strategy.scope():
                gan = sngan.SNGAN(sngan.generator(config, 10), sngan.discriminator(config, 10),
                                  num_classes=10, ema_decay=0.999)
            gan.sampler().save("generator.keras")          # the EMA weights (trained: after gan.fit)
            generator = keras.models.load_model("generator.keras")
            ```
        """
        if not self.ema_weights:
            return self.generator
        copy = keras.models.clone_model(self.generator)
        copy.set_weights(self.generator.get_weights())
        for target, ema in zip(copy.trainable_weights, self.ema_weights):
            target.assign(ops.convert_to_tensor(ema))
        return copy

    # --- training ------------------------------------------------------------------------

    def _latents(self, global_batch: int, update: int):
        """This replica's rows of the global `(z, labels)` draw for one update."""
        step = tf.cast(self.g_optimizer.iterations, tf.int32)
        seed = tf.stack([tf.constant(self.seed, tf.int32), step * (self.n_dis + 1) + update])
        z = tf.random.stateless_normal([global_batch, self.z_dim], seed)
        labels = tf.random.stateless_uniform(
            [global_batch], seed + tf.constant([0, 1 << 30]), 0, self.num_classes, tf.int32)
        local = global_batch // collectives.num_replicas()
        start = collectives.replica_id() * local
        return z[start:start + local], labels[start:start + local]

    def _discriminator_gradients(self, real, real_labels, fake, fake_labels, scale):
        """One discriminator update's gradients and mean loss (compiled with XLA if asked)."""
        local = tf.shape(real)[0]
        d_vars = self.discriminator.trainable_variables
        with tf.GradientTape() as tape:
            logits = self.discriminator(
                [tf.concat([real, tf.cast(fake, real.dtype)], 0),
                 tf.concat([real_labels, fake_labels], 0)], training=True)
            logits = tf.cast(logits, tf.float32)
            per_example = hinge_d_loss(logits[:local], logits[local:])
            d_loss = tf.reduce_sum(per_example) * scale
        return tape.gradient(d_loss, d_vars), tf.reduce_mean(per_example)

    def train_step(self, data):
        if not self.jit_compile:
            return self._sngan_step(data, self._discriminator_gradients)
        # XLA: the discriminator update's gradients compiled whole per replica; the
        # generator's layers one by one (its batch norm all-reduces, outside XLA);
        # the optimizers' applies outside XLA.
        if self._jit_discriminator_gradients is None:
            self._jit_discriminator_gradients = xla.replica_jit(self._discriminator_gradients)
        with xla.compile_layers(self.generator, self.discriminator):
            return self._sngan_step(data, self._jit_discriminator_gradients)

    def _sngan_step(self, data, d_gradients):
        images, labels = data[0], data[1]
        labels = tf.reshape(tf.cast(labels, tf.int32), [-1])
        tf.debugging.assert_non_negative(labels, message="SNGAN: a label is negative.")
        tf.debugging.assert_less(
            labels, self.num_classes,
            message=f"SNGAN: a label is outside the {self.num_classes} classes [0, {self.num_classes}).")
        local_total = tf.shape(images)[0]
        tf.debugging.assert_equal(
            local_total % self.n_dis, 0,
            message=f"Each replica's batch must be a multiple of n_dis={self.n_dis}: batch the "
            "data with n_dis * global_batch_size (see sngan.digits_dataset).")
        local = local_total // self.n_dis
        global_batch = local * collectives.num_replicas()
        scale = 1.0 / tf.cast(global_batch, tf.float32)

        d_vars = self.discriminator.trainable_variables
        g_vars = self.generator.trainable_variables
        d_losses = []
        for i in range(self.n_dis):
            z, fake_labels = self._latents(global_batch, i)
            fake = tf.stop_gradient(self.generator([z, fake_labels], training=True))
            grads, d_loss = d_gradients(
                images[i::self.n_dis], labels[i::self.n_dis], fake, fake_labels, scale)
            self.d_optimizer.apply(grads, d_vars)
            d_losses.append(d_loss)

        z, fake_labels = self._latents(global_batch, self.n_dis)
        with tf.GradientTape() as tape:
            fake = self.generator([z, fake_labels], training=True)
            logits = tf.cast(self.discriminator([fake, fake_labels], training=True), tf.float32)
            per_example = hinge_g_loss(logits)
            g_loss = tf.reduce_sum(per_example) * scale
        grads = tape.gradient(g_loss, g_vars)
        self.g_optimizer.apply(grads, g_vars)
        if self.ema_weights:
            # Warmed up as tf.train.ExponentialMovingAverage(num_updates=t): the average
            # forgets the initial weights within a short run too.
            t = tf.cast(self.g_optimizer.iterations, tf.float32)
            decay = tf.minimum(tf.constant(self.ema_decay, tf.float32), (1.0 + t) / (10.0 + t))
            for ema, w in zip(self.ema_weights, g_vars):
                ema.assign(decay * ema + (1.0 - decay) * tf.cast(w, ema.dtype))

        self.d_loss_tracker.update_state(tf.add_n(d_losses) / self.n_dis)
        self.g_loss_tracker.update_state(tf.reduce_mean(per_example))
        return {m.name: m.result() for m in self.metrics}

    def get_config(self) -> dict:
        return {
            "generator": keras.saving.serialize_keras_object(self.generator),
            "discriminator": keras.saving.serialize_keras_object(self.discriminator),
            "num_classes": self.num_classes,
            "n_dis": self.n_dis,
            "ema_decay": self.ema_decay,
            "seed": self.seed,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config: dict) -> SNGAN:
        config = dict(config)
        config["generator"] = keras.saving.deserialize_keras_object(config["generator"])
        config["discriminator"] = keras.saving.deserialize_keras_object(config["discriminator"])
        return cls(**config)


keras.saving.register_keras_serializable(package="keras_replicator")(SNGAN)
