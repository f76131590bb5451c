"""The notebooks run top to bottom (on CPU at their small shapes) so they never rot: each is
executed in a fresh Jupyter kernel by nbclient; a failing cell fails the test with its
traceback."""
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ["pytorch_quickstart.ipynb", "jax_quickstart.ipynb", "memory_and_speed.ipynb"]


def test_every_notebook_is_listed():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(nb, timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code")
