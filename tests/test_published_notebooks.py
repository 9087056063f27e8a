"""The documentation's tutorial pages are the tutorials as a real run left them."""

import glob
import os
import re
import sys

import pytest

from tests.notebooks import PUBLISHED, ROOT, TUTORIALS, runtime_log_lines

pytestmark = pytest.mark.devices(1)

def test_published_copies_are_a_folder_of_their_own():
    assert os.path.isdir(PUBLISHED) and not os.path.islink(PUBLISHED)


TUTORIAL_PATHS = sorted(glob.glob(os.path.join(TUTORIALS, "[0-9][0-9]_*.ipynb")))
# Published with a run of their own (`python -m tests.notebooks publish`, not `--smoke`): their
# outputs are that run's, their opening states its result, they show no warning and no path of
# the machine that ran them. Every tutorial is (a new one too).
REAL_RUNS = TUTORIAL_PATHS


@pytest.mark.parametrize("path", TUTORIAL_PATHS, ids=os.path.basename)
def test_tutorial_is_committed_without_outputs(path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


@pytest.mark.parametrize("path", TUTORIAL_PATHS, ids=os.path.basename)
def test_published_copy_has_the_same_cells_and_the_outputs_of_a_run(path):
    import nbformat

    published = os.path.join(PUBLISHED, os.path.basename(path))
    assert os.path.exists(published), f"run `make notebooks` to publish {os.path.basename(path)}"
    source = nbformat.read(path, as_version=4)
    shown = nbformat.read(published, as_version=4)
    assert [c.source for c in shown.cells] == [c.source for c in source.cells], (
        "the published notebook differs from tutorials/: re-run `make notebooks`"
    )
    code = [c for c in shown.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), "every code cell was run"
    assert any(c.outputs for c in code)
    published = shown.metadata["keras_replicator"]
    assert published["published_from"] == os.path.relpath(path, os.path.dirname(TUTORIALS))
    if path in REAL_RUNS:
        assert published["smoke"] is False, "publish without --smoke: the tutorial's own run"
    for cell in code:
        for out in cell.outputs:
            assert out.get("output_type") != "error", cell.source[:80]


@pytest.mark.parametrize("path", TUTORIAL_PATHS, ids=os.path.basename)
def test_published_outputs_show_no_tensorflow_runtime_noise(path):
    """No C++/absl start-up lines, and no TensorFlow engine INFO lines naming another strategy."""
    import nbformat

    shown = nbformat.read(os.path.join(PUBLISHED, os.path.basename(path)), as_version=4)
    for cell in shown.cells:
        for out in cell.get("outputs", []):
            text = out.get("text", "")
            assert not runtime_log_lines(text), (cell.source[:60], runtime_log_lines(text))
            assert "INFO:tensorflow:" not in text, (cell.source[:60], text[:300])
            assert "Using MirroredStrategy" not in text, cell.source[:60]


def _output_texts(nb):
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts = [out.get("text", ""), *out.get("traceback", [])]
            texts += [v for k, v in out.get("data", {}).items() if k.startswith("text/")]
            for text in texts:
                yield cell, "".join(text) if isinstance(text, list) else text


# An absolute path of a machine: a folder under a usual root, or any site-packages.
MACHINE_PATH = re.compile(r"(?<![\w.:/])/(?:work|home|tmp|usr|opt|root|var|srv|mnt|Users|private)/|(?<!<)site-packages")


@pytest.mark.parametrize("path", REAL_RUNS, ids=os.path.basename)
def test_published_outputs_show_no_warning_and_no_machine_path(path):
    import nbformat

    shown = nbformat.read(os.path.join(PUBLISHED, os.path.basename(path)), as_version=4)
    for cell, text in _output_texts(shown):
        assert not re.search(r"warning", text, re.IGNORECASE), (cell.source[:60], text[:500])
        assert not MACHINE_PATH.search(text), (cell.source[:60], MACHINE_PATH.search(text), text[:500])
        for place in {ROOT, sys.prefix, os.path.expanduser("~")}:
            assert place not in text, (cell.source[:60], place)


@pytest.mark.parametrize("path", REAL_RUNS, ids=os.path.basename)
def test_the_opening_states_what_this_run_got_as_its_outputs_print_it(path):
    """The first cell's "This run" paragraph quotes (in backticks) numbers the outputs print."""
    import nbformat

    from tests.notebooks import stream_text

    shown = nbformat.read(os.path.join(PUBLISHED, os.path.basename(path)), as_version=4)
    opening = shown.cells[0]
    assert opening.cell_type == "markdown"
    paragraph = next((p for p in opening.source.split("\n\n") if p.startswith("**This run")), None)
    assert paragraph, "the opening has a paragraph starting **This run"
    quoted = re.findall(r"`([^`]+)`", paragraph)
    assert len(quoted) >= 2, paragraph
    printed = stream_text(shown)
    missing = [q for q in quoted if q not in printed]
    assert missing == [], f"quoted in the opening but not printed by the run: {missing}"


def test_strip_paths_replaces_this_machines_folders():
    import site
    import tempfile

    from tests.notebooks import strip_paths

    text = (f"{site.getsitepackages()[0]}/keras/x.py:74: note\n"
            f"{os.path.join(ROOT, 'tutorials')} and {os.path.join(tempfile.gettempdir(), 'a')}\n")
    nb = nbformat_notebook([{"output_type": "stream", "name": "stderr", "text": text}])
    assert strip_paths(nb) >= 3
    shown = nb.cells[0].outputs[0]["text"]
    assert ROOT not in shown and sys.prefix not in shown and not MACHINE_PATH.search(shown), shown
    assert "<site-packages>/keras" in shown and "./tutorials" in shown and "<tmp>/a" in shown


def test_the_runtime_log_pattern_matches_what_tensorflow_prints_and_nothing_else():
    from tests.notebooks import drop_runtime_log

    log = ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
           "I0000 00:00:1795415113.652024   12382 port.cc:153] oneDNN custom operations are on.\n"
           "E0000 00:00:1795457747.712292    2108 util.cc:131] oneDNN supports DT_INT32 only\n")
    user = "epoch 1: loss 0.52\nW1 is a weight name: fine\n"
    assert len(runtime_log_lines(log)) == 3 and runtime_log_lines(user) == []
    nb = nbformat_notebook([{"output_type": "stream", "name": "stderr", "text": log + user},
                            {"output_type": "stream", "name": "stderr", "text": log}])
    assert len(drop_runtime_log(nb)) == 6
    assert [o["text"] for o in nb.cells[0].outputs] == [user]


def nbformat_notebook(outputs):
    import nbformat

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(1)")
    cell.outputs = [nbformat.from_dict(o) for o in outputs]
    nb.cells = [cell]
    return nb
