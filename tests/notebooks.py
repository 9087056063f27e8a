"""Runs the tutorial notebooks in smoke mode: for the tests, and to publish them with outputs.

`python -m tests.notebooks publish [NAME ...]` (`make notebooks`) executes each
`tutorials/NN_*.ipynb` with `SMOKE=1` in a kernel of this interpreter and writes the
executed notebook, outputs included, to `docs/tutorials/`, which the documentation
site renders. The notebooks in `tutorials/` stay without outputs (a test checks).
Nothing is hand-edited: the published outputs are those of that run.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUTORIALS = os.path.join(ROOT, "tutorials")
PUBLISHED = os.path.join(ROOT, "docs", "tutorials")
SMOKE_ENV = {
    "SMOKE": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    # Figures as inline PNG outputs, whatever MPLBACKEND the caller has.
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    # Ray (tutorial 3) keeps every socket on 127.0.0.1.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}


def _kernel(folder: str, env: dict) -> tuple[str, str]:
    """A kernelspec for this interpreter (the project's venv), found through JUPYTER_PATH."""
    name = "keras-replicator-notebooks"
    spec_dir = os.path.join(folder, "jupyter", "kernels", name)
    os.makedirs(spec_dir)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "keras_replicator",
        "language": "python",
        "env": env,
    }
    with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
        json.dump(spec, f)
    return os.path.join(folder, "jupyter"), name


def execute(path: str, *, env: dict | None = None, timeout: int = 900):
    """Executes the notebook at `path` in smoke mode; returns it with its outputs.

    Raises nbclient's `CellExecutionError` (with the cell and traceback) if a cell fails.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    saved = os.environ.get("JUPYTER_PATH")
    with tempfile.TemporaryDirectory() as tmp:
        jupyter_path, kernel_name = _kernel(tmp, {**SMOKE_ENV, **(env or {})})
        os.environ["JUPYTER_PATH"] = jupyter_path
        try:
            client = NotebookClient(
                nb, kernel_name=kernel_name, timeout=timeout,
                resources={"metadata": {"path": os.path.dirname(path)}},
            )
            client.execute()
        finally:
            if saved is None:
                os.environ.pop("JUPYTER_PATH", None)
            else:
                os.environ["JUPYTER_PATH"] = saved
    return nb


def stream_text(nb) -> str:
    """Everything the notebook's code cells printed."""
    return "\n".join(
        out.get("text", "")
        for cell in nb.cells if cell.cell_type == "code"
        for out in cell.outputs if out.get("output_type") == "stream"
    )


def images(nb) -> list:
    """The PNG outputs of the notebook's code cells."""
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
            if "image/png" in out.get("data", {})]


# TensorFlow's C++ runtime logs (absl/glog format: "E0000 00:00:17954.. 2108 util.cc:131] ...")
# and absl's preamble go to the kernel's stderr. The tutorials set TF_CPP_MIN_LOG_LEVEL=2
# before TensorFlow starts, which silences the INFO and WARNING ones; what is left is
# ERROR-level notes about the host build ("oneDNN supports DT_INT32 only on platforms with
# AVX-512. Falling back ...") that say nothing about the tutorial, and level 3 would also
# hide real errors. So publishing drops those lines from the published copy (and prints
# them here); a real failure still shows as the cell's Python error.
RUNTIME_LOG_LINE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.-]+:\d+\] .*)$"
)


def runtime_log_lines(text: str) -> list[str]:
    """The lines of `text` that are TensorFlow's C++ runtime log, not the tutorial's output."""
    return [line for line in text.splitlines() if RUNTIME_LOG_LINE.match(line)]


def drop_runtime_log(nb) -> list[str]:
    """Removes TensorFlow's C++ runtime log lines from `nb`'s stderr outputs; returns them."""
    dropped = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept_outputs = []
        for out in cell.outputs:
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                lines = out["text"].splitlines(keepends=True)
                kept = [x for x in lines if not RUNTIME_LOG_LINE.match(x.rstrip("\n"))]
                dropped += [x.rstrip("\n") for x in lines if x not in kept]
                if not kept:
                    continue
                out["text"] = "".join(kept)
            kept_outputs.append(out)
        cell.outputs = kept_outputs
    return dropped


def publish(names: list[str]) -> None:
    import nbformat

    if os.path.islink(PUBLISHED):
        raise SystemExit(f"{PUBLISHED} is a link: it must be a folder of its own, or the "
                         "tutorials themselves would get the outputs")

    paths = sorted(glob.glob(os.path.join(TUTORIALS, "[0-9][0-9]_*.ipynb")))
    if names:
        paths = [p for p in paths if any(n in os.path.basename(p) for n in names)]
        if not paths:
            raise SystemExit(f"no tutorial matches {names}")
    os.makedirs(PUBLISHED, exist_ok=True)
    for path in paths:
        print(f"executing {os.path.relpath(path, ROOT)} (SMOKE=1) ...", flush=True)
        nb = execute(path)
        for line in drop_runtime_log(nb):
            print(f"  not published (TensorFlow runtime log): {line}", flush=True)
        nb.metadata["keras_replicator"] = {"published_from": os.path.relpath(path, ROOT), "smoke": True}
        out = os.path.join(PUBLISHED, os.path.basename(path))
        nbformat.write(nb, out)
        print(f"wrote {os.path.relpath(out, ROOT)}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "publish":
        raise SystemExit("usage: python -m tests.notebooks publish [NAME ...]")
    publish(sys.argv[2:])
