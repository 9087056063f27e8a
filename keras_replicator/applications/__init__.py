"""Models and input pipelines of the tutorials, ready for replicated training.

* :func:`resnet50`, :func:`resnet`: ResNet v1.5 with global batch norm,
  zero-initialised residual gammas and weight decay on kernels only.
* :mod:`keras_replicator.applications.imagenet`: the ImageNet input pipeline
  (TFDS ``imagenet2012``, Inception-style crops) and the large-batch recipe.
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

from keras_replicator.applications import imagenet, sngan
from keras_replicator.applications.resnet import (
    RESNET50_BLOCKS,
    apply_weight_decay,
    resnet,
    resnet50,
)

__all__ = ["RESNET50_BLOCKS", "apply_weight_decay", "imagenet", "resnet", "resnet50", "sngan"]
