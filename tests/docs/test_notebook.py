"""notebooks/01_quickstart.ipynb runs top to bottom in a fresh kernel and shows what it says it shows."""

import base64
import re

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import REPO

pytestmark = pytest.mark.docs

NOTEBOOK = REPO / "notebooks" / "01_quickstart.ipynb"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    assert nb.metadata.kernelspec.name == "python3"


@pytest.fixture(scope="module")
def executed():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # A fresh kernel of this interpreter (jupyter_client runs the python3 spec with sys.executable),
    # started in notebooks/; a failing cell raises CellExecutionError with its traceback.
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    client.execute()
    return nb


def _text(nb):
    return "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "stream"
    )


@pytest.mark.slow
def test_notebook_runs_and_shows_equal_losses_plans_and_plots(executed):
    errors = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    text = _text(executed)
    assert "losses equal: True" in text
    assert "same plan after a JSON round trip: True" in text
    assert "ValueError: This plan holds no graph model" in text
    assert "plotted: loaded.png" in text
    assert "fits the budget (predicted): True" in text
    # Both plans (decorator and callback) swap something and lower the predicted peak.
    peaks = re.findall(r"predicted device peak \(simulator\): ([\d.]+) (\w+) -> ([\d.]+) (\w+)", text)
    assert len(peaks) == 3  # decorator, callback, budget
    assert all(b_unit == a_unit and float(a) < float(b) for b, b_unit, a, a_unit in peaks)
    swapped = re.search(r"fit: (\d+) tensors swapped", text)
    assert swapped and int(swapped.group(1)) > 0
    batches = re.search(r"\(simulator prediction\): (\d+) without LMS, (\d+) with LMS", text)
    assert batches and int(batches.group(2)) > int(batches.group(1)) > 0
    # The memory plots are displayed inline as PNGs.
    images = [
        base64.b64decode(o.data["image/png"])
        for c in executed.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "display_data" and "image/png" in o.get("data", {})
    ]
    assert len(images) == 2 and all(img[:8] == PNG_MAGIC for img in images)
