"""ResNet for replicated training: the network (`model`) and its ImageNet recipe (`recipe`).

Tutorial 1 (ResNet-50 on ImageNet) uses both, with the data set's pipeline in
`keras_replicator.applications.imagenet`. `kr.applications.resnet` is the
`resnet` function (the package's name is shadowed there); import the recipe
from this package by its full name.

Example:
    ```python
    import keras_replicator as kr
    from keras_replicator.applications.resnet import Recipe

    strategy = kr.ReplicatorStrategy()
    recipe = Recipe(global_batch_size=256 * strategy.num_replicas_in_sync)
    with strategy.scope():
        model = kr.applications.resnet50(weight_decay=recipe.weight_decay)
        recipe.compile(model)
    ```
"""

from keras_replicator.applications.resnet.model import (
    RESNET50_BLOCKS,
    apply_weight_decay,
    resnet,
    resnet50,
)
from keras_replicator.applications.resnet.recipe import (
    LARGE_BATCH,
    REFERENCE_TOP1,
    Recipe,
    mixed_precision_policy,
)

__all__ = [
    "LARGE_BATCH",
    "REFERENCE_TOP1",
    "RESNET50_BLOCKS",
    "Recipe",
    "apply_weight_decay",
    "mixed_precision_policy",
    "resnet",
    "resnet50",
]
