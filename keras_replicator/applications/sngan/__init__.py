"""Tutorial 2: the class-conditional SN-GAN (projection discriminator), replicated.

* `models`: `generator`, `discriminator`, `SNGANConfig`, `CONFIGS`
  (`"imagenet128"`: the reference widths; `"small32"`: 32x32, trains on a CPU;
  `"small16"`: 16x16, a quarter of small32's step).
* `training`: `SNGAN`, the two-optimizer hinge-loss step for `fit`.
* `data`: scikit-learn's digits and TFDS `imagenet2012` at 128x128.
* `config` and `builder`: the command's run as a `RunConfig` the command line fills,
  and the functions that make its parts from it (`python -m keras_replicator.applications.sngan`).

Example:
    ```python
    import keras_replicator as kr
    from keras_replicator.applications import sngan

    strategy = kr.ReplicatorStrategy()
    with strategy.scope():
        gan = sngan.SNGAN(sngan.generator("small32", 10), sngan.discriminator("small32", 10),
                          num_classes=10)
        gan.compile()
    ```
"""

from keras_replicator.applications.sngan.data import (
    DIGITS_CLASSES,
    digits,
    digits_dataset,
    imagenet_dataset,
    imagenet_input_fn,
    preprocess_imagenet,
)
from keras_replicator.applications.sngan.models import (
    CONFIGS,
    SNGANConfig,
    discriminator,
    generator,
    get_config,
)
from keras_replicator.applications.sngan.training import (
    SNGAN,
    default_optimizer,
    hinge_d_loss,
    hinge_g_loss,
)

__all__ = [
    "CONFIGS",
    "DIGITS_CLASSES",
    "SNGAN",
    "SNGANConfig",
    "default_optimizer",
    "digits",
    "digits_dataset",
    "discriminator",
    "generator",
    "get_config",
    "hinge_d_loss",
    "hinge_g_loss",
    "imagenet_dataset",
    "imagenet_input_fn",
    "preprocess_imagenet",
]
