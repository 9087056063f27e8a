"""keras_replicator: replicated training for Keras 3 on TensorFlow.

Example:
    ```python
    import keras
    import keras_replicator as kr

    kr.simulate_devices(4)            # CPU-only machine: 4 logical devices
    strategy = kr.ReplicatorStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(10)])
        model.compile("adam", "sparse_categorical_crossentropy")
    ```
"""

import os
import sys

__version__ = "0.1.0"

# `keras-replicator` and `python -m keras_replicator` (the command line: launch, k8s,
# --help) import this package first and need no TensorFlow, so there the public
# surface is imported on first use (PEP 562). Everywhere else it is imported now, so
# that `import keras_replicator` registers the package's Keras objects before a
# `keras.saving.load_model`.
_COMMAND_LINE = sys.argv[:1] == ["-m"] or os.path.basename(sys.argv[0] if sys.argv else "") == (
    "keras-replicator"
)

if _COMMAND_LINE:

    def _public_names() -> set[str]:
        """`_api.__all__`, read from its source: importing `_api` would start TensorFlow."""
        import ast

        path = os.path.join(os.path.dirname(__file__), "_api.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__all__"]:
                return set(ast.literal_eval(node.value))
        return set()

    def __getattr__(name: str):
        if name.startswith("_") or name not in _public_names():
            # A submodule (`from keras_replicator import launch`) is then imported as usual.
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import importlib

        api = importlib.import_module("keras_replicator._api")
        globals().update({n: getattr(api, n) for n in api.__all__})
        return globals()[name]

else:
    from keras_replicator import versions

    # Below the supported range: one error naming the versions, the range, why and the fix.
    versions.refuse_unsupported()

    from keras_replicator import _api, _compat
    from keras_replicator._api import *  # noqa: F403

    __all__ = _api.__all__
    # The one patch an import makes: Keras's own API that fails or is ignored on
    # TensorFlow without it (keras.RematScope, keras.distribution.set_distribution).
    _compat.install_keras_api()
