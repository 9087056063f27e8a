"""The install lines of the README and the docs work as written (issue 49).

* The README's install block runs from a fresh clone: its `git clone` (of this repository), its
  `cd`, and every `pip install` it shows.
* Every `pip install` the README and the guides show (in a ```bash block or inline) is run by pip
  from the clone's root with ``--dry-run --no-deps``: pip must accept the requirement (a path that
  is this project, the wheel `python -m build` wrote, a package of the registry), and every extra
  it names must be one the project provides (pip only warns about an unknown extra).
* The wheel `python -m build` writes is installed with ``--no-deps`` into a fresh venv that sees
  the suite's packages (TensorFlow, Keras) but not the clone, and the README's quickstart runs
  there from a folder outside the clone, with the installed `keras-replicator` command.

`--dry-run --no-deps` keeps these tests to seconds: the extras' own requirements (TensorFlow's
CUDA wheels) are not downloaded. Needs `build` (the test extra) and the registry (pip's isolated
build fetches setuptools, as `python -m build` does for a user).
"""

import glob
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig

import pytest

from tests.helpers import ROOT, python_blocks

pytestmark = pytest.mark.devices(1)  # TensorFlow only in subprocesses

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_INLINE = re.compile(r"`(pip install [^`]+)`")


def _read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def _pages() -> list[str]:
    """The README, every page under docs/ (the API reference's too) and the published tutorials."""
    found = glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    found += glob.glob(os.path.join(ROOT, "docs", "tutorials", "*.ipynb"))
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in found)


def _page_text(page: str) -> str:
    """A page's text; for a notebook, its Markdown cells (where its install lines are)."""
    if not page.endswith(".ipynb"):
        return _read(page)
    cells = json.loads(_read(page))["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def pip_lines(text: str) -> list[str]:
    """Every `pip install ...` a page shows: the lines of its shell blocks, and inline code."""
    found = []
    for fence in _FENCE.finditer(text):
        if fence.group(1) in ("bash", "sh", "shell", ""):
            for line in fence.group(2).splitlines():
                line = line.split(" #", 1)[0].strip()
                if line.startswith("pip install"):
                    found.append(line)
    prose = _FENCE.sub("", text)
    found += [m.group(1).strip() for m in _INLINE.finditer(prose.replace("\n", " "))]
    return found


def _version() -> str:
    return re.search(r'^version = "([^"]+)"', _read("pyproject.toml"), re.M).group(1)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(args, cwd, timeout=600, env=None):
    result = subprocess.run(args, cwd=cwd, env=env or _env(), capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{args} failed in {cwd}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def _wheel_name() -> str:
    return f"keras_replicator-{_version()}-py3-none-any.whl"


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """The README's install block up to its first pip line: a clone, and the wheel built in it.

    The clone is of this repository's committed state (what a user clones), made by the
    README's own `git clone` line with the URL replaced by this checkout.
    """
    block = next(b.group(2) for b in _FENCE.finditer(_read("README.md")) if "git clone" in b.group(2))
    commands = [line.split(" #", 1)[0].strip() for line in block.splitlines()]
    assert commands[0].startswith("git clone ") and commands[1] == "cd keras_replicator", commands
    _, _, _url, folder = shlex.split(commands[0])
    assert folder == "keras_replicator"
    parent = tmp_path_factory.mktemp("user")
    _run(["git", "clone", "--quiet", ROOT, folder], cwd=parent)
    where = os.path.join(parent, folder)
    spec = importlib.util.find_spec("build")
    assert spec is not None, "`python -m build` needs `build`: install the test extra"
    # Where the suite finds `build` (its site-packages, or a folder on PYTHONPATH).
    found = os.path.dirname(os.path.dirname(spec.origin))
    _run([sys.executable, "-m", "build", "--outdir", "dist"], cwd=where,
         env={**_env(), "PYTHONPATH": found})
    return where


def test_pip_lines_are_found():
    page = "# T\n\n```bash\npip install \".[gpu]\"   # a comment\npython x.py\n```\n\nthen `pip install build`."
    assert pip_lines(page) == ['pip install ".[gpu]"', "pip install build"]
    readme = pip_lines(_read("README.md"))
    assert 'pip install ".[gpu]"' in readme and 'pip install ".[cpu]"' in readme
    assert f'pip install "dist/{_wheel_name()}[gpu]"' in readme
    # The reference pages and the tutorials are read too (their install lines were once wrong).
    pages = _pages()
    assert "docs/reference/applications.md" in pages and "docs/tutorials/03_d4pg_control.ipynb" in pages
    assert 'pip install ".[cpu,rl]"' in pip_lines(_page_text("docs/tutorials/03_d4pg_control.ipynb"))
    assert not [line for page in _pages() for line in pip_lines(_read(page))
                if "keras-replicator" in line or "./keras_replicator" in line], (
        "a pip line installs keras-replicator from the registry (there is no release) or from "
        "./keras_replicator (the package folder, not the project)")


def test_no_install_hint_names_a_release_that_does_not_exist():
    # The package's own messages ("install the rl extra: ...") and the tutorials say the same.
    sources = glob.glob(os.path.join(ROOT, "keras_replicator", "**", "*.py"), recursive=True)
    sources += glob.glob(os.path.join(ROOT, "tutorials", "*.ipynb"))
    found = [os.path.relpath(path, ROOT) for path in sources
             if re.search(r"pip install \\?[\"']keras-replicator\[", _read(path))]
    assert not found, f"pip install \"keras-replicator[...]\" (no release on PyPI) in {found}"


def test_python_m_build_writes_the_wheel_the_readme_names(clone):
    assert os.path.exists(os.path.join(clone, "dist", _wheel_name())), os.listdir(os.path.join(clone, "dist"))


def _dry_run(args: list[str], cwd: str, report: str) -> list[dict]:
    _run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
          "--quiet", "--report", report, *args], cwd=cwd)
    with open(report, encoding="utf-8") as f:
        return json.load(f)["install"]


