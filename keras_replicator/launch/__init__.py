"""Starting a multi-worker job: worker processes on one or several machines, or Kubernetes pods.

`launch` (``keras-replicator launch``) runs one training script as ``N``
worker processes on this machine, each with its own ``TF_CONFIG`` on free ports
of ``127.0.0.1``: the quickest way to try multi-worker code, and the way the test
suite runs it. With ``hosts`` it starts one node's share of a job spanning
several machines. It forwards stop signals to its workers, restarts a failed
job, and writes per-worker logs. `k8s_manifest` (``keras-replicator k8s``) writes the same job
as a Kubernetes JobSet (or a Kubeflow ``TFJob`` or ``TrainJob``).

The package, one concept per module:

| module | what it holds |
| --- | --- |
| `addresses` | the ``host:port`` parser and formatter, free ports, ``TF_CONFIG``, static host lists |
| `environment` | the environment variables every launched worker gets |
| `config` | what to launch, checked before any work |
| `tcp_rendezvous` | the TCP rendezvous of ``nnodes``/``master`` |
| `gpus` | which GPUs each local worker sees |
| `supervisor` | starting, waiting for, stopping and restarting the worker processes |
| `api` | `launch`, the entry point |
| `kubernetes` | Kubernetes manifests: a JobSet, a TFJob, a TrainJob with its runtime |

Security: TensorFlow's gRPC workers are unauthenticated; anyone who can reach
a worker's port can run operations in it. The launcher therefore gives its
workers ``127.0.0.1`` addresses (and probes free ports there) unless told
otherwise, so their traffic stays on the machine. TensorFlow 2.21's server
itself listens on its port on every interface, whatever the address: on a
shared machine, firewall the ports; across machines, keep workers on a private
network.
"""

# No TensorFlow here (nor in anything imported): `keras-replicator launch` and `k8s`
# start in a fraction of a second; tests/test_launch.py checks it.
from keras_replicator.launch.addresses import (
    cluster_addresses,
    format_address,
    free_ports,
    parse_hosts,
    split_address,
    tf_config,
)
from keras_replicator.launch.api import launch
from keras_replicator.launch.config import LaunchConfig
from keras_replicator.launch.environment import (
    DEVICES_PER_WORKER_ENV,
    RESTART_COUNT_ENV,
    WORKER_INDEX_ENV,
)
from keras_replicator.launch.gpus import _detect_gpus, gpu_assignment  # noqa: F401 (private: tests)
from keras_replicator.launch.kubernetes import k8s_manifest
from keras_replicator.launch.supervisor import RestartPolicy
from keras_replicator.launch.tcp_rendezvous import rendezvous

__all__ = [
    "LaunchConfig",
    "RestartPolicy",
    "DEVICES_PER_WORKER_ENV",
    "RESTART_COUNT_ENV",
    "WORKER_INDEX_ENV",
    "cluster_addresses",
    "format_address",
    "free_ports",
    "gpu_assignment",
    "k8s_manifest",
    "launch",
    "parse_hosts",
    "rendezvous",
    "split_address",
    "tf_config",
]
