"""The machine a run measures on: its description (``env``) and its memory bandwidth (``memcopy``).

``memcopy`` is the scale of the all-reduce table: NumPy's copy of the same sizes.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_description() -> str:
    """The CPUs, the load average now (at a run's start) and Python's version, for a table's heading."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{os.cpu_count()} CPUs, load average {load:.1f} at the start, Python {platform.python_version()}"


def onednn_setting() -> str:
    """How the run asked for TensorFlow's oneDNN CPU kernels, for a table's heading: the
    ``TF_ENABLE_ONEDNN_OPTS`` its processes inherit, or TensorFlow's default for this CPU (on only
    with AVX-512 or AMX: ``python -m benchmarks.onednn`` measures both)."""
    value = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
    if value is None:
        return "oneDNN as TensorFlow's default for this CPU (TF_ENABLE_ONEDNN_OPTS unset)"
    return f"TF_ENABLE_ONEDNN_OPTS={value}"


def cpu_seconds() -> float | None:
    """User + system CPU time of this process and its finished children (Unix only)."""
    try:
        import resource
    except ImportError:
        return None
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def run_env(spec: dict[str, Any]) -> dict[str, Any]:
    """Versions, devices and the features this checkout has (layers, multi-worker)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_replicator as kr

    try:
        from keras_replicator import layers as kr_layers

        has_global_bn = hasattr(kr_layers, "GlobalBatchNormalization")
    except ImportError:
        has_global_bn = False
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": np.__version__,
        "keras_replicator": kr.__version__,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "physical_devices": [
            f"{d.device_type}:{d.name.split(':')[-1]}" for d in tf.config.list_physical_devices()
        ],
        "gpus": len(tf.config.list_physical_devices("GPU")),
        "global_batch_norm_available": has_global_bn,
    }


def run_memcopy(spec: dict[str, Any]) -> dict[str, Any]:
    """NumPy ``copyto`` bandwidth (bytes copied / time) for each size, in GB/s."""
    import numpy as np

    out = {}
    for mb in spec["sizes_mb"]:
        n = int(mb * 2**20) // 4
        src = np.random.default_rng(0).random(n, dtype=np.float32)
        dst = np.empty_like(src)
        reps = max(3, int(256 / mb))
        np.copyto(dst, src)
        samples = []
        for _ in range(spec["windows"]):
            t = time.perf_counter()
            for _ in range(reps):
                np.copyto(dst, src)
            samples.append(src.nbytes * reps / (time.perf_counter() - t) / 1e9)
        out[str(mb)] = {"gbps": statistics.median(samples), "samples": samples}
    return {"sizes": out}