def _target(arg: str) -> str:
    """A pip argument without its extras: `.[gpu,hub]` -> `.`."""
    return re.sub(r"\[[^\]]*\]$", "", arg)


def _extras(arg: str) -> set[str]:
    found = re.search(r"\[([^\]]*)\]$", arg)
    return {e.strip() for e in found.group(1).split(",")} if found else set()


def test_every_pip_line_of_the_docs_installs_from_the_clone(clone, tmp_path):
    # One pip run per target (the clone, the wheel, a registry package) with every line's
    # arguments for it: pip parses each, builds the project's metadata once, and merges extras.
    lines = sorted({line for page in _pages() for line in pip_lines(_page_text(page))})
    by_target: dict[str, list[str]] = {}
    for line in lines:
        for arg in shlex.split(line)[2:]:
            if not arg.startswith("-"):  # pip's options (`--dry-run`) are not requirements
                by_target.setdefault(_target(arg), []).append(arg)
    provided = {}
    for i, (target, args) in enumerate(sorted(by_target.items())):
        installs = _dry_run(sorted(set(args)), clone, str(tmp_path / f"report{i}.json"))
        assert len(installs) == 1, f"{args}: pip would install {[x['metadata']['name'] for x in installs]}"
        provided[target] = (installs[0]["metadata"]["name"], set(installs[0]["metadata"].get("provides_extra", [])))
    assert provided["."][0] == "keras-replicator" and {"cpu", "gpu"} <= provided["."][1]
    wrong = [(line, arg) for line in lines for arg in shlex.split(line)[2:]
             if not arg.startswith("-") and not _extras(arg) <= provided[_target(arg)][1]]
    assert not wrong, f"extras the project does not provide: {wrong}"


def _fresh_venv(path: str) -> str:
    """A venv of the suite's interpreter without pip, and its python."""
    _run([sys.executable, "-m", "venv", "--without-pip", path], cwd=os.path.dirname(path))
    return os.path.join(path, "bin", "python")


def test_the_wheel_installs_and_runs_the_quickstart_outside_the_clone(clone, tmp_path):
    python = _fresh_venv(str(tmp_path / "venv"))
    wheel = os.path.join(clone, "dist", _wheel_name())
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--quiet", wheel],
         cwd=str(tmp_path))
    # Then the suite's packages (TensorFlow, Keras, NumPy) become visible, after the venv's own.
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                cwd=str(tmp_path)).stdout.strip()
    suite_sites = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    with open(os.path.join(site, "_suite_packages.pth"), "w", encoding="utf-8") as f:
        f.write("\n".join(sorted(suite_sites)) + "\n")
    work = tmp_path / "my_project"
    work.mkdir()
    quickstart = python_blocks("README.md")[0]
    assert "model.fit" in quickstart
    (work / "quickstart.py").write_text(quickstart + "\nprint('from', kr.__file__)\n")
    result = _run([python, "quickstart.py"], cwd=str(work))
    assert "loss" in result.stdout
    assert f"from {site}{os.sep}keras_replicator" in result.stdout, result.stdout[-500:]  # the wheel's
    command = _run([os.path.join(os.path.dirname(python), "keras-replicator"), "--help"], cwd=str(work))
    assert "launch" in command.stdout  # the console script the wheel installs
