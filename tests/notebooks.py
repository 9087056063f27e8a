"""Runs the tutorial notebooks: in smoke mode for the tests, and for real to publish them.

`python -m tests.notebooks publish [--smoke] [NAME ...]` (`make notebooks`) executes each
`tutorials/NN_*.ipynb` in a kernel of this interpreter, without `SMOKE` (each tutorial's
own run at the scale of this machine, on data available offline; `--smoke` for the tests'
few-step run), and writes the executed notebook, outputs included, to `docs/tutorials/`,
which the documentation site renders. The notebooks in `tutorials/` stay without outputs
(a test checks). Nothing is hand-edited: the published outputs are those of that run, with
this machine's paths replaced by placeholders (`strip_paths`).

`python -m tests.notebooks refresh NAME ...` copies the text (Markdown) cells of the
tutorials into their published copies without running them again, and refuses if any code
cell's source changed: so a sentence can be fixed without a rerun.
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
RUN_ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "2",
    # Figures as inline PNG outputs, whatever MPLBACKEND the caller has.
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    # Ray (tutorial 3) keeps every socket on 127.0.0.1.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}
SMOKE_ENV = {**RUN_ENV, "SMOKE": "1"}


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


def execute(path: str, *, env: dict | None = None, timeout: int = 900, smoke: bool = True):
    """Executes the notebook at `path` (in smoke mode unless `smoke=False`); returns it.

    Raises nbclient's `CellExecutionError` (with the cell and traceback) if a cell fails.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    saved = os.environ.get("JUPYTER_PATH")
    with tempfile.TemporaryDirectory() as tmp:
        base = SMOKE_ENV if smoke else RUN_ENV
        jupyter_path, kernel_name = _kernel(tmp, {**base, **(env or {})})
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


def machine_paths() -> dict[str, str]:
    """This machine's folders that outputs may name, longest first, and what replaces them."""
    import site

    places = {ROOT: ".", sys.prefix: "<python>", sys.base_prefix: "<python>",
              tempfile.gettempdir(): "<tmp>", os.path.expanduser("~"): "~"}
    places.update({p: "<site-packages>" for p in site.getsitepackages()})
    places = {os.path.realpath(k): v for k, v in places.items() if k and k != os.sep} | places
    return dict(sorted(places.items(), key=lambda kv: -len(kv[0])))


def strip_paths(nb) -> int:
    """Replaces this machine's paths (`machine_paths`) in `nb`'s outputs; returns how many."""
    places = machine_paths()
    count = 0

    def strip(text: str) -> str:
        nonlocal count
        for path, placeholder in places.items():
            count += text.count(path)
            text = text.replace(path, placeholder)
        return text

    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = strip(out["text"])
            if "traceback" in out:
                out["traceback"] = [strip(line) for line in out["traceback"]]
            data = out.get("data", {})
            for kind in ("text/plain", "text/html", "text/markdown"):
                if kind in data:
                    data[kind] = strip(data[kind] if isinstance(data[kind], str) else "".join(data[kind]))
    return count


def _tutorials(names: list[str]) -> list[str]:
    paths = sorted(glob.glob(os.path.join(TUTORIALS, "[0-9][0-9]_*.ipynb")))
    if names:
        paths = [p for p in paths if any(n in os.path.basename(p) for n in names)]
        if not paths:
            raise SystemExit(f"no tutorial matches {names}")
    return paths


def publish(names: list[str], *, smoke: bool = False) -> None:
    import time

    import nbformat

    if os.path.islink(PUBLISHED):
        raise SystemExit(f"{PUBLISHED} is a link: it must be a folder of its own, or the "
                         "tutorials themselves would get the outputs")
    os.makedirs(PUBLISHED, exist_ok=True)
    for path in _tutorials(names):
        mode = "SMOKE=1" if smoke else "its own run"
        print(f"executing {os.path.relpath(path, ROOT)} ({mode}) ...", flush=True)
        started = time.monotonic()
        nb = execute(path, smoke=smoke, timeout=3600)
        seconds = time.monotonic() - started
        for line in drop_runtime_log(nb):
            print(f"  not published (TensorFlow runtime log): {line}", flush=True)
        print(f"  {strip_paths(nb)} machine path(s) replaced by placeholders", flush=True)
        nb.metadata["keras_replicator"] = {
            "published_from": os.path.relpath(path, ROOT), "smoke": smoke,
            "run_seconds": round(seconds),
        }
        out = os.path.join(PUBLISHED, os.path.basename(path))
        nbformat.write(nb, out)
        print(f"wrote {os.path.relpath(out, ROOT)} ({seconds:.0f} s)", flush=True)


def refresh(names: list[str]) -> None:
    """Copies the Markdown cells of tutorials/ into the published copies, code unchanged."""
    import nbformat

    for path in _tutorials(names):
        out = os.path.join(PUBLISHED, os.path.basename(path))
        source, shown = nbformat.read(path, as_version=4), nbformat.read(out, as_version=4)
        kinds = [(c.cell_type, c.source if c.cell_type == "code" else None) for c in source.cells]
        if kinds != [(c.cell_type, c.source if c.cell_type == "code" else None) for c in shown.cells]:
            raise SystemExit(f"{os.path.basename(path)}: code cells changed, run `publish` instead")
        for mine, theirs in zip(source.cells, shown.cells):
            if mine.cell_type == "markdown":
                theirs.source = mine.source
        nbformat.write(shown, out)
        print(f"refreshed the text of {os.path.relpath(out, ROOT)}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["publish"]:
        publish([a for a in args[1:] if a != "--smoke"], smoke="--smoke" in args)
    elif args[:1] == ["refresh"] and args[1:]:
        refresh(args[1:])
    else:
        raise SystemExit("usage: python -m tests.notebooks publish [--smoke] [NAME ...]\n"
                         "       python -m tests.notebooks refresh NAME ...")
