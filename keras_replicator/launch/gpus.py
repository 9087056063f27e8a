"""GPU assignment: which GPUs each local worker sees (``CUDA_VISIBLE_DEVICES``)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence


def _detect_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPUs this machine offers its workers: ``CUDA_VISIBLE_DEVICES`` if set, else ``nvidia-smi -L``."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [g.strip() for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, _ in enumerate(re.findall(r"^GPU \d+", listing, re.MULTILINE))]


def gpu_assignment(gpus: Sequence[str], local_workers: int) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` of each local worker: the GPUs split evenly, in order.

    ``None`` when there are no GPUs, or fewer GPUs than workers (the workers
    then share what they see, and ``CUDA_VISIBLE_DEVICES`` is left alone).

    Example:
        ```python
        from keras_replicator.launch import gpu_assignment
        gpu_assignment(["0", "1", "2", "3"], 2)   # ['0,1', '2,3']
        ```

    Args:
        gpus: the GPU ids (``CUDA_VISIBLE_DEVICES`` entries) of this machine.
        local_workers: the number of workers started on this machine.
    """
    gpus = list(gpus)
    if not gpus or len(gpus) < local_workers:
        return None
    k = len(gpus) // local_workers
    return [",".join(gpus[i * k : (i + 1) * k]) for i in range(local_workers)]

