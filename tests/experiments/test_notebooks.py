"""Every Colab notebook runs top to bottom (at smoke size) without an error, and is stored without outputs."""

import glob
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "colab", "*.ipynb")))


def test_there_are_notebooks():
  names = {os.path.basename(p) for p in NOTEBOOKS}
  assert {"quickstart.ipynb", "cluster_tour.ipynb", "dc_asgd.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_is_stripped(path):
  nb = nbformat.read(path, as_version=4)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, f"{path}: outputs not stripped"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
  monkeypatch.setenv("DELAYJAX_NOTEBOOK_SMOKE", "1")
  # The kernel imports delayjax and experiments from this checkout, so the install cell is skipped.
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  monkeypatch.setenv("MPLBACKEND", "Agg")
  monkeypatch.chdir(tmp_path)
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
  outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  assert not os.path.exists(tmp_path / "delayjax-src"), "the install cell cloned the repository"
