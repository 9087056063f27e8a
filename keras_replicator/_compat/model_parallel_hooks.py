"""What `_compat`'s layout and checkpoint patches call of `keras_replicator.model_parallel`.

`keras_replicator.model_parallel` hands its modules over when it is imported
(`register`, from its `__init__`), as `keras_replicator.keras_distribution` hands
`follow` to `_compat.keras_distribution`: no module of `_compat` imports the
public side, so there is no import cycle (tests/test_structure.py).

`mp.sharding`, `mp.fsdp`, `mp.parallel_layers`, `mp.whole_state` are those
modules and `mp.ShardedVariable` their variable class, once registered. Until
then (`keras_replicator.model_parallel` not imported: no layout can have made a
shard), the patches' gates read "nothing sharded": `mp.sharding.created_any` is
never set, `current()` is None, a layer has no sharded variables and nothing is
a `ShardedVariable`, so each patch leaves Keras's behaviour.

Example:
    ```python
    import keras_replicator.model_parallel  # registers its modules
    from keras_replicator._compat.model_parallel_hooks import mp

    mp.ShardedVariable.__name__  # 'ShardedVariable'
    ```
"""

from __future__ import annotations

import threading
import types
from typing import Any


class _NoShardedVariable:
    """Stands for `ShardedVariable` until it is registered: nothing is an instance of it."""


mp = types.SimpleNamespace(
    sharding=types.SimpleNamespace(created_any=threading.Event(), current=lambda: None,
                                   sharded_variables=lambda layer: []),
    fsdp=None, parallel_layers=None, whole_state=None, ShardedVariable=_NoShardedVariable,
)


def register(*, sharding: Any, fsdp: Any, parallel_layers: Any, whole_state: Any,
             sharded_variable: type) -> None:
    """Hands `keras_replicator.model_parallel`'s modules and `ShardedVariable` to `_compat`."""
    mp.sharding, mp.fsdp, mp.parallel_layers = sharding, fsdp, parallel_layers
    mp.whole_state, mp.ShardedVariable = whole_state, sharded_variable
