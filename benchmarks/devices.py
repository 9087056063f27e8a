"""A worker's devices and the strategy over them: stock ``MirroredStrategy`` or ours.

The simulated CPU device count must be set before TensorFlow starts, so a worker
calls :func:`setup_devices` first thing; TensorFlow is imported only inside the
functions.
"""

from __future__ import annotations


def setup_devices(devices: int | str) -> None:
    """An int: that many CPU devices (simulated), GPUs hidden; ``"gpu"``/``"gpu1"``: the GPUs."""
    if isinstance(devices, int):
        import tensorflow as tf

        if tf.config.list_physical_devices("GPU"):
            tf.config.set_visible_devices([], "GPU")
        if devices > 1:
            import keras_replicator as kr

            kr.simulate_devices(devices)


def device_names(devices: int | str) -> list[str]:
    """The names of the devices a spec's ``devices`` stands for."""
    import tensorflow as tf

    if devices == "gpu":
        return [d.name for d in tf.config.list_logical_devices("GPU")]
    return [d.name for d in tf.config.list_logical_devices("CPU")][: int(devices)]


def make_strategy(name: str, devices: list[str], cross_device_ops: str | None = None):
    """``stock`` / ``stock_default``: MirroredStrategy's default; ``stock_rtod``: with
    ReductionToOneDevice; ``ours_per_replica``: ReplicatorStrategy tracing the step
    once per replica (``trace_once=False``); ``ours``: ReplicatorStrategy, with its own choice of
    all-reduce unless ``cross_device_ops`` names one (``ring``, ``rtod``,
    ``hierarchical``, ``unpacked``: for investigations, not part of the plan)."""
    import tensorflow as tf

    import keras_replicator as kr

    if name in ("stock", "stock_default"):
        return tf.distribute.MirroredStrategy(devices)
    if name == "stock_rtod":
        return tf.distribute.MirroredStrategy(
            devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
        )
    if name == "ours_per_replica":
        # The engine before the step was traced once: one trace per replica.
        return kr.ReplicatorStrategy(devices, trace_once=False)
    if name == "ours":
        if cross_device_ops == "ring":
            return kr.ReplicatorStrategy(devices, communication="ring")
        ops = {
            None: None,
            "rtod": tf.distribute.ReductionToOneDevice(),
            "hierarchical": tf.distribute.HierarchicalCopyAllReduce(num_packs=1),
            # ours' default without packing: one reduction per tensor.
            "unpacked": tf.distribute.ReductionToOneDevice(
                accumulation_fn=kr.cross_device_ops.default_cross_device_ops(devices).accumulation_fn),
        }[cross_device_ops]
        return kr.ReplicatorStrategy(devices, cross_device_ops=ops)
    raise ValueError(f"unknown strategy {name!r}")


def build_in_scope(strategy, build):
    """``build()`` in ``strategy``'s scope, or in no scope when ``strategy`` is None."""
    if strategy is None:
        return build()
    with strategy.scope():
        return build()


def describe_cross_device_ops(strategy) -> str:
    """A short human-readable name of the strategy's cross-device reduction.

    For a `ReplicatorStrategy` whose step is traced once (the default), the all-reduce inside a
    step is its collective, not its `cross_device_ops` (which reduce outside steps): both are named.
    """
    extended = strategy.extended
    in_steps = extended.step_all_reduce() if hasattr(extended, "step_all_reduce") else None
    ops = getattr(extended, "_cross_device_ops", None)
    if in_steps is not None and in_steps is not ops:
        return f"{_describe_ops(in_steps)} in steps, {_describe_ops(ops)} outside them"
    return _describe_ops(ops)


def _describe_ops(ops) -> str:
    if ops is None:
        return "none"
    name = type(ops).__name__
    accumulate = getattr(ops, "accumulation_fn", None)
    if accumulate is not None and getattr(accumulate, "__name__", "add_n") != "add_n":
        return f"{name}(accumulation_fn={accumulate.__name__})"
    options = getattr(ops, "_options", None)
    impl = getattr(options, "implementation", None)
    if impl is not None:
        name += f"({getattr(impl, 'name', impl)})"
    return name
