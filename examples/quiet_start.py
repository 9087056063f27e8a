"""TensorFlow's start-up lines that say nothing to a user, kept off a program's stderr.

On a machine without an NVIDIA GPU, TensorFlow's C++ runtime writes, before its logging is set
up (so ``TF_CPP_MIN_LOG_LEVEL`` does not reach them), ``WARNING: All log messages before
absl::InitializeLog() is called are written to STDERR``, the oneDNN notice, "Could not find cuda
drivers", and where a CUDA driver library exists without a GPU a red ``E0000 ... failed call to
cuInit``. `quiet_start` runs a block (importing TensorFlow, listing its devices) with the
process's stderr (file descriptor 2, where C++ writes) captured, then writes back every line
but those: real errors still show. Used by `make demo` (examples/demo.py) around its import of
keras_replicator (which imports TensorFlow) and `simulate_devices` (which lists the devices). A
program that must show everything its native code writes, should it crash there, does without it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

# The lines dropped: each is TensorFlow saying it found no GPU, or a notice about its own logging.
NOISE = re.compile(
    r"All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|failed call to cuInit"
    r"|cudart_stub\.cc:\d+\] Could not find cuda drivers"
    r"|cuda_executor\.cc:\d+\] .*(no CUDA-capable device|CUDA_ERROR_NO_DEVICE)"
    r"|port\.cc:\d+\] oneDNN custom operations are on"
)


@contextlib.contextmanager
def quiet_start():
    """Runs the block with file descriptor 2 captured, then writes back its lines but `NOISE`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                    if not NOISE.search(line)]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()
