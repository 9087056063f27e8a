"""The codebase's structure rules, checked: private APIs in `_compat`, versions in range."""

import ast
import os
import re

import pytest

from keras_replicator import _compat
from tests import conftest, run_suite

pytestmark = pytest.mark.devices(1)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "keras_replicator")
COMPAT = os.path.join(PACKAGE, "_compat")
# Private TensorFlow/Keras modules, and private attributes of TensorFlow/Keras objects.
PRIVATE_IMPORT = re.compile(r"\b(tensorflow\.python|keras\.src|tensorflow\.compiler|tensorflow\.tsl)\b")
# Names a keras_replicator subclass of a Keras/TensorFlow class may use: the
# subclassing API Keras's own wrappers (LossScaleOptimizer) and layers use.
SUBCLASS_API = {
    "_track_variable", "_iterations", "_variables", "_trainable_variables",
    "_get_variable_index", "_check_variables_are_known",
    # collections.namedtuple's public API
    "_fields", "_asdict", "_replace", "_make",
}
# Private names read by string, allowed: our own strategies' marker.
GETATTR_PRIVATE = re.compile(r"""getattr\([^,]+,\s*["'](_(?!keras_replicator\b)\w+)""")


def _package_files():
    for folder, _, files in os.walk(PACKAGE):
        if folder.startswith(COMPAT):
            continue
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(folder, name)


@pytest.mark.core
def test_installed_versions_are_within_the_checked_ranges():
    problems = _compat.unchecked_versions()
    assert not problems, "\n".join(problems)


def test_every_compat_module_has_a_checked_range():
    # patching and model_parallel_hooks touch no TensorFlow or Keras API (the patch mechanism; the
    # registry of model_parallel's modules for the layout patches).
    modules = {
        name[:-3] for name in os.listdir(COMPAT)
        if name.endswith(".py") and name not in ("__init__.py", "patching.py", "model_parallel_hooks.py")
    }
    assert modules == set(_compat.CHECKED), "keep _compat.CHECKED and its table in step with the modules"
    for module in modules:
        assert f"`{module}`" in _compat.__doc__, f"{module} is missing from the table in _compat/__init__.py"


def test_no_private_tensorflow_or_keras_imports_outside_compat():
    offenders = []
    for path in _package_files():
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                code = line.split("#")[0]
                if PRIVATE_IMPORT.search(code) and ("import" in code):
                    offenders.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not offenders, "private TensorFlow/Keras modules belong in keras_replicator/_compat:\n" + "\n".join(offenders)


def test_no_private_attributes_of_tensorflow_or_keras_objects_outside_compat():
    """`x._name` where `x` is not `self`/`cls` (our own objects) is a private read."""
    offenders = []
    for path in _package_files():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
                continue
            if node.attr.startswith("__") or node.attr in SUBCLASS_API:
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue  # our own object's attributes (a subclass's own state)
            if isinstance(base, ast.Name) and base.id in _OWN_MODULES:
                continue  # our own modules' private helpers
            offenders.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: .{node.attr}")
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                for name in GETATTR_PRIVATE.findall(line):
                    offenders.append(f"{os.path.relpath(path, ROOT)}:{number}: getattr(..., {name!r})")
    assert not offenders, "private attributes of TensorFlow/Keras objects belong in _compat:\n" + "\n".join(offenders)


# Our own modules (their private helpers), and the standard library's `os._exit`.
_OWN_MODULES = {"cluster", "data", "collectives", "strategy", "layers", "optimizers", "callbacks", "os"}


def test_the_suite_runner_reads_device_counts_from_the_marks():
    assert run_suite.DEFAULT_DEVICES == conftest.DEFAULT_DEVICES
    counts = run_suite.device_counts([])
    assert conftest.DEFAULT_DEVICES in counts and 1 in counts
    assert run_suite.device_counts([os.path.join(ROOT, "tests", "test_structure.py")]) == [1]


def test_docstrings_use_markdown_not_sphinx_roles():
    """mkdocstrings renders Markdown; `:class:`x`` would show up raw in the API reference."""
    role = re.compile(r":(class|func|meth|mod|attr|exc|obj):`")
    offenders = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    for number, line in enumerate(f, 1):
                        if role.search(line):
                            offenders.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not offenders, "write `name` instead of Sphinx roles:\n" + "\n".join(offenders)


