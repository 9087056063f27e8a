"""The documentation's tutorial pages are the tutorials as a real smoke run left them."""

import glob
import os

import pytest

from tests.notebooks import PUBLISHED, TUTORIALS, runtime_log_lines

pytestmark = pytest.mark.devices(1)

def test_published_copies_are_a_folder_of_their_own():
    assert os.path.isdir(PUBLISHED) and not os.path.islink(PUBLISHED)


TUTORIAL_PATHS = sorted(glob.glob(os.path.join(TUTORIALS, "[0-9][0-9]_*.ipynb")))


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
    assert shown.metadata["keras_replicator"] == {
        "published_from": os.path.relpath(path, os.path.dirname(TUTORIALS)), "smoke": True
    }
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
