"""Replica-context primitives: the MPI-like set of TF-Replicator.

Call them inside ``strategy.run`` or anywhere Keras runs per replica (``call``,
``train_step``). Outside a replica of a multi-replica strategy they behave as on
a single replica: ``all_reduce(x)`` is ``x``, ``replica_id()`` is 0. Only
``num_replicas()`` answers the job's count everywhere: in a strategy's scope it is
that strategy's replica count (1 outside any strategy). They accept a tensor or a
nested structure of tensors (reduced together, in one collective where TensorFlow
can pack them) and are differentiable.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from keras_replicator._compat import keras_xla, short_batches
from keras_replicator._validation import ArgumentError, check_int

_OPS = ("sum", "mean", "max", "min")


def _replica_context() -> tf.distribute.ReplicaContext | None:
    """The current replica context, or None in a cross-replica context."""
    return tf.distribute.get_replica_context()


def replicas_in_step() -> int:
    """Replicas taking part in the current step: 1 outside a replica function (internal).

    The primitives and global batch norm use this count, since outside a replica
    function they act as on one replica.
    """
    ctx = _replica_context()
    return 1 if ctx is None else int(ctx.num_replicas_in_sync)


def num_replicas() -> int:
    """Number of replicas of the job, across all workers.

    In a replica function, the replicas taking part in the current step; in a
    strategy's scope (a cross-replica context), that strategy's
    ``num_replicas_in_sync``. Outside any strategy it is 1.

    Example:
        ```python
        def replica_step(x):
            return kr.all_reduce(x, "sum") / kr.num_replicas()   # == mean

        with strategy.scope():
            global_batch = 32 * kr.num_replicas()   # 32 examples per replica
        ```
    """
    ctx = _replica_context()
    if ctx is None:  # cross-replica context: the strategy of the enclosing scope
        return int(tf.distribute.get_strategy().num_replicas_in_sync)
    return int(ctx.num_replicas_in_sync)


def replica_id() -> tf.Tensor:
    """This replica's global index, ``0 .. num_replicas() - 1``, as an int32 tensor.

    The index is global: on worker ``w`` with ``k`` replicas each, local replica
    ``i`` is ``w * k + i``.

    Example:
        ```python
        def replica_step(x):
            seed = kr.replica_id()        # a different seed per replica
            ...
        ```
    """
    ctx = _replica_context()
    if ctx is None:
        return tf.constant(0, tf.int32)
    rid = ctx.replica_id_in_sync_group
    return tf.cast(rid, tf.int32) if isinstance(rid, tf.Tensor) else tf.constant(rid, tf.int32)


def real_rows(x) -> tf.Tensor:
    """A boolean per row of ``x``: True for a real example, False for a padding row.

    A batch Keras reads (`fit`, `evaluate`, `predict`) with fewer rows than
    replicas gives each replica left without rows one padding row, which weighs
    nothing in the loss, Keras's metrics, batch normalization's statistics and
    `predict`'s output (docs/input.md); so does a custom loop's batch from
    ``distribute_dataset(..., padding=True)``. Code with effects of its own in a
    step (a custom loop's loss, a custom metric's `update_state`, a counter, a
    `train_step` of the model's own) masks it out with this (and divides by
    `global_real_rows`). Outside such a step every row is real.

    Example:
        ```python
        ids = np.arange(3)
        print(kr.real_rows(ids).numpy().tolist())   # [True, True, True]
        ```
    """
    state = short_batches.current()
    real = tf.constant(True) if state is None else state.rows > 0
    return tf.fill(tf.reshape(_batch_rows(x), [1]), real)


def global_real_rows(x) -> tf.Tensor:
    """The real examples of the step's global batch (all replicas, all workers), an int32 scalar.

    What a replica of a custom loop divides its loss sum by, so that the
    gradients summed over the replicas are one device's on the global batch:
    ``sum(per_example * real) / global_real_rows(x)``, with ``real`` the
    weights of `real_rows`. In a step run from a padded batch
    (``distribute_dataset(..., padding=True)``, the batches Keras reads) it is
    the batch's real rows; elsewhere ``x``'s rows times the replicas in the step
    (`tf.nn.compute_average_loss`'s default), and outside a replica ``x``'s rows.

    Example:
        ```python
        x = tf.ones((3, 2))
        print(int(kr.global_real_rows(x)))   # 3: one replica, every row real
        ```
    """
    state = short_batches.current()
    if state is None:
        return _batch_rows(x) * replicas_in_step()
    return tf.cast(state.total, tf.int32)


def _batch_rows(x) -> tf.Tensor:
    """The rows of ``x`` (a dense or ragged tensor, or an array), int32."""
    if isinstance(x, tf.RaggedTensor):
        return tf.cast(x.nrows(), tf.int32)
    return tf.shape(tf.convert_to_tensor(x), out_type=tf.int32)[0]


def _check_op(op: str) -> str:
    if not isinstance(op, str) or op.lower() not in _OPS:
        raise ArgumentError(f"op must be one of {_OPS}, got {op!r}.")
    return op.lower()


def check_group_size(group_size: int | None, n: int) -> int | None:
    """``group_size`` checked against ``n`` replicas (internal; grouped batch norm shares it).

    Returns ``None`` for "all replicas" (``None`` or ``n``), else ``group_size``,
    which must be a positive integer dividing ``n``.
    """
    if group_size is None or group_size == n:
        return None
    check_int("group_size", group_size, minimum=1)
    if n % group_size:
        raise ArgumentError(
            f"group_size={group_size} does not divide the number of replicas ({n}); "
            "groups are consecutive replicas of equal size."
        )
    return group_size


def all_reduce(x: Any, op: str = "sum", *, group_size: int | None = None) -> Any:
    """Reduces ``x`` across replicas; every replica gets the result.

    Example:
        ```python
        def replica_step(batch):
            grads = tape.gradient(loss, model.trainable_variables)
            grads = kr.all_reduce(grads, "mean")   # identical on every replica
        ```

    Args:
        x: a tensor or nested structure of tensors, same shapes on every replica.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        group_size: reduce only within groups of ``group_size`` consecutive
            replicas (replicas ``0..g-1``, ``g..2g-1``, ...), as grouped batch
            norm does. ``None`` reduces over all replicas.

    Returns:
        The reduced value, with the structure of ``x``.
    """
    op = _check_op(op)
    ctx = _replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return x
    n = ctx.num_replicas_in_sync
    group_size = check_group_size(group_size, n)
    keras_xla.refuse_collective_in_compiled("kr.all_reduce")
    if group_size is None and op in ("sum", "mean"):
        return ctx.all_reduce(op.upper(), x)
    # max/min and grouped reductions: gather every replica's value, then reduce
    # the relevant rows locally. Exact, and differentiable through all_gather.
    reducer = {
        "sum": tf.reduce_sum,
        "mean": tf.reduce_mean,
        "max": tf.reduce_max,
        "min": tf.reduce_min,
    }[op]

    def _one(t):
        t = tf.convert_to_tensor(t)
        stacked = ctx.all_gather(t[tf.newaxis], axis=0)  # [n, ...]
        if group_size is not None:
            start = (replica_id() // group_size) * group_size
            stacked = stacked[start : start + group_size]
        return reducer(stacked, axis=0)

    return tf.nest.map_structure(_one, x)


def all_gather(x: Any, axis: int = 0) -> Any:
    """Concatenates every replica's ``x`` along ``axis``, in replica order.

    Example:
        ```python
        def replica_step(batch):
            logits = model(batch)
            everything = kr.all_gather(logits)   # [global_batch, classes]
        ```

    Args:
        x: a tensor or nested structure of tensors; shapes may differ only
            along ``axis``.
        axis: the axis to concatenate along.
    """
    ctx = _replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return x
    keras_xla.refuse_collective_in_compiled("kr.all_gather")
    return ctx.all_gather(x, axis=axis)


def broadcast(x: Any, source_replica: int = 0) -> Any:
    """Every replica gets ``source_replica``'s value of ``x``.

    Example:
        ```python
        def replica_step():
            noise = tf.random.normal([8])
            return kr.broadcast(noise, source_replica=0)   # same noise everywhere
        ```

    Args:
        x: a tensor or nested structure of tensors, same shapes on every replica.
        source_replica: the global index of the replica whose value is sent.
    """
    n = replicas_in_step()
    check_int("source_replica", source_replica, minimum=0, maximum=n - 1)
    if n == 1:
        return x
    is_source = tf.equal(replica_id(), source_replica)
    # A masked sum: exact for every dtype, and NaN/Inf on other replicas cannot leak in.
    masked = tf.nest.map_structure(
        lambda t: tf.where(is_source, t, tf.zeros_like(t)), tf.nest.map_structure(tf.convert_to_tensor, x)
    )
    return all_reduce(masked, "sum")
