"""The configuration of an SN-GAN run: a logic-free dataclass the command line fills.

`python -m keras_replicator.applications.sngan` parses its flags into a `RunConfig`
(a flag left out takes its dataset's default, `__main__.DEFAULTS`); `builder` makes the
run's parts from it. The networks' own configuration is `models.SNGANConfig`.

Example:
    ```python
    from keras_replicator.applications.sngan.config import RunConfig

    config = RunConfig(dataset="digits", out="runs/digits", config="small16", global_batch_size=128,
                       steps=600, n_dis=1, learning_rate=1e-3, eval_every=100)
    ```
"""

from __future__ import annotations

import dataclasses

__all__ = ["RunConfig"]


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every choice of an SN-GAN run (checked by the command line, not here).

    Example:
        ```python
        config = RunConfig(dataset="digits", out="runs/digits", config="small16",
                           global_batch_size=128, steps=600, n_dis=1, learning_rate=1e-3,
                           eval_every=100)
        ```

    Attributes:
        dataset: ``"digits"`` or ``"imagenet2012"``.
        out: the run's folder (a rerun resumes from its checkpoint).
        config: the networks' configuration (``small16``, ``small32``, ``imagenet128``).
        global_batch_size: examples per discriminator update over all replicas.
        steps: generator updates in all (over resumes).
        n_dis: discriminator updates per generator update.
        learning_rate: Adam's, both networks.
        eval_every: generator updates between evaluations and checkpoints.
        data_dir: TFDS ``data_dir`` of imagenet2012.
        ch: base width of both networks (``None``: the configuration's).
        image_size: image side (``None``: the configuration's).
        replicas: replicas of this machine, or of each worker under the launcher.
        ema_decay: generator EMA decay (negative: no EMA).
        eval_samples: generated samples per evaluation.
        inception_weights: InceptionV3 weights for FID/IS on imagenet2012 (``None``: skipped).
        seed: seeds the networks, the latents and the data order.
        verbose: Keras's ``fit`` verbosity on the chief.
    """

    dataset: str
    out: str
    config: str
    global_batch_size: int
    steps: int
    n_dis: int
    learning_rate: float
    eval_every: int
    data_dir: str | None = None
    ch: int | None = None
    image_size: int | None = None
    replicas: int = 4
    ema_decay: float = 0.999
    eval_samples: int = 1000
    inception_weights: str | None = None
    seed: int = 0
    verbose: int = 2
