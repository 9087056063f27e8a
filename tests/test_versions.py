"""The supported range (`keras_replicator.versions`): refused below, warned above, said by `info`.

Versions are faked where they are read (`importlib.metadata.version`), in a fresh
interpreter where `import keras_replicator` itself must see them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from keras_replicator import versions
from tests.helpers import ROOT

pytestmark = [pytest.mark.devices(1), pytest.mark.core]

# Replaces the installed versions of the named distributions, then runs `then`.
FAKE = textwrap.dedent("""
    import importlib.metadata as metadata
    import sys
    real = metadata.version
    fake = {fake!r}
    metadata.version = lambda name: fake[name] if name in fake else real(name)
""")


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def _import_with(fake: dict) -> subprocess.CompletedProcess:
    return _python(FAKE.format(fake=fake) + textwrap.dedent("""
        try:
            import keras_replicator
        except ImportError as e:
            print(e)
            print("error:", type(e).__name__)
            print("tensorflow imported:", "tensorflow" in sys.modules)
            sys.exit(3)
    """))


def test_below_the_keras_floor_import_refuses_with_versions_range_reason_and_fix():
    result = _import_with({"keras": "3.5.0"})
    assert result.returncode == 3, result.stderr[-3000:]
    message = result.stdout
    assert "installed: tensorflow " in message and "keras 3.5.0" in message
    assert "TensorFlow 2.16-2.21 with Keras 3.8-3.15" in message
    assert "without dividing by their number" in message and "trains wrong" in message
    assert 'python -m pip install "tensorflow>=2.16,<2.22" "keras>=3.8,<3.16"' in message
    assert "error: UnsupportedVersionError" in message
    assert "tensorflow imported: False" in message  # refused before any work


def test_below_the_tensorflow_floor_import_refuses():
    result = _import_with({"tensorflow": "2.15.1", "tensorflow-cpu": "2.15.1"})
    assert result.returncode == 3, result.stderr[-3000:]
    assert "tensorflow 2.15.1 is below 2.16" in result.stdout and "Keras 2" in result.stdout


def test_info_on_an_unsupported_pair_exits_non_zero_with_the_import_message():
    fake = {"keras": "3.7.0"}
    imported = _import_with(fake)
    info = _python(FAKE.format(fake=fake) + textwrap.dedent("""
        sys.argv = ["keras-replicator", "info"]
        from keras_replicator.__main__ import main
        sys.exit(main())
    """))
    assert info.returncode == 1, info.stdout + info.stderr[-3000:]
    expected = imported.stdout.splitlines()[0]
    assert "keras 3.7.0 is below 3.8" in expected
    assert expected in info.stderr


def test_check_decides_each_side_of_the_range():
    tf_ok, keras_ok = versions.SUPPORTED["tensorflow"][1] + ".0", versions.SUPPORTED["keras"][0] + ".0"
    assert versions.check({"tensorflow": tf_ok, "keras": keras_ok}).status == "supported"
    assert versions.check({"tensorflow": "2.16.2", "keras": "3.7.0"}).status == "unsupported"
    assert versions.check({"tensorflow": "2.16.2", "keras": None}).status == "unsupported"
    above = versions.check({"tensorflow": "2.22.0", "keras": "3.16.0.dev2026082103"})
    assert above.status == "untested" and above.above == ("tensorflow", "keras")
    assert versions.minor("3.16.0.dev2026082103") == (3, 16) and versions.minor("2.21") == (2, 21)


def test_the_matrix_covers_every_minor_of_both_axes_from_the_oldest_pair():
    def minors(low, high):
        (major, a), (_, b) = versions.minor(low), versions.minor(high)
        return {(major, m) for m in range(a, b + 1)}

    tested_tf = {versions.minor(tf) for tf, _ in versions.PAIRS}
    tested_keras = {versions.minor(k) for _, k in versions.PAIRS}
    assert tested_tf == minors(*versions.SUPPORTED["tensorflow"])
    assert tested_keras == minors(*versions.SUPPORTED["keras"])
    oldest = tuple(versions.minor(low) for low, _ in versions.SUPPORTED.values())
    assert tuple(versions.minor(v) for v in versions.CI_PAIRS[0]) == oldest
    assert set(versions.CI_PAIRS) <= set(versions.PAIRS)
    for pair in versions.PAIRS:
        assert versions.check(dict(zip(("tensorflow", "keras"), pair))).status == "supported"


def test_above_the_ceiling_a_strategy_warns_naming_the_untested_modules(monkeypatch):
    import keras_replicator as kr

    real = versions.installed()
    monkeypatch.setattr(versions, "installed", lambda: dict(real, keras="3.16.0"))
    monkeypatch.delenv(versions.OPT_OUT, raising=False)
    with pytest.warns(versions.UntestedVersionWarning) as caught:
        kr.ReplicatorStrategy()
    message = str(caught[0].message)
    assert "keras 3.16.0 is newer than any tested" in message
    assert "keras_xla" in message and "keras_backports" in message
    assert "tf_logging" not in message  # a TensorFlow module: its range holds
    monkeypatch.setenv(versions.OPT_OUT, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", versions.UntestedVersionWarning)
        kr.ReplicatorStrategy()


def test_a_supported_pair_makes_a_strategy_without_a_version_warning():
    import keras_replicator as kr

    assert versions.check().status == "supported"
    with warnings.catch_warnings():
        warnings.simplefilter("error", versions.UntestedVersionWarning)
        kr.ReplicatorStrategy()


def test_the_matrix_runs_kerashub_on_each_pair_a_keras_hub_release_supports():
    from tests import versions as matrix

    with_hub = {pair: matrix.hub_requirements(*pair) for pair in versions.PAIRS}
    assert {pair for pair, hub in with_hub.items() if hub} == {("2.20.0", "3.15.1"), ("2.21.0", "3.15.1")}
    # tensorflow-text pins its TensorFlow minor: the pair's, or pip would move TensorFlow.
    assert with_hub[("2.20.0", "3.15.1")] == ["keras-hub>=0.32", "tensorflow-text~=2.20.0"]
    assert with_hub[("2.21.0", "3.15.1")] == ["keras-hub>=0.32", "tensorflow-text~=2.21.0"]
