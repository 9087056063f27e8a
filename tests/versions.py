"""The core subset (`pytest -m core`) on TensorFlow x Keras pairs, each in its own venv.

Usage: `python -m tests.versions [--ci | --pairs 2.16.2:3.8.0,2.19.1:3.10.0] [--json PATH] [--prepare]`
(`make test-versions` runs every pair of `keras_replicator.versions.PAIRS`; `.ci/run`
`--ci`: `versions.CI_PAIRS`, the oldest and TF 2.19.1 + Keras 3.10).

Each TensorFlow minor gets one venv, `.venvs/tf<minor>/` (`.venvs/tf2.16/`) (ignored by git;
`KR_VENVS` names another folder), made
with `python -m venv` and `pip install` of the pair pinned and the core subset's test
dependencies (pip's cache keeps a second run fast); the pair's Keras is installed into
it before the run (`pip install keras==...`: seconds), so one venv serves every Keras
on that TensorFlow. The package itself is imported from this checkout (`PYTHONPATH`),
not installed. KerasHub's core test runs where a keras-hub release supports the pair
(`hub_requirements`: Keras 3.15 with TensorFlow 2.20 or newer), in a venv of its own.

`--prepare` only makes the pairs' venvs (`.ci/run` makes them while the full suite runs: pip
waits on the network and the disk more than on the cores).

Each pair also checks pip: `pip install --dry-run ".[cpu]"` in its venv (which holds the pair)
must install keras-replicator and nothing else (it keeps the pair's TensorFlow and Keras).

Prints one line per pair (passed or failed, the tests passed/failed/skipped, minutes, venv
setup included) and a closing table; exits non-zero if any pair failed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `KR_VENVS` puts them elsewhere: `.ci/run` keeps them in the user's cache folder, so that a
# second CI run on the same machine reuses them (pip's cache is not kept here); made anew where absent.
VENVS = os.environ.get("KR_VENVS") or os.path.join(ROOT, ".venvs")
TEST_DEPENDENCIES = ("pytest>=7", "pytest-timeout>=2.1", "psutil>=5.9")
_CORE = "pytest.mark.core"


def _versions_module():
    """`keras_replicator.versions`, read without importing the package (no TensorFlow)."""
    import importlib.util

    sys.path.insert(0, ROOT)
    try:
        spec = importlib.util.spec_from_file_location(
            "_kr_versions", os.path.join(ROOT, "keras_replicator", "versions.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # (dataclasses look their module up)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.pop(0)


def core_files(with_hub: bool) -> list[str]:
    """The test modules that hold core tests (tests/test_kerashub.py only `with_hub`)."""
    files = []
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "test_*.py"))):
        with open(path, encoding="utf-8") as f:
            if _CORE not in f.read():
                continue
        if os.path.basename(path) == "test_kerashub.py" and not with_hub:
            continue
        files.append(os.path.relpath(path, ROOT))
    return files


def _pip(python: str, *args: str) -> None:
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args],
                   check=True)


def hub_requirements(tensorflow: str, keras: str) -> list[str]:
    """KerasHub's packages for the pair, where a keras-hub release supports it, else `[]`.

    keras-hub 0.32 (the `[hub]` extra) needs Keras 3.15 and a tensorflow-text built for
    TensorFlow 2.20 or newer (pyproject.toml's table); tensorflow-text pins its TensorFlow minor.
    """
    tf_minor = tuple(map(int, tensorflow.split(".")[:2]))
    if tf_minor < (2, 20) or tuple(map(int, keras.split(".")[:2])) < (3, 15):
        return []
    return ["keras-hub>=0.32", f"tensorflow-text~={tf_minor[0]}.{tf_minor[1]}.0"]


def venv_for(tensorflow: str, keras: str) -> str:
    """The venv's python for `tensorflow` with `keras` installed (made on first use).

    Pairs with KerasHub get their own venv (`tf2.20-hub/`): keras-hub left beside an older
    Keras would make the KerasHub test run where no keras-hub supports the pair.
    """
    hub = hub_requirements(tensorflow, keras)
    folder = os.path.join(VENVS, "tf" + ".".join(tensorflow.split(".")[:2]) + ("-hub" if hub else ""))
    python = os.path.join(folder, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", folder], check=True)
        _pip(python, f"tensorflow=={tensorflow}", f"keras=={keras}", *hub, *TEST_DEPENDENCIES)
    else:
        _pip(python, f"tensorflow=={tensorflow}", f"keras=={keras}", *hub)  # no-op when installed
    return python


def _has(python: str, module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", code]).returncode == 0


def pip_keeps(python: str) -> list[str]:
    """What `pip install --dry-run ".[cpu]"` would install in the venv of `python` (names)."""
    out = subprocess.run([python, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-",
                          "--disable-pip-version-check", ".[cpu]"], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    return sorted(item["metadata"]["name"] for item in json.loads(out.stdout)["install"])


_COUNTS = re.compile(r"^(\d+) passed, (\d+) failed, (\d+) skipped$")


def _run_core(python: str, files: list[str], env: dict) -> tuple[int, dict]:
    """Runs the core subset (its output passed through); its exit code and closing counts."""
    proc = subprocess.Popen([python, "-m", "tests.run_suite", "-m", "core", *files], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    counts = {}
    for line in proc.stdout:
        print(line, end="", flush=True)
        found = _COUNTS.match(line.strip())
        if found:
            counts = dict(zip(("tests_passed", "tests_failed", "tests_skipped"), map(int, found.groups())))
    return proc.wait(), counts


def run_pair(tensorflow: str, keras: str) -> dict:
    """Sets up the pair's venv and runs the core subset there; returns its result."""
    start = time.monotonic()
    python = venv_for(tensorflow, keras)
    setup = time.monotonic() - start
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    files = core_files(_has(python, "keras_hub"))
    code, counts = _run_core(python, files, env)
    minutes = round((time.monotonic() - start) / 60, 1)
    would_install = pip_keeps(python)
    return {"tensorflow": tensorflow, "keras": keras,
            "passed": code == 0 and would_install == ["keras-replicator"], **counts,
            "pip_would_install": would_install, "setup_minutes": round(setup / 60, 1),
            "minutes": minutes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", help="comma-separated tensorflow:keras versions (default: PAIRS)")
    parser.add_argument("--ci", action="store_true", help="the pairs CI runs (versions.CI_PAIRS)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--prepare", action="store_true", help="only make the pairs' venvs")
    args = parser.parse_args(argv)
    module = _versions_module()
    pairs = ([tuple(p.split(":")) for p in args.pairs.split(",")] if args.pairs
             else module.CI_PAIRS if args.ci else module.PAIRS)
    if args.prepare:
        for tensorflow, keras in pairs:
            start = time.monotonic()
            python = venv_for(tensorflow, keras)
            print(f"versions: {python} holds TF {tensorflow} + Keras {keras} "
                  f"({(time.monotonic() - start) / 60:.1f} min)", flush=True)
        return 0
    results = []
    for tensorflow, keras in pairs:
        result = run_pair(tensorflow, keras)
        results.append(result)
        print(f"versions: TF {tensorflow} + Keras {keras}: "
              f"{'passed' if result['passed'] else 'FAILED'} in {result['minutes']} min "
              f"(venv {result['setup_minutes']} min); pip would install {result['pip_would_install']}",
              flush=True)
    print("\n| TensorFlow | Keras | core subset | passed/failed/skipped | pip keeps the pair | "
          "minutes (venv) |\n|---|---|---|---|---|---|")
    for r in results:
        tests = "/".join(str(r.get(k, "?")) for k in ("tests_passed", "tests_failed", "tests_skipped"))
        print(f"| {r['tensorflow']} | {r['keras']} | {'passed' if r['passed'] else 'FAILED'} | {tests} | "
              f"{'yes' if r['pip_would_install'] == ['keras-replicator'] else r['pip_would_install']} | "
              f"{r['minutes']} ({r['setup_minutes']}) |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
