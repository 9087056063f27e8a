"""Models, input pipelines and recipes of the tutorials, one module or package per family.

* `resnet50`, `resnet`, `apply_weight_decay` (package
  `keras_replicator.applications.resnet`: `model.py` the network, `recipe.py`
  the large-batch recipe `Recipe` and `mixed_precision_policy`): ResNet v1.5
  with global batch norm, zero-initialised residual gammas and weight decay on
  kernels only.
* `keras_replicator.applications.imagenet`: the ImageNet input pipeline (TFDS
  `imagenet2012`, Inception-style crops), shared by the tutorials that train on
  ImageNet.
* `keras_replicator.applications.tfds_input`: any TFDS data set read by file
  shards, one share per input pipeline, with per-example seeds.
* `keras_replicator.applications.d4pg`: D4PG (tutorial 3), Ray actors feeding a replicated
  learner; its environments and actors need the `rl` extra.
* `keras_replicator.applications.sngan`: the class-conditional SN-GAN of tutorial 2
  (models, the two-optimizer `SNGAN` step, digits/ImageNet data, FID and IS).

Example:
    ```python
    import keras_replicator as kr

    strategy = kr.ReplicatorStrategy()
    with strategy.scope():
        model = kr.applications.resnet50(num_classes=1000)
    ```
"""

from keras_replicator.applications import d4pg, imagenet, sngan, tfds_input
from keras_replicator.applications.resnet import (
    RESNET50_BLOCKS,
    apply_weight_decay,
    resnet,
    resnet50,
)

__all__ = [
    "RESNET50_BLOCKS",
    "apply_weight_decay",
    "d4pg",
    "imagenet",
    "resnet",
    "resnet50",
    "sngan",
    "tfds_input",
]
