"""Models and input pipelines of the tutorials, ready for replicated training.

* :func:`resnet50`, :func:`resnet`: ResNet v1.5 with global batch norm,
  zero-initialised residual gammas and weight decay on kernels only.
* :mod:`keras_replicator.applications.imagenet`: the ImageNet input pipeline
  (TFDS ``imagenet2012``, Inception-style crops) and the large-batch recipe.
* `keras_replicator.applications.d4pg`: D4PG (tutorial 3), Ray actors feeding a replicated
  learner; its environments and actors need the `rl` extra.

Example:
    ```python
    import keras_replicator as kr

    strategy = kr.ReplicatorStrategy()
    with strategy.scope():
        model = kr.applications.resnet50(num_classes=1000)
    ```
"""

from keras_replicator.applications import d4pg, imagenet
from keras_replicator.applications.resnet import (
    RESNET50_BLOCKS,
    apply_weight_decay,
    resnet,
    resnet50,
)

__all__ = ["RESNET50_BLOCKS", "apply_weight_decay", "d4pg", "imagenet", "resnet", "resnet50"]
