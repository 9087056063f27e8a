"""The documentation's tutorial pages are the tutorials as a real smoke run left them."""

import glob
import os

import pytest

from tests.notebooks import PUBLISHED, TUTORIALS

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
