"""Every bad argument of the public surface raises kr.errors.ArgumentError, before any work.

docs/troubleshooting.md promises it: one table of (call, the bad argument) over the strategy's
neighbours (collectives, data, layers, optimizers, schedules, testing, cluster), the launcher
and its Kubernetes manifests, and the applications' configs. No training: each call is refused
while it checks its arguments. ArgumentError is a ValueError and a TypeError, so code (and
tests) catching either keep working.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator import launch
from keras_replicator.applications import imagenet, tfds_input
from keras_replicator.applications.d4pg import networks
from keras_replicator.applications.resnet import model as resnet_model
from keras_replicator.applications.resnet import recipe
from keras_replicator.applications.sngan import metrics, models
from keras_replicator.launch import addresses, grace, kubernetes
from keras_replicator.launch import config as launch_config

HERE = __file__


def _dense():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def _dataset():
    return tf.data.Dataset.from_tensor_slices(np.zeros((8, 3), "float32"))


def _strategy():
    return kr.ReplicatorStrategy(["/cpu:0"])


# (what is wrong, the call): each call is refused with an ArgumentError naming the argument.
CASES = [
    # the strategy and its neighbours
    ("devices not a list", "devices", lambda: kr.ReplicatorStrategy(3)),
    ("simulate_devices(0)", "n", lambda: kr.simulate_devices(0)),
    ("all_reduce op", "op", lambda: kr.all_reduce(tf.constant(1.0), op="median")),
    ("distribute_dataset of a list", "distribute_dataset",
     lambda: _strategy().distribute_dataset([1, 2], global_batch_size=2)),
    ("both batch sizes", "global_batch_size",
     lambda: _strategy().distribute_dataset(_dataset(), global_batch_size=4, per_replica_batch_size=4)),
    ("distribute_dataset options", "options",
     lambda: kr.data.distribute_dataset(_strategy(), _dataset(), global_batch_size=4, options="x")),
    ("distribute_dataset strategy", "strategy",
     lambda: kr.data.distribute_dataset("mirrored", _dataset(), global_batch_size=4)),
    ("CrossReplicaOptimizer of a number", "optimizer", lambda: kr.CrossReplicaOptimizer(3)),
    ("CrossReplicaOptimizer twice", "twice",
     lambda: kr.CrossReplicaOptimizer(kr.CrossReplicaOptimizer(keras.optimizers.SGD()))),
    ("schedule alpha", "alpha",
     lambda: kr.schedules.LinearScalingWarmup(0.1, 256, decay="cosine", decay_steps=10, alpha=2.0)),
    ("schedule boundaries", "boundaries",
     lambda: kr.schedules.LinearScalingWarmup(0.1, 256, decay="step", boundaries=(5, 3))),
    ("batch norm momentum", "momentum", lambda: kr.layers.GlobalBatchNormalization(momentum=2.0)),
    ("spectral norm of a string", "SpectralNormalization",
     lambda: kr.layers.SpectralNormalization("dense")),
    ("convert a non-model", "convert_to_global_batch_norm",
     lambda: kr.layers.convert_to_global_batch_norm(object())),
    ("weights of two models", "weights",
     lambda: kr.testing.max_weight_difference(_dense(), [np.zeros(1)])),
    ("tf_config not a string", "tf_config", lambda: kr.cluster.tf_config_cluster(tf_config=3)),
    ("resolver of a dict", "cluster_resolver", lambda: kr.cluster.resolve_cluster({"a": 1})),
    # the launcher
    ("launch host", "host", lambda: launch.LaunchConfig(script=HERE, workers=2, host="")),
    ("launch args", "args", lambda: launch.LaunchConfig(script=HERE, workers=2, args=[1])),
    ("launch workers and hosts", "hosts",
     lambda: launch.LaunchConfig(script=HERE, workers=2, hosts="a:1,b:1", node_rank=0)),
    ("launch nothing to run on", "workers", lambda: launch.LaunchConfig(script=HERE)),
    ("worker range", "MIN <= MAX", lambda: launch_config.parse_worker_range("4:1")),
    ("address", "host:port", lambda: addresses.split_address("localhost")),
    ("port range", "65535", lambda: addresses.split_address("localhost:70000")),
    ("hosts spec", "host:count", lambda: addresses.parse_hosts("a:1,b")),
    ("grace", "save_seconds", lambda: grace.grace_for(-1.0)),
    ("kubernetes kind", "kind",
     lambda: kubernetes.KubernetesJob(script="train.py", workers=2, image="img:1", kind="pod")),
    ("kubernetes image", "image",
     lambda: kubernetes.KubernetesJob(script="train.py", workers=2, image="")),
    ("kubernetes name", "name",
     lambda: kubernetes.KubernetesJob(script="train.py", workers=2, image="img:1", name="Bad_Name")),
    # the applications
    ("resnet input shape", "input_shape",
     lambda: resnet_model.resnet((2, 2), input_shape=(32, 32), num_classes=10)),
    ("weight decay of a non-model", "apply_weight_decay",
     lambda: resnet_model.apply_weight_decay("model", 1e-4)),
    ("recipe label smoothing", "label_smoothing",
     lambda: recipe.Recipe(global_batch_size=256, label_smoothing=1.5)),
    ("imagenet crop fraction", "crop_fraction",
     lambda: imagenet.preprocess_for_eval(tf.zeros((8, 8, 3)), crop_fraction=2.0)),
    ("tfds name", "name", lambda: tfds_input.sharded_dataset("", "train", training=False)),
    ("sngan config", "configuration", lambda: models.get_config("nope")),
    ("inception score shape", "probabilities",
     lambda: metrics.inception_score(np.ones((1, 3)), splits=2)),
    ("d4pg atoms", "v_min", lambda: networks.make_atoms(5.0, -5.0, 11)),
    ("d4pg bounds", "low and high", lambda: networks.make_policy(3, [2.0], [-2.0])),
]


@pytest.mark.parametrize("what,named,call", CASES, ids=[c[0] for c in CASES])
def test_a_bad_argument_is_an_argument_error(what, named, call):
    with pytest.raises(kr.errors.ArgumentError) as info:
        call()
    assert named in str(info.value), (what, str(info.value))
    # Code written against the plain types keeps working.
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)
