"""Whether TensorFlow's oneDNN CPU kernels are on in this process.

Why: TensorFlow turns them on by itself only on x86 CPUs with AVX-512 VNNI,
AVX-VNNI or AMX (`TF_ENABLE_ONEDNN_OPTS` overrides that, read when TensorFlow
starts), and the kernels differ: oneDNN's convolution fails on an empty batch
(`keras_trainer`'s error names it), and TensorFlow's own input gradient of a
1x1 convolution on small maps measured 19.76x slower than oneDNN's
(`benchmarks/onednn.py`). The benchmarks record which ran.

What it reads: `tensorflow.python.util._pywrap_util_port.IsMklEnabled`.
Checked on TensorFlow 2.16-2.21.
"""

from __future__ import annotations

from tensorflow.python.util import _pywrap_util_port


def enabled() -> bool:
    """Whether TensorFlow runs its oneDNN kernels on CPUs in this process."""
    return bool(_pywrap_util_port.IsMklEnabled())