@pytest.mark.core
def test_info_reports_versions_patch_ranges_and_devices():
    import subprocess
    import sys

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("KR_TEST_DEVICES", None)
    result = subprocess.run([sys.executable, "-m", "keras_replicator", "info", "--simulate", "2"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "private-API patches: checked on these versions" in result.stdout
    assert "devices: /device:CPU:0, /device:CPU:1" in result.stdout


# --- the patch lifetime: installed and scoped patches are undone exactly ------------


def _every_patch():
    from keras_replicator._compat import parameter_server

    sets = [*_compat.installed_patches(), _compat._strategy_scope(), parameter_server.ATOMIC_UPDATES,
            _compat.keras_api_patches()]
    return [patch for patches in sets for patch in patches.patches]


def _snapshot(patches):
    """What each patched attribute is now: (owner, name) -> (own?, the owner's own value)."""
    return {
        (id(p.owner), p.name): (p.name in vars(p.owner), vars(p.owner).get(p.name), getattr(p.owner, p.name))
        for p in patches
    }


def test_install_then_uninstall_restores_every_patched_attribute_exactly():
    patches = _every_patch()
    assert len(patches) >= 15, "every patch of _compat is a patch object"
    was_installed = _compat.installed_patches()[0].applied
    _compat.uninstall()
    try:
        before = _snapshot(patches)
        _compat.install(sharded_variable_reads=True)
        _compat.install(sharded_variable_reads=True)  # idempotent
        installed = {(id(p.owner), p.name) for patches in _compat.installed_patches() for p in patches.patches}
        for key, (_, _, value) in _snapshot(patches).items():
            if key in installed:
                assert value is not before[key][2], f"{key} was not patched by install()"
        with _compat.strategy_scope_patches(), _compat.strategy_scope_patches():
            assert all(p.applied for p in _compat._strategy_scope().patches)
        assert not any(p.applied for p in _compat._strategy_scope().patches)
        _compat.uninstall()
        _compat.uninstall()  # idempotent
        after = _snapshot(patches)
        for key, (own, value, _) in before.items():
            assert after[key][0] == own and after[key][1] is value, f"{key} not restored exactly"
    finally:
        if was_installed:
            _compat.install()


def test_patch_scopes_are_reentrant_and_thread_safe():
    import threading

    from keras_replicator._compat import patching

    class Owner:
        def method(self):
            return "original"

    class Child(Owner):
        pass

    patches = patching.Patches([patching.ScopedPatch(Child, "method", lambda original: lambda self: "patched")])
    entered, release = threading.Barrier(5), threading.Event()

    def worker():
        with patches.scope():
            entered.wait()
            release.wait()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    entered.wait()
    assert Child().method() == "patched"
    with patches.scope():
        release.set()
        for t in threads:
            t.join()
        assert Child().method() == "patched"  # still inside this thread's scope
    assert Child().method() == "original" and "method" not in vars(Child)  # inherited again


def test_the_keras_api_set_is_undone_exactly():
    patches = _compat.keras_api_patches().patches
    _compat.uninstall_keras_api()
    try:
        before = _snapshot(patches)
        assert not any(p.applied for p in patches)
        _compat.install_keras_api()
        assert all(p.applied for p in patches)
        _compat.uninstall_keras_api()
        after = _snapshot(patches)
        for key, (own, value, _) in before.items():
            assert after[key][0] == own and after[key][1] is value, f"{key} not restored exactly"
    finally:
        _compat.install_keras_api()


def test_importing_the_package_patches_nothing():
    """No patch is a side effect of an import, but the package's Keras-API set: strategies (and
    CrossReplicaOptimizer) install the rest; `import keras_replicator` installs only
    `_compat.keras_api_patches()` (Keras's own API that fails or is ignored on TensorFlow)."""
    import subprocess
    import sys

    code = (
        "import importlib, pkgutil, keras_replicator, keras_replicator._compat as c\n"
        "for m in pkgutil.iter_modules(c.__path__):\n"
        "    importlib.import_module('keras_replicator._compat.' + m.name)\n"
        "import keras_replicator.optimizers\n"
        "from keras_replicator._compat import patching\n"
        "expected = {(id(p.owner), p.name) for p in c.keras_api_patches().patches}\n"
        "assert set(patching._applied) == expected, sorted(p.name for p in patching._applied.values())\n"
        "print('clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "KR_TEST_DEVICES": "1"})
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr[-3000:]


# --- import cycles, counting imports inside functions (lazy) ---------------------------


def _import_graph() -> dict[str, set[str]]:
    """Each keras_replicator module -> the keras_replicator modules it imports, anywhere in it.

    `from package import name` counts as importing the submodule `package.name` where there
    is one (not the package's `__init__`).
    """
    modules = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                modules[dotted.removesuffix(".__init__")] = path
    graph = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
        graph[module] = {m for m in found if m in modules and m != module}
    return graph


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, stack = set(), [start]
    while stack:
        module = stack.pop()
        if module == goal:
            return True
        if module not in seen:
            seen.add(module)
            stack.extend(graph[module])
    return False


def test_compat_hands_nothing_back_to_keras_distribution():
    """`_compat.keras_distribution` gets `follow` registered by the public module (issue 52):
    no import path, lazy ones included, leads from it back to `keras_replicator.keras_distribution`."""
    graph = _import_graph()
    assert not _reaches(graph, "keras_replicator._compat.keras_distribution",
                        "keras_replicator.keras_distribution")
    assert not _reaches(graph, "keras_replicator.versions", "keras_replicator._compat")


def test_compat_reaches_no_public_module_of_model_parallel():
    """`_compat`'s layout and checkpoint patches get `model_parallel`'s modules registered
    (`_compat.model_parallel_hooks`, issue 52): no import path, lazy ones included, leads from
    `_compat` to `keras_replicator.model_parallel`, and the package has no import cycle."""
    graph = _import_graph()
    compat = [m for m in graph if m.startswith("keras_replicator._compat")]
    for module in compat:
        for target in ("keras_replicator.model_parallel", "keras_replicator.model_parallel.sharding"):
            assert not _reaches(graph, module, target), f"{module} reaches {target}"
    cycles = [m for m in graph if any(_reaches(graph, n, m) for n in graph[m])]
    assert not cycles, f"modules in an import cycle: {sorted(cycles)}"

