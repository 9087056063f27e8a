"""Keras layers under a `LayoutMap`: sharded weights, the parallel layer rules, unsharded saving.

Patches (checked on Keras 3.15):

* `Layer.add_weight`, scoped (`ADD_WEIGHT`: the strategy's scope, or
  `ModelSharding.scope()`): the variable's path (Keras's name scope, as
  `add_weight` makes it) is resolved against the current `ModelSharding`'s
  `LayoutMap`, which makes k shard variables when the layout names the model axis.
* `Dense.call`, `EinsumDense.call`, `Embedding.call`, `MultiHeadAttention.call`,
  installed: a layer whose weight is a `ShardedVariable` computes on its shards
  (`model_parallel.parallel_layers`); `MultiHeadAttention` by heads when its
  Q/K/V kernels are split on the heads and its output kernel on its heads input.
  Other layers, and these with LoRA, quantization or a gate, use the whole tensor.
* `TFOptimizer.add_variable_from_reference`, installed: a shard's slots are made
  under its placement (a strategy colocates them anyway; eagerly without one, a
  colocation is ignored).
* `Trainer.compile` (when the model is built) and
  `TensorFlowTrainer._maybe_symbolic_build` (the first `fit`, `evaluate`, `predict`),
  installed, under a strategy with a `layout_map`: the earliest points where every
  variable exists, so a rule that matched none warns there (`LayoutWarning`), or
  raises with `strict_layouts=True`, before any step.
* `Layer.get_weights`, `set_weights`, `save_own_variables`,
  `load_own_variables`, `_check_load_own_variables`, installed: while they run,
  the layers' variable lists (`_trainable_variables`, `_non_trainable_variables`)
  hold each `ShardedVariable` at its first shard's place instead of its shards, so
  `get_weights` returns whole arrays and `.weights.h5` / `model.save` files have
  the unsharded format: a model saved from a mesh loads on one device and back.

Each acts only on layers holding a `ShardedVariable`, which only a keras_replicator
strategy's layouts (or `ModelSharding.scope()`) make.

The optimizer's slots of shards, and `tf.train.Checkpoint`, are saved whole too:
`_compat/sharded_checkpoints.py`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator

import keras
from keras.src import backend as keras_backend
from keras.src.backend.common.name_scope import current_path
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
from keras.src.layers import Layer as _Layer
from keras.src.trainers.trainer import Trainer

from keras_replicator._compat import sharded_checkpoints
from keras_replicator._compat.model_parallel_hooks import mp
from keras_replicator._compat.patching import Patches, ScopedPatch
from keras_replicator.errors import LayoutError

_POSITIONAL = ("shape", "initializer", "dtype")


def variable_path(layer, name: str) -> str:
    """The path `layer.add_weight(name=name)` gives its variable (Keras's name scope)."""
    with keras.name_scope(layer.name, caller=layer):
        parent = current_path()
    return f"{parent}/{name}" if parent else name


def _sharded_add_weight(original):
    def add_weight(self, *args, **kwargs):
        model_sharding = mp.sharding.current()
        if model_sharding is None or len(args) > len(_POSITIONAL):
            return original(self, *args, **kwargs)
        kwargs.update(zip(_POSITIONAL, args))
        name = kwargs.get("name")
        if name is None:
            variable = original(self, **kwargs)
            layout = model_sharding.rules.resolve(variable.path, variable.shape)
            rules = model_sharding.rules
            if layout is not None and (layout.sharded or (rules.data_axis in layout.axes and rules.data_size > 1)):
                raise LayoutError(
                    f"LayoutMap rule {layout.rule!r} shards the unnamed variable {variable.path!r}: "
                    "give it a name (add_weight(name=...)) so its path is known when it is made."
                )
            return variable
        return model_sharding.add_weight(self, original, variable_path(self, name), kwargs)

    return add_weight


def _sharded(layer, attribute: str) -> mp.ShardedVariable | None:
    value = layer.__dict__.get(attribute)
    if not isinstance(value, mp.ShardedVariable):
        return None
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return None
    if getattr(value, "data_axis", None) is not None:
        return None  # also split over the replicas (FSDP): the rules would read a slice; use it gathered
    return value


def _dense_call(original):
    def call(self, inputs, training=None):
        kernel = _sharded(self, "_kernel")
        if kernel is not None:
            return mp.parallel_layers.dense(inputs, kernel, self.bias, self.activation)
        return original(self, inputs, training=training)

    return call


def _einsum_dense_call(original):
    def call(self, inputs, training=None):
        kernel = _sharded(self, "_kernel")
        if kernel is not None:
            y = mp.parallel_layers.einsum_dense(self.equation, inputs, kernel, self.bias, self.activation)
            if y is not None:
                return y
        return original(self, inputs, training=training)

    return call


def _embedding_call(original):
    def call(self, inputs):
        table = _sharded(self, "_embeddings")
        if table is not None:
            return mp.parallel_layers.embedding(inputs, table, self.compute_dtype)
        return original(self, inputs)

    return call


def _heads_sharded(mha) -> bool:
    """Whether Q/K/V kernels split their output's heads axis (-2) and the output kernel its input's."""
    if getattr(mha, "_use_gate", False):
        return False
    counts = set()
    for dense, side in ((mha.query_dense, "out"), (mha.key_dense, "out"), (mha.value_dense, "out"),
                        (mha.output_dense, "in")):
        kernel = _sharded(dense, "_kernel")
        if kernel is None:
            return False
        counts.add(kernel.num_shards)
        inputs, output = dense.equation.split("->")
        x_spec, kernel_spec = inputs.split(",")
        spec = output if side == "out" else x_spec
        letter = kernel_spec[kernel.axis]
        if letter not in spec or len(spec) - spec.index(letter) != 2:
            return False
    return len(counts) == 1


def _bias_slice(bias, j: int, k: int):
    """Head shard j of a Q/K/V bias, whose heads axis is -2 when it has one."""
    if bias is None:
        return None
    bias = keras.ops.convert_to_tensor(bias)
    if len(bias.shape) < 2:
        return bias
    return keras.ops.split(bias, k, axis=-2)[j]



@functools.cache
def _takes_scores_argument() -> bool:
    """Keras 3.12+'s `MultiHeadAttention._compute_attention` takes `return_attention_scores`
    (3.8-3.11: always returns the scores)."""
    return "return_attention_scores" in inspect.signature(
        keras.layers.MultiHeadAttention._compute_attention).parameters


def _scores_argument(return_attention_scores) -> dict:
    return {"return_attention_scores": return_attention_scores} if _takes_scores_argument() else {}

def _attention_by_heads(self, query, value, key, attention_mask, training, return_attention_scores,
                        use_causal_mask):
    """Megatron's attention: each logical device computes its heads; one add_n at the end."""
    query_mask = keras_backend.get_keras_mask(query)
    for tensor in (query, value, key):
        keras_backend.set_keras_mask(tensor, None)
    attention_mask = self._compute_attention_mask(
        query, value, query_mask=query_mask, value_mask=None, key_mask=None,
        attention_mask=attention_mask, use_causal_mask=use_causal_mask)
    per_head = {}
    for name, dense, x in (("q", self.query_dense, query), ("k", self.key_dense, key),
                           ("v", self.value_dense, value)):
        kernel = dense.__dict__["_kernel"]
        parts = mp.parallel_layers.column_parallel_einsum(dense.equation, x, kernel)
        per_head[name] = []
        for j, part in enumerate(parts):
            bias = _bias_slice(dense.bias, j, kernel.num_shards)
            with kernel.placement.ops(j):
                per_head[name].append(part if bias is None else keras.ops.add(part, bias))
    output_kernel = self.output_dense.__dict__["_kernel"]
    outputs, scores = [], []
    for j in range(output_kernel.num_shards):
        with output_kernel.placement.ops(j):
            out, score = self._compute_attention(per_head["q"][j], per_head["k"][j], per_head["v"][j],
                                                 attention_mask, training, **_scores_argument(
                                                     return_attention_scores))
        outputs.append(out)
        scores.append(score)
    y = mp.parallel_layers.row_parallel_einsum(self.output_dense.equation, outputs, output_kernel)
    if self.output_dense.bias is not None:
        y = keras.ops.add(y, self.output_dense.bias)
    if query_mask is not None:
        keras_backend.set_keras_mask(y, query_mask)
    if return_attention_scores:
        return y, keras.ops.concatenate(scores, axis=1)
    return y


def _attention_call(original):
    def call(self, query, value, key=None, query_mask=None, value_mask=None, key_mask=None,
             attention_mask=None, return_attention_scores=False, training=None, use_causal_mask=False):
        if value_mask is None and key_mask is None and _heads_sharded(self):
            return _attention_by_heads(self, query, value, value if key is None else key, attention_mask,
                                       training, return_attention_scores, use_causal_mask)
        return original(self, query, value, key=key, query_mask=query_mask, value_mask=value_mask,
                        key_mask=key_mask, attention_mask=attention_mask,
                        return_attention_scores=return_attention_scores, training=training,
                        use_causal_mask=use_causal_mask)

    return call


@contextlib.contextmanager
def whole_variables(root) -> Iterator[None]:
    """While inside, `root`'s layers list each `ShardedVariable` in place of its shards."""
    if not mp.sharding.created_any.is_set() or not isinstance(root, _Layer):
        yield
        return
    swapped = []
    try:
        for layer in root._flatten_layers(include_self=True, recursive=True):
            groups = {id(s): v for v in mp.sharding.sharded_variables(layer) for s in v.shards}
            if not groups:
                continue
            for attribute in ("_trainable_variables", "_non_trainable_variables"):
                before = layer.__dict__[attribute]
                after, seen = [], set()
                for variable in before:
                    whole = groups.get(id(variable), variable)
                    if id(whole) not in seen:
                        seen.add(id(whole))
                        after.append(whole)
                swapped.append((layer, attribute, before))
                layer.__dict__[attribute] = after
        yield
    finally:
        for layer, attribute, before in reversed(swapped):
            layer.__dict__[attribute] = before


def _slot_beside_shard(original):
    def add_variable_from_reference(self, reference_variable, *args, **kwargs):
        home = mp.sharding.shard_home(reference_variable)
        if home is None:
            return original(self, reference_variable, *args, **kwargs)
        placement, j = home
        # TensorFlow's strategies colocate a slot with its variable; without one,
        # an eager colocation is ignored, so the shard's device is set here too.
        with placement.variables(j):
            slot = original(self, reference_variable, *args, **kwargs)
        mp.fsdp.mark_like(slot, reference_variable)  # a slot of a variable split over the replicas is too
        mp.whole_state.record_slot(slot, reference_variable)  # saved whole with its shards' others
        return slot

    return add_variable_from_reference


def _check_rules(model, where: str) -> None:
    model_sharding = getattr(getattr(model, "distribute_strategy", None), "model_sharding", None)
    if model_sharding is not None:
        model_sharding.check_rules(where)  # LayoutWarning, or LayoutError with strict_layouts=True
        mp.fsdp.check_optimizer(model)


def _check_at_compile(original):
    def compile(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if self.built:
            _check_rules(self, "compile (the model was built)")
        return result

    return compile


def _check_after_build(original):
    def _maybe_symbolic_build(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        _check_rules(self, "the first fit, evaluate or predict (once Keras built the model)")
        # The optimizer is built now: a tf.train.Checkpoint's values waiting for its slots.
        sharded_checkpoints.restore_waiting(getattr(self, "optimizer", None))
        return result

    return _maybe_symbolic_build


def _whole(original):
    def method(self, *args, **kwargs):
        with whole_variables(self):
            return original(self, *args, **kwargs)

    return method


ADD_WEIGHT = Patches([ScopedPatch(_Layer, "add_weight", _sharded_add_weight)])

PATCHES = [
    ScopedPatch(keras.layers.Dense, "call", _dense_call),
    ScopedPatch(keras.layers.EinsumDense, "call", _einsum_dense_call),
    ScopedPatch(keras.layers.Embedding, "call", _embedding_call),
    ScopedPatch(keras.layers.MultiHeadAttention, "call", _attention_call),
    ScopedPatch(TFOptimizer, "add_variable_from_reference", _slot_beside_shard),
    ScopedPatch(Trainer, "compile", _check_at_compile),
    ScopedPatch(TensorFlowTrainer, "_maybe_symbolic_build", _check_after_build),
    *(ScopedPatch(_Layer, name, _whole) for name in (
        "get_weights", "set_weights", "save_own_variables", "load_own_variables")),
    # From Keras 3.12 (absent before: nothing to patch there).
    ScopedPatch(_Layer, "_check_load_own_variables", _whole, optional=True),
    # Keras 3.8-3.11: the layers' own save/load_own_variables count the variables themselves
    # (3.12 moved that to `_check_load_own_variables`): they list whole variables too.
    *(ScopedPatch(cls, name, _whole)
      for cls in (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Embedding)
      for name in ("save_own_variables", "load_own_variables")
      if not hasattr(_Layer, "_check_load_own_variables") and name in vars(cls)),
]
